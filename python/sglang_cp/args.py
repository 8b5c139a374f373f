"""sglang-cp's command-line flags: names, defaults, help and validation, in one place.

The flags are added to SGLang's own parser (see ``integration/server_args/cli.py``) as
their own argument group, copied onto the ``ServerArgs`` record as plain attributes
(they survive pickling into the scheduler, detokenizer and DP-controller processes), and
validated before any model loads. Every flag defaults to off; with none given, the
record is exactly what upstream would build.

This module imports no sglang: it works on any object that carries the attributes
(an ``argparse.Namespace``, a ``ServerArgs``), so it is testable and reusable alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, fields
from typing import Any, Optional

from sglang_cp.l3.recovery import COLD_START_MODES as COLD_START_CHOICES, DEFAULT_COLD_START

logger = logging.getLogger(__name__)

GROUP_TITLE = "sglang-cp (context-parallel tiered KV cache)"
GROUP_DESCRIPTION = (
    "Flags added by the sglang-cp plugin. All default off; with none given SGLang "
    "behaves exactly as without the plugin. Kill switch: SGLANG_CP_DISABLE=1."
)
# Name under which our store is handed to upstream's dynamic storage-backend factory.
L3_BACKEND_NAME = "sglang_cp_l3"


class CpArgsError(ValueError):
    """A bad combination or value of our flags; the message names the flag and the fix."""


@dataclass(frozen=True)
class CpFlags:
    """Our flags with their defaults; attribute names are the CLI names with '_'."""

    enable_cp_l3: bool = False
    cp_l3_config: Optional[str] = None
    cp_l3_cold_start: str = DEFAULT_COLD_START
    enable_cp_shared_physical_l2_hicache: bool = False
    cp_shared_l2_hugetlbfs_dir: str = "/dev/hugepages"
    cp_hicache_max_slab_gb: float = 480.0
    cp_hicache_placement_assert: bool = False


FLAG_NAMES = tuple(f.name for f in fields(CpFlags))
_DEFAULTS = CpFlags()

# (flag, argparse kwargs). Help strings are user documentation: README's flag table is
# generated from them (scripts/gen_flags_table.py), so keep them complete sentences.
_ARGS = (
    (
        "--enable-cp-l3",
        dict(
            action="store_true",
            help="Persist HiCache pages to the crash-consistent NVMe tier (L3) and reload "
            "them on a miss. Needs --enable-hierarchical-cache and --cp-l3-config. Under "
            "CP each rank persists only the pages it owns.",
        ),
    ),
    (
        "--cp-l3-config",
        dict(
            type=str,
            default=None,
            metavar="PATH",
            help="TOML file describing the L3 tier: disks, capacity per disk, rank->disk "
            "map, slot sizes, LMDB index dir and map size, GC watermarks, PLP policy.",
        ),
    ),
    (
        "--cp-l3-cold-start",
        dict(
            type=str,
            default=_DEFAULTS.cp_l3_cold_start,
            choices=COLD_START_CHOICES,
            help="What L3 does with pages already on disk at startup: 'clear' starts "
            "empty; 'load' rebuilds each rank's slots from its slab headers cross-checked "
            "with the index; 'verify' is 'load' plus a full CRC scan.",
        ),
    ),
    (
        "--enable-cp-shared-physical-l2-hicache",
        dict(
            action="store_true",
            help="Allocate every HiCache host pool of the rank from hugetlbfs files, in "
            "slabs of at most --cp-hicache-max-slab-gb, each one cudaHostRegister; "
            "no fallback to ordinary memory.",
        ),
    ),
    (
        "--cp-shared-l2-hugetlbfs-dir",
        dict(
            type=str,
            default=_DEFAULTS.cp_shared_l2_hugetlbfs_dir,
            metavar="PATH",
            help="Mount point of the hugetlbfs used by --enable-cp-shared-physical-l2-hicache.",
        ),
    ),
    (
        "--cp-hicache-max-slab-gb",
        dict(
            type=float,
            default=_DEFAULTS.cp_hicache_max_slab_gb,
            metavar="GB",
            help="Largest host slab (GiB) registered with one cudaHostRegister call; "
            "larger host pools are split into page-aligned slabs and no transfer "
            "straddles a slab.",
        ),
    ),
    (
        "--cp-hicache-placement-assert",
        dict(
            action="store_true",
            help="Debug: check that all CP ranks agree on KV page placement (digest "
            "MIN/MAX over the CP group). Costs collectives; not for production.",
        ),
    ),
)


ERROR_PROG = "sglang serve"  # upstream's parser prog: our errors read like its argparse errors


def install_error_hook() -> None:
    """Make an uncaught CpArgsError one line on stderr (``sglang serve: error: ...``), as upstream's
    argparse errors read, instead of two chained tracebacks; any other exception goes to the hook that
    was there before. Callers that catch CpArgsError (Engine users, ``sglang-cp check-args``) still get
    the exception. Idempotent."""
    prev = sys.excepthook
    if getattr(prev, "_sglang_cp", False):
        return

    def hook(etype, value, tb):
        if isinstance(value, CpArgsError):
            sys.stderr.write(f"{ERROR_PROG}: error: {value}\n")
            sys.stderr.flush()
            return
        prev(etype, value, tb)

    hook._sglang_cp = True
    sys.excepthook = hook


class _CpValue(argparse.Action):
    """Store one of our valued flags, reporting a bad value or a second, different value as a
    CpArgsError (one line naming the flag and the fix) instead of argparse's error, which prints
    SGLang's whole usage (some 480 lines) before the message. ``--help`` is unchanged: ``choices``
    become the metavar."""

    def __init__(self, option_strings, dest, convert=str, choices=None, **kw):
        self.convert, self.allowed = convert, tuple(choices) if choices else None
        if self.allowed and "metavar" not in kw:
            kw["metavar"] = "{" + ",".join(self.allowed) + "}"
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        flag = self.option_strings[0]
        if self.allowed and values not in self.allowed:
            raise CpArgsError(f"{flag} must be one of {', '.join(self.allowed)}; got {values!r}.")
        try:
            value = self.convert(values)
        except ValueError:
            raise CpArgsError(f"{flag}: {values!r} is not a number; give it in {self.metavar}, "
                              f"e.g. {flag} {self.default}.") from None
        given = namespace.__dict__.setdefault("_sglang_cp_given", {})
        # Upstream's --config puts a YAML file's values in front of the command line's; where the command
        # line gives one of our flags, the merge hook (integration/server_args/cli.py) dropped the YAML's.
        if self.dest in given and given[self.dest] != value:
            raise CpArgsError(f"{flag} is given twice ({given[self.dest]!r}, then {value!r}): "
                              f"give it once, with the value you mean.")
        given[self.dest] = value
        setattr(namespace, self.dest, value)


def add_cli_group(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add our flags to ``parser`` as one argument group; a second call is a no-op."""
    for action in parser._actions:
        if "--enable-cp-l3" in action.option_strings:
            return None
    group = parser.add_argument_group(GROUP_TITLE, GROUP_DESCRIPTION)
    ours = []
    for flag, kwargs in _ARGS:
        kwargs = dict(kwargs)
        if kwargs.get("action") is None:  # a valued flag: ours reports its errors (_CpValue)
            kwargs.update(action=_CpValue, convert=kwargs.pop("type", str))
        ours.append(group.add_argument(flag, **kwargs))
    keep_upstream_abbreviations(parser, ours)
    return group


