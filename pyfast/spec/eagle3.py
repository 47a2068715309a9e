"""The ``draft-eagle3`` proposer: EAGLE-3 drafting from the target's own features (``algorithms.md`` §5).

An EAGLE-3 head is one decoder layer that reads three of the target's layers. Per draft row:

    g  = fc(F)                  F = [h_l1 ; h_l2 ; h_l3], the target's rows (feature capture),
                                optionally RMS-normed first (``norm_before_fc``: fc_norm)
    a  = [RMS_in(Emb(x)) ; RMS_h(g)]                          width 2d; q / k / v project from 2d
    x1 = r + attn_output(attention(rope(q), rope(k), v))     r = g, or RMS_h(g) with
                                                              ``norm_before_residual``
    z  = x1 + ffn(RMS_ffn(x1))                                the pre-norm output: the next step's g
    logits = head(RMS_out(z))   own reduced head [V_d, d] scattered through ``d2t`` into a V-vector
                                of -inf, or the target's head (V_d = V)

Pairing (§5): the row at draft position P is ``(token_{P+1}, g_P)`` with ``g_P`` from the target's
features of position P. After every target decode, ``process`` writes the complete pairs of the
batch into the head's own one-layer KV cache (K/V only: no queries, no FFN) and defers the last
row (its next token is not known yet). ``draft`` first completes the deferred pair with
``id_last`` (step 0: ``(id_last @ n_past-1, fc(F_{n_past-1}))``), then chains ``(d_i, z_{i-1})``
at ``n_past-1+i``. After a verify batch with k accepted draft tokens the deferred row is verify
row k; the rejected rows' pairs are never written and the draft chain's rows are truncated before
the next catch-up.

GGUF format (``general.architecture = "eagle3"``, written by ``pyfast convert --draft``):

* metadata ``eagle3.embedding_length`` (d), ``eagle3.target_embedding_length`` (d_t, default d),
  ``eagle3.feed_forward_length``, ``eagle3.attention.head_count`` / ``head_count_kv`` /
  ``key_length``, ``eagle3.attention.layer_norm_rms_epsilon``, ``eagle3.rope.freq_base`` (and the
  usual ``eagle3.rope.scaling.*``), ``eagle3.context_length``, ``eagle3.vocab_size`` (the
  target's V), ``eagle3.draft_vocab_size`` (V_d), ``eagle3.target_layers`` (int array: target
  layer ids as *inputs* of those layers, id n = the final hidden state before the output norm;
  absent: ``{2, n/2, n-3}`` of the target), ``eagle3.norm_before_residual`` (bool, default
  false), ``eagle3.norm_before_fc`` (bool, default false);
* tensors ``fc.weight`` [d, L * d_t], ``fc_norm.weight`` [L * d_t] (norm_before_fc),
  ``blk.0.attn_norm.weight`` (RMS_in), ``blk.0.hidden_norm.weight`` (RMS_h),
  ``blk.0.attn_{q,k,v}.weight`` [*, 2d], ``blk.0.attn_output.weight``, ``blk.0.ffn_norm.weight``,
  ``blk.0.ffn_{gate,up,down}.weight``, ``output_norm.weight``; optional ``token_embd.weight``
  [V, d] (else the target's), ``output.weight`` [V_d, d] (else the target's head), ``d2t`` I32
  [V_d] (absolute target ids; checked in range and unique at load; required when V_d < V).
  Rope is NEOX (the checkpoint's rotate_half layout; q / k rows are not permuted).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import numpy as np

from pyfast._loader import native
from pyfast.context import cached_plan
from pyfast.memory.kv_cache import KVCache
from pyfast.models.base import BatchShape, GraphBuilder, JointWeights, TensorSpec, Weights, head_name
from pyfast.models.rope import ROPE_NEOX, Rope, read_rope
from pyfast.spec.base import DecodeBatch, Draft, DraftRequest
from pyfast.spec.model_drafter import DrafterSeq, ModelDrafter

__all__ = ["ARCH", "Eagle3Args", "Eagle3Model", "Eagle3Proposer", "check_d2t", "default_layers", "make_eagle3"]

ARCH = "eagle3"
DType = native.DType
TGT = "target/"     # prefix of the target's tensors inside the head's graphs
WINDOW = 64         # target feature rows kept per sequence (a resumed prefix finds its deferred row; a
                    # context checkpoint keeps its own: save_state)


def default_layers(n_layer: int) -> tuple[int, ...]:
    """EAGLE-3's default feature layers {2, n/2, n-3} (inputs of those layers), clipped to [1, n]."""
    return tuple(min(max(l, 1), n_layer) for l in (2, n_layer // 2, n_layer - 3))


def check_d2t(d2t: np.ndarray, n_vocab: int, where: str) -> np.ndarray:
    """Validate a d2t table of absolute target ids: in [0, n_vocab) and no id twice. Returns it
    as int64; raises ValueError with one line naming the first bad row."""
    d2t = np.asarray(d2t).reshape(-1)
    if d2t.dtype.kind not in "iu":
        raise ValueError(f"{where}: d2t must hold integer token ids, got {d2t.dtype}")
    d2t = d2t.astype(np.int64)
    bad = np.flatnonzero((d2t < 0) | (d2t >= n_vocab))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: d2t maps draft row {i} to target id {int(d2t[i])}, outside [0, {n_vocab})")
    order = np.argsort(d2t, kind="stable")
    dup = np.flatnonzero(np.diff(d2t[order]) == 0)
    if dup.size:
        i, j = int(order[dup[0]]), int(order[dup[0] + 1])
        raise ValueError(f"{where}: d2t maps draft rows {i} and {j} both to target id {int(d2t[i])}")
    return d2t


@dataclass
class Eagle3Args:
    n_embd: int
    n_embd_target: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    eps: float
    rope: Rope
    n_vocab: int           # the target's vocabulary
    n_vocab_draft: int     # rows of the head (V_d)
    target_layers: tuple[int, ...] | None
    norm_before_residual: bool
    norm_before_fc: bool
    own_embd: bool
    own_head: bool
    n_ctx_train: int

    @property
    def n_features(self) -> int:
        return len(self.target_layers) if self.target_layers else 3

    @classmethod
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None) -> "Eagle3Args":
        from pyfast.models import meta as M
        from pyfast.models.decoder import attention_dims

        m = M.Meta(md, path, types)
        a = ARCH
        d = m.int(f"{a}.embedding_length", lo=1, hi=M.MAX_EMBD)
        dt = m.int(f"{a}.target_embedding_length", d, lo=1, hi=M.MAX_EMBD)
        n_head, n_head_kv, head_dim = attention_dims(m, a, d, path)
        layers = m.int_list(f"{a}.target_layers", None, lo=0, hi=M.MAX_LAYERS) if m.has(f"{a}.target_layers") else None
        if layers is not None and not layers:
            raise m.fail(f"{a}.target_layers", layers, "a non-empty list of layer ids")
        n_vocab = m.int(f"{a}.vocab_size", lo=1, hi=M.MAX_VOCAB)
        vd = m.int(f"{a}.draft_vocab_size", n_vocab, lo=1, hi=n_vocab)
        return cls(n_embd=d, n_embd_target=dt, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                   n_ff=m.int(f"{a}.feed_forward_length", lo=1, hi=M.MAX_FF),
                   eps=m.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6, positive=True),
                   rope=read_rope(m, a, weights, head_dim, ROPE_NEOX),
                   n_vocab=n_vocab, n_vocab_draft=vd, target_layers=None if layers is None else tuple(layers),
                   norm_before_residual=m.bool(f"{a}.norm_before_residual", False),
                   norm_before_fc=m.bool(f"{a}.norm_before_fc", False),
                   own_embd="token_embd.weight" in weights, own_head="output.weight" in weights,
                   n_ctx_train=m.int(f"{a}.context_length", 4096, lo=1, hi=M.MAX_CTX))


