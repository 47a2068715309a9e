"""Qwen3.5-only checks on the tiny random model: text M-RoPE equals plain NEOX rope, Context
argument errors, and LLM prompt-cache reuse on a recurrent model. The checks every hybrid
architecture shares are parametrized in test_hybrid_tiny.py."""
from __future__ import annotations

import numpy as np
import pytest

from tests.models import test_hybrid_common as H

NAME = "qwen35"
pytestmark = pytest.mark.skipif(not H.has_ops("gated_delta_net", "ssm_conv"), reason="native lacks the GDN ops")


def test_text_mrope_is_plain_neox_rope():
    """Qwen3.5's M-RoPE (interleaved sections over the rotary pairs, as transformers builds it)
    with equal position components is the NEOX rope the graph uses: check it on the fixture's
    sections against the native rope op."""
    from pyfast._loader import native

    model, _ = H.load(NAME)
    a = model.args
    sections = list(a.rope_sections)
    assert sum(sections) * 2 == a.n_rot                    # the sections cover the rotary dims
    T, Hh, D = 5, 2, a.head_dim
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, Hh, D)).astype(np.float32)
    pos = np.array([0, 1, 7, 30, 255], dtype=np.int32)

    def mrope(x, p3):                                        # p3: [3, T] (t, h, w) positions
        half = a.n_rot // 2
        inv = a.rope_base ** (-np.arange(half) * 2.0 / a.n_rot)
        comp = np.zeros(half, dtype=int)                     # interleaved: pair i -> t / h / w
        for dim in (1, 2):
            comp[dim: 3 * sections[dim]: 3] = dim
        ang = p3[comp].T * inv                               # [T, half]
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        x1, x2 = x[..., :half], x[..., half:a.n_rot]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., a.n_rot:]], axis=-1)

    g = native.Graph()
    xi = g.input("x", native.DType.F32, [T, Hh, D])
    pi = g.input("pos", native.DType.I32, [T])
    g.output(g.rope(xi, pi, a.n_rot, 2, a.rope_base, 1.0), "y")
    plan = native.Plan(g, native.ThreadPool(1))
    plan.set_input("x", x)
    plan.set_input("pos", pos)
    plan.run()
    y = plan.output("y")
    assert np.abs(y - mrope(x, np.stack([pos, pos, pos]))).max() < 1e-5
    assert np.abs(y - mrope(x, np.stack([pos, pos + 3, pos]))).max() > 1e-2   # unequal components differ


def test_context_argument_errors():
    model, _ = H.load(NAME)
    with pytest.raises(ValueError, match="n_ubatch"):
        H.make_ctx(model, n_rollback=8, n_ubatch=4)
    with pytest.raises(ValueError, match="n_seq_max"):
        H.make_ctx(model, n_seq_max=0)
    ctx = H.make_ctx(model, n_seq_max=2)
    ctx.decode([1, 2], seq_ids=[0, 1], positions=[0, 0])
    from pyfast.memory.recurrent import NoFreeSlot

    with pytest.raises(NoFreeSlot, match="n_seq_max"):
        ctx.decode([3], seq_ids=2)
    with pytest.raises(ValueError, match="consecutive"):
        ctx.decode([3, 4], seq_ids=0, positions=[1, 3])
    assert ctx.seq_len(0) == 1 and ctx.seq_len(1) == 1
    ctx.remove_seq(1)
    ctx.decode([3], seq_ids=2)


def test_llm_prompt_cache_on_recurrent_model():
    """LLM.generate reuses the cached prefix when the new prompt extends it and starts afresh when
    the recurrent state cannot be rolled back to the common prefix; outputs equal a fresh LLM."""
    from pyfast.llm import LLM

    path, ref = H.fixture(NAME)
    a, b = ref["tokens_0"].tolist(), ref["tokens_1"].tolist()
    llm = LLM(path, n_ctx=256, n_threads=2)

    def fresh(p):
        return LLM(path, n_ctx=256, n_threads=2).generate(p, max_tokens=6, temperature=0, ignore_eos=True).tokens

    r1 = llm.generate(a, max_tokens=6, temperature=0, ignore_eos=True)
    assert r1.tokens == fresh(a)
    ext = a + r1.tokens[:-1] + b[:3]                      # extends what is cached: no re-prefill
    r2 = llm.generate(ext, max_tokens=6, temperature=0, ignore_eos=True)
    assert r2.timings.n_prompt_cached == len(a) + len(r1.tokens) - 1
    assert r2.tokens == fresh(ext)
    other = a[:8] + b                                     # shares 8 tokens: the state cannot go back there
    r3 = llm.generate(other, max_tokens=6, temperature=0, ignore_eos=True)
    assert r3.timings.n_prompt_cached == 0
    assert r3.tokens == fresh(other)
    with pytest.raises(ValueError, match="n_seq_max"):
        llm.generate_batch([a, b, a, b, a], max_tokens=2)
