"""The GPU suite's CPU-side helpers, on CPU. The soak's workload and bookkeeping (test/gpu/soak_support.py):
its prompts answer with their document's planted token under a model that answers with its prefix's most
frequent token (what the KV-sensitive weights do), chats grow from the answers, the stream is
deterministic and Zipf-skewed, the phase plan ends gracefully, and the process-group RSS reader finds a
real group. The start slots (test/gpu/start_slots.py): at most N holders per GPU, a bounded wait, the first
start of a model building its kernels alone."""

import collections
import importlib.util
import os
import subprocess
import sys
import threading
import time

import pytest

_GPU = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_GPU, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


soak = _load("soak_support")
slots = _load("start_slots")


def mode_model(ids):
    """What the shaped model computes: its prefix's most frequent token, as its answer."""
    return [collections.Counter(ids).most_common(1)[0][0]] * 8


def test_every_prompt_answers_with_its_documents_planted_token():
    w = soak.build()
    assert len({soak.planted(d) for d in range(w.sizes.documents)}) == w.sizes.documents
    assert soak.planted(w.sizes.documents - 1) < soak.RANDOM_LO
    for (d, q), ids in w.questions.items():
        assert mode_model(ids)[0] == soak.planted(d) == soak.expected_answer(w, ("q", d, q))
    for c in range(w.sizes.chats):
        prompts, outs = soak.chat_turns(w, c, mode_model)
        assert len(prompts) == w.sizes.turns
        for t in range(1, w.sizes.turns):  # each turn extends the previous prompt by its answer and a user turn
            assert prompts[t][:len(prompts[t - 1])] == prompts[t - 1]
            assert prompts[t][len(prompts[t - 1]):len(prompts[t - 1]) + 8] == outs[t - 1]
        assert {o[0] for o in outs} == {soak.expected_answer(w, ("chat", c, 0))}


