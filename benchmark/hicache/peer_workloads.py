"""Workloads of the peers benchmark (``bench_peers.py``): deterministic, seeded, pure Python.

A workload is a list of ``Prompt``s: each names the ids of the blocks its tokens come from (in order),
its length in tokens, how many tokens to generate and when to send it (open loop). Two prompts that
name the same leading blocks share that prefix token for token, which is all a prefix cache can see.

**Trace replay** (the Mooncake FAST'25 format, JSON Lines)::

    {"timestamp": 3000, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3, ...]}

``timestamp`` is the arrival in milliseconds, ``hash_ids`` the ids of the prompt's 512-token blocks
(``TRACE_BLOCK_TOKENS``; the same id at the same place means the same tokens and the same prefix).

- *Tokens.* A block id maps to a fixed sequence of ``block_tokens`` token ids inside the model's vocab
  (``BlockTokens``: same id, same tokens); a prompt is the concatenation of its blocks cut to
  ``input_length * block_tokens / 512`` tokens (rounded up), and to ``max_input_tokens`` if given. Each
  block carries a marker token planted at a density of its own, so a prompt has one most frequent token
  (``prompt_mode``): under the test-only KV-sensitive weights (``test/gpu/kv_sensitive``) a server's first
  output token is that token, read from the prefix KV, so a wrong KV page can change the answer.
- *System prompt.* The longest block prefix shared by a strict majority of the trace's requests
  (``system_prefix``): grown one block at a time, each time with the most common next block among the
  requests that still share it, while more than half of all requests share the longer prefix.
- *Conversation.* Requests that share their first block after the system prompt are one conversation
  (``conversation_key``): the block at position k, where k is the length of the common prefix of the
  request's ``hash_ids`` and the system prompt. A request that has no block past that point is a
  conversation of its own.
- *Sampling* (``sample_conversations``) keeps whole conversations, chosen with a seeded RNG, every
  request of a kept conversation in its trace order: the reuse between turns stays intact.
- *Time.* ``time_compression`` divides the gaps between timestamps (open loop sends at the compressed
  offsets from the first request; closed loop ignores them).

**Ideal hit ratio** (``ideal_hits``), what a prefix cache of unbounded size could serve on the replayed
sample, in send order: a block of a prompt is a hit when earlier prompts of the sample held all of the
block this prompt uses (a prompt cut inside a block held only that block's first tokens) and every
earlier block of the same prompt is a hit (a prefix cache serves only a prefix). The block ratio is hit
blocks / blocks. The token ratio counts the hit blocks' tokens plus, of the first block that is not a
hit, the tokens earlier prompts held of it; at most ``(tokens - 1) // page * page`` per prompt (a server
caches whole pages and never a prompt's last token), over all prompt tokens: the ceiling for a tier's
``cached_tokens_details`` (device + host + storage).

**Reachable at send** (``reachable_at_send``), the same prefix cache as a run could have had it: a
prompt's blocks count only from the moment its first token came back (its prefill is then done), so a
turn sent while an earlier turn of its conversation was still in prefill reaches less than the ideal.
It splits a tier's shortfall from the ideal into *in flight* (no tier could hold those blocks yet: the
replay's own concurrency) and *lost* (blocks a prompt that had already answered held, not served:
evicted from every level, never written, or declined by the prefetch) -- ``peer_report`` prints both.
The trace's turns come minutes apart; a replay that keeps a conversation's turns in order (closed loop
of conversations, ``--loop sessions``) leaves little in flight, one that sends requests in trace order
on a few clients (``--loop closed``) sends later turns before earlier ones are done.

**Long-document storm** (``storm``): ``docs`` documents x ``suffixes`` suffixes, documents drawn with
Zipf(``alpha``) popularity from a seeded RNG, each request a whole document and one of its suffixes.
``storm_docs_needed`` sizes ``docs`` so the documents' KV exceeds device + host pool memory.

**Pool notes.** Two of upstream's limits decide what a run measures whatever the storage tier:
``device_pool_note`` (a queued request's device prefix is evicted before admission) and
``host_pool_notes`` (a host pool smaller than the device pool; the prefetch budget of half the host
pool). ``bench_peers`` appends them to the workload's description, which the log and the report print.
"""

from __future__ import annotations

import hashlib
import json
from array import array
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional

TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' block size
LOW_TOKEN = 3  # ids below this are often special tokens (bos, eos, pad)
PAGE = 64


class WorkloadError(ValueError):
    """Bad workload input: the message names the line or flag, the field and the fix."""


