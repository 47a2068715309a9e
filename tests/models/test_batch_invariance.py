"""Batch invariance: a sequence's logits are bit-identical whether it is decoded alone, together
with other sequences, with its prompt split into different micro-batches, or with its next
tokens processed as one multi-token batch."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast._loader import native
from pyfast.context import Context
from tests.reference.tiny_gguf import write_tiny_llama

PROMPT = [1604, 3987, 46477, 24, 94, 727, 284, 9615, 30, 2516, 1219, 260, 1345, 28, 17]
OTHER1 = [504, 3458, 281, 260, 6384, 12070, 30, 378]
OTHER2 = [28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45]
NEXT = [216, 585, 304, 1758]


@pytest.fixture(params=["scalar", "best"])
def isa(request):
    name = native.cpu_best_isa() if request.param == "best" else "scalar"
    old = native.cpu_isa()
    native.set_cpu_isa(name)
    yield name
    native.set_cpu_isa(old)


def alone(model, n_threads=2, n_ubatch=512, device=None):
    """Prompt as one batch, then NEXT one token at a time; returns all rows' logits."""
    ctx = Context(model, n_ctx=256, n_threads=n_threads, n_ubatch=n_ubatch, device=device)
    rows = [ctx.decode(PROMPT, seq_ids=0, logits="all")]
    for t in NEXT:
        rows.append(ctx.decode([t], seq_ids=0, logits="all"))
    return np.concatenate(rows)


def run_invariance_checks(model, device=None):
    """device: run every context there (a name or an opened Device)."""
    ref = alone(model, device=device)

    # 1. Together with two other sequences, interleaved in the same batches.
    ctx = Context(model, n_ctx=256, n_threads=2, device=device)
    toks, seqs = [], []
    for i in range(max(len(PROMPT), len(OTHER1), len(OTHER2))):
        for s, src in ((1, OTHER1), (0, PROMPT), (2, OTHER2)):
            if i < len(src):
                toks.append(src[i])
                seqs.append(s)
    out = ctx.decode(toks, seq_ids=seqs, logits="all")
    got = [out[[i for i, s in enumerate(seqs) if s == 0]]]
    for t in NEXT:
        out = ctx.decode([7, t, 9], seq_ids=[1, 0, 2], logits="all")
        got.append(out[1:2])
    np.testing.assert_array_equal(np.concatenate(got), ref)

    # 2. The prompt split into different micro-batches (odd sizes, and by the context itself).
    ctx = Context(model, n_ctx=256, n_threads=2, device=device)
    got = []
    for a, b in ((0, 1), (1, 6), (6, 13), (13, len(PROMPT))):
        got.append(ctx.decode(PROMPT[a:b], seq_ids=0, logits="all"))
    for t in NEXT:
        got.append(ctx.decode([t], seq_ids=0, logits="all"))
    np.testing.assert_array_equal(np.concatenate(got), ref)
    np.testing.assert_array_equal(alone(model, n_ubatch=4, device=device), ref)

    # 3. The next tokens as one multi-token batch (as a speculative verify batch is).
    ctx = Context(model, n_ctx=256, n_threads=2, device=device)
    got = [ctx.decode(PROMPT, seq_ids=0, logits="all"), ctx.decode(NEXT, seq_ids=0, logits="all")]
    np.testing.assert_array_equal(np.concatenate(got), ref)

    # 4. Thread count does not matter.
    np.testing.assert_array_equal(alone(model, n_threads=1, device=device), ref)
    np.testing.assert_array_equal(alone(model, n_threads=3, device=device), ref)

    # 5. After another sequence's cells were freed and reused in between (cells out of order).
    ctx = Context(model, n_ctx=256, n_threads=2, device=device)
    ctx.decode(OTHER2, seq_ids=2, logits="none")
    ctx.decode(PROMPT[:5], seq_ids=0, logits="none")
    ctx.truncate(2, 3)  # frees cells below sequence 0's next ones
    got = [ctx.decode(PROMPT[5:], seq_ids=0, logits="all")]
    for t in NEXT:
        got.append(ctx.decode([t], seq_ids=0, logits="all"))
    full = alone(model, device=device)
    np.testing.assert_array_equal(np.concatenate(got), full[5:])


def test_batch_invariance_smollm2(smollm2_model, isa):
    run_invariance_checks(smollm2_model)


@pytest.mark.parametrize("wtype", ["f32", "f16", "q8_0", "q4_0", "q4_1"])
def test_batch_invariance_tiny(tmp_path, wtype):
    from pyfast.models import Model

    path = tmp_path / f"tiny-{wtype}.gguf"
    write_tiny_llama(path, n_vocab=50000, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96, wtype=wtype)
    run_invariance_checks(Model(path))
