"""The ``draft-mtp`` proposer: drafting with the target's own MTP (NextN) block (``algorithms.md`` §1).

The MTP block runs as a second "context" on the target's weights: its own one-layer KV cache
(``KVCache(1, ...)``, every sequence in it) and its own plans, cached per batch shape like a
``Context``'s, so no graph is built per token. Row ``p`` of the block consumes ``(token_p,
h_{p-1})`` (the target's post-final-norm hidden of the previous position; a zero vector before
position 0) and predicts ``token_{p+1}``.

Per sequence it keeps ``carry_in`` (the trunk ``h`` of the position before ``id_last``) and a
small window of the trunk rows of the last target batch (``verify_rows``), and follows §1.3-1.5:

- ``process(batch)`` after every target decode (prompt micro-batches and verify batches) reads the
  target's exported hidden rows ``h_0..h_{B-1}`` and decodes an MTP batch with the same tokens and
  positions and the hidden rows ``[carry_in, h_0, .., h_{B-2}]`` (only the MTP KV cache is filled:
  the catch-up plan has no head); then ``verify_rows = h_0..h_{B-1}`` and ``carry_in = h_{B-1}``.
  A verify batch whose accepted count is already known only decodes its kept rows.
- ``draft`` runs the recursion for all requesting sequences together, one MTP decode per step with
  one row per sequence: step 0 is ``(id_last @ n_past, carry_in)``, step i is ``(d_i @ n_past+i,
  the block's own post-norm output of step i-1)``, each appended to the MTP KV. A greedy target
  gets the argmax (stopping when its probability is below p_min); a sampling one gets tokens drawn
  from the MTP's own distribution q under the user's sampler chain, and q for rejection sampling.
- ``accept(k)``: ``carry_in = verify_rows[min(k, rows-1)]``, and the MTP KV is truncated after the
  accepted prefix (draft rows and rejected catch-up rows go).

The proposer finds where a sequence stands from the positions of each batch: a batch starting at
position 0 starts the sequence afresh; one starting at P reuses the MTP rows before P and takes
``h_{P-1}`` from the window (a reused prompt prefix after a short rollback). If the window does not
reach back that far (e.g. tokens decoded without telling the proposers, a KV cache truncated further
back than the last batch), drafting continues with a zero carry: drafts get worse, output stays exact
(the target verifies everything). A server context checkpoint keeps the carry of its position
(``save_state``), so a restore loses nothing.

The target must export hidden rows: create its ``Context`` with ``export_hidden=True``
(``pyfast.LLM`` does when draft-mtp is configured) and bind it (``SpecDecoder`` calls
``bind_target``). A ``DecodeBatch`` carrying a ``hidden`` attribute (rows aligned with the batch)
is used directly instead.

The carry type is a per-architecture flag ``MTP_CARRY`` ("post_norm" for Qwen3.5 / Qwen3.5-MoE /
Qwen3-Next: the block's output after its head norm, matching the trunk's post-norm export).
"""
from __future__ import annotations

import dataclasses
from types import ModuleType

import numpy as np

from pyfast._loader import native
from pyfast.context import cached_plan
from pyfast.memory.kv_cache import KVCache
from pyfast.models import BatchShape, Model
from pyfast.models.base import GraphBuilder
from pyfast.spec.base import DecodeBatch, Draft, DraftRequest
from pyfast.spec.model_drafter import DrafterSeq, ModelDrafter

__all__ = ["MTPProposer", "mtp_impl", "check_mtp"]


def mtp_impl(model: Model) -> ModuleType | None:
    """The module that builds this model's MTP block (``build_nextn``, ``nextn_tensors`` and
    ``MTP_CARRY``): the architecture's own, or the one whose layers it reuses (Qwen3.5-MoE and
    Qwen3-Next are built from ``qwen35.py``)."""
    arch = model.arch
    if hasattr(arch, "build_nextn"):
        return arch
    from pyfast.models import qwen35

    if isinstance(model.args, qwen35.Args):
        return qwen35
    return None