@dataclass(frozen=True)
class TraceRequest:
    line: int  # 1-based line in the trace file
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple


@dataclass(frozen=True)
class Prompt:
    blocks: tuple  # ids of the blocks its tokens come from, in order
    tokens: int  # prompt length in tokens
    output_tokens: int  # max_new_tokens
    at_s: float = 0.0  # open loop: send offset from the phase's start
    conversation: Hashable = None  # the trace conversation or storm document it belongs to


# ---- trace ----------------------------------------------------------------------------------------
def _int_field(obj: dict, name: str, where: str, minimum: int) -> int:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < minimum:
        raise WorkloadError(f"{where}: field '{name}' must be an integer >= {minimum}, got {v!r}; "
                            "fix the line (Mooncake trace format: timestamp, input_length, output_length, hash_ids)")
    return int(v)


def parse_trace(lines: Iterable[str], source: str = "trace") -> list:
    """TraceRequests from JSON lines (blank lines skipped), in file order."""
    out = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{source}:{n}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: not a JSON object ({e.msg}); write one JSON object per line") from None
        if not isinstance(obj, dict):
            raise WorkloadError(f"{where}: not a JSON object; write one JSON object per line")
        ts = obj.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
            raise WorkloadError(f"{where}: field 'timestamp' must be a number of milliseconds >= 0, got {ts!r}")
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise WorkloadError(f"{where}: field 'hash_ids' must be a non-empty list of integers, got {ids!r}")
        out.append(TraceRequest(n, float(ts), _int_field(obj, "input_length", where, 1),
                                _int_field(obj, "output_length", where, 0), tuple(ids)))
    if not out:
        raise WorkloadError(f"{source}: no requests; give a JSON Lines file with one request per line")
    return out


def read_trace(path: str) -> list:
    with open(path) as f:
        return parse_trace(f, source=path)


def system_prefix(reqs: list) -> tuple:
    """The longest block prefix shared by a strict majority of ``reqs`` (see the module docstring)."""
    prefix: list = []
    alive = list(reqs)
    while True:
        k = len(prefix)
        counts = Counter(r.hash_ids[k] for r in alive if len(r.hash_ids) > k)
        if not counts:
            return tuple(prefix)
        block, c = counts.most_common(1)[0]
        if 2 * c <= len(reqs):
            return tuple(prefix)
        prefix.append(block)
        alive = [r for r in alive if len(r.hash_ids) > k and r.hash_ids[k] == block]


def conversation_key(req: TraceRequest, prefix: tuple) -> Hashable:
    """The first block after the system prompt, or ("alone", line) for a request with none."""
    k = 0
    while k < min(len(prefix), len(req.hash_ids)) and req.hash_ids[k] == prefix[k]:
        k += 1
    return req.hash_ids[k] if k < len(req.hash_ids) else ("alone", req.line)


def conversations(reqs: list) -> dict:
    """{conversation key: its requests in trace order}, keys in order of first appearance."""
    prefix = system_prefix(reqs)
    out: dict = {}
    for r in reqs:
        out.setdefault(conversation_key(r, prefix), []).append(r)
    return out


def sample_conversations(reqs: list, count: Optional[int] = None, fraction: Optional[float] = None,
                         seed: int = 0) -> list:
    """Whole conversations, ``count`` of them or ``fraction`` of them (rounded, at least one), chosen with
    a seeded RNG; their requests in trace order. Neither given: the whole trace."""
    convs = conversations(reqs)
    keys = list(convs)
    if count is None and fraction is None:
        n = len(keys)
    elif count is not None:
        if count < 1:
            raise WorkloadError(f"--conversations {count}: must be >= 1")
        n = min(count, len(keys))
    else:
        if not 0 < fraction <= 1:
            raise WorkloadError(f"--sample-fraction {fraction}: must be in (0, 1]")
        n = max(1, round(fraction * len(keys)))
    kept = set(random.Random(seed).sample(range(len(keys)), n))
    chosen = {id(r) for i, k in enumerate(keys) if i in kept for r in convs[k]}
    return [r for r in reqs if id(r) in chosen]


def open_loop_offsets(timestamps_ms: list, compression: float) -> list:
    """Send offsets in seconds from the first request: the trace's gaps divided by ``compression``."""
    if compression <= 0:
        raise WorkloadError(f"--time-compression {compression}: must be > 0 (2 = twice as fast as the trace)")
    t0 = min(timestamps_ms)
    return [(t - t0) / 1000.0 / compression for t in timestamps_ms]