def test_schedule_is_deterministic_zipf_skewed_and_mixes_chats():
    w = soak.build()
    a, b = soak.Schedule(w), soak.Schedule(w)
    keys = [a.next() for _ in range(4000)]
    assert keys == [b.next() for _ in range(4000)]
    docs = collections.Counter(k[1] for k in keys if k[0] == "q")
    assert docs.most_common()[0][1] > 5 * max(1, docs.most_common()[-1][1])
    chats = [k for k in keys if k[0] == "chat"]
    assert 0.2 < len(chats) / len(keys) < 0.3
    assert chats[:w.sizes.chats * 2] == [("chat", i % w.sizes.chats, i // w.sizes.chats) for i in range(w.sizes.chats * 2)]


def test_phase_plan_kills_and_restarts_and_ends_gracefully():
    short = soak.phase_plan(150, False)
    assert [p[:2] for p in short] == [("clear", "kill"), ("load", "stop"), ("load", "stop")]
    assert sum(p[2] for p in short) == pytest.approx(150)
    long = soak.phase_plan(3000, True, 600)
    assert long[0][0] == "clear" and all(p[0] == "load" for p in long[1:]) and long[-1][1] == "stop"
    ends = [p[1] for p in long]
    assert "kill" in ends and all(x != y for x, y in zip(ends, ends[1:]))


def test_percentile_nearest_rank():
    assert soak.percentile([], 50) is None
    xs = list(range(1, 101))
    assert soak.percentile(xs, 50) == 50 and soak.percentile(xs, 99) == 99 and soak.percentile(xs, 100) == 100


def test_group_rss_reads_a_real_process_group():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(60)"],
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and soak.scheduler_rss(child.pid) < (64 << 20):
            time.sleep(0.1)
        procs = soak.group_processes(child.pid)
        assert [p[0] for p in procs] == [child.pid]
        assert soak.scheduler_rss(child.pid) >= 64 << 20  # no scheduler title: the group's largest
    finally:
        child.kill()
        child.wait(30)
    assert soak.scheduler_rss(child.pid) == 0


def test_start_slots_admit_n_per_gpu_and_the_wait_is_bounded(tmp_path):
    env0, env1 = {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}
    kw = dict(slots=2, lock_dir=str(tmp_path))
    with slots.start_slot(env0, wait_s=1, **kw) as a, slots.start_slot(env0, wait_s=1, **kw) as b:
        assert {a, b} == {0, 1}
        with slots.start_slot(env1, wait_s=1, **kw) as c:  # another GPU has its own slots
            assert c == 0
        with pytest.raises(TimeoutError, match="no server start slot of GPU 0"):
            with slots.start_slot(env0, wait_s=0.5, **kw):
                pass
    with slots.start_slot(env0, wait_s=1, **kw) as again:  # released on exit
        assert again == 0


def test_every_gpu_test_that_changes_hugepages_shares_one_xdist_group():
    """vm.nr_hugepages is host-wide: two workers raising and restoring it at once would shrink each
    other's reservation. Every GPU module that reserves hugepages (writes nr_hugepages or takes the
    ``hugetlbfs`` fixture) must put those tests in the one ``hugepages`` group, which xdist's
    ``--dist loadgroup`` runs on one worker."""
    offenders = []
    for name in sorted(os.listdir(_GPU)):
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        with open(os.path.join(_GPU, name)) as f:
            src = f.read()
        if ("nr_hugepages" in src or "hugetlbfs" in src) and 'xdist_group("hugepages")' not in src:
            offenders.append(name)
    assert offenders == [], f"reserve hugepages outside the 'hugepages' xdist group: {offenders}"


def test_start_ledger_records_each_start_its_slot_wait_and_failures(tmp_path):
    """Two starts on one slot: the second waits for the first; a failed start is recorded and re-raised;
    the table counts both and names the slowest."""
    ledger, env = str(tmp_path / "starts.jsonl"), {"CUDA_VISIBLE_DEVICES": "0"}
    kw = dict(path=ledger, slots=1, wait_s=30, lock_dir=str(tmp_path / "locks"))
    holding = threading.Event()

    def first():
        with slots.ledgered_start(env, "first", **kw):
            holding.set()
            time.sleep(0.6)

    t = threading.Thread(target=first)
    t.start()
    assert holding.wait(10)
    with pytest.raises(RuntimeError, match="boom"):
        with slots.ledgered_start(env, "second", **kw):
            raise RuntimeError("boom")
    t.join(10)
    assert oct(os.stat(ledger).st_mode & 0o777) == "0o600"
    starts = slots.read_starts(ledger)
    assert [(e["tag"], e["ok"]) for e in starts] == [("first", True), ("second", False)]
    assert starts[0]["start_s"] >= 0.5 and starts[0]["wait_s"] < 0.5
    assert starts[1]["wait_s"] >= 0.3  # queued behind "first" on the one slot
    table = slots.start_table(starts)
    row = table.splitlines()[2].split()
    assert row[:3] == ["0", "2", "1"], table  # gpu, starts, failed
    assert "[second]" in table and "FAILED" in table
    assert "first starts" not in table  # no gate in these starts: nothing built
    assert slots.start_table([]) == "" and slots.read_starts(str(tmp_path / "none.jsonl")) == []
    slots.record_start({"x": 1}, path="")  # no ledger: nothing written, no error


def test_start_table_names_each_kernels_first_start_and_its_time():
    """The table says what the first start of each kernels key took (a cold build or a warm start), the
    figure that told a cold JIT build from a slow layout in the fifteenth run's call A."""
    base = {"gpu": "0", "gate_s": 0.0, "wait_s": 0.0, "slot": 0, "priority": False, "test": "t.py::x"}
    starts = [dict(base, tag="clear", kernels="tiny-glm5-dsa-dsa", first=True, ok=True, start_s=235.3),
              dict(base, tag="l2", kernels="tiny-dsv3-triton", first=True, ok=False, start_s=159.5),
              dict(base, tag="load", kernels="tiny-glm5-dsa-dsa", first=False, ok=True, start_s=57.6)]
    line = [ln for ln in slots.start_table(starts).splitlines() if ln.startswith("first starts")]
    assert line == ["first starts (built kernels): tiny-glm5-dsa-dsa 235 s; tiny-dsv3-triton 160 s FAILED"]


def test_a_priority_start_takes_the_next_free_slot_before_waiting_starts(tmp_path):
    """A long pole's start (priority) queued behind a full GPU gets the slot that frees next, though a
    plain start was waiting longer; while one is queued no plain start takes a slot, even a free one; a
    queue file whose process is gone holds nobody back and is cleared."""
    env, d = {"CUDA_VISIBLE_DEVICES": "0"}, str(tmp_path / "locks")
    kw = dict(slots=1, wait_s=30, lock_dir=d)
    order = []

    def start(name, priority):
        with slots.start_slot(env, priority=priority, **kw):
            order.append(name)
            time.sleep(0.3)

    with slots.start_slot(env, **kw):
        plain = threading.Thread(target=start, args=("plain", False))
        plain.start()
        time.sleep(0.5)  # the plain start has been polling for a while
        prio = threading.Thread(target=start, args=("priority", True))
        prio.start()
        deadline = time.monotonic() + 10
        while not any(".prio." in n for n in os.listdir(d)) and time.monotonic() < deadline:
            time.sleep(0.05)
    plain.join(20)
    prio.join(20)
    assert order == ["priority", "plain"]
    assert not any(".prio." in n for n in os.listdir(d))  # dequeued once it had its slot

    # A queued priority start (this live process) holds back a plain start even from a free slot.
    queued = os.path.join(d, f"gpu0.prio.{os.getpid()}.1")
    os.close(os.open(queued, os.O_WRONLY | os.O_CREAT, 0o600))
    with pytest.raises(TimeoutError):
        with slots.start_slot(env, slots=2, wait_s=0.5, lock_dir=d):
            pass
    os.unlink(queued)
    # One whose process is gone does not, and is cleared.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    stale = os.path.join(d, f"gpu0.prio.{gone.pid}.1")
    os.close(os.open(stale, os.O_WRONLY | os.O_CREAT, 0o600))
    with slots.start_slot(env, slots=2, wait_s=5, lock_dir=d) as got:
        assert got == 0
    assert not os.path.exists(stale)


def test_first_start_of_a_model_builds_alone_and_others_go_on(tmp_path, monkeypatch):
    """Until one start of a model's kernels is healthy on a GPU, its other starts wait at the gate holding
    no slot; another model's start takes the free slot meanwhile. A failed first start leaves the model
    cold (the next start builds); once warm, starts pass the gate at once. The gate's wait is bounded."""
    monkeypatch.delenv("SGLANG_CP_GPU_FIRST_START_GATE", raising=False)
    ledger, env = str(tmp_path / "starts.jsonl"), {"CUDA_VISIBLE_DEVICES": "0"}
    kw = dict(path=ledger, slots=2, wait_s=30, lock_dir=str(tmp_path / "locks"))
    building, release = threading.Event(), threading.Event()

    def first(tag, fail):
        try:
            with slots.ledgered_start(env, tag, kernels="dsa-model-dsa", **kw):
                building.set()
                assert release.wait(10)
                if fail:
                    raise RuntimeError("start failed")
        except RuntimeError:
            pass

    t = threading.Thread(target=first, args=("cold-fails", True))
    t.start()
    assert building.wait(10)
    waiter_entry = {}

    def second():
        with slots.ledgered_start(env, "waits", kernels="dsa-model-dsa", **kw) as e:
            waiter_entry.update(e)

    w = threading.Thread(target=second)
    w.start()
    time.sleep(0.5)
    assert not waiter_entry  # held at the gate
    with slots.ledgered_start(env, "other-model", kernels="mla-model-triton", wait_s=1,
                              **{k: v for k, v in kw.items() if k != "wait_s"}) as other:
        assert other["slot"] == 1 and other["first"] is True  # the waiter holds no slot
    release.set()
    t.join(10)
    w.join(10)
    assert waiter_entry["first"] is True  # the failed start left the model cold: the waiter built it
    with slots.ledgered_start(env, "warm", kernels="dsa-model-dsa", **kw) as warm:
        assert warm["first"] is False and warm["gate_s"] < 0.5
    by_tag = {e["tag"]: e for e in slots.read_starts(ledger)}
    assert (by_tag["cold-fails"]["ok"], by_tag["cold-fails"]["first"]) == (False, True)
    assert by_tag["waits"]["ok"] and by_tag["waits"]["gate_s"] >= 0.4
    locks = sorted(os.listdir(tmp_path / "locks"))
    assert "gpu0.dsa-model-dsa.warm" in locks and "gpu0.mla-model-triton.warm" in locks, locks
    assert all(oct(os.stat(tmp_path / "locks" / n).st_mode & 0o777) == "0o600" for n in locks)

    # The gate's wait is bounded and names the kernels; off, it lets every start through.
    lk = dict(lock_dir=str(tmp_path / "locks2"))
    with slots.first_start_gate(env, "mha-x", wait_s=1, **lk) as built:
        assert built is True
        with pytest.raises(TimeoutError, match="first start of mha-x on GPU 0"):
            with slots.first_start_gate(env, "mha-x", wait_s=0.3, **lk):
                pass
        monkeypatch.setenv("SGLANG_CP_GPU_FIRST_START_GATE", "0")
        with slots.first_start_gate(env, "mha-x", wait_s=0.3, **lk) as off:
            assert off is False


def test_waiters_at_the_gate_start_together_once_the_model_is_warm(tmp_path, monkeypatch):
    """Once the first start has built a model's kernels, the starts that waited for it go on at once and
    side by side (one slot each), not one after another through the gate: a waiter that held the gate for
    its own warm start queued the next behind it (169 + 78 + 43 s on the H200)."""
    monkeypatch.delenv("SGLANG_CP_GPU_FIRST_START_GATE", raising=False)
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    kw = dict(path=str(tmp_path / "starts.jsonl"), slots=3, wait_s=30, lock_dir=str(tmp_path / "locks"))
    building, release = threading.Event(), threading.Event()
    inside, both_inside = [], threading.Event()
    lock = threading.Lock()

    def builder():
        with slots.ledgered_start(env, "builds", kernels="m-dsa", **kw):
            building.set()
            assert release.wait(10)

    def waiter(tag):
        with slots.ledgered_start(env, tag, kernels="m-dsa", **kw) as e:
            with lock:
                inside.append(e["first"])
                if len(inside) == 2:
                    both_inside.set()
            both_inside.wait(20)  # a serialised gate keeps the other waiter out: this times out

    b = threading.Thread(target=builder)
    b.start()
    assert building.wait(10)
    ws = [threading.Thread(target=waiter, args=(f"w{i}",)) for i in range(2)]
    for w in ws:
        w.start()
    time.sleep(0.5)
    assert inside == []  # both wait at the gate while the kernels build
    release.set()
    b.join(10)
    assert both_inside.wait(10), "the second waiter only got in after the first waiter's start ended"
    for w in ws:
        w.join(10)
    assert inside == [False, False]


@pytest.fixture
def gpu_harness(monkeypatch):
    """test/gpu's server harness imported on CPU: its modules skip at import without CUDA, so their plain
    Python (the servers' commands, the gate's key, the start path) ran first on the H200, where a
    ValueError in the gate's key failed the README launch test. CUDA is only claimed for the imports;
    sys.modules, sys.path and torch are restored after the test."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.syspath_prepend(_GPU)
    mods = {}
    for name in ("server_support", "test_readme_launch"):
        spec = importlib.util.spec_from_file_location(name, os.path.join(_GPU, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, mod)
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods


# Every TestServer subclass in test/gpu, with how the test below builds one.
SERVER_KINDS = {"ReadmeServer"}


def test_every_test_server_kind_names_the_kernels_its_first_start_builds(gpu_harness, tmp_path, monkeypatch):
    """The gate's key comes from each server's own command: the suite's servers name their attention
    backend, the README's launch line does not (upstream chooses)."""
    import re

    monkeypatch.delenv("SGLANG_CP_TEST_ATTENTION_BACKEND", raising=False)
    support, readme = gpu_harness["server_support"], gpu_harness["test_readme_launch"]
    keys = {m: support.server(m, [], str(tmp_path), m).kernels() for m in support.MODELS}
    assert keys == {"mla": "tiny-dsv3-triton", "mha": "tiny-olmo2-triton", "dsa": "tiny-glm5-dsa-dsa"}, keys
    srv = readme.ReadmeServer(readme.readme_command("python -m sglang.launch_server"),
                              log_path=str(tmp_path / "readme.log"))
    assert "--attention-backend" not in srv.command() and srv.kernels() == "tiny-dsv3-default"
    monkeypatch.setenv("SGLANG_CP_TEST_ATTENTION_BACKEND", "fa3")
    assert srv.kernels() == "tiny-dsv3-fa3"
    found = set()
    for name in os.listdir(_GPU):
        if name.endswith(".py"):
            with open(os.path.join(_GPU, name)) as f:
                found |= set(re.findall(r"^class (\w+)\(TestServer\)", f.read(), re.M))
    assert found == SERVER_KINDS, f"build the new kinds in this test: {found - SERVER_KINDS}"


def test_test_server_start_takes_the_gate_and_a_slot_and_is_ledgered(gpu_harness, tmp_path, monkeypatch):
    """TestServer.start end to end with a real child process (an HTTP server answering /health in place
    of sglang): the gate builds on the first start of its kernels only, the ledger records both starts."""
    support = gpu_harness["server_support"]
    ledger = tmp_path / "starts.jsonl"
    monkeypatch.setenv("SGLANG_CP_GPU_START_LOG", str(ledger))
    monkeypatch.setenv("SGLANG_CP_GPU_START_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.delenv("SGLANG_CP_GPU_FIRST_START_GATE", raising=False)
    health = ("import http.server, sys\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
              "    def log_message(self, *a): pass\n"
              "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")

    class HealthOnly(support.TestServer):
        def command(self):
            return [sys.executable, "-c", health, str(self.port)]

    for tag in ("first", "second"):
        srv = HealthOnly(support.MODELS["mla"], log_path=str(tmp_path / f"{tag}.log"),
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "3"},
                         startup_timeout_s=60)
        with srv:
            assert srv.startup_s is not None
    starts = slots.read_starts(str(ledger))
    assert [(e["tag"], e["kernels"], e["first"], e["ok"]) for e in starts] == [
        ("first", "tiny-dsv3-default", True, True), ("second", "tiny-dsv3-default", False, True)], starts
    assert os.path.exists(tmp_path / "locks" / "gpu3.tiny-dsv3-default.warm")


def test_fsck_summary_keeps_totals_and_counts_not_a_tail(tmp_path):
    """The soak keeps fsck's totals and counts per kind, and a head of the findings: the old tail of the
    text cut the totals off behind hundreds of inert orphans (the first H200 pass's JSON)."""
    import json

    from sglang_cp.demo_config import write_demo_config

    cfg = write_demo_config(str(tmp_path / "l3"), capacity_gb=0.1)
    real = subprocess.run([sys.executable, "-m", "sglang_cp.cli", "l3", "fsck", "--cp-l3-config", cfg, "--json"],
                          capture_output=True, text=True, timeout=120)
    s = soak.fsck_summary(real.stdout, real.returncode)
    assert (s["rc"], s["findings_total"], s["counts"], s["live"]) == (0, 0, {}, 0), real.stderr[-2000:]
    assert soak.fsck_line(s).endswith("0 live; no finding")

    orphans = [{"kind": "orphan", "slab": "r0.kv.slab", "slot": i, "rank": 0, "detail": "inert"} for i in range(300)]
    text = json.dumps({"entries": 288, "live": 288, "slabs": 1, "counts": {"orphan": 300}, "findings": orphans})
    s = soak.fsck_summary(text, 0)
    assert (s["findings_total"], len(s["findings_head"]), s["entries"]) == (300, 10, 288)
    assert soak.fsck_line(s) == "fsck rc 0: 1 slab files, 288 index entries, 288 live; 300 orphan"
    assert soak.fsck_summary("Traceback: boom", 2) == {"rc": 2, "unparsed_tail": "Traceback: boom"}
