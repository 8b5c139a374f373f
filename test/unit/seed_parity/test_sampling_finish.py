"""Seed items on sampling and finish state, all already upstream in 0.5.23.

- 002#05 min_new_tokens penalty via torch.where (no mask-index sync, no -inf*0 NaN)
- 002#06 ReasonerGrammarObject tracks current_token on the wrapper
- 002#07 stop string checked before EOS in one speculative step; finished_len at the stop
"""

from __future__ import annotations

from array import array

import pytest
import torch

from conftest import WORDS

ID = {w: i for i, w in enumerate(WORDS)}


class _Batch:
    """Holder the orchestrator weak-references: it reads only .reqs and .device."""

    def __init__(self, reqs, device):
        self.reqs = reqs
        self.device = device


def _req(rid, tokenizer, *, min_new_tokens=0, stop=None, max_new_tokens=16):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(
        max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, stop=stop
    )
    sp.normalize(tokenizer)
    req = Req(rid, "hello", array("i", [ID["hello"]]), sp, vocab_size=len(WORDS))
    req.tokenizer = tokenizer
    return req


@pytest.fixture
def tokenizer(word_tokenizer):
    # Upstream's penalizer reads this attribute that sglang's tokenizer wrapper adds.
    word_tokenizer.additional_stop_token_ids = None
    return word_tokenizer


def test_min_new_tokens_masks_eos_only_while_below_minimum(tokenizer):
    from sglang.srt.sampling.penaltylib.min_new_tokens import (
        BatchedMinNewTokensPenalizer,
    )
    from sglang.srt.sampling.penaltylib.orchestrator import (
        BatchedPenalizerOrchestrator,
    )

    reqs = [_req("a", tokenizer, min_new_tokens=2), _req("b", tokenizer)]
    batch = _Batch(reqs, "cpu")
    orch = BatchedPenalizerOrchestrator(
        vocab_size=len(WORDS), batch=batch, penalizers={BatchedMinNewTokensPenalizer}
    )
    assert orch.is_required
    pen = orch.penalizers[BatchedMinNewTokensPenalizer]

    logits = torch.zeros(2, len(WORDS))
    # Row b already carries -inf (e.g. a grammar mask). A multiply-by-mask
    # implementation would compute -inf * 0 = NaN on the inactive row.
    logits[1, ID["x"]] = float("-inf")
    pen.apply(logits)
    assert not torch.isnan(logits).any()
    assert logits[0, ID["<eos>"]] == float("-inf")  # below minimum: EOS banned
    assert logits[1, ID["<eos>"]] == 0.0  # no minimum: untouched
    assert logits[1, ID["x"]] == float("-inf")

    for _ in range(2):
        pen.cumulate_output_tokens(torch.tensor([ID["x"], ID["x"]]))
    logits = torch.zeros(2, len(WORDS))
    pen.apply(logits)
    assert torch.equal(logits, torch.zeros(2, len(WORDS)))  # minimum reached


def test_min_new_tokens_apply_has_no_data_dependent_indexing():
    """On the meta device any boolean-mask write (logits[mask] = ...) raises,
    because its shape depends on data; that is exactly the host-sync pattern
    the seed removed. torch.where/add_ run fine on meta."""
    from sglang.srt.sampling.penaltylib.min_new_tokens import (
        BatchedMinNewTokensPenalizer,
    )

    pen = object.__new__(BatchedMinNewTokensPenalizer)
    pen.min_new_tokens = torch.empty(3, 1, dtype=torch.int32, device="meta")
    pen.len_output_tokens = torch.empty(3, 1, dtype=torch.int32, device="meta")
    pen.stop_token_penalties = torch.empty(3, 11, device="meta")
    logits = torch.empty(3, 11, device="meta")
    pen._apply(logits)  # raises on meta if it indexes with a boolean mask
    with pytest.raises(Exception):
        logits[pen.len_output_tokens.squeeze(1) < 1] += 1.0  # the control


def test_reasoner_grammar_wrapper_tracks_current_token():
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject

    wrapper = ReasonerGrammarObject(grammar=None, think_end_ids=[ID["END"]])
    assert wrapper.current_token is None
    wrapper.accept_token(ID["x"])
    # disaggregation's prebuilt replay reads the WRAPPER's current_token to
    # avoid accepting an already-accepted token twice.
    assert wrapper.current_token == ID["x"]
    wrapper.accept_token(ID["END"])
    assert wrapper.current_token == ID["END"]


def test_reasoner_grammar_copy_keeps_current_token():
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject

    wrapper = ReasonerGrammarObject(grammar=None, think_end_ids=[ID["END"]])
    wrapper.accept_token(ID["y"])
    assert wrapper.copy().current_token == ID["y"]


@pytest.mark.parametrize(
    "accepted, expected_len",
    [
        # one spec step accepts "world END tail <eos>": the stop string wins and
        # the output is cut right after END (tail and EOS must not leak)
        (["world", "END", "tail", "<eos>"], 2),
        # EOS before the stop string still finishes at the EOS
        (["world", "<eos>", "tail", "y"], 2),
    ],
)
def test_stop_string_before_eos_in_one_spec_step(tokenizer, accepted, expected_len):
    from sglang.srt.managers.schedule_batch import FINISH_MATCHED_STR, FINISH_MATCHED_TOKEN

    req = _req("r", tokenizer, stop=["END"])
    req.output_ids.extend(ID[w] for w in accepted)
    req.update_finish_state(new_accepted_len=len(accepted))
    assert req.finished()
    assert req.finished_len == expected_len
    expected_type = FINISH_MATCHED_STR if "END" in accepted[:expected_len] else FINISH_MATCHED_TOKEN
    assert isinstance(req.finished_reason, expected_type)


def test_out_of_vocab_token_sanitized_before_stop_string(tokenizer):
    """Vocab-boundary sanitization runs before any decode of the new tokens."""
    req = _req("r", tokenizer, stop=["END"])
    req.output_ids.extend([ID["world"], len(WORDS) + 5, ID["END"]])
    req.update_finish_state(new_accepted_len=3)
    assert req.finished_len == 2
    assert req.finished_reason.to_json()["matched"] == "NaN happened"
