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
reach back that far (e.g. tokens decoded without telling the proposers), drafting continues with a
zero carry: drafts get worse, output stays exact (the target verifies everything).

The target must export hidden rows: create its ``Context`` with ``export_hidden=True``
(``pyfast.LLM`` does when draft-mtp is configured) and bind it (``SpecDecoder`` calls
``bind_target``). A ``DecodeBatch`` carrying a ``hidden`` attribute (rows aligned with the batch)
is used directly instead.

The carry type is a per-architecture flag ``MTP_CARRY`` ("post_norm" for Qwen3.5 / Qwen3.5-MoE /
Qwen3-Next: the block's output after its head norm, matching the trunk's post-norm export).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from types import ModuleType

import numpy as np

from pyfast._loader import native
from pyfast.context import cached_plan
from pyfast.memory.kv_cache import KVCache
from pyfast.models import BatchShape, Model
from pyfast.models.base import GraphBuilder
from pyfast.spec.base import DecodeBatch, Draft, DraftRequest, DraftTokenPicker, Proposer, free_cells, seq_rows

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
class _Seq:
    """What the proposer knows of one sequence.

    n_mtp:  the MTP KV holds this sequence's catch-up rows for positions 0..n_mtp-1 (rows beyond
            are draft rows, dropped before the next decode).
    toks:   the tokens at positions 0..n_mtp-1 (to notice a history that changed under it; -1 where
            a batch skipped positions the proposer never saw).
    pos0, rows: trunk hidden rows for positions pos0..pos0+len(rows)-1 (position -1 is the zero
            vector); the last row is carry_in (position n_mtp-1). Holds the previous batch's
            carry and the rows of the last target batch (verify_rows) still valid.
    k_next: an accept count given before the verify batch's process() (the decoder's order).
    open_rows: a verify batch was processed without a known accept count: rows are provisional
            until accept().
    """

    n_mtp: int = 0
    toks: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    pos0: int = -1
    rows: np.ndarray | None = None
    k_next: int | None = None
    open_rows: bool = False
    retired: bool = False

    def common(self, tokens) -> int:
        """Length of the common prefix of toks and `tokens`."""
        n = min(self.n_mtp, len(tokens))
        a = self.toks[:n]
        diff = np.flatnonzero((a != np.asarray(tokens[:n])) & (a >= 0))
        return int(diff[0]) if diff.size else n

    def hidden_at(self, p: int) -> np.ndarray | None:
        if self.rows is None:
            return None
        i = p - self.pos0
        return self.rows[i] if 0 <= i < self.rows.shape[0] else None


