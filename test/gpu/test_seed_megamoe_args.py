"""002#04 MegaMoE a2a backend: on an SM90/SM100 GPU upstream resolves
--moe-a2a-backend megamoe and forces ep_size to tp_size (on CPU it refuses
with a clear message, covered by test/unit/seed_parity)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    # The lent GPU machine runs Python 3.12 and sglang 0.5.23's wheel is cp311-only:
    # these drive upstream code, so they need a CUDA machine with the pinned sglang.
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang 0.5.23"),
    pytest.mark.skipif(
        not torch.cuda.is_available()
        or torch.cuda.get_device_capability()[0] not in (9, 10),
        reason="needs an SM90 or SM100 GPU",
    ),
]


def test_megamoe_forces_ep_size_to_tp_size():
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    # A real MoE config (DeepseekV3, 8 routed experts). With "--model-path dummy"
    # the H200 run resolved ep_size to 1: no model, no MoE layers to size.
    model = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "tiny-dsv3")
    args = prepare_server_args(
        ["--model-path", model, "--load-format", "dummy", "--moe-a2a-backend", "megamoe", "--tp-size", "8"]
    )
    args.resolve_once()
    # 0.5.23 resolves through declared overrides: the raw record keeps the input
    # (ep_size 1), the resolved view carries what the server runs with.
    cfg = resolved_view(args)
    assert cfg.moe_a2a_backend == "megamoe"
    assert cfg.ep_size == cfg.tp_size == 8
