"""The plans of a CPU context share one arena (native.ArenaPool): results are bit-identical to
plans with their own arenas, and the memory held stays near the largest plan's instead of
growing with the number of cached plans."""
from __future__ import annotations

import numpy as np

from pyfast.context import Context
from tests.reference.tiny_gguf import write_tiny_llama

PROMPTS = [list(range(10 + n, 10 + 2 * n + 1)) for n in range(1, 11)]  # 10 prompt lengths


def _run(ctx) -> list[np.ndarray]:
    """Prompts of several lengths on several sequences, then single steps and a verify-like run:
    many plan shapes (token counts x cache sizes)."""
    out = []
    for s, p in enumerate(PROMPTS):
        out.append(ctx.decode(p, seq_ids=s, logits="all"))
    for t in range(12):
        for s in range(len(PROMPTS)):
            out.append(ctx.decode([100 + t], seq_ids=s, logits="all"))
    out.append(ctx.decode([3, 4, 5, 6], seq_ids=0, logits="all"))
    out.append(np.array(ctx.decode_step(7, ctx.seq_len(1), 1)))
    return out


def test_shared_arena_matches_own_arenas_and_stays_small(tmp_path):
    from pyfast.models import Model

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, n_vocab=2000, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96, wtype="q8_0")
    model = Model(path)
    shared = Context(model, n_ctx=512, n_threads=2, max_plans=64)
    own = Context(model, n_ctx=512, n_threads=2, max_plans=64)
    own.arenas = None  # every plan allocates its own arena, as before the pool
    a, b = _run(shared), _run(own)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(_run(shared), _run(own)):  # again: every plan now runs on the pool's last buffer
        np.testing.assert_array_equal(x, y)
    plans = list(shared._plans.values())
    assert len(plans) >= 8
    sizes = [p.stats["arena_bytes"] for p in plans]
    held = shared.arenas.live_bytes
    assert held >= max(sizes)
    # one buffer (growth keeps up to half again the largest plan's) instead of one per plan
    assert held == shared.arenas.current_bytes <= 1.5 * max(sizes) < sum(sizes) / 3, (held, max(sizes), sum(sizes))