def keep_upstream_abbreviations(parser: argparse.ArgumentParser, ours: list) -> None:
    """argparse takes a unique prefix of an option for the option (``--enable-cp`` for upstream's
    ``--enable-cp-decode-attn-tp``). Our flags would make such prefixes ambiguous, so a command line that
    upstream parses would fail once the plugin is installed, flags off or not. Where a prefix names one of
    upstream's options besides ours, it names upstream's as before; a prefix of ours alone still works."""
    lookup = parser._get_option_tuples  # argparse's prefix lookup (the one place abbreviations resolve)
    mine = {id(a) for a in ours}

    def upstream_first(option_string):
        found = lookup(option_string)
        theirs = [t for t in found if id(t[0]) not in mine]
        return theirs if theirs else found
    parser._get_option_tuples = upstream_first


def valued_flags() -> set:
    """Our flags that take a value (each refuses a second, different one)."""
    return {flag for flag, kwargs in _ARGS if kwargs.get("action") is None}


def arg_specs() -> list[tuple[str, dict]]:
    """The flags and their argparse kwargs (for docs generation)."""
    return [(flag, dict(kwargs)) for flag, kwargs in _ARGS]


def copy_flags(src: Any, dst: Any) -> None:
    """Copy our flags from a parsed namespace onto a ServerArgs record (defaults if absent)."""
    for name in FLAG_NAMES:
        setattr(dst, name, getattr(src, name, getattr(_DEFAULTS, name)))


def flags_of(obj: Any) -> CpFlags:
    """Our flags as carried by ``obj`` (a ServerArgs or Namespace); defaults where absent."""
    return CpFlags(**{n: getattr(obj, n, getattr(_DEFAULTS, n)) for n in FLAG_NAMES})


def any_enabled(obj: Any) -> bool:
    f = flags_of(obj)
    return f.enable_cp_l3 or f.enable_cp_shared_physical_l2_hicache or f.cp_hicache_placement_assert


