"""The one-token decode path of recurrent (hybrid) models (Context._decode_one with a
HybridMemory) gives what the general grouped path gives: the same logits bit for bit over a
generation with verify batches, rollbacks, a second sequence and a restored state, and the same
memory afterwards (KV cells, recurrent slots, snapshot planes, the state buffers themselves)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.models.test_hybrid_common import fixture, make_ctx


def _mem(c):
    r = c.rec
    return (c.kv.cell_pos.copy(), c.kv.cell_seq.copy(), r.rs_idx.copy(), r.tail.copy(), r.n_last.copy(),
            dict(r._slot_of), r._conv.copy(), r._ssm.copy())


def _same_mem(a, b):
    for x, y in zip(_mem(a), _mem(b)):
        if isinstance(x, dict):
            assert x == y
        else:
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", ["qwen35", "qwen35moe"])
def test_one_token_path_equals_grouped_path(name):
    from pyfast.models import Model

    path, _ = fixture(name)
    model = Model(str(path))
    a = make_ctx(model, n_rollback=3, n_seq_max=2)  # general path: seq_ids as a list
    b = make_ctx(model, n_rollback=3, n_seq_max=2)  # decode_step / decode(..., seq_ids=int)
    grouped = {"n": 0}
    inner = b._decode_grouped

    def counted(*args, **kw):
        grouped["n"] += 1
        return inner(*args, **kw)

    b._decode_grouped = counted
    rng = np.random.default_rng(7)
    V = model.n_vocab
    prompt = rng.integers(0, V, 9).tolist()
    for c in (a, b):
        c.decode(prompt, seq_ids=0)
    n = len(prompt)
    n_grouped = grouped["n"]
    fast_steps = 0

    def step(tok, pos, seq, via_step):
        nonlocal fast_steps
        ref = a.decode([tok], positions=[pos], seq_ids=[seq], logits="all")[0]
        got = b.decode_step(tok, pos, seq) if via_step else b.decode([tok], positions=[pos], seq_ids=seq)[0]
        np.testing.assert_array_equal(got, ref)
        fast_steps += 1

    for rnd in range(5):
        for i in range(3):
            step(int(rng.integers(0, V)), n, 0, via_step=i % 2 == 0)
            n += 1
        _same_mem(a, b)
        # a verify batch, then a rollback of some of its tokens; the next steps read a snapshot plane
        k = 4
        toks = rng.integers(0, V, k).tolist()
        ref = a.decode(toks, positions=list(range(n, n + k)), seq_ids=0, logits="all")
        got = b.decode(toks, positions=list(range(n, n + k)), seq_ids=0, logits="all")
        np.testing.assert_array_equal(got, ref)
        keep = 1 + rnd % 4  # removes 3, 2, 1 or 0 tokens (at most n_rollback)
        a.truncate(0, n + keep)
        b.truncate(0, n + keep)
        n += keep
        _same_mem(a, b)
    assert grouped["n"] - n_grouped == 5  # only the verify batches took the grouped path

    # a second sequence: its first token goes through the general path, the next ones the short one
    q = rng.integers(0, V, 3).tolist()
    for c in (a, b):
        c.decode(q, seq_ids=1)
    m = len(q)
    for i in range(4):
        step(int(rng.integers(0, V)), m, 1, via_step=True)
        step(int(rng.integers(0, V)), n, 0, via_step=False)
        m += 1
        n += 1
    _same_mem(a, b)

    # a saved state restored, then generation continues from it
    sa, sb = a.save_state(0), b.save_state(0)
    for i in range(2):
        step(int(rng.integers(0, V)), n + i, 0, via_step=True)
    a.restore_state(0, sa)
    b.restore_state(0, sb)
    for i in range(3):
        step(int(rng.integers(0, V)), n + i, 0, via_step=True)
    _same_mem(a, b)

    # a position that does not continue the sequence: the general path's error, nothing changed
    with pytest.raises(ValueError, match="do not continue its recurrent state"):
        b.decode_step(1, n + 7, 0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        b.decode_step(V, n + 3, 0)
    _same_mem(a, b)
    assert fast_steps >= 25


@pytest.mark.parametrize("name", ["qwen35", "qwen35moe"])
def test_thread_count_does_not_change_logits(name):
    """The decode plans' groups (ssm_conv, gated_delta_net, small matmul_id, topk and gather run
    alongside independent nodes, their shares on any thread) give the same logits bit for bit on
    1, 2 and 3 threads, for a prompt and for single-token steps."""
    from pyfast.models import Model

    path, _ = fixture(name)
    model = Model(str(path))
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, model.n_vocab, 7).tolist()
    steps = rng.integers(0, model.n_vocab, 6).tolist()
    outs = []
    for nt in (1, 2, 3):
        c = make_ctx(model, n_threads=nt, n_rollback=2)
        rows = [c.decode(prompt, seq_ids=0, logits="all")]
        for i, t in enumerate(steps):
            rows.append(c.decode_step(t, len(prompt) + i, 0)[None].copy())
        outs.append(np.concatenate(rows))
    for nt, o in zip((2, 3), outs[1:]):
        np.testing.assert_array_equal(o, outs[0], err_msg=f"{name}: {nt} threads vs 1")
