"""Shared mixture-of-experts builders: expert selection (softmax or sigmoid gating, an optional
selection bias, DeepSeek-V3-style grouped routing) and the routed SwiGLU experts.

Selection follows llama.cpp's ``build_moe_ffn`` / transformers' DeepSeek-V3 router:

1. ``p = softmax(logits)`` or ``p = sigmoid(logits)`` (``gating``);
2. the choice uses ``c = p + bias`` when a bias (``exp_probs_b``) is given, else ``p``;
3. grouped routing (``n_group > 1``): the E experts form ``n_group`` groups of E / n_group; a
   group scores the sum of its two largest ``c``; only the ``n_group_used`` best groups are
   eligible (the others' ``c`` become -inf);
4. ``ids = topk(c, k)``; the weights are the *unbiased* ``p`` of the chosen experts, renormalised to
   sum to 1 when ``norm``, times ``scale``.

The renormalisation is a softmax over the chosen experts' log-probabilities: ``softmax(l_sel)``
for softmax gating, ``softmax(log sigmoid(l_sel)) = softmax(-softplus(-l_sel))`` for sigmoid
gating, so no division op is needed.
"""
from __future__ import annotations

from pyfast.models.base import GraphBuilder


def select_experts(b: GraphBuilder, logits, k: int, gating: str = "softmax", bias=None, n_group: int = 1,
                   n_group_used: int = 1, norm: bool = True, scale: float = 1.0):
    """logits: [T, E] router logits. Returns (ids [T, k] i32, weights [T, k] f32)."""
    g = b.g
    T, E = logits.shape
    if gating == "softmax":
        probs = g.softmax(logits)
    elif gating == "sigmoid":
        probs = g.sigmoid(logits)
    else:
        raise ValueError(f"unknown expert gating function {gating!r} (softmax or sigmoid)")
    choice = probs if bias is None else g.add(probs, bias)                  # [T, E]
    if n_group > 1 and n_group_used < n_group:
        n_per = E // n_group
        grouped = g.reshape(choice, [T, n_group, n_per])
        top2 = g.gather(grouped, g.topk(grouped, min(2, n_per)))           # [T, G, 2]
        group_score = g.sum(top2, 2)                                         # [T, G]
        keep = g.topk_mask(group_score, n_group_used)                       # 0 / -inf
        choice = g.reshape(g.add(grouped, g.reshape(keep, [T, n_group, 1])), [T, E])
    ids = g.topk(choice, k)                                                  # [T, k]
    if norm:
        sel = g.gather(logits, ids)
        if gating == "sigmoid":
            sel = g.scale(g.softplus(g.scale(sel, -1.0)), -1.0)             # log sigmoid
        w = g.softmax(sel)
    else:
        w = g.gather(probs, ids)
    if scale != 1.0:
        w = g.scale(w, scale)
    return ids, w


def routed_experts(b: GraphBuilder, x, prefix: str, ids, w):
    """SwiGLU experts ``{prefix}.ffn_{gate,up,down}_exps`` (or a merged ``ffn_gate_up_exps``) for the
    chosen ids, weighted by w and summed. x: [T, d], ids / w: [T, k] -> [T, d]."""
    g = b.g
    T, k = ids.shape
    if b.tp_empty(f"{prefix}.ffn_gate_exps.weight"):  # tensor parallelism: no expert columns on this rank
        return b.zeros_like(x)
    if b.has(f"{prefix}.ffn_gate_up_exps.weight"):
        gu = g.matmul_id(x, b.mat_weight(f"{prefix}.ffn_gate_up_exps.weight"), ids)  # [T, k, 2F]
        F = gu.shape[2] // 2
        st = list(gu.strides)
        gate = g.view(gu, [T, k, F], st)
        up = g.view(gu, [T, k, F], st, offset=F * 4)
    else:
        gate = g.matmul_id(x, b.mat_weight(f"{prefix}.ffn_gate_exps.weight"), ids)   # [T, k, F]
        up = g.matmul_id(x, b.mat_weight(f"{prefix}.ffn_up_exps.weight"), ids)
    down = g.matmul_id(g.swiglu(gate, up), b.mat_weight(f"{prefix}.ffn_down_exps.weight"), ids)  # [T, k, d]
    down = g.mul(down, g.reshape(w, [T, k, 1]))
    return g.sum(down, 1)                                                    # [T, d]