def storage_backend_is_ours(server_args: Any) -> bool:
    """True when the HiCache storage backend was selected by us (issue #5's wiring)."""
    if getattr(server_args, "hicache_storage_backend", None) != "dynamic":
        return False
    extra = getattr(server_args, "hicache_storage_backend_extra_config", None)
    return isinstance(extra, str) and L3_BACKEND_NAME in extra


# Keys of --hicache-storage-backend-extra-config that upstream's controller itself consumes (its
# parse_storage_backend_extra_config pops them before a backend sees the rest): the prefetch policy, the
# same for every backend. With --enable-cp-l3 they pass through into the config we declare; any other
# key is refused (the L3 store's own settings live in --cp-l3-config).
UPSTREAM_PREFETCH_KEYS = {
    "prefetch_threshold": "a whole number of tokens >= 0 (upstream's default 256)",
    "prefetch_timeout_base": "a number of seconds > 0 (upstream's default 1)",
    "prefetch_timeout_per_ki_token": "a number of seconds > 0 (upstream's default 0.25)",
}
_EXTRA_FLAG = "--hicache-storage-backend-extra-config"


def _read_extra_config(text: str) -> Any:
    """The flag's value as upstream reads it: JSON, or @PATH of a .json, .toml or .yaml file."""
    import json

    if not text.startswith("@"):
        try:
            return json.loads(text)
        except ValueError as e:
            raise CpArgsError(f"{_EXTRA_FLAG}: not valid JSON ({e}); give a JSON object or @PATH of a file.") from e
    path = text[1:]
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".json":
            with open(path) as f:
                return json.load(f)
        if ext == ".toml":
            import tomllib

            with open(path, "rb") as f:
                return tomllib.load(f)
        if ext in (".yaml", ".yml"):
            import yaml

            with open(path) as f:
                return yaml.safe_load(f)
    except OSError as e:
        raise CpArgsError(f"{_EXTRA_FLAG} {text}: cannot read it ({e.strerror}).") from e
    except Exception as e:  # a parser's own error type: JSONDecodeError, TOMLDecodeError, YAMLError
        raise CpArgsError(f"{_EXTRA_FLAG} {text}: not a valid {ext[1:]} file ({e}).") from e
    raise CpArgsError(f"{_EXTRA_FLAG} {text}: upstream reads .json, .toml or .yaml files; rename it.")


def user_prefetch_tuning(server_args: Any) -> dict:
    """With --enable-cp-l3: upstream's prefetch settings the user gave in --hicache-storage-backend-extra-config
    (validated; {} when none), which the config we declare carries on. Raises CpArgsError for any other key
    or a value upstream would reject once the server is up."""
    text = getattr(server_args, "hicache_storage_backend_extra_config", None)
    if not text or storage_backend_is_ours(server_args):
        return {}
    cfg = _read_extra_config(text)
    if not isinstance(cfg, dict):
        raise CpArgsError(f"{_EXTRA_FLAG}: must be an object of settings, got {type(cfg).__name__}.")
    out = {}
    for key, value in cfg.items():
        if key not in UPSTREAM_PREFETCH_KEYS:
            raise CpArgsError(
                f"{_EXTRA_FLAG}: {key!r} is not used with --enable-cp-l3, which takes only upstream's prefetch "
                f"settings ({', '.join(UPSTREAM_PREFETCH_KEYS)}); the L3 store's own settings go in --cp-l3-config.")
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
        ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 0 if key == "prefetch_threshold"
              else number and 0 < value < float("inf"))
        if not ok:
            raise CpArgsError(f"{_EXTRA_FLAG}: {key} must be {UPSTREAM_PREFETCH_KEYS[key]}; got {value!r}.")
        out[key] = value
    return out


MIN_SLAB_GB = 2 / 1024  # one 2 MiB hugepage, in GiB


