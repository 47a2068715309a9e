"""Block drafters: DFlash and DSpark (``algorithms.md`` §4), their GGUF format and graphs.

A block drafter is a small non-causal transformer that predicts a whole block of tokens in one
decode. It reads the target's hidden rows of a few chosen layers (feature capture,
``DecodeBatch.features``) and shares the target's token embedding and output head unless the
file has its own.

GGUF format (``general.architecture = "dflash"``; ``pyfast convert --draft`` writes it, see
``pyfast/convert/dflash.py``):

* metadata ``dflash.*``: the usual ``block_count``, ``embedding_length``, ``feed_forward_length``,
  ``attention.head_count`` / ``head_count_kv`` / ``key_length``, ``attention.layer_norm_rms_epsilon``,
  ``rope.*``; ``dflash.block_size`` (default 16), ``dflash.mask_token_id``, ``dflash.target_layers``
  (target layer ids as "output of layer l", -1 = the embedding output), ``dflash.target_hidden_size``,
  ``dflash.vocab_size`` (the target's vocabulary), ``dflash.sample_from_anchor`` (bool; absent =
  true for DSpark, false for DFlash), optional ``dflash.attention.sliding_window`` (W: a sliding
  layer's query at position p sees keys at positions > p - W), ``dflash.attention.sliding_window_pattern``
  (one bool per layer, true = sliding) and ``dflash.attention.sliding_window_causal`` (sliding
  layers causal inside the block; default false);
* tensors: ``fc.weight`` [d, L * d_t], ``enc.output_norm.weight`` [d] (the encoder's norm),
  ``blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, ffn_norm,
  ffn_gate, ffn_up, ffn_down}``, ``output_norm.weight``; optional ``token_embd.weight`` [V, d]
  (own embedding), ``output.weight`` [V_d, d] (own head; V_d < V needs ``d2t``), ``d2t`` I32
  [V_d] (absolute target ids of the draft rows, checked unique and in range at load);
* DSpark (auto-detected: ``markov_w1.weight`` present): ``markov_w1.weight`` [V, R] (a rank-R row
  per previous target token), ``markov_w2.weight`` [V_d, R], and the confidence head
  ``conf_proj.weight`` [1, d + R] (or [1, d]: hidden rows only) with ``conf_proj.bias`` [1].

How it runs (:class:`BlockDrafter`): after every target decode, ``process`` injects the K/V of the
batch's kept rows into the drafter's own KV cache (``inject`` graph: ``c = RMS(fc F)``, then per
layer ``K = rope(k_norm(W_K c))``, ``V = W_V c``; no queries, no FFN), so the drafter's cache
always holds exactly the target's tokens. ``draft`` decodes one block per sequence, all
sequences' full blocks in one graph (rows slot-major), non-causal over the sequence's cached
context plus its block, and truncates the block's scratch K/V afterwards. Block layouts:

* bonus-anchor ("1+N", DFlash): ``[id_last, MASK x (block-1)]`` at ``n_past ..``; slot 0 is not
  read, slot i proposes position ``n_past + i``: up to block-1 drafts;
* anchor-first (DSpark default): the same block, slot i proposes ``n_past + i + 1``: up to block.

DSpark's Markov head is chained inside the graph, sequential over the read slots and vectorised
over sequences: ``prev`` = the anchor, then ``logits'_i = logits_i + E2 . E1[prev]``,
``conf_i = sigmoid(w_c . [h_i ; E1[prev]] + b_c)``, ``prev = argmax(logits'_i)`` (a reduced
vocabulary's argmax is a draft row, looked up in ``E1[d2t]``). The draft is cut at the first slot
with ``conf < p_min`` (p_min 1: empty, 0: the whole block); without a confidence head (and for
DFlash) at the first slot whose top-1 probability is below p_min. The chain is greedy: with a
sampling target each draft token is drawn from its slot's biased distribution (the user's sampler
chain on ``logits'_i``) and that distribution goes to rejection sampling, which keeps the output
exact; the chain's ``prev`` stays the argmax, so sampled drafts that differ from it are accepted
less often (documented mismatch, ``algorithms.md`` §4.6).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pyfast._loader import native
from pyfast.context import cached_plan
from pyfast.memory.kv_cache import KVCache
from pyfast.models.base import BatchShape, GraphBuilder, JointWeights, TensorSpec, Weights, _elem_stride
from pyfast.models.rope import ROPE_NEOX, Rope, read_rope
from pyfast.spec.base import DecodeBatch, Draft, DraftRequest
from pyfast.spec.model_drafter import DrafterSeq, ModelDrafter

__all__ = ["ARCH", "BlockArgs", "BlockDrafterModel", "BlockDrafter", "make_block_drafter"]

ARCH = "dflash"
DType = native.DType
_F32 = DType.F32
TGT = "target/"  # prefix of the target's tensors inside a drafter graph


@dataclass
class BlockArgs:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    eps: float
    rope: Rope
    block_size: int
    mask_token_id: int
    target_layers: tuple[int, ...]   # "output of layer l" ids (-1: the embedding output)
    target_n_embd: int
    n_vocab: int                     # the target's vocabulary
    n_vocab_draft: int               # rows of the draft head (== n_vocab unless d2t)
    sample_from_anchor: bool
    qk_norm: bool
    own_embd: bool
    own_head: bool
    markov_rank: int = 0
    conf: str = ""                   # "": none, "h": hidden rows only, "hm": hidden + E1[prev]
    swa_window: int = 0
    swa_layers: tuple[bool, ...] = ()
    swa_causal: bool = False         # sliding layers causal inside the block (speculators' default)

    @property
    def is_dspark(self) -> bool:
        return self.markov_rank > 0

    @property
    def first_slot(self) -> int:
        """The first block slot that is read (0 for anchor-first, 1 for bonus-anchor)."""
        return 0 if self.sample_from_anchor else 1

    @property
    def n_read(self) -> int:
        """Slots read per block = the longest draft."""
        return self.block_size - self.first_slot

    @property
    def capture_ids(self) -> tuple[int, ...]:
        """The target layers to capture in the feature-capture convention (input of layer l)."""
        return tuple(int(l) + 1 for l in self.target_layers)


def _tensors(a: BlockArgs) -> list[TensorSpec]:
    d, D, H, Hkv = a.n_embd, a.head_dim, a.n_head, a.n_head_kv
    specs = [TensorSpec("fc.weight", (d, len(a.target_layers) * a.target_n_embd)),
             TensorSpec("enc.output_norm.weight", (d,)), TensorSpec("output_norm.weight", (d,))]
    for i in range(a.n_layer):
        p = f"blk.{i}"
        specs += [TensorSpec(f"{p}.attn_norm.weight", (d,)), TensorSpec(f"{p}.attn_q.weight", (H * D, d)),
                  TensorSpec(f"{p}.attn_k.weight", (Hkv * D, d)), TensorSpec(f"{p}.attn_v.weight", (Hkv * D, d)),
                  TensorSpec(f"{p}.attn_output.weight", (d, H * D)), TensorSpec(f"{p}.ffn_norm.weight", (d,)),
                  TensorSpec(f"{p}.ffn_gate.weight", (a.n_ff, d)), TensorSpec(f"{p}.ffn_up.weight", (a.n_ff, d)),
                  TensorSpec(f"{p}.ffn_down.weight", (d, a.n_ff))]
        if a.qk_norm:
            specs += [TensorSpec(f"{p}.attn_q_norm.weight", (D,)), TensorSpec(f"{p}.attn_k_norm.weight", (D,))]
    if a.own_embd:
        specs.append(TensorSpec("token_embd.weight", (a.n_vocab, d)))
    if a.own_head:
        specs.append(TensorSpec("output.weight", (a.n_vocab_draft, d)))
    if a.is_dspark:
        R = a.markov_rank
        specs += [TensorSpec("markov_w1.weight", (a.n_vocab, R)), TensorSpec("markov_w2.weight", (a.n_vocab_draft, R))]
        if a.conf:
            specs += [TensorSpec("conf_proj.weight", (1, d + (R if a.conf == "hm" else 0))),
                      TensorSpec("conf_proj.bias", (1,))]
    return specs


class BlockDrafterModel:
    """A DFlash / DSpark GGUF: its arguments (:class:`BlockArgs`), weights and checked ``d2t``."""

    def __init__(self, path, in_memory: bool = True):
        from pyfast.gguf import GGUFReader
        from pyfast.models import meta as M

        self.path = str(path)
        self.reader = GGUFReader(self.path)
        md = self.metadata = self.reader.metadata
        arch = md.get("general.architecture")
        if arch != ARCH:
            raise ValueError(f"{self.path}: general.architecture is {arch!r}; a DFlash / DSpark drafter has "
                             f"'{ARCH}' (convert the checkpoint with `pyfast convert --draft`)")
        index = Weights(self.reader, in_memory=False)
        m = M.Meta(md, self.path, self.reader.metadata_types)
        a = ARCH
        d = m.int(f"{a}.embedding_length", lo=1, hi=M.MAX_EMBD)
        n_layer = m.int(f"{a}.block_count", lo=1, hi=M.MAX_LAYERS)
        M.check_blocks(self.path, f"{a}.block_count", n_layer, index)
        n_head = m.int(f"{a}.attention.head_count", lo=1, hi=M.MAX_HEADS)
        n_head_kv = m.int(f"{a}.attention.head_count_kv", n_head, lo=1, hi=n_head)
        if n_head % n_head_kv:
            raise m.fail(f"{a}.attention.head_count_kv", n_head_kv, f"a divisor of attention.head_count ({n_head})")
        head_dim = m.int(f"{a}.attention.key_length", d // n_head if d % n_head == 0 else 0, lo=2, hi=M.MAX_HEAD_DIM)
        if head_dim % 2:
            raise m.fail(f"{a}.attention.key_length", head_dim, "an even number")
        n_rot = m.int(f"{a}.rope.dimension_count", head_dim, lo=2, hi=head_dim)
        target_layers = tuple(m.int_list(f"{a}.target_layers", lo=-1, hi=M.MAX_LAYERS, max_len=64))
        if not target_layers:
            raise m.fail(f"{a}.target_layers", [], "a non-empty array of target layer ids")
        if len(set(target_layers)) != len(target_layers):
            raise m.fail(f"{a}.target_layers", list(target_layers), "distinct target layer ids")
        fc = index.shape("fc.weight") if "fc.weight" in index else None
        if fc is None or len(fc) != 2 or fc[0] != d or fc[1] % len(target_layers):
            raise ValueError(f"{self.path}: tensor 'fc.weight' has shape {None if fc is None else list(fc)}, expected "
                             f"[{d}, {len(target_layers)} * target hidden size]")
        d_t = m.int(f"{a}.target_hidden_size", fc[1] // len(target_layers), lo=1, hi=M.MAX_EMBD)
        own_embd = "token_embd.weight" in index
        own_head = "output.weight" in index
        V = m.int(f"{a}.vocab_size", index.shape("token_embd.weight")[0] if own_embd else 0, lo=1, hi=M.MAX_VOCAB)
        V_d = index.shape("output.weight")[0] if own_head else V
        markov = "markov_w1.weight" in index
        R = index.shape("markov_w1.weight")[1] if markov else 0
        conf = ""
        if markov and "conf_proj.weight" in index:
            w = index.shape("conf_proj.weight")
            conf = "hm" if tuple(w) == (1, d + R) else ("h" if tuple(w) == (1, d) else "?")
            if conf == "?":
                raise ValueError(f"{self.path}: tensor 'conf_proj.weight' has shape {list(w)}, expected [1, {d + R}] "
                                 f"(hidden + Markov rank) or [1, {d}]")
        bs = m.int(f"{a}.block_size", 16, lo=2, hi=256)
        mask = m.int(f"{a}.mask_token_id", lo=0, hi=V - 1)
        swa = m.int(f"{a}.attention.sliding_window", 0, lo=0, hi=M.MAX_CTX)
        pattern = tuple(m.bool_list(f"{a}.attention.sliding_window_pattern", [True] * n_layer)) if swa else ()
        if swa and len(pattern) != n_layer:
            raise m.fail(f"{a}.attention.sliding_window_pattern", list(pattern), f"{n_layer} bools (one per layer)")
        self.args = BlockArgs(
            n_embd=d, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
            n_ff=m.int(f"{a}.feed_forward_length", lo=1, hi=M.MAX_FF),
            eps=m.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6, positive=True),
            rope=read_rope(m, a, index, n_rot, ROPE_NEOX), block_size=bs, mask_token_id=mask,
            target_layers=target_layers, target_n_embd=d_t, n_vocab=V, n_vocab_draft=V_d,
            sample_from_anchor=m.bool(f"{a}.sample_from_anchor", markov), qk_norm="blk.0.attn_q_norm.weight" in index,
            own_embd=own_embd, own_head=own_head, markov_rank=R, conf=conf, swa_window=swa, swa_layers=pattern,
            swa_causal=m.bool(f"{a}.attention.sliding_window_causal", False) if swa else False)
        if V_d != V and "d2t" not in index:
            raise ValueError(f"{self.path}: the draft head has {V_d} rows but the vocabulary {V} tokens, and there "
                             "is no 'd2t' table mapping draft rows to target ids")
        index.check(_tensors(self.args), self.path)
        self.weights = Weights(self.reader, in_memory=in_memory)
        self.d2t = None
        if "d2t" in index:
            self.d2t = check_d2t(self._int_tensor("d2t"), V_d, V, self.path)

    def _int_tensor(self, name: str) -> np.ndarray:
        dt = self.weights.dtype(name)
        raw = self.weights.data(name)
        if dt == DType.I32:
            return np.frombuffer(raw, dtype=np.int32).astype(np.int64)
        if dt == DType.I64:
            return np.frombuffer(raw, dtype=np.int64).copy()
        raise ValueError(f"{self.path}: tensor '{name}' has type {dt.name}; expected I32 (absolute target ids)")

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name") or self.path)


def check_d2t(d2t: np.ndarray, n_draft: int, n_vocab: int, where: str = "d2t") -> np.ndarray:
    """Validate a draft-to-target table of absolute ids: n_draft entries, each in [0, n_vocab),
    no id twice. Returns it as int64; ValueError naming the first bad entry."""
    d2t = np.asarray(d2t).reshape(-1).astype(np.int64)
    if d2t.size != n_draft:
        raise ValueError(f"{where}: d2t has {d2t.size} entries, expected {n_draft} (rows of the draft head)")
    bad = np.flatnonzero((d2t < 0) | (d2t >= n_vocab))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: d2t[{i}] = {int(d2t[i])} is outside the target vocabulary [0, {n_vocab})")
    u, first, counts = np.unique(d2t, return_index=True, return_counts=True)
    if (counts > 1).any():
        t = int(u[np.argmax(counts > 1)])
        rows = np.flatnonzero(d2t == t)[:2].tolist()
        raise ValueError(f"{where}: d2t maps draft rows {rows[0]} and {rows[1]} both to target id {t}")
    return d2t


def _norm(b: GraphBuilder, x, name: str, eps: float):
    w = b.weight(name)
    if w.dtype != _F32:
        w = b.g.cpy(w, _F32)
    return b.g.mul(b.g.rms_norm(x, eps), w)


def _kv_proj(b: GraphBuilder, a: BlockArgs, p: str, h):
    """K (per-head normed, rotated) and V of layer prefix p from rows h [T, d]."""
    g, T = b.g, h.shape[0]
    k = g.reshape(b.linear(h, f"{p}.attn_k.weight"), [T, a.n_head_kv, a.head_dim])
    if a.qk_norm:
        k = _norm(b, k, f"{p}.attn_k_norm.weight", a.eps)
    v = g.reshape(b.linear(h, f"{p}.attn_v.weight"), [T, a.n_head_kv, a.head_dim])
    return a.rope.apply(b, k), v


def build_inject(b: GraphBuilder, a: BlockArgs):
    """Context injection (§4.3): input "feat" [T, L * d_t] -> every layer's K/V written to the
    drafter's cache at the batch's positions. Outputs "c" [T, d] (the encoder rows) and, per
    layer, "touch_k.{il}" / "touch_v.{il}" (one cache row read back, so the writes are part of
    the plan)."""
    g, T = b.g, b.shape.n_tokens
    feat = g.input("feat", _F32, [T, len(a.target_layers) * a.target_n_embd])
    c = _norm(b, b.linear(feat, "fc.weight"), "enc.output_norm.weight", a.eps)      # [T, d]
    g.output(c, "c")
    first = g.view(b.kv_idx, [1], None, 0)
    for il in range(a.n_layer):
        k, v = _kv_proj(b, a, f"blk.{il}", c)
        b.kv_store(il, k, v)
        for kind, rows in (("k", b.k_all[il]), ("v", b.v_all[il])):   # one written row of each, read back
            g.output(g.get_rows(rows, first), f"touch_{kind}.{il}")
    return c


class _Builder(GraphBuilder):
    """GraphBuilder whose kv_store remembers each layer's written cache nodes (``k_all`` /
    ``v_all``: the inject graph reads a row of each back so that its writes are part of the plan)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.k_all: dict[int, object] = {}
        self.v_all: dict[int, object] = {}

    def kv_store(self, il, k, v, swa=False):
        g, T = self.g, self.shape.n_tokens
        kv = self.kv
        H, n_ctx = kv.n_head_kv, kv.n_ctx
        k_cache = g.external(f"cache_k.{il}", kv.dtype, [H * n_ctx, kv.head_dim], kv.k, offset=il * kv.k_layer_bytes)
        k_all = g.set_rows(k_cache, g.reshape(k, [T * H, kv.head_dim]), self.kv_idx)
        self.k_all[il] = k_all
        kb = kv.k_row_bytes
        k_vis = g.view(k_all, [self.shape.n_kv, H, kv.head_dim], [kb, n_ctx * kb, _elem_stride(kv.dtype)])
        v_cache = g.external(f"cache_v.{il}", kv.dtype_v, [H * n_ctx, kv.head_dim_v], kv.v,
                             offset=il * kv.v_layer_bytes)
        v_all = g.set_rows(v_cache, g.reshape(v, [T * H, kv.head_dim_v]), self.kv_idx)
        self.v_all[il] = v_all
        vb = kv.v_row_bytes
        v_vis = g.view(v_all, [self.shape.n_kv, H, kv.head_dim_v], [vb, n_ctx * vb, _elem_stride(kv.dtype_v)])
        return k_vis, v_vis


