"""The ``sglang-cp`` command: operator tools around the plugin (see ``COMMANDS`` for the list
``--help`` prints)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import warnings

from sglang_cp.demo_config import DEMO_CONFIG, write_demo_config  # noqa: F401 (public here too)
from sglang_cp.display import rel


# What `sglang-cp --help` lists, one command per line (argparse's own listing is hidden: it would
# repeat these, and could not show the two `l3` subcommands).
DESCRIPTION = "Operator tools of the sglang-cp plugin (context-parallel tiered KV cache for SGLang 0.5.23)."
COMMANDS = """\
commands:
  doctor       can this machine run what was asked for (table; exit 1 on a blocker)
  check-args   parse and validate a launch_server command line through SGLang's own
               parser with the plugin loaded, without starting a server (works on a
               CPU box for a GPU command line)
  demo         a local L3 config, doctor on it, and launch_server's parser accepting it
               and rejecting a bad one
  cachebench   the README's main job: CP ranks with upstream's HiCache and our L3
               through warm-up, L2 pressure, reload and a full restart (table/JSON/PNG)
  l3 stats     occupancy per rank/disk/payload of an L3 directory (no server needed)
  l3 fsck      check (and --repair) slab headers against the index; exit 0/1/2/3

Run 'sglang-cp COMMAND --help' for the options of one command."""

# UserWarnings sglang 0.5.23 emits while importing its quantization modules on a machine without
# CUDA: they say nothing about our tools' work. Matched by message and emitting module, so every
# other warning (ours, sglang's elsewhere, a GPU box's) still shows.
SGLANG_CPU_IMPORT_WARNINGS = (
    (r"Only CUDA, HIP and XPU support AWQ currently", r"sglang\.srt\.layers\.quantization\.awq"),
    (r"Only CUDA(, MUSA)? and (MUSA|NPU) support GGUF quantization currently",
     r"sglang\.srt\.layers\.quantization\.gguf"),
)


def quiet_sglang_cpu_import_warnings() -> None:
    for message, module in SGLANG_CPU_IMPORT_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)


def escape(text: str) -> str:
    """Our text through rich: brackets in names and messages (``[index]``, ``disks[0]``) are not markup."""
    from rich.markup import escape as _escape

    return _escape(text)


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
    """Run SGLang's own parse + resolution on ``argv`` with our plugin loaded (as check-args does)."""
    from sglang_cp.check_args import parse_launch_args as parse

    return parse(argv)


def _cmd_check_args(ns) -> int:
    from rich.table import Table

    from sglang_cp.args import FLAG_NAMES
    from sglang_cp.check_args import CheckArgsError, check_l3_where_it_will_run, first_line
    from sglang_cp.check_args import parse_launch_args as parse

    console = _wide_console()
    notes: list[str] = []
    try:
        server_args = parse(ns.launch_args, notes)
        check_l3_where_it_will_run(server_args)
    except (CheckArgsError, ValueError) as e:  # CpArgsError, L3ConfigError and upstream's own ValueErrors
        if getattr(ns, "traceback", False):
            raise
        console.print(f"[bold red]rejected[/]: {escape(first_line(e))}", soft_wrap=True)
        return 2
    except Exception as e:  # upstream's resolution refusing the line another way (assert, RuntimeError)
        if getattr(ns, "traceback", False):
            raise
        console.print(f"[bold red]rejected by SGLang[/] ({type(e).__name__}): {escape(first_line(e))} "
                      "(--traceback shows where)", soft_wrap=True)
        return 2
    for note in notes:
        console.print(escape(f"note: {note}"), soft_wrap=True)
    table = Table(title="launch_server arguments as SGLang parsed them (sglang-cp flags)")
    table.add_column("flag")
    table.add_column("value")
    for name in FLAG_NAMES:
        table.add_row("--" + name.replace("_", "-"), escape(repr(getattr(server_args, name))))
    from sglang.srt.arg_groups.overrides import resolved_view

    cfg = resolved_view(server_args)  # what the scheduler processes will see
    for name in ("device", "enable_hierarchical_cache", "hicache_storage_backend",
                 "hicache_storage_backend_extra_config"):
        table.add_row("--" + name.replace("_", "-") + " (upstream, resolved)", escape(repr(getattr(cfg, name))))
    console.print(table)
    console.print("[green]accepted[/]")
    return 0