def validate(server_args: Any, *, check_paths: bool = True) -> CpFlags:
    """Validate our flags against each other and against SGLang's own flags.

    Raises CpArgsError naming the flag (or TOML field) and the fix. Pure apart from
    reading the L3 config file and statting paths; safe to call more than once.
    """
    f = flags_of(server_args)
    hicache = bool(getattr(server_args, "enable_hierarchical_cache", False))
    backend = getattr(server_args, "hicache_storage_backend", None)

    if f.cp_l3_cold_start not in COLD_START_CHOICES:
        raise CpArgsError(
            f"--cp-l3-cold-start must be one of {', '.join(COLD_START_CHOICES)}; "
            f"got {f.cp_l3_cold_start!r}."
        )
    if f.cp_l3_config is not None and not f.enable_cp_l3:
        raise CpArgsError(
            "--cp-l3-config is given but --enable-cp-l3 is not: add --enable-cp-l3 to use "
            "the L3 tier, or drop --cp-l3-config."
        )
    if f.enable_cp_l3:
        if not hicache:
            raise CpArgsError(
                "--enable-cp-l3 needs --enable-hierarchical-cache: the L3 tier persists "
                "pages of the HiCache host pool. Add --enable-hierarchical-cache."
            )
        if not f.cp_l3_config:
            raise CpArgsError(
                "--enable-cp-l3 needs --cp-l3-config PATH (a TOML file naming the disks, "
                "capacity and LMDB index dir); see examples/l3.single-nvme.toml."
            )
        if backend is not None and not storage_backend_is_ours(server_args):
            raise CpArgsError(
                f"--enable-cp-l3 selects sglang-cp's L3 store as the HiCache storage "
                f"backend and excludes --hicache-storage-backend {backend}. Drop "
                f"--hicache-storage-backend, or drop --enable-cp-l3."
            )
        if (getattr(server_args, "enable_kv_cache_sharding", False)
                and getattr(server_args, "hicache_host_memory_mode", "cache") == "buffer_only"):
            # A buffer-mode prefetch drops its device-resident head after the ranks agreed on where each
            # page goes (trim_prefetch_full_head), which would shift every page onto another owner.
            raise CpArgsError(
                "--hicache-host-memory-mode buffer_only is not supported with --enable-cp-l3 under "
                "--enable-kv-cache-sharding (a buffer-mode prefetch would shift each rank's pages onto other "
                "owners); use --hicache-host-memory-mode cache, the default."
            )
        user_prefetch_tuning(server_args)
        if check_paths:
            load_config(f.cp_l3_config)
    if f.enable_cp_shared_physical_l2_hicache:
        if not hicache:
            raise CpArgsError(
                "--enable-cp-shared-physical-l2-hicache needs --enable-hierarchical-cache: "
                "it changes where the HiCache host pool lives. Add --enable-hierarchical-cache."
            )
        if (getattr(server_args, "dcp_size", 1) or 1) > 1:
            # Under DCP the host pool's transfer methods take logical slots (size x dcp) that upstream maps
            # to physical rows only inside the copy; the slab splitter cuts physical rows.
            raise CpArgsError(
                f"--enable-cp-shared-physical-l2-hicache does not support --dcp-size {server_args.dcp_size} "
                "yet (its slab splitter would cut a page's transfer at the wrong rows); drop one of them.")
        if (getattr(server_args, "dp_size", 1) or 1) > 1 and not getattr(server_args, "enable_dp_attention", False):
            # Each DP replica is its own torch.distributed world: every replica's rank 0 would name the same
            # slab files (namespaced by --port and rank) and the second would be refused as their owner.
            raise CpArgsError(
                f"--enable-cp-shared-physical-l2-hicache does not support --dp-size {server_args.dp_size} "
                "without --enable-dp-attention (the replicas would claim the same hugepage slab files); run one "
                "server per replica, each with its own --port, or add --enable-dp-attention.")
        if check_paths and not os.path.isdir(f.cp_shared_l2_hugetlbfs_dir):
            raise CpArgsError(
                f"--cp-shared-l2-hugetlbfs-dir {f.cp_shared_l2_hugetlbfs_dir!r} is not a "
                f"directory. Mount hugetlbfs there (mount -t hugetlbfs none "
                f"{f.cp_shared_l2_hugetlbfs_dir}) or point the flag at an existing mount."
            )
    if not (MIN_SLAB_GB <= f.cp_hicache_max_slab_gb < float("inf")):
        raise CpArgsError(
            f"--cp-hicache-max-slab-gb must be a finite number of GiB per cudaHostRegister call, at least one "
            f"2 MiB hugepage ({MIN_SLAB_GB:g}); got {f.cp_hicache_max_slab_gb}. The default 480 is safe on "
            "current drivers."
        )
    if f.cp_hicache_placement_assert and not hicache:
        raise CpArgsError(
            "--cp-hicache-placement-assert checks HiCache placement across CP ranks and "
            "needs --enable-hierarchical-cache. Add it, or drop the assert flag."
        )
    return f


def load_config(path: str):
    """Load and fully validate the L3 TOML; errors are re-raised naming the flag."""
    from sglang_cp.l3.config import L3ConfigError, load_l3_config

    if not os.path.isfile(path):
        raise CpArgsError(
            f"--cp-l3-config {path!r}: no such file. Pass the path of an L3 TOML file "
            f"(examples/l3.single-nvme.toml is a template)."
        )
    try:
        return load_l3_config(path)
    except L3ConfigError as e:
        raise CpArgsError(f"--cp-l3-config {path}: {e}") from e
