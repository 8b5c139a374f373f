"""The real-server soak's workload and bookkeeping (``test_server_soak.py``). Imports nothing
GPU-specific, so its logic is checked on CPU (``test/unit/test_gpu_soak_support.py``).

Workload (token ids; the models ship no tokenizer), built for the KV-sensitive weights
(``kv_sensitive/sitecustomize.py``: the model answers with the most frequent token of its prefix):
- a few shared system prompts (random ids from a range no planted token uses);
- documents, each with its own planted token at a high density: the answer to any prompt holding a
  document is that document's token, read from the prefix KV, so a page served from the wrong place
  (another document's, a stale slot) changes the output ids;
- questions: system prompt + document + a random question tail; documents Zipf-popular;
- multi-turn chats: system prompt + document + turns, each turn's prompt the previous prompt plus the
  reference run's answer to it plus the next user turn (``chat_turns``).
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from typing import Callable, Optional

RANDOM_LO, RANDOM_HI = 3000, 31999   # random ids (the test models' vocab is 32000)
PLANT_BASE, PLANT_STEP = 500, 97     # planted ids: 500, 597, ... (below RANDOM_LO for 25 documents)


@dataclass(frozen=True)
class Sizes:
    system_prompts: int = 3
    system_tokens: int = 512
    documents: int = 24
    doc_tokens: int = 2048
    density: float = 0.3
    questions: int = 3
    question_tokens: int = 128
    chats: int = 8
    turns: int = 4
    turn_tokens: int = 96
    zipf_s: float = 1.1
    chat_share: float = 0.25  # of the scheduled requests


def planted(doc: int) -> int:
    return PLANT_BASE + PLANT_STEP * doc


def _random_ids(rng: random.Random, n: int) -> list:
    return [rng.randint(RANDOM_LO, RANDOM_HI) for _ in range(n)]


@dataclass
class Workload:
    sizes: Sizes
    system: list          # [ids]
    docs: list            # [ids]
    questions: dict       # (doc, q) -> ids of the whole prompt
    chat_doc: list        # chat -> its document
    user_turns: dict      # (chat, turn) -> ids of that user turn

    def chat_head(self, c: int) -> list:
        d = self.chat_doc[c]
        return self.system[c % len(self.system)] + self.docs[d]


def build(sizes: Sizes = Sizes(), seed: int = 0) -> Workload:
    if planted(sizes.documents - 1) >= RANDOM_LO:
        raise ValueError(f"{sizes.documents} documents: planted ids would reach the random range")
    rng = random.Random(seed)
    system = [_random_ids(rng, sizes.system_tokens) for _ in range(sizes.system_prompts)]
    docs = []
    for d in range(sizes.documents):
        docs.append([planted(d) if rng.random() < sizes.density else rng.randint(RANDOM_LO, RANDOM_HI)
                     for _ in range(sizes.doc_tokens)])
    questions = {(d, q): system[d % len(system)] + docs[d] + _random_ids(rng, sizes.question_tokens)
                 for d in range(sizes.documents) for q in range(sizes.questions)}
    chat_doc = [rng.randrange(sizes.documents) for _ in range(sizes.chats)]
    user_turns = {(c, t): _random_ids(rng, sizes.turn_tokens) for c in range(sizes.chats) for t in range(sizes.turns)}
    return Workload(sizes, system, docs, questions, chat_doc, user_turns)


def chat_turns(w: Workload, c: int, answer: Callable[[list], list]) -> tuple:
    """Chat ``c``'s turns: turn t's prompt is turn t-1's prompt + ``answer(turn t-1's prompt)`` (the
    reference run's output ids) + user turn t. Returns ([prompt ids per turn], [answer per turn])."""
    prompts, outs = [], []
    for t in range(w.sizes.turns):
        ids = w.chat_head(c) + w.user_turns[(c, 0)] if t == 0 else prompts[-1] + list(outs[-1]) + w.user_turns[(c, t)]
        prompts.append(ids)
        outs.append(answer(ids))
    return prompts, outs


def expected_answer(w: Workload, key) -> int:
    """The planted id a prompt's answer must be (its document's)."""
    doc = key[1] if key[0] == "q" else w.chat_doc[key[1]]
    return planted(doc)


class Schedule:
    """A deterministic request stream over prompt keys: ("q", doc, question) with Zipf-popular documents,
    and ("chat", c, turn) taking the chats' turns in order, round robin."""

    def __init__(self, w: Workload, seed: int = 1):
        self.w = w
        self.rng = random.Random(seed)
        n = w.sizes.documents
        weights = [1.0 / (i + 1) ** w.sizes.zipf_s for i in range(n)]
        order = list(range(n))
        random.Random(seed + 1).shuffle(order)  # popularity is not the document number
        self.docs, self.weights = order, weights
        self.chat_pos = 0

    def next(self):
        s = self.w.sizes
        if s.chats and self.rng.random() < s.chat_share:
            k = self.chat_pos % (s.chats * s.turns)
            self.chat_pos += 1
            return ("chat", k % s.chats, k // s.chats)
        d = self.rng.choices(self.docs, self.weights)[0]
        return ("q", d, self.rng.randrange(s.questions))


def phase_plan(total_s: float, long: bool, cycle_s: float = 600.0) -> list:
    """[(cold start, how the server's life ends, seconds of load)]: the first server starts empty, every
    later one loads what the previous one left. Short: SIGKILL, then two graceful restarts. Long: a
    SIGKILL and a graceful restart alternating every ``cycle_s``; the last server always stops gracefully
    (fsck runs after it)."""
    if not long:
        return [("clear", "kill", 0.4 * total_s), ("load", "stop", 0.3 * total_s), ("load", "stop", 0.3 * total_s)]
    out, left, end = [], total_s, "kill"
    while left > 0:
        out.append(("clear" if not out else "load", end, min(cycle_s, left)))
        left -= cycle_s
        end = "stop" if end == "kill" else "kill"
    if out[-1][1] == "kill":
        out.append(("load", "stop", min(cycle_s, 60.0)))
    return out


def percentile(xs: list, p: float) -> Optional[float]:
    """Nearest-rank percentile (p in 0..100) of ``xs``; None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))
    return s[k]


def group_processes(pgid: int) -> list:
    """[(pid, cmdline, rss bytes)] of the live processes of process group ``pgid`` (from /proc)."""
    from benchmark.support.server_process import proc_cmdline, proc_stats

    out = []
    for pid, fields in proc_stats():
        if int(fields[2]) != pgid:
            continue
        try:
            cmd = proc_cmdline(pid)
            rss = 0
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1]) * 1024
            out.append((pid, cmd, rss))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


def scheduler_rss(pgid: int) -> int:
    """RSS of the server's scheduler (upstream titles it ``sglang::scheduler...``); the largest member of
    the group where no process has that title; 0 for a group that is gone."""
    procs = group_processes(pgid)
    sched = [rss for _pid, cmd, rss in procs if "sglang::scheduler" in cmd]
    return max(sched or [rss for _pid, _cmd, rss in procs] or [0])


def fsck_summary(stdout: str, rc: int, head: int = 10) -> dict:
    """What a soak keeps of ``sglang-cp l3 fsck --json``: its exit code, its totals and counts per finding
    kind, and the first ``head`` findings (a stopped soak directory holds hundreds of inert orphans, and a
    tail of the text would cut the totals off). Output that is not fsck's JSON is kept as its tail."""
    try:
        rep = json.loads(stdout)
        findings = rep.pop("findings")
    except (ValueError, KeyError, AttributeError):
        return {"rc": rc, "unparsed_tail": stdout[-2000:]}
    return {"rc": rc, **rep, "findings_head": findings[:head], "findings_total": len(findings)}


def fsck_line(summary: dict) -> str:
    if "unparsed_tail" in summary:
        return f"fsck rc {summary['rc']}: output not JSON"
    counts = ", ".join(f"{n} {k}" for k, n in sorted(summary.get("counts", {}).items())) or "no finding"
    return (f"fsck rc {summary['rc']}: {summary.get('slabs')} slab files, {summary.get('entries')} index entries, "
            f"{summary.get('live')} live; {counts}")