def _cmd_demo(ns) -> int:
    from rich.console import Console

    console = Console()
    cfg = write_demo_config(ns.out_dir)
    console.rule("1. sglang-cp doctor on the embedded default L3 config")
    console.print(escape(f"config: {cfg}"))
    rc = _cmd_doctor(argparse.Namespace(
        cp_l3_config=cfg, cp_shared_l2_hugetlbfs_dir=None, hicache_size=None,
        cp_hicache_max_slab_gb=480.0, enable_cp_shared_physical_l2_hicache=False))
    good = ["--model-path", "dummy", "--enable-hierarchical-cache", "--enable-cp-l3",
            "--cp-l3-config", cfg, "--cp-l3-cold-start", "load"]
    console.rule("2. launch_server's parser accepts our flags")
    console.print(escape("python -m sglang.launch_server " + " ".join(good)))
    rc |= _cmd_check_args(argparse.Namespace(launch_args=good))
    bad_cfg = os.path.join(os.path.dirname(cfg), "bad.toml")
    with open(bad_cfg, "w") as f:
        f.write(open(cfg).read().replace("low_watermark = 0.85", "low_watermark = 0.95"))
    console.rule("3. ... and rejects a bad config, naming the field and the fix")
    bad = good[:5] + [bad_cfg]
    console.print(escape("python -m sglang.launch_server " + " ".join(bad)))
    if _cmd_check_args(argparse.Namespace(launch_args=bad)) != 2:
        console.print("[bold red]a bad config was accepted[/]")
        rc |= 1
    return rc


def _cmd_cachebench(ns) -> int:
    from sglang_cp.cachebench.runner import run

    return run(ns)


