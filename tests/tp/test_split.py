"""The split plan (``pyfast/parallel/split.py``) as data, without MPI: shares with a rotating
remainder, every weight row / column held by exactly one rank (padding aside), the head and
KV / GDN head counts per rank, and a clear refusal where a cut would split a quant block."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast.models import Model
from pyfast.parallel import SplitError, plan, shares
from tests.models.test_hybrid_common import FIXTURES
from tests.reference.tiny_gguf import write_tiny_llama


def test_shares_rotate_the_remainder():
    assert shares(7, 3, 0) == [(0, 3), (3, 2), (5, 2)]
    assert shares(7, 3, 1) == [(0, 2), (2, 3), (5, 2)]
    assert shares(2, 3, 0) == [(0, 1), (1, 1), (2, 0)]   # a zero-size slice
    assert shares(2, 3, 2) == [(0, 1), (1, 0), (1, 1)]
    for n, N in ((10, 4), (3, 2), (0, 2), (5, 5)):
        for rot in range(N):
            s = shares(n, N, rot)
            assert sum(c for _, c in s) == n and all(a == sum(c for _, c in s[:r]) for r, (a, _) in enumerate(s))
            assert max(c for _, c in s) - min(c for _, c in s) <= 1
    # over N layers every rank gets the same total
    tot = np.zeros(3, int)
    for layer in range(3):
        tot += [c for _, c in shares(7, 3, layer)]
    assert tot.tolist() == [7, 7, 7]


def _coverage(model, N):
    """For each split weight: how many ranks hold each source row (rows rule) / column (cols rule)."""
    plans = [plan(model.arch.ARCH, model.args, model.weights, r, N) for r in range(N)]
    cover: dict[str, np.ndarray] = {}
    for p in plans:
        for name, rule in p.rules.items():
            src = name[5:] if name.startswith("head:") else name
            if src not in model.weights:
                continue
            shape = model.weights.shape(src)
            n = shape[-2] if rule.axis == "rows" and len(shape) > 1 else shape[-1] if rule.axis == "cols" else shape[0]
            c = cover.setdefault(name, np.zeros(n, int))
            for s, k in rule.pieces:
                if s >= 0:
                    c[s:s + k] += 1
    return plans, cover


@pytest.mark.parametrize("name", ["qwen35", "qwen35kv2", "qwen35moe", "qwen3next"])
@pytest.mark.parametrize("N", [2, 3])
def test_hybrid_plans_partition_every_weight(name, N):
    model = Model(str(FIXTURES / f"{name}.gguf"), mmap=True)
    plans, cover = _coverage(model, N)
    for w, c in cover.items():
        # a weight whose block a rank skips is covered by the other ranks only
        skipped = [p for p in plans if any(e.split(".")[:2] == w.split(".")[:2] for e in p.empty)]
        if not skipped:
            assert (c == 1).all(), f"{w}: rows/cols held {sorted(set(c.tolist()))} times over {N} ranks"
        else:
            assert (c <= 1).all(), w
    a = model.args
    # the head's vocabulary rows are split exactly
    assert sum(p.info["head"][2] for p in plans) == a.n_vocab
    # GDN key heads per rank: the most any layer gives it
    assert sum(p.info["gdn_heads"] for p in plans) >= a.n_k_heads


def test_uneven_llama_q8_groups_and_blocks(tmp_path):
    path = tmp_path / "q8.gguf"
    write_tiny_llama(path, n_vocab=120, n_embd=96, n_layer=3, n_head=6, n_head_kv=3, n_ff=96, wtype="q8_0", seed=3)
    model = Model(str(path), mmap=True)
    plans, cover = _coverage(model, 2)
    assert all((c == 1).all() for c in cover.values())
    # 3 KV groups over 2 ranks: 2 + 1 rotating, each rank padded to 2 groups (4 query heads)
    assert [p.args.n_head_kv for p in plans] == [2, 2] and [p.args.n_head for p in plans] == [4, 4]
    # attn_output is cut between groups: 2 x 16 = 32 columns = one Q8_0 block per group
    for p in plans:
        for il in range(3):
            r = p.rules[f"blk.{il}.attn_output.weight"]
            assert all((s < 0 or s % 32 == 0) and k % 32 == 0 for s, k in r.pieces)


def test_groups_coarsen_to_whole_quant_blocks(tmp_path):
    path = tmp_path / "q8odd.gguf"  # 2 query heads of 24 per group: 48 columns, not whole 32-blocks
    write_tiny_llama(path, n_vocab=64, n_embd=96, n_layer=1, n_head=4, n_head_kv=2, n_ff=64, wtype="q8_0", seed=1)
    model = Model(str(path), mmap=True)
    p0, p1 = (plan(model.arch.ARCH, model.args, model.weights, r, 2) for r in (0, 1))
    # the unit is both groups (96 columns = 3 blocks): one rank holds the layer's heads, the other none
    assert p0.rules["blk.0.attn_output.weight"].pieces == ((0, 96),)
    assert "blk.0.attn_q.weight" in p1.empty and "blk.0.attn_output.weight" not in p1.rules


def test_no_whole_block_unit_is_refused(tmp_path):
    path = tmp_path / "q8odd.gguf"
    write_tiny_llama(path, n_vocab=64, n_embd=96, n_layer=1, n_head=4, n_head_kv=2, n_ff=64, wtype="q8_0", seed=1)
    model = Model(str(path), mmap=True)
    import dataclasses

    args = dataclasses.replace(model.args, n_head_kv=1, n_head=2)  # one group of 48 columns: no unit fits
    with pytest.raises(SplitError, match=r"attn_output\.weight.*quant block"):
        plan(model.arch.ARCH, args, model.weights, 0, 2)


def test_unsupported_architecture_is_named():
    class A:
        pass

    with pytest.raises(SplitError, match="gemma3"):
        plan("gemma3", A(), None, 0, 2)
