"""cachebench workloads: requests as lists of shared prefix segments.

A request is the concatenation of named segments (a system prompt, a document, the turns
of one conversation so far). A segment's token ids are a pure function of its id, so two
requests that name the same leading segments share that prefix token for token, and every
rank process regenerates the identical workload from (spec, seed) or from a trace file:
the replicated input that keeps the ranks' cache decisions uniform.

Trace format (``--trace FILE``, JSON Lines, one request per line, replayed in order)::

    {"segments": [{"id": "sys-0", "tokens": 2048}, {"id": "doc-17", "tokens": 30000},
                  {"id": "chat-4/turn-0", "tokens": 512}]}
    {"segments": [{"token_ids": [101, 2023, 2003]}], "id": "req-9"}

- ``segments`` (required, non-empty list): each item is either ``{"id": str, "tokens": int}``
  (synthetic token ids derived from the id: same id -> same tokens) or
  ``{"token_ids": [int, ...]}`` (your own token ids, e.g. from a tokenizer log);
- ``id`` (optional): a label for the request.
Only whole 64-token pages are cached (as in SGLang's storage path), so the tail of a
request shorter than a page is ignored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

VOCAB = 150_000


class TraceError(ValueError):
    """A trace line is malformed; the message names the line, the field and the fix."""


@dataclass(frozen=True)
class Segment:
    id: str
    n_tokens: int
    token_ids: tuple[int, ...] | None = None

    def tokens(self) -> list[int]:
        if self.token_ids is not None:
            return list(self.token_ids)
        seed = int.from_bytes(hashlib.blake2b(self.id.encode(), digest_size=8).digest(), "little")
        return np.random.default_rng(seed).integers(1, VOCAB, self.n_tokens).tolist()


@dataclass(frozen=True)
class Request:
    id: str
    segments: tuple[Segment, ...]

    def tokens(self, page: int) -> list[int]:
        out: list[int] = []
        for s in self.segments:
            out += s.tokens()
        return out[: len(out) // page * page]


@dataclass(frozen=True)
class WorkloadSpec:
    """Synthetic multi-turn long-context workload (sizes in tokens)."""

    system_prompts: int = 4
    system_tokens: int = 1024
    documents: int = 24
    doc_tokens_min: int = 1024
    doc_tokens_max: int = 3072
    sessions: int = 40
    turns: int = 3
    turn_tokens: int = 256
    zipf_s: float = 1.1
    seed: int = 0

    def validate(self) -> None:
        for name in ("system_prompts", "documents", "sessions", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        for name in ("system_tokens", "doc_tokens_min", "turn_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1 token, got {getattr(self, name)}")
        if self.doc_tokens_max < self.doc_tokens_min:
            raise ValueError(f"--doc-tokens-max: {self.doc_tokens_max} is below --doc-tokens-min "
                             f"{self.doc_tokens_min}; raise it")
        if self.zipf_s <= 0:
            raise ValueError(f"--zipf-s: must be > 0, got {self.zipf_s}")


def generate(spec: WorkloadSpec) -> list[Request]:
    """Sessions pick a system prompt (uniform) and a document (Zipf by rank); their turns are
    interleaved with other sessions', so a document's prefix comes back after others ran."""
    spec.validate()
    rng = np.random.default_rng(spec.seed)
    doc_len = rng.integers(spec.doc_tokens_min, spec.doc_tokens_max + 1, spec.documents)
    weights = 1.0 / np.arange(1, spec.documents + 1) ** spec.zipf_s
    weights /= weights.sum()
    sessions = []
    for s in range(spec.sessions):
        sys_i = int(rng.integers(spec.system_prompts))
        doc_i = int(rng.choice(spec.documents, p=weights))
        sessions.append([Segment(f"sys-{spec.seed}-{sys_i}", spec.system_tokens),
                         Segment(f"doc-{spec.seed}-{doc_i}", int(doc_len[doc_i]))])
    # Turn t of a session is issued after turn t-1; sessions are otherwise shuffled together.
    order = [s for s in range(spec.sessions) for _ in range(spec.turns)]
    rng.shuffle(order)
    next_turn = [0] * spec.sessions
    requests = []
    for s in order:
        t = next_turn[s]
        next_turn[s] += 1
        turns = tuple(Segment(f"chat-{spec.seed}-{s}/turn-{k}", spec.turn_tokens) for k in range(t + 1))
        requests.append(Request(f"s{s}t{t}", tuple(sessions[s]) + turns))
    return requests


def read_trace(path: str) -> list[Request]:
    requests = []
    try:
        f = open(path)
    except OSError as e:
        raise TraceError(f"--trace: cannot open '{path}' ({e.strerror}); pass a JSONL trace file") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"--trace {path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg}); one JSON object per line") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: must be a JSON object with 'segments'")
            segs = obj.get("segments")
            if not isinstance(segs, list) or not segs:
                raise TraceError(f"{where}: 'segments' must be a non-empty list of "
                                 '{"id": str, "tokens": int} or {"token_ids": [int, ...]}')
            out = []
            for i, s in enumerate(segs):
                out.append(_segment(s, f"{where}: segments[{i}]"))
            requests.append(Request(str(obj.get("id", f"line{n}")), tuple(out)))
    if not requests:
        raise TraceError(f"--trace: '{path}' holds no requests; write one JSON object per line")
    return requests


def _segment(s, where: str) -> Segment:
    if not isinstance(s, dict):
        raise TraceError(f"{where}: must be an object")
    if "token_ids" in s:
        ids = s["token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                          and t >= 0 for t in ids):
            raise TraceError(f"{where}.token_ids: must be a non-empty list of non-negative integers")
        return Segment("<explicit>", len(ids), tuple(ids))
    sid, n = s.get("id"), s.get("tokens")
    if not isinstance(sid, str) or not sid:
        raise TraceError(f"{where}.id: must be a non-empty string (or give token_ids instead)")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TraceError(f"{where}.tokens: must be a positive integer, got {n!r}")
    return Segment(sid, n)


def write_trace(requests: list[Request], path: str) -> None:
    with open(path, "w") as f:
        for r in requests:
            segs = [{"token_ids": list(s.token_ids)} if s.token_ids is not None else {"id": s.id, "tokens": s.n_tokens}
                    for s in r.segments]
            f.write(json.dumps({"id": r.id, "segments": segs}) + "\n")


def unique_pages(requests: list[Request], page: int) -> int:
    """Distinct page-aligned prefixes (= distinct storage pages) the workload touches."""
    seen = set()
    for r in requests:
        toks = r.tokens(page)
        h = hashlib.blake2b(digest_size=16)
        for p in range(len(toks) // page):
            h.update(np.asarray(toks[p * page:(p + 1) * page], dtype=np.int64).tobytes())
            seen.add(h.copy().digest())
    return len(seen)
