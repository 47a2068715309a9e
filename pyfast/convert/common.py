"""Pieces the converters share: the planned tensor and its ``add``, the expert stacks, the dense
FFN and nextn (MTP) tensors, the unused-tensor check and the leading block of attention metadata."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class PlannedTensor:
    name: str
    shape: tuple[int, ...]          # numpy order
    keep_f32: bool                   # always written as F32 (norms, 1-D, router, conv, non-.weight)
    produce: Callable[[], np.ndarray]


def tensor_adder(tensors: list, keep_f32: Callable[[str, tuple[int, ...]], bool]) -> Callable:
    """``add(name, shape, produce)`` appending a planned tensor to ``tensors``; ``keep_f32`` decides
    whether it stays F32 whatever the output type."""

    def add(name: str, shape: tuple[int, ...], produce: Callable[[], np.ndarray]) -> None:
        tensors.append(PlannedTensor(name, tuple(shape), keep_f32(name, tuple(shape)), produce))

    return add


def dense_ffn(add: Callable, get: Callable, b: str, p: str, ff: int, d: int) -> None:
    """``{b}.ffn_{gate,up,down}.weight`` from ``{p}.mlp.{gate,up,down}_proj.weight``."""
    add(f"{b}.ffn_gate.weight", (ff, d), get(f"{p}.mlp.gate_proj.weight", (ff, d)))
    add(f"{b}.ffn_up.weight", (ff, d), get(f"{p}.mlp.up_proj.weight", (ff, d)))
    add(f"{b}.ffn_down.weight", (d, ff), get(f"{p}.mlp.down_proj.weight", (d, ff)))


def nextn_tensors(add: Callable, get: Callable, has: Callable[[str], bool], b: str, p: str, d: int, V: int) -> None:
    """An MTP layer's ``nextn.*`` tensors (DeepSeek / GLM layout: ``{p}.eh_proj``, ``enorm``, ``hnorm``,
    ``shared_head.norm`` and the optional ``shared_head.head`` / ``embed_tokens``)."""
    add(f"{b}.nextn.eh_proj.weight", (d, 2 * d), get(f"{p}.eh_proj.weight", (d, 2 * d)))
    add(f"{b}.nextn.enorm.weight", (d,), get(f"{p}.enorm.weight", (d,)))
    add(f"{b}.nextn.hnorm.weight", (d,), get(f"{p}.hnorm.weight", (d,)))
    add(f"{b}.nextn.shared_head_norm.weight", (d,), get(f"{p}.shared_head.norm.weight", (d,)))
    if has(f"{p}.shared_head.head.weight"):
        add(f"{b}.nextn.shared_head_head.weight", (V, d), get(f"{p}.shared_head.head.weight", (V, d)))
    if has(f"{p}.embed_tokens.weight"):
        add(f"{b}.nextn.embed_tokens.weight", (V, d), get(f"{p}.embed_tokens.weight", (V, d)))


def experts(src, p: str, E: int, ff: int, d: int) -> tuple[Callable, Callable, Callable]:
    """(gate, up, down) stacks ``[E, ff, d]``, ``[E, ff, d]``, ``[E, d, ff]`` of layer prefix p
    (``{p}.experts.*``): split from a fused ``gate_up_proj`` (gate rows first) or stacked per expert."""
    from pyfast.convert.qwen35 import _map

    fused = f"{p}.experts.gate_up_proj"
    fused = fused if src.has(fused) else (fused + ".weight" if src.has(fused + ".weight") else None)
    if fused is not None:
        gu = src.get(fused, (E, 2 * ff, d))
        down_name = f"{p}.experts.down_proj"
        down = src.get(down_name if src.has(down_name) else down_name + ".weight", (E, d, ff))
        return _map(gu, lambda w: w[:, :ff]), _map(gu, lambda w: w[:, ff:]), down
    parts = []
    for w, shape in (("gate_proj", (ff, d)), ("up_proj", (ff, d)), ("down_proj", (d, ff))):
        fs = [src.get(f"{p}.experts.{e}.{w}.weight", shape) for e in range(E)]
        parts.append(lambda fs=fs: np.stack([f() for f in fs]))
    return tuple(parts)


def reject_unused(where: str, unused: list[str]) -> None:
    """Raise naming (up to 8 of) the checkpoint tensors no GGUF tensor was made from."""
    if unused:
        more = f" (and {len(unused) - 8} more)" if len(unused) > 8 else ""
        raise ValueError(f"{where}: unexpected tensor(s) in the checkpoint: {', '.join(unused[:8])}{more}")


def check_unused(src, st) -> None:
    """:func:`reject_unused` for a ``_Source`` over the safetensors directory ``st``."""
    reject_unused(st.dir, sorted(src.names[n] for n in src.names if n not in src.used))


def attention_metadata(a: str, n_block: int, n_ctx: int | None, n_embd: int, n_ff: int | None,
                       n_head: int, n_head_kv: int, head_dim: int) -> list[tuple[str, Any, str]]:
    """``block_count``, ``context_length`` (when known), ``embedding_length``,
    ``feed_forward_length`` (when known), the head counts and the key / value lengths of arch ``a``."""
    m: list[tuple[str, Any, str]] = []

    def u32(key: str, v: int) -> None:
        m.append((f"{a}.{key}", int(v), "uint32"))

    u32("block_count", n_block)
    if n_ctx is not None:
        u32("context_length", n_ctx)
    u32("embedding_length", n_embd)
    if n_ff is not None:
        u32("feed_forward_length", n_ff)
    u32("attention.head_count", n_head)
    u32("attention.head_count_kv", n_head_kv)
    u32("attention.key_length", head_dim)
    u32("attention.value_length", head_dim)
    return m


def routed_moe_ffn(add: Callable, get: Callable, b: str, p: str, E: int, ff: int, d: int, n_shared: int,
                   stacks) -> None:
    """A DeepSeek / GLM MoE FFN: router ``ffn_gate_inp``, selection bias ``exp_probs_b.bias``, the
    expert stacks ``stacks`` = (gate, up, down) as ``ffn_{gate,up,down}_exps`` and, when ``n_shared``,
    the shared experts ``ffn_{gate,up,down}_shexp`` (``n_shared * ff`` rows)."""
    gate, up, down = stacks
    add(f"{b}.ffn_gate_inp.weight", (E, d), get(f"{p}.mlp.gate.weight", (E, d)))
    add(f"{b}.exp_probs_b.bias", (E,), get(f"{p}.mlp.gate.e_score_correction_bias", (E,)))
    add(f"{b}.ffn_gate_exps.weight", (E, ff, d), gate)
    add(f"{b}.ffn_up_exps.weight", (E, ff, d), up)
    add(f"{b}.ffn_down_exps.weight", (E, d, ff), down)
    if n_shared:
        fs = n_shared * ff
        s = f"{p}.mlp.shared_experts"
        add(f"{b}.ffn_gate_shexp.weight", (fs, d), get(f"{s}.gate_proj.weight", (fs, d)))
        add(f"{b}.ffn_up_shexp.weight", (fs, d), get(f"{s}.up_proj.weight", (fs, d)))
        add(f"{b}.ffn_down_shexp.weight", (d, fs), get(f"{s}.down_proj.weight", (d, fs)))
