"""How our command-line tools show things to people (no sglang, no rich at import)."""

from __future__ import annotations

import os


def rel(path: str) -> str:
    """``path`` relative to the working directory when it lies under it: printed output names no
    machine's absolute paths."""
    try:
        r = os.path.relpath(path)
    except ValueError:
        return path
    return path if r.startswith("..") else r


# The L3 loader's warning about a drive whose write cache is volatile (l3/config.py): logged by the
# process that loads the config, once per device. The server loads it at every start and keeps that.
PLP_WARNING_LOGGER = "sglang_cp.l3.config"
PLP_WARNING_MARK = "write cache is volatile"


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


class OncePerBootFilter:
    """A logging filter for the sglang-cp tools: a record containing ``mark`` passes once per boot per
    text (per disk and device, for the PLP warning), then is dropped. `make demo` runs four tools on one
    L3 directory; each used to print the same warning. Markers are empty 0600 files in a 0700
    directory of this user under $XDG_RUNTIME_DIR (else the temp dir), named by the boot id, so a
    reboot shows it again. Fails open: anything unexpected lets the record through."""

    def __init__(self, mark: str, root: str | None = None):
        import tempfile

        self.mark = mark
        base = root or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        self.dir = os.path.join(base, f"sglang-cp-{os.geteuid()}", "once-per-boot")

    def filter(self, record) -> bool:
        try:
            text = record.getMessage()
        except Exception:
            return True
        if self.mark not in text:
            return True
        boot = _boot_id()
        if boot is None:
            return True
        import hashlib

        from sglang_cp.l3.format.files import open_private, private_dirs

        name = f"{boot}-{hashlib.sha256(text.encode()).hexdigest()[:24]}"
        try:
            private_dirs(self.dir, "sglang-cp tools' once-per-boot markers")
            os.close(open_private(os.path.join(self.dir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                  "once-per-boot marker"))
        except FileExistsError:
            return False  # shown earlier in this boot
        except Exception:
            return True
        for old in os.listdir(self.dir):  # markers of earlier boots
            if not old.startswith(boot):
                try:
                    os.unlink(os.path.join(self.dir, old))
                except OSError:
                    pass
        record.msg = f"{record.msg} [shown once per boot by the sglang-cp tools; a server logs it at every start]"
        return True


def quiet_repeated_plp_warnings(root: str | None = None) -> OncePerBootFilter:
    """Install the once-per-boot filter on the L3 loader's logger (idempotent); for our CLI only."""
    import logging

    logger = logging.getLogger(PLP_WARNING_LOGGER)
    for f in logger.filters:
        if isinstance(f, OncePerBootFilter):
            return f
    f = OncePerBootFilter(PLP_WARNING_MARK, root)
    logger.addFilter(f)
    return f