def build_block(b: GraphBuilder, a: BlockArgs, n_seq: int, e1_draft=None):
    """The block draft (§4.4, §4.6) of n_seq full blocks, rows slot-major (row = slot * n_seq + s).

    Inputs: "tokens" / "pos" (the blocks), the drafter cache's "kv_idx" / "mask" (non-causal:
    context + own block) / "kv_order", "mask_swa" for sliding layers, and for DSpark "anchor"
    [n_seq] (target ids). Outputs: DFlash "logits" [n_read * n_seq, V_d] and "argmax"; DSpark per
    read slot j: "logits.{j}" [n_seq, V_d] (Markov-biased), "tok.{j}" [n_seq] (its argmax, draft
    rows) and "conf.{j}" [n_seq, 1] (the confidence logit, before the sigmoid) when there is a
    confidence head, and "logits" [n_read * n_seq, V_d] before the bias. Also "hidden"
    [n_read * n_seq, d] (post-norm rows of the read slots)."""
    g = b.g
    T = b.shape.n_tokens
    d = a.n_embd
    emb = "token_embd.weight" if a.own_embd else TGT + "token_embd.weight"
    x = b.embed(emb)                                                       # [T, d]
    mask_swa = g.input("mask_swa", _F32, [T, b.shape.n_kv]) if a.swa_window else None
    scale = 1.0 / math.sqrt(a.head_dim)
    for il in range(a.n_layer):
        p = f"blk.{il}"
        h = _norm(b, x, f"{p}.attn_norm.weight", a.eps)
        q = g.reshape(b.linear(h, f"{p}.attn_q.weight"), [T, a.n_head, a.head_dim])
        if a.qk_norm:
            q = _norm(b, q, f"{p}.attn_q_norm.weight", a.eps)
        q = a.rope.apply(b, q)
        k, v = _kv_proj(b, a, p, h)
        sliding = a.swa_window and a.swa_layers[il]
        o = b.kv_attention(il, q, k, v, scale, mask=mask_swa if sliding else None)
        x = g.add(x, b.linear(o, f"{p}.attn_output.weight"))
        h = _norm(b, x, f"{p}.ffn_norm.weight", a.eps)
        x = g.add(x, b.ffn_swiglu(h, p))
    n_read = a.n_read
    R = n_read * n_seq
    x = g.view(x, [R, d], None, a.first_slot * n_seq * d * 4)            # the read slots' rows
    y = _norm(b, x, "output_norm.weight", a.eps)                          # [R, d]
    g.output(y, "hidden")
    head = "output.weight" if a.own_head else (TGT + "output.weight" if TGT + "output.weight" in b.w
                                               else TGT + "token_embd.weight")
    logits = b.linear(y, head)                                            # [R, V_d]
    if not a.is_dspark:
        g.output(logits, "logits")
        g.output(g.argmax(logits), "argmax")
        return logits
    g.output(logits, "logits")                                            # before the Markov bias
    Vd = a.n_vocab_draft
    anchor = g.input("anchor", DType.I32, [n_seq])
    w1 = b.mat_weight("markov_w1.weight")
    w2 = b.mat_weight("markov_w2.weight")
    w1d = w1 if e1_draft is None else e1_draft
    conf_w = b.mat_weight("conf_proj.weight") if a.conf else None
    conf_b = b.weight("conf_proj.bias") if a.conf else None
    if conf_b is not None and conf_b.dtype != _F32:
        conf_b = g.cpy(conf_b, _F32)
    prev = None
    for j in range(n_read):
        lj = g.view(logits, [n_seq, Vd], None, j * n_seq * Vd * 4)
        e = g.get_rows(w1, anchor) if prev is None else g.get_rows(w1d, prev)      # [n_seq, R]
        lj = g.add(lj, g.matmul(e, w2))                                            # + E2 . E1[prev]
        g.output(lj, f"logits.{j}")
        prev = g.argmax(lj)                                                        # [n_seq] draft rows
        g.output(prev, f"tok.{j}")
        if conf_w is not None:
            hj = g.view(y, [n_seq, d], None, j * n_seq * d * 4)
            feat = g.concat(hj, e, -1) if a.conf == "hm" else hj
            g.output(g.add(g.matmul(feat, conf_w), conf_b), f"conf.{j}")
    return logits


