"""Hook point: ``sglang.srt.server_args.ServerArgs`` CLI surface.

Targets:
- ``ServerArgs.add_cli_args`` (AROUND): upstream builds its parser from the msgspec
  fields of ``ServerArgs``, which a plugin cannot extend; we add our flags as their own
  argument group after upstream's, so ``--help`` lists them and argparse parses them.
- ``ServerArgs.from_cli_args`` (AFTER): upstream keeps only known fields, so our parsed
  values would be dropped; we copy them onto the record as plain attributes (they
  survive pickling into every subprocess) and validate them right there, before any
  model or device is touched.

- ``sglang.srt.utils.server_args_config_parser.ConfigArgumentMerger.merge_config_with_args``
  (AFTER): upstream's ``--config`` puts the YAML's values in front of the command line's, which
  override them; our valued flags refuse a second, different value ("given twice"), so where the
  command line gives one of them, the YAML's occurrence is dropped from the merged list (the
  command line wins, as for upstream's flags). Only our flags are touched.

Seed items served: the ``--enable-cp-l3`` / ``--cp-l3-config`` server args and their
validation ("enable_cp_l3 ... requires cp_l3_config", mutually exclusive with another
hicache_storage_backend), the cold-start policy (was env SGLANG_CP_L3_COLD_START), the
slab cap (was env SGLANG_CP_HICACHE_MAX_SLAB_GB) and the placement assert (was env
SGLANG_CP_HICACHE_PLACEMENT_ASSERT), all now flags of SGLang's own CLI.
"""

from __future__ import annotations

from sglang_cp import args as cp_args
from sglang_cp.integration.hookspec import HookSpec


def add_cli_args_around(original, parser):
    result = original(parser)
    cp_args.add_cli_group(parser)
    return result


def from_cli_args_after(result, cls, namespace):
    cp_args.copy_flags(namespace, result)
    cp_args.validate(result)
    return result


def merge_config_with_args_after(result, self, cli_args, *args, **kwargs):
    if "--config" not in cli_args or not isinstance(result, list):
        return result
    at = cli_args.index("--config")
    cli_part = cli_args[:at] + cli_args[at + 2:]  # upstream returns: the YAML's args + these
    split = len(result) - len(cli_part)
    if split < 0 or result[split:] != cli_part:
        return result  # not the shape this hook knows: upstream's list as it is
    config_part = result[:split]
    valued = cp_args.valued_flags()
    given = {_flag(a) for a in cli_part if a.startswith("--")} & valued
    if not given:
        return result
    kept, i = [], 0
    while i < len(config_part):
        a = config_part[i]
        if a.startswith("--") and _flag(a) in given:
            i += 1 if "=" in a else 2  # the flag and its value
            continue
        kept.append(a)
        i += 1
    return kept + cli_part


def _flag(arg: str) -> str:
    """``--cp_l3_config=x`` -> ``--cp-l3-config`` (upstream's YAML keys may use underscores)."""
    return "--" + arg.split("=", 1)[0][2:].replace("_", "-")


HOOKS = (
    HookSpec(
        target="sglang.srt.utils.server_args_config_parser.ConfigArgumentMerger.merge_config_with_args",
        kind="after",
        fn=merge_config_with_args_after,
        seed="server_args: --enable-cp-l3 + --cp-l3-config fields/args",
        why="the one place upstream merges a --config YAML with the command line",
    ),
    HookSpec(
        target="sglang.srt.server_args.ServerArgs.add_cli_args",
        kind="around",
        fn=add_cli_args_around,
        seed="server_args: --enable-cp-l3 + --cp-l3-config fields/args",
        why="the only place upstream's parser is built; our group goes after upstream's",
    ),
    HookSpec(
        target="sglang.srt.server_args.ServerArgs.from_cli_args",
        kind="after",
        fn=from_cli_args_after,
        seed="server_args validation: enable_cp_l3 requires cp_l3_config, excludes hicache_storage_backend",
        why="upstream drops unknown namespace attributes here; we carry ours onto the record",
    ),
)