def tensors(a: Eagle3Args) -> list[TensorSpec]:
    d, d2, hd = a.n_embd, 2 * a.n_embd, a.head_dim
    F = a.n_features * a.n_embd_target
    p = "blk.0"
    specs = [TensorSpec("fc.weight", (d, F)),
             TensorSpec("fc_norm.weight", (F,), optional=not a.norm_before_fc),
             TensorSpec(f"{p}.attn_norm.weight", (d,)), TensorSpec(f"{p}.hidden_norm.weight", (d,)),
             TensorSpec(f"{p}.attn_q.weight", (a.n_head * hd, d2)),
             TensorSpec(f"{p}.attn_k.weight", (a.n_head_kv * hd, d2)),
             TensorSpec(f"{p}.attn_v.weight", (a.n_head_kv * hd, d2)),
             TensorSpec(f"{p}.attn_output.weight", (d, a.n_head * hd)),
             TensorSpec(f"{p}.ffn_norm.weight", (d,)),
             TensorSpec(f"{p}.ffn_gate.weight", (a.n_ff, d)), TensorSpec(f"{p}.ffn_up.weight", (a.n_ff, d)),
             TensorSpec(f"{p}.ffn_down.weight", (d, a.n_ff)),
             TensorSpec("output_norm.weight", (d,)),
             TensorSpec("token_embd.weight", (a.n_vocab, d), optional=True),
             TensorSpec("output.weight", (a.n_vocab_draft, d), optional=True),
             TensorSpec("d2t", (a.n_vocab_draft,), optional=True)]
    return specs