def _wide_console():
    """A log or a pipe gets 160 columns: rich would squeeze the tables into 80."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=160)


def _load_l3_config_or_exit(path, console):
    from sglang_cp.l3 import L3ConfigError, load_l3_config

    try:
        return load_l3_config(path)
    except L3ConfigError as e:
        console.print(f"[bold red]config error[/]: {escape(str(e))}")
        return None


def _cmd_l3_stats(ns) -> int:
    import json
    import time

    from rich.table import Table

    from sglang_cp.l3.tools import occupancy

    console = _wide_console()
    cfg = _load_l3_config_or_exit(ns.cp_l3_config, console)
    if cfg is None:
        return 2
    st = occupancy.collect(cfg)
    if ns.json:
        print(json.dumps(st, indent=1))
        return 0
    t = Table(title=escape(f"L3 occupancy ({ns.cp_l3_config}); GC high {st['gc']['high_watermark']:.2f} / "
                           f"low {st['gc']['low_watermark']:.2f}"))
    for col in ("rank", "disk", "payload", "slot B", "used / slots", "used", "payload GB", "coldest page",
                "GC"):
        t.add_column(col, justify="left" if col == "GC" else "right", no_wrap=True)
    for r in st["slabs"]:
        age = "-" if r["coldest_age_s"] is None else f"{r['coldest_age_s']:.0f} s ago"
        t.add_row(str(r["rank"]), escape(r["disk"]), r["payload"], str(r["slot_bytes"]), f"{r['used']} / {r['slots']}",
                  f"{r['fraction']:.1%}", f"{r['payload_bytes'] / 1e9:.3f}", age, r["gc"])
    console.print(t)
    for state in sorted({r["gc"] for r in st["slabs"]}):
        console.print(f"GC {state}: {st['gc_states'][state]}")
    ix = st["index"]
    if ix is None:
        console.print(escape(f"index: none at {cfg.index_dir} (no server has written here yet)"))
    else:
        console.print(f"index: {ix['entries']} entries, {ix['used_bytes'] / 1e6:.1f} MB used of a "
                      f"{ix['map_size'] / 1e9:.2f} GB map (max {ix['max_map_size'] / 1e9:.2f} GB); "
                      f"{st['unmatched_entries']} entries name no current slab slot (see `sglang-cp l3 fsck`)")
    recs = st["last_cold_start"]
    if not recs:
        console.print("last cold start: none recorded (no store has opened these slabs yet)")
        return 0
    ct = Table(title="last cold start per rank (recorded by the store at open and at a runtime clear)")
    for col in ("rank", "disk", "mode", "when", "live", "dropped", "wiped", "seconds", "by"):
        ct.add_column(col, justify="right", no_wrap=True)
    now = time.time()
    for r in recs:
        if "error" in r:
            ct.add_row(str(r.get("rank")), escape(r["disk"]), f"[red]{escape(r['error'])}[/]", *["-"] * 6)
            continue
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.get("drop_reasons", {}).items()))
        ct.add_row(str(r["rank"]), escape(r["disk"]), r.get("mode", "?"),
                   f"{max(0.0, now - r.get('finished_unix', now)):.0f} s ago", str(r.get("live", "-")),
                   f"{r.get('dropped', 0)}" + (f" ({reasons})" if reasons else ""),
                   str(r.get("index_entries_wiped", "-")), f"{r.get('seconds', 0):.3f}",
                   f"{r.get('host', '?')}:{r.get('pid', '?')}")
    console.print(ct)
    return 0


FSCK_CLEAN, FSCK_PROBLEMS, FSCK_USAGE, FSCK_REPAIRED = 0, 1, 2, 3
_FSCK_HELP = (
    "Check an L3 directory with no server running: index entries against slab headers and payload CRCs. "
    "Exit codes: 0 clean (orphans are informational), 1 problems found and not repaired, 2 usage/config "
    "error or refused (--repair while the directory is in use; a check while a live store owns one of its "
    "ranks, i.e. holds its rank lock, without --live), 3 repaired.",
    "A live store frees and rewrites slots while fsck reads them, so an exact check needs the server "
    "stopped: without --live, fsck refuses a directory whose rank locks a running store holds and names it "
    "(rank, pid, identity).",
    "--live checks it anyway, read-only: each problem is confirmed by reading its index entry again after "
    "its slot was read. An entry deleted or rewritten meanwhile is counted 'transient' (informational); one "
    "that still maps the same slot is a real problem (exit 1), since the store frees a slot only after its "
    "entry's delete committed and a rewritten page gets a new sequence number. Orphan counts mean little "
    "there (pages in flight). --live reads every referenced payload from the serving disk, so it competes "
    "with the server for I/O; --repair is refused while a store is live.",
)


def _holders(owners: list) -> str:
    """The live owners of L3 ranks (``fsck.live_owners``), for a message."""
    return "; ".join(f"rank {r} by pid {h.pid if h.pid is not None else '?'}" + (f" ({h.owner})" if h.owner else "")
                     for r, h in owners)


def _users(users) -> str:
    """fsck.live_users' processes as the messages name them."""
    return "; ".join(f"pid {p} ({c})" for p, c in users)


