"""Tensor-parallel split plans (``algorithms.md`` §3): which slice of each weight a rank holds.

Weights are ``W [out, in]`` row-major as in the GGUF (``[E, out, in]`` for experts):

* **column-parallel** (split the output dim = the weight's rows): q / k / v (and their biases),
  the FFN gate / up (dense, shared and routed experts), the GDN input projections (qkv, gate z,
  beta / alpha, their per-head vectors and conv rows) and the output head. Cutting rows of a
  row-major quantized weight is free: rows are whole blocks.
* **row-parallel** (split the input dim = the weight's columns): attention out, FFN down (dense,
  shared, experts) and GDN out. Their products are partial sums; the graph adds them over the
  ranks with one ``allreduce`` after the attention / GDN mixer and one after the FFN (for MoE
  after the router-weighted sum of the experts and the shared expert), two per layer. A column
  cut must fall on a quant-block boundary, so the unit of a split is chosen to keep whole blocks.
* everything else (embedding, norms, router, per-head q / k norms) is mirrored.

Units and granularity: attention splits whole GQA groups (one KV head and its query heads),
the GDN whole key heads with their value heads, the FFN blocks of ``block_size(down)`` columns,
the head rows in steps of 16. ``n`` units over ``N`` ranks give ``n // N`` each and one more to
``n % N`` ranks; which ranks take the extra unit rotates from layer to layer (counting layers of
the same kind only), so an uneven split loads every rank alike over the model. A rank may get
zero units of a layer: it skips that computation and adds zeros to the reduce.

KV cache and recurrent state are split by head with the attention / GDN weights. Their geometry
must be one per rank across layers, so a rank's slice of every attention (GDN) layer is padded
to the most groups (key heads) it holds in any layer: padded heads have zero weights, compute
zeros and add nothing (the cost of an uneven split is at most one group per layer).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from pyfast._loader import native

Piece = tuple[int, int]  # (first index along the split axis, count); first -1: count zeros


def shares(n_units: int, n_ranks: int, rotation: int = 0) -> list[tuple[int, int]]:
    """(first unit, count) per rank: n_units // n_ranks each, one more for n_units % n_ranks
    ranks starting at rank ``rotation % n_ranks``; ranges are contiguous in rank order."""
    base, rem = divmod(n_units, n_ranks)
    counts = [base + (1 if (r - rotation) % n_ranks < rem else 0) for r in range(n_ranks)]
    out, a = [], 0
    for c in counts:
        out.append((a, c))
        a += c
    return out


@dataclass(frozen=True)
class Rule:
    """A weight's local slice: ``axis`` "rows" (column-parallel: axis -2 of a matrix, axis 0 of a
    vector) or "cols" (row-parallel: the last axis), and the pieces taken along it in order."""
    axis: str
    pieces: tuple[Piece, ...]

    @property
    def length(self) -> int:
        return sum(n for _, n in self.pieces)


def _merge(pieces) -> tuple[Piece, ...]:
    out: list[list[int]] = []
    for s, n in pieces:
        if n <= 0:
            continue
        if out and ((s < 0 and out[-1][0] < 0) or (s >= 0 and out[-1][0] >= 0 and out[-1][0] + out[-1][1] == s)):
            out[-1][1] += n
        else:
            out.append([s, n])
    return tuple((a, b) for a, b in out)


def _block(weights, name: str) -> int:
    return native.dtype_block_size(weights.dtype(name)) if name in weights else 1


def _lcm(a: int, b: int) -> int:
    return a * b // np.gcd(a, b)


class SplitError(ValueError):
    pass


@dataclass
class SplitPlan:
    """Every split weight's rule for one rank, the rank's local hyper-parameters (head counts
    the graph is built with) and the names of the pieces this rank skips."""
    rank: int
    size: int
    rules: dict[str, Rule]
    args: object
    empty: set[str]                       # weights whose local slice is empty (the block is skipped)
    info: dict[str, object] = dataclasses.field(default_factory=dict)

    def reduces_per_layer(self) -> int:
        return 2


# --- per-family plans --------------------------------------------------------------------------
def _attn_units(args, weights, p: str, rows_per_q: int) -> int:
    """GQA groups per split unit: the fewest whole groups whose attention-out columns are whole
    quant blocks."""
    ratio = args.n_head // args.n_head_kv
    cols = ratio * args.head_dim
    blk = _block(weights, f"{p}.attn_output.weight")
    u = _lcm(cols, blk) // cols
    if args.n_head_kv % u:
        raise SplitError(f"{p}.attn_output.weight: its quant block ({blk}) does not fit whole GQA groups "
                         f"({cols} columns each, {args.n_head_kv} groups); it cannot be split by heads")
    return u


def _attention(rules, empty, weights, args, layers: list[int], rank: int, size: int, qwen35: bool) -> int:
    """Rules for the attention layers; returns M, this rank's padded group count."""
    hd, ratio = args.head_dim, args.n_head // args.n_head_kv
    q_rows = (2 if qwen35 else 1) * hd  # qwen35: per head [q | gate]
    per = []
    for j, il in enumerate(layers):
        u = _attn_units(args, weights, f"blk.{il}", q_rows)
        a, c = shares(args.n_head_kv // u, size, j)[rank]
        per.append((a * u, c * u))
    M = max([c for _, c in per] + [0])
    for il, (a, c) in zip(layers, per):
        p = f"blk.{il}"
        if c == 0:
            empty.add(f"{p}.attn_q.weight")
            continue

        def groups(width):  # pieces over group-major rows of `width` per group, padded to M
            return _merge([((a + g) * width if g < c else -1, width) for g in range(M)])

        rules[f"{p}.attn_q.weight"] = rules[f"{p}.attn_q.bias"] = Rule("rows", groups(ratio * q_rows))
        for t in ("attn_k", "attn_v"):
            rules[f"{p}.{t}.weight"] = rules[f"{p}.{t}.bias"] = Rule("rows", groups(hd))
        rules[f"{p}.attn_output.weight"] = Rule("cols", groups(ratio * hd))
    return M


def _ffn(rules, empty, weights, p: str, suffix: str, n_ff: int, rank: int, size: int, rotation: int) -> None:
    """Rules for one FFN of width n_ff: a dense one (suffix "" or "_shexp") or the routed experts
    (suffix "_exps": n_ff columns per expert, gate and up also fused as ``ffn_gate_up_exps``)."""
    down = f"{p}.ffn_down{suffix}.weight"
    g = _block(weights, down)
    if n_ff % g:
        per = " per expert" if suffix == "_exps" else ""
        raise SplitError(f"{down}: {n_ff} columns{per} are not whole quant blocks of {g}")
    a, c = shares(n_ff // g, size, rotation)[rank]
    gate, up = f"{p}.ffn_gate{suffix}.weight", f"{p}.ffn_up{suffix}.weight"
    fused = f"{p}.ffn_gate_up_exps.weight" if suffix == "_exps" else None
    if c == 0:
        empty.add(gate)
        if fused:
            empty.add(fused)
        return
    piece = (a * g, c * g)
    rules[gate] = rules[up] = Rule("rows", (piece,))
    if fused:
        rules[fused] = Rule("rows", (piece, (n_ff + a * g, c * g)))  # [gate | up]
    rules[down] = Rule("cols", (piece,))


def _ffns(rules, empty, weights, args, rank: int, size: int) -> None:
    """Rules for every layer's FFN: the dense one, or the routed experts and the shared expert."""
    for i in range(args.n_layer):
        p = f"blk.{i}"
        if args.is_moe:
            _ffn(rules, empty, weights, p, "_exps", args.n_ff_exp, rank, size, i)
            if getattr(args, "n_ff_shexp", 0):
                _ffn(rules, empty, weights, p, "_shexp", args.n_ff_shexp, rank, size, i)
        else:
            _ffn(rules, empty, weights, p, "", args.n_ff, rank, size, i)


def _head(rules, weights, args, rank: int, size: int, info: dict) -> None:
    name = "token_embd.weight" if args.tied else "output.weight"
    V = args.n_vocab
    step = 16 if V % 16 == 0 else 1
    a, c = shares(V // step, size, 0)[rank]
    info["head"] = (name, a * step, c * step, V)
    rules["head:" + name] = Rule("rows", ((a * step, c * step),))


def _gdn(rules, empty, weights, args, layers: list[int], rank: int, size: int) -> int:
    """Rules for the Gated-DeltaNet layers; returns M, this rank's padded key-head count."""
    S, Hk, Hv = args.state_size, args.n_k_heads, args.n_v_heads
    r = Hv // Hk
    tiled = args.gdn_broadcast == 0
    if args.fused_ba and tiled:
        raise SplitError("a fused ssm_ba weight with the tiled value-head order cannot be split by heads yet")
    per = []
    for j, il in enumerate(layers):
        p = f"blk.{il}"
        blk = _block(weights, f"{p}.ssm_out.weight")
        if S % blk:
            raise SplitError(f"{p}.ssm_out.weight: its quant block ({blk}) is larger than a head ({S} columns)")
        per.append(shares(Hk, size, j)[rank])
    M = max([c for _, c in per] + [0])
    for il, (a, c) in zip(layers, per):
        p = f"blk.{il}"
        if c == 0:
            empty.add(f"{p}.attn_qkv.weight")
            continue
        keys = [a + k if k < c else -1 for k in range(M)]       # local key head -> global (-1: pad)
        if tiled:   # value head m * Hk + key (global) -> m * M + local key
            vals = [(m * Hk + kh) if kh >= 0 else -1 for m in range(r) for kh in keys]
        else:       # grouped: key * r + m
            vals = [(kh * r + m) if kh >= 0 else -1 for kh in keys for m in range(r)]

        def heads(ids, width, off=0):
            return [((off + h * width) if h >= 0 else -1, width) for h in ids]

        qkv = heads(keys, S) + heads(keys, S, Hk * S) + heads(vals, S, 2 * Hk * S)
        rules[f"{p}.attn_qkv.weight"] = rules[f"{p}.ssm_conv1d.weight"] = Rule("rows", _merge(qkv))
        rules[f"{p}.attn_gate.weight"] = Rule("rows", _merge(heads(vals, S)))
        for t in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias", "ssm_a"):
            rules[f"{p}.{t}"] = Rule("rows", _merge(heads(vals, 1)))
        rules[f"{p}.ssm_ba.weight"] = Rule("rows", _merge(heads(keys, 2 * r)))
        rules[f"{p}.ssm_out.weight"] = Rule("cols", _merge(heads(vals, S)))
    return M


def plan(arch: str, args, weights, rank: int, size: int) -> SplitPlan:
    """The split plan of a model for one rank of ``size``. Supported: the standard decoder family
    (llama, qwen2, qwen3, qwen3moe) and the Qwen3.5 hybrids (qwen35, qwen35moe, qwen3next)."""
    from pyfast.models import decoder, qwen35

    if size < 1 or not 0 <= rank < size:
        raise SplitError(f"rank {rank} of {size}")
    rules: dict[str, Rule] = {}
    empty: set[str] = set()
    info: dict = {}
    if isinstance(args, decoder.Args) and arch in ("llama", "qwen2", "qwen3", "qwen3moe"):
        M = _attention(rules, empty, weights, args, list(range(args.n_layer)), rank, size, qwen35=False)
        _ffns(rules, empty, weights, args, rank, size)
        local = dataclasses.replace(args, n_head=max(M, 1) * (args.n_head // args.n_head_kv), n_head_kv=max(M, 1))
    elif isinstance(args, qwen35.Args):
        attn = [i for i, r in enumerate(args.recurrent) if not r]
        rec = [i for i, r in enumerate(args.recurrent) if r]
        M = _attention(rules, empty, weights, args, attn, rank, size, qwen35=True)
        Mk = _gdn(rules, empty, weights, args, rec, rank, size)
        _ffns(rules, empty, weights, args, rank, size)
        r = args.n_v_heads // args.n_k_heads
        local = dataclasses.replace(args, n_head=max(M, 1) * (args.n_head // args.n_head_kv), n_head_kv=max(M, 1),
                                    n_k_heads=max(Mk, 1), n_v_heads=max(Mk, 1) * r)
        info["gdn_heads"] = Mk
    else:
        raise SplitError(f"tensor parallelism supports the llama / qwen2 / qwen3 / qwen3moe / qwen35 / qwen35moe / "
                         f"qwen3next architectures, not {arch!r}")
    _head(rules, weights, args, rank, size, info)
    info["attn_groups"] = M
    return SplitPlan(rank=rank, size=size, rules=rules, args=local, empty=empty, info=info)


# --- slicing -----------------------------------------------------------------------------------
def slice_bytes(dtype, shape: tuple[int, ...], data: np.ndarray, rule: Rule) -> tuple[np.ndarray, tuple[int, ...]]:
    """The local slice of a tensor's bytes (``data``, as in the file) under ``rule``: a new
    contiguous uint8 array and its shape. Zero pieces are zero bytes (0.0 in every GGUF type)."""
    bs, ts = native.dtype_block_size(dtype), native.dtype_type_size(dtype)
    if len(shape) == 1:
        shape2 = (shape[0], 1)
    else:
        shape2 = tuple(shape)
    C = shape2[-1]
    row_bytes = C // bs * ts
    R = shape2[-2]
    outer = int(np.prod(shape2[:-2])) if len(shape2) > 2 else 1
    m = np.asarray(data).reshape(outer, R, row_bytes)
    parts = []
    if rule.axis == "rows":
        for s, n in rule.pieces:
            if s < 0:
                parts.append(np.zeros((outer, n, row_bytes), np.uint8))
            else:
                if s + n > R:
                    raise SplitError(f"rows {s}..{s + n} of a tensor with {R}")
                parts.append(m[:, s:s + n, :])
        out = np.concatenate(parts, axis=1) if len(parts) > 1 else np.ascontiguousarray(parts[0])
        new_shape = (rule.length,) if len(shape) == 1 else tuple(shape[:-2]) + (rule.length, C)
    else:
        for s, n in rule.pieces:
            if (s >= 0 and s % bs) or n % bs:
                raise SplitError(f"a column cut at {s}+{n} is not on a quant block boundary ({bs})")
            if s < 0:
                parts.append(np.zeros((outer, R, n // bs * ts), np.uint8))
            else:
                if s + n > C:
                    raise SplitError(f"columns {s}..{s + n} of a tensor with {C}")
                parts.append(m[:, :, s // bs * ts:(s + n) // bs * ts])
        out = np.concatenate(parts, axis=2) if len(parts) > 1 else np.ascontiguousarray(parts[0])
        new_shape = tuple(shape[:-1]) + (rule.length,)
    return np.ascontiguousarray(out).reshape(-1), new_shape
