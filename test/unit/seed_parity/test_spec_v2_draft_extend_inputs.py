"""002#12 / 002#13 on the real Triton kernel that prepares spec-v2 draft-extend
inputs (sglang.kernels.ops.speculative.eagle.prepare_draft_extend_inputs),
run on CPU through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess
because the flag is read when triton loads).

- select_index is the strided arange ``i * num_draft_tokens + accept_len_i - 1``
  (no host-side list building), num_correct_drafts = accept_len - 1;
- token ids come out int64 whatever integer dtype the producer used, so DP
  collectives downstream see one stable dtype.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys, torch
from sglang.kernels.ops.speculative.eagle import prepare_draft_extend_inputs
out = []
for dtype in (torch.int32, torch.int64):
    for acc, ndt in (([1, 3, 2], 4), ([4, 4, 1, 2, 3], 4), ([1], 1), ([2, 1], 3)):
        accept = torch.tensor(acc, dtype=torch.int32)
        predict = (torch.arange(len(acc) * ndt) + 1000).to(dtype)
        correct, select, ids = prepare_draft_extend_inputs(accept, predict, ndt)
        out.append(dict(acc=acc, ndt=ndt, src=str(dtype), correct=correct.tolist(),
                        select=select.tolist(), ids=ids.tolist(), ids_dtype=str(ids.dtype),
                        select_dtype=str(select.dtype), predict=predict.tolist()))
print("KERNEL " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def kernel_runs():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("KERNEL ")][-1]
    return json.loads(line.split(" ", 1)[1])


def test_select_index_is_the_strided_last_accepted_position(kernel_runs):
    for run in kernel_runs:
        ndt = run["ndt"]
        assert run["select"] == [i * ndt + a - 1 for i, a in enumerate(run["acc"])], run
        assert run["correct"] == [a - 1 for a in run["acc"]], run


def test_draft_extend_token_ids_are_int64_for_any_producer_dtype(kernel_runs):
    for run in kernel_runs:
        assert run["ids_dtype"] == "torch.int64" and run["select_dtype"] == "torch.int64"
        assert run["ids"] == run["predict"]