def _cmd_l3_fsck(ns) -> int:
    import json

    from rich.table import Table

    from sglang_cp.l3.tools import fsck

    console = _wide_console()
    cfg = _load_l3_config_or_exit(ns.cp_l3_config, console)
    if cfg is None:
        return FSCK_USAGE
    owners = fsck.live_owners(cfg)
    held = _holders(owners)
    if owners and ns.repair:
        console.print(escape(f"refusing --repair: a live store owns this L3 directory ({held}). Stop the "
                             "server and run it again."), style="bold red")
        return FSCK_USAGE
    if owners and not ns.live:
        console.print(escape(f"refusing to check a live directory: a store owns it ({held}). While it writes, it "
                             "frees and rewrites slots under the scan, which would show as dangling or crc "
                             "findings. Stop the server for an exact check, or pass --live (read-only; see "
                             "`sglang-cp l3 fsck --help`)."), style="bold red")
        return FSCK_USAGE
    users = fsck.live_users(cfg)
    if users and ns.repair:
        console.print("[bold red]refusing --repair[/]: the L3 directory is in use by "
                      + escape(_users(users))
                      + ". Stop the server (or those processes) and run it again.")
        return FSCK_USAGE
    if users and not owners:
        console.print("[yellow]warning[/]: in use by pid(s) " + ", ".join(str(p) for p, _ in users)
                      + "; a live writer can make this report inconsistent")
    rep = fsck.check(cfg)
    if ns.live:
        fsck.confirm_live(cfg, rep)
        if owners:
            console.print(escape(f"live check ({held}): each problem was confirmed against the index after its "
                                 "slot was read; the others are counted as transient"))
    counts = rep.counts()
    if ns.repair and (rep.problems() or counts["orphan"]):
        # Checked again now the scan is over: a server that started during a long scan may have written
        # pages into slots the scan found free (orphans), whose headers repair would zero.
        late = "; ".join(x for x in (_holders(fsck.live_owners(cfg)), _users(fsck.live_users(cfg))) if x)
        if late:
            console.print(escape(f"refusing --repair: a store started while fsck scanned ({late}); "
                                 "nothing was repaired. Stop the server and run it again."), style="bold red")
            return FSCK_USAGE
        fsck.repair(cfg, rep)
    if ns.json:
        print(json.dumps({"entries": rep.entries, "live": rep.live, "slabs": len(rep.slabs), "live_check": ns.live,
                          "owners": [{"rank": r, "pid": h.pid, "owner": h.owner} for r, h in owners],
                          "counts": dict(counts), "repaired": dict(rep.repaired),
                          "repair_failed": rep.repair_failed, "cleared_after_delete": rep.cleared_after_delete,
                          "findings": [{"kind": f.kind, "slab": f.slab, "slot": f.slot, "rank": f.rank,
                                        "detail": f.detail} for f in rep.findings[:1000]]}, indent=1))
    else:
        t = Table(title=escape(f"L3 fsck ({ns.cp_l3_config}): {len(rep.slabs)} slab files, {rep.entries} index "
                        f"entries, {rep.live} live"))
        for col in ("finding", "count", "repaired", "meaning"):
            t.add_column(col)
        meaning = {"dangling": "index entry without its blob (no slab/slot, or the slot holds another)",
                   "crc": "payload CRC mismatch", "cross_rank": "slot holds, or is claimed by, another rank",
                   "collision": "two entries of one rank claim one slot",
                   "orphan": "valid blob no entry references (inert; informational)",
                   "stray": "file named like a slab the store never writes (skipped; informational)",
                   "transient": "--live: the entry was deleted or rewritten while read (informational)"}
        for kind in (*fsck.PROBLEMS, *fsck.INFO):
            t.add_row(kind, str(counts[kind]), str(rep.repaired[kind]) if ns.repair else "-", meaning[kind])
        console.print(t)
        if rep.cleared_after_delete:
            console.print(f"cleared the headers of {rep.cleared_after_delete} slot(s) whose entries were deleted")
        for f in [f for f in rep.findings if f.kind != "orphan"][:20]:
            slab = rel(f.slab) if f.slab else ""
            where = slab if f.kind == "stray" else f"rank {f.rank} slot {f.slot} {slab}"
            console.print(escape(f"  {f.kind}: {where}: {f.detail}"))
    if rep.problems() == 0:
        return FSCK_REPAIRED if rep.repaired else FSCK_CLEAN
    if ns.repair and rep.repair_failed == 0:
        return FSCK_REPAIRED
    return FSCK_PROBLEMS