def _logit(p: float) -> float:
    """The confidence logit threshold of probability p (conf >= p  <=>  z >= _logit(p))."""
    if p <= 0.0:
        return -math.inf
    if p >= 1.0:
        return math.inf
    return math.log(p / (1.0 - p))


def _top1_prob(row: np.ndarray) -> float:
    r = row.astype(np.float64)
    return 1.0 / float(np.exp(r - r.max()).sum())


class BlockDrafter(ModelDrafter):
    """The ``draft-dflash`` / ``draft-dspark`` proposer; see the module docstring.

    model: a :class:`BlockDrafterModel` or GGUF path; target: the target ``Model`` (its embedding
    and head are shared unless the drafter has its own); n_ctx: the target context's size (the
    drafter's cache mirrors it, plus room for the blocks); kv_dtype: the drafter's cache type
    (default: the bound target's K type); n_ubatch: largest injection decode. A sequence's state
    is a plain DrafterSeq: toks are the positions its cache holds (the injected context).
    """

    def __init__(self, model, target, n_ctx: int, n_threads: int | None = None, kv_dtype=None,
                 n_ubatch: int = 512, max_plans: int = 32, require_dspark: bool = False):
        self.model = model if isinstance(model, BlockDrafterModel) else BlockDrafterModel(model)
        a = self.args = self.model.args
        self.name = "draft-dspark" if a.is_dspark else "draft-dflash"
        if require_dspark and not a.is_dspark:
            raise ValueError(f"draft-dspark: {self.model.path} is a DFlash drafter (no Markov head "
                             "'markov_w1.weight'); use --spec-type draft-dflash")
        self.target_model = target
        check_target(self.model, target)
        self.capture_layers = a.capture_ids
        self.default_n_max = a.n_read
        self._w = JointWeights(self.model.weights, target.weights, TGT)
        # the cache gets room for the blocks of every sequence on top (_new_kv); n_lost counts
        # batches whose features were missing (context incomplete, drafts worse)
        self._init_drafter(n_ctx, n_threads, kv_dtype, n_ubatch, max_plans, a.n_vocab, salt=0xD1A5)

    # --- setup -------------------------------------------------------------------------------
    def bind_target(self, ctx) -> None:
        have = tuple(getattr(ctx, "capture_layers", ()) or ())
        missing = [l for l in self.capture_layers if l not in have]
        if missing:
            raise ValueError(f"{self.name}: the target context captures layers {list(have)} but the drafter reads "
                             f"{list(self.capture_layers)}; create it with capture_layers=capture_layers(proposers)")
        self._attach(ctx)

    def _new_kv(self, dtype, dtype_v) -> KVCache:
        a = self.args  # (one type for K and V)
        n_seq = max(8, int(getattr(self.target, "n_seq_max", 0) or 0))
        return KVCache(a.n_layer, self.n_ctx + n_seq * a.block_size, a.n_head_kv, a.head_dim, dtype,
                       device=self._device())

    def _markov_draft_rows(self):
        """E1 re-indexed by draft row (``E1[d2t]``) for a reduced vocabulary, as a graph tensor."""
        d2t = self.model.d2t
        if d2t is None or not self.args.is_dspark:
            return None
        w = self.model.weights
        name = "markov_w1.weight"

        def make():
            raw = w.data(name)
            V = self.args.n_vocab
            return np.ascontiguousarray(raw.reshape(V, raw.size // V)[d2t]).reshape(-1)

        return w.dtype(name), w.derived("markov_w1[d2t]", make)

    def _plan(self, kind: str, n: int, n_kv: int):
        def build():
            a = self.args
            if kind == "inject":
                b = _Builder(self._w, BatchShape(n, n_kv, 1), self.kv)
                build_inject(b, a)
            else:
                T = a.block_size * n
                b = GraphBuilder(self._w, BatchShape(T, n_kv, T), self.kv)
                e1d = None
                rows = self._markov_draft_rows()
                if rows is not None:
                    dt, arr = rows
                    e1d = b.g.external("markov_w1_draft", dt, [a.n_vocab_draft, a.markov_rank], arr)
                build_block(b, a, n, e1d)
            return native.Plan(b.g, self.pool, self._device())

        return cached_plan(self, (kind, n, n_kv), build)

    # --- sequences ---------------------------------------------------------------------------
    def begin(self, seq: int, prompt) -> None:
        self._ensure()
        if seq not in self._seqs:
            self.kv.remove_seq(seq)
        super().begin(seq, prompt)

    def _resume(self, seq: int, st: DrafterSeq, prompt: np.ndarray) -> None:
        p = prompt.astype(np.int32, copy=False)
        n = min(st.toks.size, p.size)
        diff = np.flatnonzero(st.toks[:n] != p[:n])
        self._cut(seq, st, int(diff[0]) if diff.size else n)

    def _keep(self, seq: int, st: DrafterSeq, n: int) -> None:
        self._cut(seq, st, n)  # (its cache holds every injected row: nothing else to keep)

    def _cut(self, seq: int, st: DrafterSeq, n: int) -> None:
        """Keep positions < n of a sequence."""
        self.kv.truncate(seq, n)
        st.toks = st.toks[: max(n, 0)]

    def cache_len(self, seq: int) -> int:
        """Positions the drafter's cache holds for a sequence (its injected context)."""
        return 0 if self.kv is None else self.kv.seq_len(seq)

    # --- context injection (§4.3) ------------------------------------------------------------
    def process(self, batch: DecodeBatch) -> None:
        if len(batch.tokens) == 0:
            return
        self._ensure()
        seqs = np.asarray(batch.seq_ids, dtype=np.int32).reshape(-1)
        toks = np.asarray(batch.tokens, dtype=np.int32).reshape(-1)
        pos = np.asarray(batch.positions, dtype=np.int32).reshape(-1)
        feats = batch.layer_features(self.capture_layers) if batch.features is not None else None
        verify = batch.kind == "verify"
        rows = []
        for s, st, P, idx, n, k in self._batch_seqs(batch, check=False):
            self._cut(s, st, P)
            if feats is None:  # no features: the context stops here (drafts get worse, output stays exact)
                self.n_lost += 1
                continue
            if st.toks.size < P:
                self.n_lost += 1
            rows.append(idx[:n])
            st.put_toks(P, toks[idx[:n]])
            st.open_at = P if (verify and k is None) else None
        if not rows:
            return
        r = np.concatenate(rows)
        self._inject(toks[r], pos[r], seqs[r], np.ascontiguousarray(feats[r], dtype=np.float32))

    def _inject(self, toks, pos, seqs, feat) -> None:
        T = toks.size
        self._need_cells(T)
        for u0 in range(0, T, self.n_ubatch):
            u1 = min(T, u0 + self.n_ubatch)
            slots = self.kv.prepare(seqs[u0:u1], pos[u0:u1])
            plan = self._plan("inject", u1 - u0, slots.n_kv)
            plan.set_input("pos", pos[u0:u1])
            plan.set_input("kv_idx", slots.rows)
            plan.set_input("feat", feat[u0:u1])
            plan.run()
            self.n_decodes += 1

    def _settle(self, seq: int, st: DrafterSeq, k: int | None) -> None:
        """Close a verify batch injected whole: keep its first k+1 rows."""
        if st.open_at is not None and k is not None:
            self._cut(seq, st, st.open_at + int(k) + 1)
        st.open_at = None

    # --- drafting (§4.4 - §4.6) --------------------------------------------------------------
    def draft(self, requests: list[DraftRequest]) -> list[Draft | None]:
        self._ensure()
        a = self.args
        live = [r for r in requests if r.n_max >= 1 and r.tokens.size > 0]
        out: dict[int, Draft | None] = {}
        if live and not self._free_cells(len(live) * a.block_size):
            live = []
        if live:
            self._draft(live, out)
        return [out.get(r.seq) for r in requests]

    def _draft(self, live: list[DraftRequest], out: dict) -> None:
        a = self.args
        B, bs = len(live), a.block_size
        n_past = np.array([r.tokens.size - 1 for r in live], dtype=np.int32)
        anchor = np.array([int(r.tokens[-1]) for r in live], dtype=np.int32)
        sid = np.array([r.seq for r in live], dtype=np.int32)
        for r, npast in zip(live, n_past.tolist()):
            st = self._draft_seq(r.seq)
            self._cut(r.seq, st, npast)           # drop any scratch rows
            d = st.first_diff(r.tokens, npast)
            if d is not None:                     # the history changed under the cache
                self._cut(r.seq, st, d)
                self.n_lost += 1
        # full blocks, slot-major: row = slot * B + s
        slot = np.repeat(np.arange(bs, dtype=np.int32), B)
        toks = np.where(slot == 0, np.tile(anchor, bs), np.int32(a.mask_token_id)).astype(np.int32)
        pos = (np.tile(n_past, bs) + slot).astype(np.int32)
        seqs = np.tile(sid, bs)
        slots = self.kv.prepare(seqs, pos)
        try:
            n_kv = slots.n_kv
            cpos, cseq = self.kv.cell_pos[:n_kv], self.kv.cell_seq[:n_kv]
            allowed = (cseq[None, :] == seqs[:, None]) & (cpos[None, :] >= 0)
            mask = np.where(allowed, np.float32(0), np.float32(-np.inf)).astype(np.float32)
            plan = self._plan("block", B, n_kv)
            plan.set_input("tokens", toks)
            plan.set_input("pos", pos)
            plan.set_input("out_ids", np.arange(toks.size, dtype=np.int32))
            plan.set_input("kv_idx", slots.rows)
            plan.set_input("mask", mask)
            plan.set_input("kv_order", slots.order)
            if a.swa_window:
                win = allowed & (cpos[None, :] > pos[:, None] - a.swa_window)
                if a.swa_causal:
                    win &= cpos[None, :] <= pos[:, None]
                plan.set_input("mask_swa", np.where(win, np.float32(0), np.float32(-np.inf)).astype(np.float32))
            if a.is_dspark:
                plan.set_input("anchor", anchor)
            plan.run()
            self.n_decodes += 1
            # the logits rows are read only to sample or to cut at the top-1 probability
            res = self._read(plan, B, any(not r.greedy or (r.p_min > 0.0 and not a.conf) for r in live))
        finally:
            for r, npast in zip(live, n_past.tolist()):
                self.kv.truncate(r.seq, npast)     # the block's K/V are scratch
        if self.trace is not None:
            self.trace.append(dict(seqs=sid.copy(), anchor=anchor.copy(), n_past=n_past.copy(), **res))
        for i, r in enumerate(live):
            out[r.seq] = self._pick(r, i, B, res)

    def _read(self, plan, B: int, need_logits: bool) -> dict:
        """The plan's outputs as arrays: tok [n_read, B] (draft rows), conf (logits, [n_read, B])
        or None, and logits [n_read, B, V_d] (None unless need_logits: greedy drafting without a
        top-1 cut reads only the argmax)."""
        a = self.args
        n = a.n_read
        need_logits = need_logits or self.trace is not None
        if not a.is_dspark:
            logits = np.asarray(plan.output("logits")).reshape(n, B, -1) if need_logits else None
            tok = np.asarray(plan.output("argmax")).reshape(n, B)
            return dict(logits=logits, tok=tok, conf=None)
        logits = np.stack([np.asarray(plan.output(f"logits.{j}")) for j in range(n)]) if need_logits else None
        tok = np.stack([np.asarray(plan.output(f"tok.{j}")).reshape(B) for j in range(n)])
        conf = (np.stack([np.asarray(plan.output(f"conf.{j}")).reshape(B) for j in range(n)])
                if a.conf else None)
        out = dict(logits=logits, tok=tok, conf=conf)
        if self.trace is not None:  # the logits before the Markov bias, for tests
            out["base"] = np.asarray(plan.output("logits")).reshape(n, B, -1).copy()
        return out

    def _full_row(self, row: np.ndarray) -> np.ndarray:
        """A draft-vocabulary row scattered into the target's vocabulary (-inf elsewhere)."""
        d2t = self.model.d2t
        if d2t is None:
            return row
        full = np.full(self.args.n_vocab, -np.inf, dtype=np.float32)
        full[d2t] = row
        return full

    def _pick(self, r: DraftRequest, i: int, B: int, res: dict) -> Draft | None:
        import dataclasses

        a = self.args
        d2t = self.model.d2t
        n = min(r.n_max, a.n_read)
        conf = res["conf"]
        zmin = _logit(r.p_min) if conf is not None else None
        drafted: list[int] = []
        probs: list[np.ndarray] = []
        if r.greedy:
            for j in range(n):
                if zmin is not None:
                    if not float(conf[j, i]) >= zmin:
                        break
                elif r.p_min > 0.0 and _top1_prob(res["logits"][j, i]) < r.p_min:
                    break
                t = int(res["tok"][j, i])
                drafted.append(int(d2t[t]) if d2t is not None else t)
        else:
            rq = dataclasses.replace(r, p_min=0.0) if zmin is not None else r
            for j in range(n):
                if zmin is not None and not float(conf[j, i]) >= zmin:
                    break
                got = self._picker.pick(rq, self._full_row(res["logits"][j, i]), drafted)
                if got is None:
                    break
                t, q = got
                drafted.append(t)
                probs.append(q)
        if not drafted:
            return None
        return Draft(np.asarray(drafted, dtype=np.int32), np.stack(probs) if probs else None)


def check_target(model: BlockDrafterModel, target) -> None:
    """Raise ValueError unless the drafter fits the target model (vocabulary, feature width,
    layer ids, shared embedding / head)."""
    a, ta = model.args, target.args
    p, tp = model.path, target.path
    if target.n_vocab != a.n_vocab:
        raise ValueError(f"{p}: the drafter was made for a vocabulary of {a.n_vocab} tokens but the target {tp} "
                         f"has {target.n_vocab}")
    if ta.n_embd != a.target_n_embd:
        raise ValueError(f"{p}: the drafter reads target rows of width {a.target_n_embd} but the target {tp} has "
                         f"n_embd {ta.n_embd}")
    n_layer = int(ta.n_layer)
    bad = [l for l in a.target_layers if not -1 <= l < n_layer]
    if bad:
        raise ValueError(f"{p}: dflash.target_layers {list(a.target_layers)} name layer(s) {bad} but the target {tp} "
                         f"has {n_layer} layers (ids -1 .. {n_layer - 1})")
    if not a.own_embd and "token_embd.weight" not in target.weights:
        raise ValueError(f"{p}: the drafter shares the target's token embedding but {tp} has none")
    if not a.own_embd and target.weights.shape("token_embd.weight")[1] != a.n_embd:
        raise ValueError(f"{p}: the drafter's width {a.n_embd} differs from the target's embedding width; "
                         "it needs its own token_embd.weight")
    if not a.own_head and ta.n_embd != a.n_embd:
        raise ValueError(f"{p}: the drafter's width {a.n_embd} differs from the target's; it needs its own "
                         "output.weight")


def make_block_drafter(kind: str, cfg, target, n_ctx: int, n_threads: int | None = None) -> BlockDrafter:
    """The proposer of spec type ``draft-dflash`` / ``draft-dspark`` from a SpecConfig
    (``cfg.draft_model``: the drafter GGUF path or a :class:`BlockDrafterModel`)."""
    dm = cfg.draft_model
    if dm is None:
        raise ValueError(f"speculative type {kind!r} needs the drafter GGUF (-md / --model-draft)")
    if not isinstance(dm, BlockDrafterModel):
        from pyfast.hub import resolve_model

        dm = BlockDrafterModel(resolve_model(str(dm), quiet=True))
    return BlockDrafter(dm, target, n_ctx=n_ctx, n_threads=cfg.draft_threads or n_threads,
                        require_dspark=kind == "draft-dspark")