class Eagle3Model:
    """An EAGLE-3 head GGUF: metadata, weights and the validated d2t table."""

    def __init__(self, path: str | os.PathLike):
        from pyfast.gguf import GGUFReader

        self.path = str(path)
        self.reader = GGUFReader(self.path)
        md = self.reader.metadata
        arch = md.get("general.architecture")
        if arch != ARCH:
            raise ValueError(f"{self.path}: not an EAGLE-3 head (general.architecture is {arch!r}, expected "
                             f"{ARCH!r}); convert a checkpoint with `pyfast convert --draft`")
        self.weights = Weights(self.reader, in_memory=False)
        self.args = Eagle3Args.from_gguf(md, self.weights, self.path, self.reader.metadata_types)
        self.weights.check(tensors(self.args), self.path)
        a = self.args
        if a.norm_before_fc and "fc_norm.weight" not in self.weights:
            raise ValueError(f"{self.path}: eagle3.norm_before_fc is set but the file has no fc_norm.weight")
        self.d2t: np.ndarray | None = None
        if "d2t" in self.weights:
            if self.weights.dtype("d2t") != DType.I32:
                raise ValueError(f"{self.path}: tensor 'd2t' must be I32, got {self.weights.dtype('d2t').name}")
            raw = np.frombuffer(self.weights.data("d2t").tobytes(), dtype="<i4")
            self.d2t = check_d2t(raw, a.n_vocab, f"{self.path}")
        if a.own_head and a.n_vocab_draft < a.n_vocab and self.d2t is None:
            raise ValueError(f"{self.path}: a reduced draft vocabulary ({a.n_vocab_draft} of {a.n_vocab} tokens) "
                             "needs a d2t table")
        if not a.own_head and a.n_vocab_draft != a.n_vocab:
            raise ValueError(f"{self.path}: without its own output.weight the head uses the target's, so "
                             f"eagle3.draft_vocab_size ({a.n_vocab_draft}) must equal eagle3.vocab_size ({a.n_vocab})")

    def check_target(self, target) -> tuple[int, ...]:
        """Raise ValueError unless ``target`` (a Model) fits this head; returns the feature layers."""
        a, ta, p, tp = self.args, target.args, self.path, target.path
        if target.n_vocab != a.n_vocab:
            raise ValueError(f"{p}: the EAGLE-3 head was made for a vocabulary of {a.n_vocab} tokens but the "
                             f"target {tp} has {target.n_vocab}")
        if ta.n_embd != a.n_embd_target:
            raise ValueError(f"{p}: the EAGLE-3 head reads target rows of width {a.n_embd_target} but the target "
                             f"{tp} has width {ta.n_embd}")
        layers = a.target_layers or default_layers(ta.n_layer)
        if len(layers) * a.n_embd_target != self.weights.shape("fc.weight")[1]:
            raise ValueError(f"{p}: fc.weight reads {self.weights.shape('fc.weight')[1]} columns but "
                             f"{len(layers)} target layers of width {a.n_embd_target} give "
                             f"{len(layers) * a.n_embd_target}")
        try:
            target.check_capture(tuple(dict.fromkeys(layers)))  # (a small target may repeat one)
        except ValueError as e:
            raise ValueError(f"{p}: eagle3.target_layers {list(layers)} do not fit the target: {e}") from None
        if not a.own_embd and ta.n_embd != a.n_embd:
            raise ValueError(f"{p}: the head's width {a.n_embd} differs from the target's {ta.n_embd}; it needs "
                             "its own token_embd.weight")
        if not a.own_head and ta.n_embd != a.n_embd:
            raise ValueError(f"{p}: the head's width {a.n_embd} differs from the target's {ta.n_embd}; it needs "
                             "its own output.weight")
        return tuple(int(l) for l in layers)