def trace_prompts(reqs: list, block_tokens: int, time_compression: float = 1.0,
                  max_input_tokens: Optional[int] = None, max_output_tokens: Optional[int] = None,
                  prefix: Optional[tuple] = None) -> list:
    """Prompts of ``reqs`` (sorted by timestamp, ties in trace order): lengths scaled from 512-token
    blocks to ``block_tokens``, cut to ``max_input_tokens``; output lengths cut to ``max_output_tokens``
    (at least 1 token). ``prefix``: the system prompt that names conversations (default: that of ``reqs``;
    give the whole trace's when ``reqs`` is a sample)."""
    if block_tokens < 1:
        raise WorkloadError(f"--block-tokens {block_tokens}: must be >= 1")
    reqs = sorted(reqs, key=lambda r: (r.timestamp_ms, r.line))
    at = open_loop_offsets([r.timestamp_ms for r in reqs], time_compression)
    prefix = system_prefix(reqs) if prefix is None else prefix
    out = []
    for r, t in zip(reqs, at):
        n = -(-r.input_length * block_tokens // TRACE_BLOCK_TOKENS)
        n = min(n, len(r.hash_ids) * block_tokens)
        if max_input_tokens:
            n = min(n, max_input_tokens)
        nblocks = -(-n // block_tokens)
        gen = max(1, min(r.output_length, max_output_tokens) if max_output_tokens else r.output_length)
        out.append(Prompt(r.hash_ids[:nblocks], n, gen, t, conversation_key(r, prefix)))
    return out


# ---- tokens ---------------------------------------------------------------------------------------
class BlockTokens:
    """Block id -> its ``block_tokens`` token ids in [LOW_TOKEN, vocab): a pure function of (seed, id).
    Each block plants its marker token at a density of its own (2-30 %), so a prompt's most frequent
    token is a marker of one of its blocks."""

    def __init__(self, block_tokens: int, vocab: int, seed: int = 0):
        if vocab <= LOW_TOKEN + 1:
            raise WorkloadError(f"vocab {vocab}: the model's vocab_size must be > {LOW_TOKEN + 1}")
        self.block_tokens, self.vocab, self.seed = block_tokens, vocab, seed
        self._cache: dict = {}

    def block(self, block_id: Hashable) -> array:
        got = self._cache.get(block_id)
        if got is None:
            digest = hashlib.blake2b(f"{self.seed}/{block_id!r}".encode(), digest_size=8).digest()
            rng = random.Random(int.from_bytes(digest, "little"))
            marker = rng.randrange(LOW_TOKEN, self.vocab)
            density = 0.02 + 0.28 * rng.random()
            got = array("i", (marker if rng.random() < density else rng.randrange(LOW_TOKEN, self.vocab)
                              for _ in range(self.block_tokens)))  # 4 bytes a token: a trace's blocks stay small
            self._cache[block_id] = got
        return got

    def prompt(self, p: Prompt) -> list:
        out = array("i")
        for b in p.blocks:
            out += self.block(b)
        return out[:p.tokens].tolist()


def prompt_mode(ids: list) -> Optional[int]:
    """The most frequent token of a prompt, or None when two tie (no single expected answer)."""
    top = Counter(ids).most_common(2)
    if not top or (len(top) == 2 and top[0][1] == top[1][1]):
        return None
    return top[0][0]


# ---- ideal hit ratio ------------------------------------------------------------------------------
class _Held:
    """Blocks a prefix cache of unbounded size holds: block -> how many of its first tokens it holds."""

    def __init__(self, block_tokens: int, page: int):
        self.block_tokens, self.page, self.tokens = block_tokens, page, {}

    def add(self, p: Prompt) -> None:
        for j, b in enumerate(p.blocks):
            self.tokens[b] = max(self.tokens.get(b, 0), min(self.block_tokens, p.tokens - j * self.block_tokens))

    def serve(self, p: Prompt) -> tuple:
        """(whole blocks hit, tokens servable) for ``p``: its held prefix, whole pages, never its last token."""
        n_hit = prefix = 0
        for j, b in enumerate(p.blocks):
            need, have = min(self.block_tokens, p.tokens - j * self.block_tokens), self.tokens.get(b, 0)
            if have < need:
                prefix += have  # a block held in part: its first tokens still match, then the prefix ends
                break
            n_hit += 1
            prefix += need
        return n_hit, min(prefix, max(0, (p.tokens - 1) // self.page * self.page))


def ideal_hits(prompts: list, block_tokens: int, page: int = PAGE, warm: Iterable = ()) -> dict:
    """What an unbounded prefix cache could serve of ``prompts`` in order (module docstring), having
    seen the ``warm`` prompts first (a restart's replay: the store kept everything the first pass wrote)."""
    held = _Held(block_tokens, page)
    for p in warm:
        held.add(p)
    hit_blocks = blocks = hit_tokens = tokens = 0
    per_prompt = []
    for p in prompts:
        n_hit, servable = held.serve(p)
        per_prompt.append(servable)
        hit_blocks += n_hit
        blocks += len(p.blocks)
        hit_tokens += servable
        tokens += p.tokens
        held.add(p)
    return {"hit_blocks": hit_blocks, "blocks": blocks, "block_ratio": hit_blocks / blocks if blocks else 0.0,
            "hit_tokens": hit_tokens, "tokens": tokens, "token_ratio": hit_tokens / tokens if tokens else 0.0,
            "per_prompt_tokens": per_prompt}


def reachable_at_send(prompts: list, sends: list, block_tokens: int, page: int = PAGE, warm: Iterable = ()) -> list:
    """Per prompt, what an unbounded prefix cache could have served it at the moment it was sent, given
    when each prompt's KV existed: ``sends[i]`` is (sent_s, first_token_s) of prompt i in one phase, or
    None for a request that failed. A server caches a prompt's KV as its prefill runs and the first token
    ends the prefill, so prompt j's blocks count for prompt i when j's first token came back no later than
    i was sent; the ``warm`` prompts' blocks count from the start. None where ``sends[i]`` is None.

    The gap between the ideal (``ideal_hits``, trace order) and this is the run's own concurrency: a turn
    sent while the turn before it was still in prefill cannot find that turn's KV in any tier."""
    if len(sends) != len(prompts):
        raise ValueError(f"reachable_at_send: {len(sends)} send times for {len(prompts)} prompts")
    held = _Held(block_tokens, page)
    for p in warm:
        held.add(p)
    answered = sorted((s[1], i) for i, s in enumerate(sends) if s is not None)
    out: list = [None] * len(prompts)
    k = 0
    for sent, i in sorted((s[0], i) for i, s in enumerate(sends) if s is not None):
        while k < len(answered) and answered[k][0] <= sent:
            held.add(prompts[answered[k][1]])
            k += 1
        out[i] = held.serve(prompts[i])[1]
    return out


def block_numbers(prompts: list) -> list:
    """Each prompt's blocks as small integers, numbered in order of first appearance: what a saved run
    keeps of the block ids (equality is all the hit-ratio functions need)."""
    ids: dict = {}
    return [[ids.setdefault(b, len(ids)) for b in p.blocks] for p in prompts]


def distinct_tokens(prompts: list, block_tokens: int) -> int:
    """Tokens of KV the workload's distinct blocks hold (its working set): each block at the most of
    it any prompt covers."""
    held = _Held(block_tokens, PAGE)
    for p in prompts:
        held.add(p)
    return sum(held.tokens.values())


# ---- long-document storm --------------------------------------------------------------------------
def storm_docs_needed(device_tokens: int, host_bytes: int, kv_bytes_per_token: int, doc_tokens: int,
                      over: float = 1.5) -> int:
    """Documents whose KV is ``over`` x (device pool + host pool): the storm's working set cannot stay
    in memory, so a re-read document comes from storage or is recomputed."""
    pools = device_tokens * kv_bytes_per_token + host_bytes
    return max(2, math.ceil(over * pools / (doc_tokens * kv_bytes_per_token)))


def device_pool_note(device_tokens: int, concurrency: int, prompt_tokens: int, output_tokens: int = 1,
                     page_tokens: int = PAGE) -> str | None:
    """None when the device pool holds every client's request at once (its prompt and its output, in whole
    pages: what a running request takes); else one line on what upstream does then. A queued request's
    matched device prefix is evicted by the running ones before it is admitted; upstream re-issues its
    storage lookup each time that prefix shrinks and, after ``hicache_storage_prefetch_retry_max_attempts``,
    admits it without storage: recomputed tokens that no storage tier could have served, whatever it holds."""
    per_request = -(-(prompt_tokens + output_tokens) // page_tokens) * page_tokens
    need = concurrency * per_request
    if device_tokens >= need:
        return None
    return (f"--device-tokens {device_tokens} holds {device_tokens // per_request} of the {concurrency} clients' "
            f"{prompt_tokens}-token prompts (with their {output_tokens} output tokens, {per_request} tokens in pages "
            f"of {page_tokens}): queued requests lose their device prefix before admission and upstream "
            f"admits some without storage after its re-issue cap (recomputed, on every tier); "
            f"--device-tokens {need} measures the storage tiers instead")


def host_pool_notes(host_bytes: int, device_tokens: int, host_bytes_per_token: int, concurrency: int,
                    prompt_tokens: list) -> list:
    """Lines on what upstream's host pool (HiCache cache mode, ``hicache_size`` GB) cannot do for this run,
    the last one the ``--hicache-size`` (whole GB, as upstream takes it) that avoids them all; empty when
    it can.

    - A host pool smaller than the device pool holds little the device pool does not already hold
      (upstream warns at start): its host hits measure nothing.
    - Upstream prefetches from storage into the host pool and declines a prefetch (rate limited) once the
      prefetches in flight reserve half the pool (``HiCacheController.prefetch_capacity_limit``; checked
      before the new one reserves its span). A declined prefetch is retried while its request waits but
      not once it heads the queue: computed instead, on every storage tier alike. ``concurrency`` clients
      prefetch at most their prompts at once, so the pool never declines when the ``concurrency - 1``
      longest ``prompt_tokens`` fit in its half (fewer when there are fewer prompts than clients)."""
    host_tokens = int(host_bytes // host_bytes_per_token)
    asking = min(concurrency, len(prompt_tokens))  # clients with a prompt to send
    in_flight = sum(sorted(prompt_tokens, reverse=True)[:max(0, asking - 1)])  # reserved when the last asks
    notes = []
    if host_tokens < device_tokens:
        notes.append(f"the host pool holds {host_tokens} tokens, fewer than the device pool's {device_tokens}: "
                     "it keeps little the device pool does not")
    if in_flight >= host_tokens // 2:
        notes.append(f"upstream declines a storage prefetch (rate limited) once those in flight reserve half the "
                     f"host pool ({host_tokens // 2} tokens) and {concurrency} clients can reserve {in_flight} before "
                     "the last one asks: declined prefetches are recomputed, on every tier")
    if notes:
        need_tokens = max(device_tokens, 2 * in_flight + 2)
        notes.append(f"--hicache-size {math.ceil(need_tokens * host_bytes_per_token / 1e9)} "
                     "measures the storage tiers instead")
    return notes


def warm_up_prompts(prompts: list, block_tokens: int) -> list:
    """The prompts a run sends once, to a server of its own, before its first tier: the workload's
    shortest, median and longest prompt lengths, each of blocks no workload prompt names (``warm/...``),
    all sent twice, the second time as a prefix hit. A kernel compiled at its first use (triton's JIT,
    cached on disk for every later server of the machine) is then compiled before any tier is timed,
    instead of inside the first tier's first requests."""
    lengths = sorted({p.tokens for p in prompts})
    picked = sorted({lengths[0], lengths[len(lengths) // 2], lengths[-1]})
    warm = [Prompt(tuple(f"warm/{k}/{j}" for j in range(-(-n // block_tokens))), n, 1)
            for k, n in enumerate(picked)]
    return warm + warm


def storm(docs: int, suffixes: int, requests: int, alpha: float, seed: int, doc_tokens: int,
          suffix_tokens: int, block_tokens: int, output_tokens: int = 1) -> list:
    """``requests`` prompts: document d drawn with weight 1 / (d + 1) ** alpha, then one of its
    ``suffixes`` suffixes uniformly; blocks "d<d>/<j>" (the document) then "d<d>/s<s>/<j>"."""
    if doc_tokens % block_tokens:
        raise WorkloadError(f"--doc-tokens {doc_tokens}: must be a multiple of --block-tokens {block_tokens} "
                            "(documents are whole blocks, so every request of a document shares all of it)")
    for flag, v in (("--docs", docs), ("--suffixes", suffixes), ("--requests", requests),
                    ("--suffix-tokens", suffix_tokens)):
        if v < 1:
            raise WorkloadError(f"{flag} {v}: must be >= 1")
    rng = random.Random(seed)
    weights = [1.0 / (d + 1) ** alpha for d in range(docs)]
    doc_blocks = doc_tokens // block_tokens
    sfx_blocks = -(-suffix_tokens // block_tokens)
    out = []
    for d in rng.choices(range(docs), weights=weights, k=requests):
        s = rng.randrange(suffixes)
        blocks = tuple(f"d{d}/{j}" for j in range(doc_blocks)) + tuple(f"d{d}/s{s}/{j}" for j in range(sfx_blocks))
        out.append(Prompt(blocks, doc_tokens + suffix_tokens, output_tokens, 0.0, f"d{d}"))
    return out