class MTPProposer(Proposer):
    """Drafts with the target model's MTP block; see the module docstring.

    model: the target Model (its MTP block and weights are used); n_ctx: cells of the MTP KV
    cache (the target's context size: it mirrors the target's sequences); n_threads: threads when
    not bound to a target context (bound, it shares the target's thread pool); kv_dtype: the MTP
    KV type (default: the bound target's KV type, else F16); n_ubatch: largest MTP catch-up decode.
    """

    name = "draft-mtp"
    provides_probs = True
    is_model = True
    needs_hidden = True
    default_n_max = 3

    def __init__(self, model: Model, n_ctx: int, n_threads: int | None = None,
                 kv_dtype: "native.DType | None" = None, n_ubatch: int = 512, max_plans: int = 32):
        self.impl = check_mtp(model)
        self.model = model
        self.args = model.args
        self.n_ctx = int(n_ctx) + 64  # the target's cells plus room for the draft rows
        self.n_threads = n_threads
        self.kv_dtype = kv_dtype
        self.n_ubatch = max(1, int(n_ubatch))
        self.max_plans = max_plans
        self.target = None            # the bound target Context
        self.kv: KVCache | None = None
        self.pool = None
        self._plans: OrderedDict[tuple, object] = OrderedDict()
        self._seqs: dict[int, _Seq] = {}
        self._picker = DraftTokenPicker(self.model.n_vocab, salt=0x3A7D)
        self.n_plan_builds = 0
        self.n_decodes = 0            # MTP decodes (catch-up and draft steps)
        self.n_lost = 0               # batches whose carry could not be recovered (zero carry used)
        self.trace: list | None = None  # set to a list to record draft steps (tests)

    # --- setup -----------------------------------------------------------------------------
    def bind_target(self, ctx) -> None:
        """Use the hidden rows the target Context exports (it must have export_hidden=True)."""
        if not getattr(ctx, "export_hidden", False):
            raise ValueError("draft-mtp needs the target's hidden rows: create its Context with "
                             "export_hidden=True (pyfast.LLM does this when draft-mtp is configured)")
        if ctx.model.args.n_embd != self.args.n_embd or ctx.model.n_vocab != self.model.n_vocab:
            raise ValueError("draft-mtp: the target context runs another model than the MTP block's")
        self.target = ctx
        if self.pool is None:
            self.pool = ctx.pool

    def _device(self):
        """The target context's device (the MTP block runs beside the target)."""
        return getattr(self.target, "device", None)

    def _ensure(self) -> None:
        if self.kv is None:
            a = self.args
            if self.kv_dtype is not None:
                dtype, dtype_v = self.kv_dtype, None
            elif self.target is not None:  # the target's cache types
                dtype, dtype_v = self.target.kv.dtype, self.target.kv.dtype_v
            else:
                dtype, dtype_v = native.DType.F16, None
            # head_dim_v: MLA blocks (DeepSeek / GLM) keep a value row narrower than the key row
            self.kv = KVCache(1, self.n_ctx, a.n_head_kv, a.head_dim, dtype, getattr(a, "head_dim_v", None),
                              dtype_v=dtype_v, device=self._device(), v_in_k=getattr(a, "v_in_k", False))
        if self.pool is None:
            from pyfast.context import default_threads

            self.pool = native.ThreadPool(self.n_threads or default_threads())

    def _plan(self, draft: bool, n_tokens: int, n_kv: int):
        def build():
            n_out = n_tokens if draft else 1
            b = GraphBuilder(self.model.weights, BatchShape(n_tokens, n_kv, n_out), self.kv)
            logits = self.impl.build_nextn(b, self.args, 0)
            if draft:  # catch-up plans output only "hidden": the head is never run for them
                b.g.output(logits, "logits")
            return native.Plan(b.g, self.pool, self._device())

        return cached_plan(self, (draft, n_tokens, n_kv), build)

    def _free_cells(self, need: int) -> bool:
        return free_cells(self.kv, self._seqs, need)

    def _decode(self, draft: bool, toks: np.ndarray, pos: np.ndarray, seqs: np.ndarray, h: np.ndarray):
        """One MTP decode (catch-up: KV only, in micro-batches; draft: every row's logits and
        post-norm output). Returns (logits, hidden) for a draft step, None for a catch-up."""
        T = toks.size
        if not self._free_cells(T):
            from pyfast.memory.kv_cache import KVCacheFull

            raise KVCacheFull(f"draft-mtp: MTP KV cache is full ({self.kv.n_ctx} cells, {self.kv.n_used} used, "
                              f"{T} more needed)")
        step = T if draft else self.n_ubatch
        logits = hidden = None
        for u0 in range(0, T, step):
            u1 = min(T, u0 + step)
            slots = self.kv.prepare(seqs[u0:u1], pos[u0:u1])
            plan = self._plan(draft, u1 - u0, slots.n_kv)
            plan.set_input("tokens", toks[u0:u1])
            plan.set_input("pos", pos[u0:u1])
            plan.set_input("out_ids", np.arange(u1 - u0 if draft else 1, dtype=np.int32))
            plan.set_input("kv_idx", slots.rows)
            plan.set_input("mask", slots.mask)
            plan.set_input("kv_order", slots.order)
            plan.set_input("h", h[u0:u1])
            plan.run()
            self.n_decodes += 1
            if draft:
                logits = plan.output("logits")
                hidden = plan.output("hidden")
        return (logits, hidden) if draft else None

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
    def begin(self, seq: int, prompt) -> None:
        st = self._seqs.get(seq)
        if st is not None:  # keep the rows a reused prompt prefix can resume from (see process)
            st.retired = False
            st.k_next = None
            if st.open_rows:
                self._settle(seq, st, None)
            self._cut(seq, st, st.common(np.asarray(prompt)))
        self._picker.forget(seq)

    def end(self, seq: int) -> None:
        st = self._seqs.get(seq)
        if st is not None:
            st.retired = True
            if st.open_rows:
                self._settle(seq, st, None)
        self._picker.forget(seq)

    def forget(self, seq: int) -> None:
        """Drop everything kept for a sequence."""
        if self.kv is not None:
            self.kv.remove_seq(seq)
        self._seqs.pop(seq, None)
        self._picker.forget(seq)

    def save_state(self, seq: int, n: int) -> np.ndarray | None:
        """The carry of a sequence holding n tokens: the trunk's hidden row of position n - 1
        (the MTP rows before n stay in the MTP cache)."""
        st = self._seqs.get(seq)
        h = st.hidden_at(n - 1) if st is not None and n > 0 else None
        return None if h is None else h.copy()

    def restore_state(self, seq: int, n: int, state: np.ndarray | None) -> None:
        st = self._seqs.get(seq)
        if st is None:
            return
        st.k_next = None
        if st.open_rows:
            self._settle(seq, st, None)
        self._cut(seq, st, n)
        if state is not None:
            st.rows, st.pos0 = np.asarray(state, dtype=np.float32)[None, :].copy(), n - 1

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
        d = self.args.n_embd
        zero = np.zeros(d, dtype=np.float32)
        for s, idx, pp in seq_rows(seqs, pos, "draft-mtp"):
            P = int(pp[0])
            st = self._seqs.get(s)
            if st is None or P == 0:
                if st is not None:
                    self.kv.remove_seq(s)
                st = self._seqs[s] = _Seq()
            elif st.open_rows:
                self._settle(s, st, None)
            carry = zero if P == 0 else st.hidden_at(P - 1)
            if carry is None or st.n_mtp < P:
                self.n_lost += 1
                carry = zero if carry is None else carry
            self.kv.truncate(s, P)
            st.n_mtp = min(st.n_mtp, P)
            st.toks = st.toks[: st.n_mtp]
            # the accepted count, when known already, limits the rows worth decoding
            k = None
            if verify:
                k = (batch.n_accepted or {}).get(s, st.k_next)
                st.k_next = None
            n = idx.size if k is None else min(int(k) + 1, idx.size)
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
            gap = np.full(P - st.toks[:P].size, -1, dtype=np.int32)    # positions never seen (lost)
            st.toks = np.concatenate([st.toks[:P], gap, toks[idx]])
            st.n_mtp = P + idx.size
            st.open_rows = verify and k is None
            if not st.open_rows:
                self._settle(s, st, n - 1)

    # --- accept (§1.5) ---------------------------------------------------------------------
    def _settle(self, seq: int, st: _Seq, k: int | None) -> None:
        """Close a processed verify batch: keep its first k+1 rows (all when k is None)."""
        st.open_rows = False
        if k is None:
            return
        n = min(int(k) + 1, st.rows.shape[0] - 1)   # carry_in = verify_rows[min(k, rows - 1)]
        st.rows = st.rows[: n + 1]
        st.n_mtp = st.pos0 + 1 + n
        st.toks = st.toks[: st.n_mtp]
        self.kv.truncate(seq, st.n_mtp)

    def accept(self, seq: int, n_accepted: int, other: bool = False) -> None:
        st = self._seqs.get(seq)
        if st is None:
            return
        if st.open_rows:   # the verify batch was processed first: settle it now
            self._settle(seq, st, n_accepted)
        else:              # process() of the verify batch comes next (SpecDecoder's order)
            st.k_next = int(n_accepted)

    # --- drafting (§1.4) -------------------------------------------------------------------
    def carry_in(self, seq: int, n_past: int) -> np.ndarray:
        """The step-0 hidden input of a sequence whose id_last sits at n_past (zeros if unknown)."""
        st = self._seqs.get(seq)
        h = st.hidden_at(n_past - 1) if st is not None and n_past > 0 else None
        return np.zeros(self.args.n_embd, dtype=np.float32) if h is None else h

    def draft(self, requests: list[DraftRequest]) -> list[Draft | None]:
        self._ensure()
        d = self.args.n_embd
        drafts: dict[int, list[int]] = {r.seq: [] for r in requests}
        probs: dict[int, list[np.ndarray]] = {r.seq: [] for r in requests}
        live, feed_t, feed_p, feed_h = [], [], [], []
        for r in requests:
            if r.n_max < 1 or r.tokens.size == 0:
                continue
            n_past = int(r.tokens.size) - 1
            st = self._seqs.get(r.seq)
            if st is None:
                st = self._seqs[r.seq] = _Seq()
            if st.open_rows:
                self._settle(r.seq, st, None)
            self.kv.truncate(r.seq, n_past)     # drop last round's draft rows
            st.n_mtp = min(st.n_mtp, n_past)
            st.toks = st.toks[: st.n_mtp]
            m = st.common(r.tokens)
            if m < st.n_mtp:                    # the history changed under the MTP's rows
                self._cut(r.seq, st, m)
                self.n_lost += 1
            live.append(r)
            feed_t.append(int(r.tokens[-1]))
            feed_p.append(n_past)
            feed_h.append(self.carry_in(r.seq, n_past))
        step = 0
        while live:
            if not self._free_cells(len(live)):
                break
            toks = np.asarray(feed_t, dtype=np.int32)
            pos = np.asarray(feed_p, dtype=np.int32)
            seqs = np.asarray([r.seq for r in live], dtype=np.int32)
            h = np.ascontiguousarray(np.stack(feed_h).reshape(len(live), d), dtype=np.float32)
            logits, out_h = self._decode(True, toks, pos, seqs, h)
            if self.trace is not None:
                self.trace.append(dict(step=step, seqs=seqs.copy(), tokens=toks.copy(), pos=pos.copy(),
                                       h=h.copy(), logits=logits.copy(), hidden=out_h.copy()))
            nl, nt, npos, nh = [], [], [], []
            for i, r in enumerate(live):
                t = self._picker.extend(r, logits[i], drafts[r.seq], probs[r.seq])
                if t is None:
                    continue
                if len(drafts[r.seq]) < r.n_max:
                    nl.append(r)
                    nt.append(t)
                    npos.append(int(pos[i]) + 1)
                    nh.append(out_h[i])                # the block's own post-norm output carries
            live, feed_t, feed_p, feed_h = nl, nt, npos, nh
            step += 1

        out: list[Draft | None] = []
        for r in requests:
            dr = drafts[r.seq]
            if not dr:
                out.append(None)
                continue
            q = np.stack(probs[r.seq]) if probs[r.seq] else None
            out.append(Draft(np.asarray(dr, dtype=np.int32), q))
        return out
