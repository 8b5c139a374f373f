"""The ``sglang-cp`` command: operator tools around the plugin.

Subcommands:
  doctor       can this machine run what was asked for (table; exit 1 on a blocker)
  check-args   parse and validate a launch_server command line through SGLang's own
               parser with the plugin loaded, without starting a server
  demo         the README's main job until cachebench lands: a local L3 config, doctor
               on it, and launch_server's parser accepting it and rejecting a bad one
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap


def _cmd_doctor(ns) -> int:
    from sglang_cp import doctor

    rows = doctor.run_checks(
        cp_l3_config=ns.cp_l3_config,
        hugetlbfs_dir=ns.cp_shared_l2_hugetlbfs_dir,
        hicache_size_gb=ns.hicache_size,
        max_slab_gb=ns.cp_hicache_max_slab_gb,
        require_hugepages=ns.enable_cp_shared_physical_l2_hicache,
    )
    doctor.render(rows)
    return doctor.exit_code(rows)


def parse_launch_args(argv: list[str]):
    """Run SGLang's own parse + resolution on ``argv`` with our plugin loaded."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    return server_args


def _cmd_check_args(ns) -> int:
    from rich.console import Console
    from rich.table import Table

    from sglang_cp.args import FLAG_NAMES, CpArgsError

    console = Console()
    try:
        server_args = parse_launch_args(ns.launch_args)
    except (CpArgsError, ValueError) as e:
        console.print(f"[bold red]rejected[/]: {e}")
        return 2
    table = Table(title="launch_server arguments as SGLang parsed them (sglang-cp flags)")
    table.add_column("flag")
    table.add_column("value")
    for name in FLAG_NAMES:
        table.add_row("--" + name.replace("_", "-"), repr(getattr(server_args, name)))
    from sglang.srt.arg_groups.overrides import resolved_view

    cfg = resolved_view(server_args)  # what the scheduler processes will see
    for name in ("enable_hierarchical_cache", "hicache_storage_backend",
                 "hicache_storage_backend_extra_config"):
        table.add_row("--" + name.replace("_", "-") + " (upstream, resolved)", repr(getattr(cfg, name)))
    console.print(table)
    console.print("[green]accepted[/]")
    return 0


DEMO_CONFIG = """\
# sglang-cp L3 config written by `sglang-cp demo`: one local directory as the "disk".
[index]
dir = "{root}/index"
map_size_gb = 0.25

[gc]
high_watermark = 0.90
low_watermark = 0.85

[durability]
plp_policy = "warn"

[[disks]]
name = "local0"
path = "{root}/disk0"
capacity_gb = 1.0
"""


def write_demo_config(root: str) -> str:
    root = os.path.abspath(root)
    for sub in ("index", "disk0"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    path = os.path.join(root, "l3.toml")
    with open(path, "w") as f:
        f.write(DEMO_CONFIG.format(root=root))
    return path


def _cmd_demo(ns) -> int:
    from rich.console import Console

    console = Console()
    cfg = write_demo_config(ns.out_dir)
    console.rule("1. sglang-cp doctor on the embedded default L3 config")
    console.print(f"config: {cfg}")
    rc = _cmd_doctor(argparse.Namespace(
        cp_l3_config=cfg, cp_shared_l2_hugetlbfs_dir=None, hicache_size=None,
        cp_hicache_max_slab_gb=480.0, enable_cp_shared_physical_l2_hicache=False))
    good = ["--model-path", "dummy", "--enable-hierarchical-cache", "--enable-cp-l3",
            "--cp-l3-config", cfg, "--cp-l3-cold-start", "load"]
    console.rule("2. launch_server's parser accepts our flags")
    console.print("python -m sglang.launch_server " + " ".join(good))
    rc |= _cmd_check_args(argparse.Namespace(launch_args=good))
    bad_cfg = os.path.join(os.path.dirname(cfg), "bad.toml")
    with open(bad_cfg, "w") as f:
        f.write(open(cfg).read().replace("low_watermark = 0.85", "low_watermark = 0.95"))
    console.rule("3. ... and rejects a bad config, naming the field and the fix")
    bad = good[:5] + [bad_cfg]
    console.print("python -m sglang.launch_server " + " ".join(bad))
    if _cmd_check_args(argparse.Namespace(launch_args=bad)) != 2:
        console.print("[bold red]a bad config was accepted[/]")
        rc |= 1
    return rc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang-cp", description=textwrap.dedent(__doc__))
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("doctor", help="check this machine against what was asked for")
    d.add_argument("--cp-l3-config", default=None)
    d.add_argument("--enable-cp-shared-physical-l2-hicache", action="store_true")
    d.add_argument("--cp-shared-l2-hugetlbfs-dir", default="/dev/hugepages")
    d.add_argument("--hicache-size", type=float, default=None,
                   help="host pool size per rank in GB (1e9 bytes, as upstream's --hicache-size)")
    d.add_argument("--cp-hicache-max-slab-gb", type=float, default=480.0)
    d.set_defaults(fn=_cmd_doctor)

    c = sub.add_parser("check-args", help="parse a launch_server command line without serving")
    c.add_argument("launch_args", nargs=argparse.REMAINDER)
    c.set_defaults(fn=_cmd_check_args)

    m = sub.add_parser("demo", help="doctor + parser demonstration on a local L3 config")
    m.add_argument("--out-dir", default="out/demo")
    m.set_defaults(fn=_cmd_demo)
    return p


def main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    if getattr(ns, "launch_args", None) and ns.launch_args[0] == "--":
        ns.launch_args = ns.launch_args[1:]
    return ns.fn(ns)


if __name__ == "__main__":
    sys.exit(main())
