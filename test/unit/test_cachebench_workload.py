"""cachebench's workload: replicated (same spec -> same requests in every rank process),
shared prefixes where the design says so, Zipf popularity, and the JSONL trace format."""

import collections
import json

import pytest

from sglang_cp.cachebench.report import summarize
from sglang_cp.cachebench.workload import (Request, Segment, TraceError, WorkloadSpec, generate, read_trace,
                                           unique_pages, write_trace)

PAGE = 64


def _common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_same_spec_same_requests_other_seed_other_requests():
    spec = WorkloadSpec(sessions=6, documents=4, seed=3)
    a, b = generate(spec), generate(spec)
    assert [r.tokens(PAGE) for r in a] == [r.tokens(PAGE) for r in b]
    c = generate(WorkloadSpec(sessions=6, documents=4, seed=4))
    assert [r.tokens(PAGE) for r in a] != [r.tokens(PAGE) for r in c]


def test_turns_extend_their_session_and_sessions_share_system_and_document_prefixes():
    spec = WorkloadSpec(sessions=8, turns=3, documents=2, system_prompts=1, doc_tokens_min=640,
                        doc_tokens_max=640, system_tokens=512, turn_tokens=128)
    reqs = generate(spec)
    by_session = collections.defaultdict(list)
    for r in reqs:
        by_session[r.id.split("t")[0]].append(r)
    for turns in by_session.values():
        assert [r.id for r in turns] == sorted(r.id for r in turns)  # turn t after turn t-1
        for prev, nxt in zip(turns, turns[1:]):
            p, n = prev.tokens(PAGE), nxt.tokens(PAGE)
            assert n[:len(p)] == p and len(n) == len(p) + 128  # the next turn extends the conversation
    firsts = [t[0].tokens(PAGE) for t in by_session.values()]
    # One system prompt: every pair shares it; same document: they share it too.
    assert min(_common_prefix(a, b) for a in firsts for b in firsts if a is not b) >= 512
    docs = collections.Counter(t[0].segments[1].id for t in by_session.values())
    same_doc = [t[0].tokens(PAGE) for t in by_session.values()
                if t[0].segments[1].id == docs.most_common(1)[0][0]]
    if len(same_doc) > 1:
        assert _common_prefix(same_doc[0], same_doc[1]) >= 512 + 640


def test_document_popularity_is_zipf_ranked():
    reqs = generate(WorkloadSpec(sessions=2000, turns=1, documents=10, zipf_s=1.2, seed=1))
    counts = collections.Counter(r.segments[1].id for r in reqs)
    ranked = [counts[f"doc-1-{i}"] for i in range(10)]
    assert ranked[0] > ranked[1] > ranked[4] > ranked[9]
    assert ranked[0] / ranked[9] > 8  # 10 ** 1.2 ~ 15.8 expected; loose for sampling noise


def test_trace_round_trip_and_explicit_token_ids(tmp_path):
    reqs = generate(WorkloadSpec(sessions=3, documents=2, seed=9))
    reqs.append(Request("explicit", (Segment("<explicit>", 130, tuple(range(1, 131))),)))
    path = tmp_path / "t.jsonl"
    write_trace(reqs, str(path))
    back = read_trace(str(path))
    assert [r.tokens(PAGE) for r in back] == [r.tokens(PAGE) for r in reqs]
    assert back[-1].tokens(PAGE) == list(range(1, 129))  # the partial last page is not cached
    assert unique_pages(back, PAGE) == unique_pages(reqs, PAGE) > 0


@pytest.mark.parametrize("line,field", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"segments": []}', "'segments' must be a non-empty list"),
    ('{"segments": [{"id": "a", "tokens": 0}]}', "segments[0].tokens"),
    ('{"segments": [{"tokens": 5}]}', "segments[0].id"),
    ('{"segments": [{"token_ids": [1, -2]}]}', "segments[0].token_ids"),
])
def test_bad_trace_lines_name_the_line_and_field(tmp_path, line, field):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"segments": [{"id": "ok", "tokens": 64}]}) + "\n" + line + "\n")
    with pytest.raises(TraceError) as e:
        read_trace(str(path))
    assert "bad.jsonl:2" in str(e.value) and field in str(e.value)


def _rec(phase, l2, l3, computed, **kw):
    return dict(dict(phase=phase, pages=l2 + l3 + computed, l2=l2, l3=l3, computed=computed, t=0.0, dt=1.0,
                     t_read=0.5, t_write=0.5, read_bytes=l3 * 1000, write_bytes=computed * 1000,
                     store_errors=0), **kw)


def test_summary_counts_rank_divergence_and_store_errors_as_errors():
    ranks = [{"rank": 0, "records": [_rec("reload", 2, 3, 0)], "errors": [], "restart_cold_start": {},
              "occupancy_after_restart": {}},
             {"rank": 1, "records": [_rec("reload", 2, 3, 0)], "errors": [], "restart_cold_start": {},
              "occupancy_after_restart": {}}]
    ok = summarize({}, {"read_gbps": 1.0, "write_gbps": 1.0}, ranks, 1.0)
    assert ok["errors"] == 0 and ok["phases"]["reload"]["recompute_avoided_tokens"] == 3 * PAGE
    assert ok["phases"]["reload"]["l3_read_bytes"] == 6000  # both ranks' stripes
    ranks[1]["records"] = [_rec("reload", 2, 2, 1)]  # rank 1 took another branch: a divergence
    assert summarize({}, {"read_gbps": 1.0, "write_gbps": 1.0}, ranks, 1.0)["errors"] == 1
    ranks[1]["records"] = [_rec("reload", 2, 3, 0, store_errors=2)]
    assert summarize({}, {"read_gbps": 1.0, "write_gbps": 1.0}, ranks, 1.0)["errors"] == 2
