"""Context.decode's short paths give what the general path gives: the run bookkeeping for one
sequence at consecutive positions (a verify batch, seq_ids given as one int), copy=False views,
and decode_step; same logits bit for bit and the same cache afterwards."""
from __future__ import annotations

import numpy as np

from pyfast.context import Context


def _pair(model):
    return Context(model, n_ctx=256, n_threads=2), Context(model, n_ctx=256, n_threads=2)


def test_run_path_and_views_equal_general_path(smollm2_model):
    a, b = _pair(smollm2_model)
    rng = np.random.default_rng(3)
    prompt = rng.integers(100, 20000, 40).tolist()
    for c in (a, b):
        c.decode(prompt, seq_ids=0)
    n = len(prompt)
    for step in range(6):
        k = int(rng.integers(2, 12))
        toks = rng.integers(100, 20000, k).tolist()
        pos = list(range(n, n + k))
        ref = a.decode(toks, positions=pos, seq_ids=[0] * k, logits="all")       # general path
        got = b.decode(toks, positions=pos, seq_ids=0, logits="all", copy=False)  # run path, a view
        np.testing.assert_array_equal(got, ref)
        keep = int(rng.integers(0, k + 1))  # a verify round keeps a prefix
        a.truncate(0, n + keep)
        b.truncate(0, n + keep)
        np.testing.assert_array_equal(a.kv.cell_pos, b.kv.cell_pos)
        np.testing.assert_array_equal(a.kv.cell_seq, b.kv.cell_seq)
        n += keep
        one_a = a.decode([toks[0]], positions=[n], seq_ids=[0], logits="all")[0]
        one_b = b.decode_step(toks[0], n, 0)
        np.testing.assert_array_equal(one_b, one_a)
        n += 1
    # logits="none" with copy=False is an empty result, not the graph's placeholder row
    none = b.decode([5, 6], positions=[n, n + 1], seq_ids=0, logits="none", copy=False)
    assert none.shape == (0, smollm2_model.n_vocab)
