"""Shared fixtures for the seed-parity audit tests (issue 6).

Every test here drives the REAL upstream sglang 0.5.23 code path. Helpers only
build inputs (a tiny real tokenizer, a parallel topology); none re-implement
upstream logic.
"""

from __future__ import annotations

import contextlib

import pytest


def _word_tokenizer(words):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece decoding joins whole words with spaces: decode() is exact text.
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>"
    )


WORDS = ["<unk>", "<eos>", "hello", "world", "END", "tail", "x", "y", "z"]


@pytest.fixture(scope="session")
def word_tokenizer():
    """A real HF fast tokenizer over WORDS (id == index)."""
    return _word_tokenizer(WORDS)


@contextlib.contextmanager
def topology(*, tp_size: int, attn_tp_size: int, attn_cp_size: int, **ranks):
    """Scoped upstream ParallelContext override with a self-consistent shape."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(
        tp_size=tp_size,
        moe_tp_size=tp_size,
        attn_tp_size=attn_tp_size,
        attn_cp_size=attn_cp_size,
        **ranks,
    ):
        yield get_parallel()


def gloo_rendezvous(d) -> str:
    """A gloo init method for rank processes: a file store in the fresh private directory `d`. A TCP
    port picked by bind + close can be taken by another process before rank 0 binds it."""
    return f"file://{d}/store"
