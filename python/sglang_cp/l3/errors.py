"""Exception types of the L3 store.

Config and startup errors are shown to users verbatim, so they always carry the field and the fix.
Invariant errors are for broken bookkeeping inside the store (double free, overrun): loud on purpose.
"""


class L3ConfigError(ValueError):
    """The L3 TOML config is unusable; the message names the field path and the fix."""


class L3StartupError(RuntimeError):
    """The store cannot open (disk space, permissions, sizes); the message names the fix."""


class L3InvariantError(AssertionError):
    """Our own bookkeeping is inconsistent (double free, slot overrun, key/slot mismatch)."""