def check_mtp(model: Model) -> ModuleType:
    """Raise ValueError unless ``model`` has a usable MTP (nextn) block; return its module."""
    impl = mtp_impl(model)
    arch = model.metadata.get("general.architecture")
    if impl is None:
        raise ValueError(f"draft-mtp: {model.path} (architecture {arch!r}) has no MTP (nextn) layers; "
                         "use a model with multi-token-prediction layers or another --spec-type")
    a = model.args
    n = int(getattr(a, "n_nextn", 0) or 0)
    if n < 1:
        raise ValueError(f"draft-mtp: {model.path} has no MTP (nextn) layers ({arch}.nextn_predict_layers = 0, "
                         f"{arch}.block_count = {a.n_layer}: trunk only); convert the checkpoint with its MTP "
                         "layers (pyfast convert --mtp) or use another --spec-type")
    il = a.n_layer
    missing = [s.name for s in impl.nextn_tensors(a, 0) if not s.optional and s.name not in model.weights]
    if missing:
        raise ValueError(f"draft-mtp: {model.path} declares {n} MTP (nextn) layer(s) but MTP layer blk.{il} "
                         f"lacks {', '.join(repr(m) for m in missing[:4])}"
                         + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    model.weights.check(impl.nextn_tensors(a, 0), model.path)
    carry = getattr(impl, "MTP_CARRY", None)
    if carry != "post_norm":
        raise ValueError(f"draft-mtp: architecture {arch!r} uses an MTP carry of type {carry!r}; this build "
                         "supports the post-norm carry only")
    if not model.supports_hidden:
        raise ValueError(f"draft-mtp: architecture {arch!r} cannot export the trunk's hidden rows")
    return impl


@dataclasses.dataclass
class _Seq(DrafterSeq):
    """What the proposer knows of one sequence (and DrafterSeq's toks / k_next / open_at).

    n_mtp:  the MTP KV holds this sequence's catch-up rows for positions 0..n_mtp-1 (rows beyond
            are draft rows, dropped before the next decode); toks covers the same positions.
    pos0, rows: trunk hidden rows for positions pos0..pos0+len(rows)-1 (position -1 is the zero
            vector); the last row is carry_in (position n_mtp-1). Holds the previous batch's
            carry and the rows of the last target batch (verify_rows) still valid.
    """

    n_mtp: int = 0
    pos0: int = -1

    def common(self, tokens) -> int:
        """Length of the common prefix of toks and `tokens`."""
        n = min(self.n_mtp, len(tokens))
        d = self.first_diff(tokens, n)
        return n if d is None else d


class MTPProposer(ModelDrafter):
    """Drafts with the target model's MTP block; see the module docstring.

    model: the target Model (its MTP block and weights are used); n_ctx: cells of the MTP KV
    cache (the target's context size: it mirrors the target's sequences); n_threads: threads when
    not bound to a target context (bound, it shares the target's thread pool); kv_dtype: the MTP
    KV type (default: the bound target's KV type, else F16); n_ubatch: largest MTP catch-up decode.
    """

    name = "draft-mtp"
    needs_hidden = True
    default_n_max = 3
    kv_what = "MTP KV cache"
    new_seq = _Seq
    trace_x = "h"

    def __init__(self, model: Model, n_ctx: int, n_threads: int | None = None,
                 kv_dtype: "native.DType | None" = None, n_ubatch: int = 512, max_plans: int = 32):
        self.impl = check_mtp(model)
        self.model = model
        self.args = model.args
        # the target's cells plus room for the draft rows
        self._init_drafter(int(n_ctx) + 64, n_threads, kv_dtype, n_ubatch, max_plans, model.n_vocab, salt=0x3A7D)

    # --- setup -----------------------------------------------------------------------------
    def bind_target(self, ctx) -> None:
        """Use the hidden rows the target Context exports (it must have export_hidden=True)."""
        if not getattr(ctx, "export_hidden", False):
            raise ValueError("draft-mtp needs the target's hidden rows: create its Context with "
                             "export_hidden=True (pyfast.LLM does this when draft-mtp is configured)")
        if ctx.model.args.n_embd != self.args.n_embd or ctx.model.n_vocab != self.model.n_vocab:
            raise ValueError("draft-mtp: the target context runs another model than the MTP block's")
        self._attach(ctx)

    def _new_kv(self, dtype, dtype_v) -> KVCache:
        a = self.args
        # head_dim_v: MLA blocks (DeepSeek / GLM) keep a value row narrower than the key row
        return KVCache(1, self.n_ctx, a.n_head_kv, a.head_dim, dtype, getattr(a, "head_dim_v", None),
                       dtype_v=dtype_v, device=self._device(), v_in_k=getattr(a, "v_in_k", False))

    def _plan(self, draft: bool, n_tokens: int, n_kv: int):
        def build():
            n_out = n_tokens if draft else 1
            b = GraphBuilder(self.model.weights, BatchShape(n_tokens, n_kv, n_out), self.kv)
            logits = self.impl.build_nextn(b, self.args, 0)
            if draft:  # catch-up plans output only "hidden": the head is never run for them
                b.g.output(logits, "logits")
            return native.Plan(b.g, self.pool, self._device())

        return cached_plan(self, (draft, n_tokens, n_kv), build)

    def _decode(self, draft: bool, toks: np.ndarray, pos: np.ndarray, seqs: np.ndarray, h: np.ndarray):
        """One MTP decode (catch-up: KV only, in micro-batches; draft: every row's logits and
        post-norm output). Returns (logits, hidden) for a draft step, None for a catch-up."""
        T = toks.size
        plan = self._run_rows(draft, toks, pos, seqs, h, "h", T if draft else self.n_ubatch, None if draft else 1)
        return (plan.output("logits"), plan.output("hidden")) if draft else None

    def forward(self, tokens, positions, seq_ids, h) -> tuple[np.ndarray, np.ndarray]:
        """Run rows ``(tokens[t] @ positions[t], h[t])`` through the MTP block with the draft
        plans, appending them to the MTP KV; returns (logits [T, n_vocab], post-norm out [T, d])."""
        self._ensure()
        T = len(tokens)
        seqs = np.broadcast_to(np.asarray(seq_ids, dtype=np.int32), (T,)).copy()
        return self._decode(True, np.asarray(tokens, dtype=np.int32).reshape(-1),
                            np.asarray(positions, dtype=np.int32).reshape(-1), seqs,
                            np.ascontiguousarray(h, dtype=np.float32).reshape(T, self.args.n_embd))

    # --- sequences -------------------------------------------------------------------------
    def _resume(self, seq: int, st: _Seq, prompt: np.ndarray) -> None:
        self._cut(seq, st, st.common(prompt))

    def _keep(self, seq: int, st: _Seq, n: int) -> None:
        self._cut(seq, st, n)

    def _cut(self, seq: int, st: _Seq, m: int) -> None:
        """Forget positions >= m (the history differs there): MTP rows and trunk rows alike."""
        if m >= st.n_mtp:
            return
        if self.kv is not None:
            self.kv.truncate(seq, m)
        st.n_mtp = m
        st.toks = st.toks[:m]
        if st.rows is not None:
            keep = m - st.pos0          # trunk rows at positions <= m - 1 depend on matching tokens only
            st.rows = st.rows[:keep] if keep > 0 else None

    # --- catch-up (§1.3) -------------------------------------------------------------------
    def _batch_hidden(self, batch: DecodeBatch) -> np.ndarray:
        h = getattr(batch, "hidden", None)
        if h is None:
            if self.target is None:
                raise RuntimeError("draft-mtp: no hidden rows for process(): bind the target Context "
                                   "(bind_target) or pass DecodeBatch.hidden")
            h = self.target.last_hidden
            if h is None:
                raise RuntimeError("draft-mtp: the target Context exported no hidden rows (export_hidden=True?)")
        h = np.asarray(h, dtype=np.float32)
        if h.shape != (len(batch.tokens), self.args.n_embd):
            raise RuntimeError(f"draft-mtp: the target's last decode exported {h.shape[0]} hidden rows but the "
                               f"{batch.kind} batch given to process() has {len(batch.tokens)}; process() must "
                               "follow the decode of exactly that batch")
        return h

    def process(self, batch: DecodeBatch) -> None:
        if len(batch.tokens) == 0:
            return
        self._ensure()
        hid = self._batch_hidden(batch)
        seqs = np.asarray(batch.seq_ids, dtype=np.int32).reshape(-1)
        toks = np.asarray(batch.tokens, dtype=np.int32).reshape(-1)
        pos = np.asarray(batch.positions, dtype=np.int32).reshape(-1)
        verify = batch.kind == "verify"
        keep_rows, h_in, plan_rows = [], [], []
        zero = np.zeros(self.args.n_embd, dtype=np.float32)
        for s, st, P, idx, n, k in self._batch_seqs(batch):
            carry = zero if P == 0 else st.row(P - 1)
            if carry is None or st.n_mtp < P:
                self.n_lost += 1
                carry = zero if carry is None else carry
            self.kv.truncate(s, P)
            st.n_mtp = min(st.n_mtp, P)
            st.toks = st.toks[: st.n_mtp]
            # the accepted count, when known already, limits the rows worth decoding
            use = idx[:n]
            keep_rows.append(use)
            h_in.append(carry[None, :])
            if n > 1:
                h_in.append(hid[use[:-1]])
            plan_rows.append((s, st, P, idx, n, carry, k))
        rows = np.concatenate(keep_rows)
        self._decode(False, toks[rows], pos[rows], seqs[rows], np.ascontiguousarray(np.concatenate(h_in)))
        for s, st, P, idx, n, carry, k in plan_rows:
            st.pos0 = P - 1
            st.rows = np.concatenate([carry[None, :], hid[idx]])    # [carry_in, verify_rows...]
            st.put_toks(P, toks[idx])                                 # (-1: positions never seen, lost)
            st.n_mtp = P + idx.size
            st.open_at = P if (verify and k is None) else None
            if st.open_at is None:
                self._settle(s, st, n - 1)

    # --- accept (§1.5) ---------------------------------------------------------------------
    def _settle(self, seq: int, st: _Seq, k: int | None) -> None:
        """Close a processed verify batch: keep its first k+1 rows (all when k is None)."""
        st.open_at = None
        if k is None:
            return
        n = min(int(k) + 1, st.rows.shape[0] - 1)   # carry_in = verify_rows[min(k, rows - 1)]
        st.rows = st.rows[: n + 1]
        st.n_mtp = st.pos0 + 1 + n
        st.toks = st.toks[: st.n_mtp]
        self.kv.truncate(seq, st.n_mtp)

    # --- drafting (§1.4) -------------------------------------------------------------------
    def carry_in(self, seq: int, n_past: int) -> np.ndarray:
        """The step-0 hidden input of a sequence whose id_last sits at n_past (zeros if unknown)."""
        st = self._seqs.get(seq)
        h = st.row(n_past - 1) if st is not None and n_past > 0 else None
        return np.zeros(self.args.n_embd, dtype=np.float32) if h is None else h

    def draft(self, requests: list[DraftRequest]) -> list[Draft | None]:
        self._ensure()
        start = []
        for r in requests:
            if r.n_max < 1 or r.tokens.size == 0:
                continue
            n_past = int(r.tokens.size) - 1
            st = self._draft_seq(r.seq)
            self.kv.truncate(r.seq, n_past)     # drop last round's draft rows
            st.n_mtp = min(st.n_mtp, n_past)
            st.toks = st.toks[: st.n_mtp]
            m = st.common(r.tokens)
            if m < st.n_mtp:                    # the history changed under the MTP's rows
                self._cut(r.seq, st, m)
                self.n_lost += 1
            start.append((r, int(r.tokens[-1]), n_past, self.carry_in(r.seq, n_past)))
        return self._chain(requests, start)

    def _step(self, step: int, toks, pos, seqs, x):
        logits, out_h = self._decode(True, toks, pos, seqs, x)
        return logits, logits, out_h  # the block's own post-norm output carries