def build(b: GraphBuilder, a: Eagle3Args, mode: str, head: str, embd: str):
    """The head as a graph. mode "kv": catch-up rows from target features (graph input "f" [T, L *
    d_t]); only their K/V are computed and stored. "feat": full rows from target features; "hid":
    full rows from the previous step's output (input "h" [T, d]). Full rows output "hidden" [T, d]
    (the pre-norm z) and return logits [n_out, V_d] for b.out_ids."""
    g, T, d, hd, eps = b.g, b.shape.n_tokens, a.n_embd, a.head_dim, a.eps
    p = "blk.0"
    if mode == "hid":
        h = g.input("h", DType.F32, [T, d])
    else:
        f = g.input("f", DType.F32, [T, a.n_features * a.n_embd_target])
        if a.norm_before_fc:
            f = b.norm(f, "fc_norm.weight", eps)
        h = b.linear(f, "fc.weight")                                           # [T, d]
    hn = b.norm(h, f"{p}.hidden_norm.weight", eps)
    x2 = g.concat(b.norm(b.embed(embd), f"{p}.attn_norm.weight", eps), hn, -1)  # [T, 2d]: embedding first
    k = a.rope.apply(b, g.reshape(b.linear(x2, f"{p}.attn_k.weight"), [T, a.n_head_kv, hd]))
    v = g.reshape(b.linear(x2, f"{p}.attn_v.weight"), [T, a.n_head_kv, hd])
    if mode == "kv":
        k_vis, v_vis = b.kv_store(0, k, v)
        # the cache writes are the product; a copy of one cached row of each keeps them in the plan
        for name, t in (("k_row", k_vis), ("v_row", v_vis)):
            g.output(g.cpy(g.view(t, [1, hd], [t.strides[0], t.strides[2]]), DType.F32), name)
        return None
    q = a.rope.apply(b, g.reshape(b.linear(x2, f"{p}.attn_q.weight"), [T, a.n_head, hd]))
    o = b.kv_attention(0, q, k, v, 1.0 / math.sqrt(hd))                        # [T, H * hd]
    x = g.add(hn if a.norm_before_residual else h, b.linear(o, f"{p}.attn_output.weight"))
    x = g.add(x, b.ffn_swiglu(b.norm(x, f"{p}.ffn_norm.weight", eps), p))
    g.output(x, "hidden")                                                      # z: the next step's g
    return b.linear(b.norm(b.select_outputs(x), "output_norm.weight", eps), head)


@dataclasses.dataclass
class _Seq(DrafterSeq):
    """The head's view of one sequence (and DrafterSeq's toks / k_next / open_at).

    n_kv:  pairs for positions 0..n_kv-1 are in the head's KV cache; the deferred row is the
           target's feature row of position n_kv (its pair waits for token n_kv + 1). toks holds
           the target's tokens at positions 0..n_kv.
    pos0, rows: the target's feature rows of positions pos0 .. pos0 + len(rows) - 1 (a window).
    """

    n_kv: int = 0