def build_parser() -> argparse.ArgumentParser:
    # The command list is laid out by hand (one command per line): keep its line breaks.
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="sglang-cp", usage="sglang-cp [-h] COMMAND ...", description=DESCRIPTION,
                                epilog=COMMANDS, formatter_class=raw)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", help=argparse.SUPPRESS, prog="sglang-cp")

    d = sub.add_parser("doctor", help="check this machine against what was asked for")
    d.add_argument("--cp-l3-config", default=None)
    d.add_argument("--enable-cp-shared-physical-l2-hicache", action="store_true")
    d.add_argument("--cp-shared-l2-hugetlbfs-dir", default="/dev/hugepages")
    d.add_argument("--hicache-size", type=float, default=None,
                   help="host pool size per rank in GB (1e9 bytes, as upstream's --hicache-size)")
    d.add_argument("--cp-hicache-max-slab-gb", type=float, default=480.0)
    d.set_defaults(fn=_cmd_doctor)

    c = sub.add_parser("check-args", help="parse a launch_server command line without serving",
                       usage="sglang-cp check-args [--traceback] -- LAUNCH_SERVER_ARGS ...",
                       description="Parse and resolve a launch_server / sglang serve command line through "
                       "SGLang's own parser with the plugin loaded, without starting a server. Works on a "
                       "machine without a GPU (no --device: checked as for --device cuda) and without network "
                       "(the model's config.json must be local: a model directory, or the Hugging Face cache). "
                       "Exit 0 accepted, 2 rejected (one line naming the argument and the fix).")
    c.add_argument("--traceback", action="store_true", help="on a rejection, raise it with its traceback")
    c.add_argument("launch_args", nargs=argparse.REMAINDER)
    c.set_defaults(fn=_cmd_check_args)

    m = sub.add_parser("demo", help="doctor + parser demonstration on a local L3 config")
    m.add_argument("--out-dir", default="out/demo")
    m.set_defaults(fn=_cmd_demo)

    from sglang_cp.cachebench.runner import add_arguments as _cachebench_args

    b = sub.add_parser("cachebench", help="CP ranks + upstream HiCache + our L3 through warm-up, "
                       "L2 pressure, reload and a restart; table, JSON and PNG")
    _cachebench_args(b)
    b.set_defaults(fn=_cmd_cachebench)

    l3 = sub.add_parser("l3", help="offline L3 tools: stats, fsck [--repair]")
    l3sub = l3.add_subparsers(dest="l3_cmd", required=True)
    st = l3sub.add_parser("stats", help="occupancy per rank/disk/payload, GC state, last cold start")
    st.add_argument("--cp-l3-config", required=True)
    st.add_argument("--json", action="store_true", help="print JSON instead of tables")
    st.set_defaults(fn=_cmd_l3_stats)
    fk = l3sub.add_parser("fsck", help="scan slab headers and the index; exit 0 clean, 1 problems, "
                          "2 usage/config error, 3 repaired",
                          description="\n\n".join(textwrap.fill(para, 100) for para in _FSCK_HELP),
                          formatter_class=raw)
    fk.add_argument("--cp-l3-config", required=True)
    fk.add_argument("--repair", action="store_true",
                    help="drop dangling/bad index entries and clear orphaned slot headers")
    fk.add_argument("--live", action="store_true",
                    help="check a directory a running store owns (read-only; unconfirmed findings are "
                    "reported as transient)")
    fk.add_argument("--json", action="store_true", help="print JSON instead of tables")
    fk.set_defaults(fn=_cmd_l3_fsck)
    return p


def main(argv=None) -> int:
    from sglang_cp.display import quiet_repeated_plp_warnings

    quiet_sglang_cpu_import_warnings()
    quiet_repeated_plp_warnings()
    ns = build_parser().parse_args(argv)
    if getattr(ns, "launch_args", None) and ns.launch_args[0] == "--":
        ns.launch_args = ns.launch_args[1:]
    return ns.fn(ns)


if __name__ == "__main__":
    sys.exit(main())