class Eagle3Proposer(ModelDrafter):
    """Drafts with an EAGLE-3 head (see the module docstring).

    head: an Eagle3Model or a GGUF path; target: the target Model; n_ctx: cells of the head's KV
    cache (the target's context: it mirrors the target's sequences, plus room for draft rows);
    n_threads: threads when not bound to a target context; kv_dtype: the head's KV type
    (default: the bound target's, else F16); n_ubatch: the largest catch-up decode.
    """

    name = "draft-eagle3"
    default_n_max = 3
    kv_what = "the head's KV cache"
    new_seq = _Seq

    def __init__(self, head: "Eagle3Model | str | os.PathLike", target, n_ctx: int, n_threads: int | None = None,
                 kv_dtype: "native.DType | None" = None, n_ubatch: int = 512, max_plans: int = 32):
        self.head = head if isinstance(head, Eagle3Model) else Eagle3Model(head)
        self.capture_layers = self.head.check_target(target)
        self.model = target
        self.args = self.head.args
        self.weights = JointWeights(self.head.weights, target.weights, TGT)
        a = self.args
        self._embd = "token_embd.weight" if a.own_embd else TGT + "token_embd.weight"
        self._head = "output.weight" if a.own_head else TGT + head_name(target.args)
        self.d2t = self.head.d2t
        self.n_vocab = target.n_vocab
        self._init_drafter(int(n_ctx) + 64, n_threads, kv_dtype, n_ubatch, max_plans, self.n_vocab, salt=0xEA93)

    # --- setup -----------------------------------------------------------------------------
    def bind_target(self, ctx) -> None:
        """Read the features the target Context captures (its capture_layers must hold ours)."""
        have = tuple(getattr(ctx, "capture_layers", ()) or ())
        if not set(self.capture_layers) <= set(have):
            raise ValueError(f"draft-eagle3 needs the target's layers {list(self.capture_layers)} captured: create "
                             f"its Context with capture_layers including them (it captures {list(have)}; "
                             "pyfast.LLM does this when draft-eagle3 is configured)")
        if ctx.model.n_vocab != self.n_vocab:
            raise ValueError("draft-eagle3: the target context runs another model than the head was checked against")
        self._attach(ctx)

    def _new_kv(self, dtype, dtype_v) -> KVCache:
        a = self.args
        return KVCache(1, self.n_ctx, a.n_head_kv, a.head_dim, dtype, dtype_v=dtype_v, device=self._device())

    def _plan(self, mode: str, n_tokens: int, n_kv: int):
        def make():
            b = GraphBuilder(self.weights, BatchShape(n_tokens, n_kv, n_tokens), self.kv)
            logits = build(b, self.args, mode, self._head, self._embd)
            if logits is not None:
                b.g.output(logits, "logits")
            return native.Plan(b.g, self.pool, self._device())

        return cached_plan(self, (mode, n_tokens, n_kv), make)

    def _decode(self, mode: str, toks, pos, seqs, x):
        """One head decode: "kv" writes catch-up pairs (in micro-batches, nothing returned);
        "feat" / "hid" run draft rows and return (logits [T, V_d], z [T, d])."""
        plan = self._run_rows(mode, toks, pos, seqs, x, "h" if mode == "hid" else "f",
                              self.n_ubatch if mode == "kv" else toks.size)
        return None if mode == "kv" else (plan.output("logits"), plan.output("hidden"))

    def forward(self, tokens, positions, seq_ids, x, mode: str = "feat") -> tuple[np.ndarray, np.ndarray]:
        """Run rows ``(tokens[t] @ positions[t], x[t])`` (x: target features for mode "feat", the
        previous output z for "hid") through the head, appending them to its KV cache; returns
        (logits [T, V_d], z [T, d]). For tests and tools."""
        self._ensure()
        T = len(tokens)
        seqs = np.broadcast_to(np.asarray(seq_ids, dtype=np.int32), (T,)).copy()
        return self._decode(mode, np.asarray(tokens, dtype=np.int32).reshape(-1),
                            np.asarray(positions, dtype=np.int32).reshape(-1), seqs, np.asarray(x, np.float32))

    def scatter(self, logits: np.ndarray) -> np.ndarray:
        """Draft-vocabulary logits [.., V_d] -> target-vocabulary logits [.., V] (-inf off d2t)."""
        if self.d2t is None:
            return logits
        out = np.full(logits.shape[:-1] + (self.n_vocab,), -np.inf, dtype=np.float32)
        out[..., self.d2t] = logits
        return out

    # --- sequences -------------------------------------------------------------------------
    def _keep(self, seq: int, st: _Seq, n: int) -> None:
        self._cut(seq, st, n - 1)  # pairs 0..n-2; the deferred row is position n - 1's

    def _cut(self, seq: int, st: _Seq, n: int) -> None:
        """Keep pairs 0..n-1 (the deferred row becomes position n's, if the window has it)."""
        n = max(0, min(n, st.n_kv))
        st.n_kv = n
        st.toks = st.toks[: n + 1]
        self.kv.truncate(seq, n)

    def _settle(self, seq: int, st: _Seq, k: int | None) -> None:
        """Close a verify batch processed whole: drop the pairs of its rejected rows."""
        if k is not None:
            self._cut(seq, st, st.open_at + int(k))
        st.open_at = None

    # --- catch-up --------------------------------------------------------------------------
    def process(self, batch: DecodeBatch) -> None:
        if len(batch.tokens) == 0:
            return
        self._ensure()
        feats = batch.layer_features(self.capture_layers) if batch.features is not None else None
        F = self.args.n_features * self.args.n_embd_target
        toks = np.asarray(batch.tokens, dtype=np.int32).reshape(-1)
        verify = batch.kind == "verify"
        zero = np.zeros(F, dtype=np.float32)
        w_tok, w_pos, w_seq, w_f = [], [], [], []
        for s, st, P0, idx, n, k in self._batch_seqs(batch):
            use = idx[:n]
            rows = feats[use] if feats is not None else np.zeros((n, F), dtype=np.float32)
            if feats is None:
                self.n_lost += n
            if P0 > 0:
                prev = st.row(P0 - 1)
                if prev is None or st.n_kv < P0 - 1:
                    self.n_lost += 1
                    prev = zero if prev is None else prev
                self._cut(s, st, P0 - 1)
                # the deferred pair (F_{P0-1}, t_{P0}) completes now; then the batch's own pairs
                w_f.append(prev[None, :])
                w_tok.append(toks[use])
                w_pos.append(np.arange(P0 - 1, P0 - 1 + n, dtype=np.int32))
                w_seq.append(np.full(n, s, dtype=np.int32))
                if n > 1:
                    w_f.append(rows[:-1])
            elif n > 1:
                w_f.append(rows[:-1])
                w_tok.append(toks[use[1:]])
                w_pos.append(np.arange(0, n - 1, dtype=np.int32))
                w_seq.append(np.full(n - 1, s, dtype=np.int32))
            # the window of feature rows: older rows before P0, then this batch's
            keep = st.rows[: max(0, P0 - st.pos0)] if st.rows is not None and st.pos0 <= P0 else None
            if keep is not None and keep.shape[0] and st.pos0 + keep.shape[0] == P0:
                win, p0 = np.concatenate([keep, rows]), st.pos0
            else:
                win, p0 = rows.copy(), P0
            if win.shape[0] > WINDOW:
                p0 += win.shape[0] - WINDOW
                win = win[-WINDOW:]
            st.rows, st.pos0 = np.ascontiguousarray(win), p0
            st.put_toks(P0, toks[use])
            st.n_kv = P0 + n - 1
            st.open_at = P0 if (verify and k is None) else None
        if w_tok:
            self._decode("kv", np.concatenate(w_tok), np.concatenate(w_pos), np.concatenate(w_seq),
                         np.concatenate(w_f))

    # --- drafting --------------------------------------------------------------------------
    def draft(self, requests: list[DraftRequest]) -> list[Draft | None]:
        self._ensure()
        start = []
        for r in requests:
            n_past = int(r.tokens.size) - 1
            st = self._seqs.get(r.seq)
            if r.n_max < 1 or n_past < 1 or st is None:
                continue
            if st.open_at is not None:
                self._settle(r.seq, st, None)
            d = st.first_diff(r.tokens, min(st.n_kv + 1, st.toks.size, n_past))
            if d is not None:                   # the history changed under the head's cache
                self._cut(r.seq, st, max(d - 1, 0))
                self.n_lost += 1
            if st.n_kv != n_past - 1:
                self._cut(r.seq, st, min(st.n_kv, n_past - 1))
            f = st.row(n_past - 1)
            if f is None or st.n_kv != n_past - 1:
                continue                        # the deferred row is unknown: no draft this round
            self.kv.truncate(r.seq, n_past - 1)  # (last round's draft rows are gone already)
            start.append((r, int(r.tokens[-1]), n_past - 1, f))
        return self._chain(requests, start)

    def _step(self, step: int, toks, pos, seqs, x):
        logits, z = self._decode("feat" if step == 0 else "hid", toks, pos, seqs, x)
        return logits, self.scatter(logits), z


def make_eagle3(cfg, target, n_ctx: int, n_threads: int | None = None) -> Eagle3Proposer:
    """The proposer of spec type ``draft-eagle3`` from a SpecConfig (``cfg.draft_model``: the
    head's GGUF path or an :class:`Eagle3Model`)."""
    dm = cfg.draft_model
    if dm is None:
        raise ValueError("speculative type 'draft-eagle3' needs the EAGLE-3 head GGUF (-md / --model-draft)")
    if not isinstance(dm, Eagle3Model):
        from pyfast.hub import resolve_model

        dm = Eagle3Model(resolve_model(str(dm), quiet=True))
    return Eagle3Proposer(dm, target, n_ctx=n_ctx, n_threads=cfg.draft_threads or n_threads)
