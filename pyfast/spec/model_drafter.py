"""What the drafters that run a small network beside the target share: the MTP block
(``mtp.py``), EAGLE-3 heads (``eagle3.py``) and DFlash / DSpark block drafters (``dflash.py``).

Each keeps its own KV cache (every sequence in it, mirroring the target's), cached plans and a
state per sequence (:class:`DrafterSeq`). They follow the target through the same protocol:

- ``process(batch)`` after every target decode: per sequence of the batch (``_batch_seqs``) a
  batch starting at position 0 starts it afresh; a verify batch keeps the rows of its accepted
  tokens when the count is known already (``accept`` came first), else all of them, marked open
  (``DrafterSeq.open_at``) until ``accept`` settles it (``_settle``: the subclass drops the rows
  of the rejected tokens).
- ``accept(seq, k)`` settles an open verify batch, or leaves ``k`` for the ``process`` that
  follows (``SpecDecoder``'s order: accept, then process).
- ``begin`` / ``end`` keep a finished sequence's rows (``retired``) for a later prompt that
  reuses its prefix, until their cells are needed (``free_cells``).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np

from pyfast._loader import native
from pyfast.memory.kv_cache import KVCacheFull
from pyfast.spec.base import (DecodeBatch, Draft, DraftRequest, DraftTokenPicker, Proposer, free_cells, make_drafts,
                              seq_rows)


@dataclasses.dataclass
class DrafterSeq:
    """A drafter's view of one sequence (subclasses add their rows).

    toks:    the target's tokens at the positions the drafter's cache holds (-1 where a batch
             skipped positions the drafter never saw), to notice a history that changed under it.
    k_next:  an accept count given before the verify batch's process() (the decoder's order).
    open_at: a verify batch starting at this position was processed without its accept count:
             its rows are provisional until accept().
    retired: the sequence ended; its rows stay until the cache needs the room.
    pos0, rows: the target's rows the drafter reads next (features, hidden rows) of positions
             pos0 .. pos0 + len(rows) - 1, for drafters that keep a window of them.
    """

    toks: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    k_next: int | None = None
    open_at: int | None = None
    retired: bool = False
    pos0: int = 0
    rows: np.ndarray | None = None

    def row(self, p: int) -> np.ndarray | None:
        """The kept target row of position p, or None."""
        if self.rows is None or not 0 <= p - self.pos0 < self.rows.shape[0]:
            return None
        return self.rows[p - self.pos0]

    def first_diff(self, tokens, n: int) -> int | None:
        """The first of positions 0..n-1 where ``toks`` (known positions only) differs from
        ``tokens``; None when they agree."""
        a = self.toks[: min(n, len(tokens))]
        d = np.flatnonzero((a != np.asarray(tokens[: a.size])) & (a >= 0))
        return int(d[0]) if d.size else None

    def put_toks(self, p: int, new: np.ndarray) -> None:
        """The tokens from position p on are ``new`` (positions before p never seen: -1)."""
        head = self.toks[:p]
        gap = np.full(p - head.size, -1, dtype=np.int32)
        self.toks = np.concatenate([head, gap, new])


class ModelDrafter(Proposer):
    """Base of the model drafters (see the module docstring). A subclass sets ``name``,
    ``kv_what`` (its cache in error messages), ``new_seq`` (its DrafterSeq class), and
    implements ``_new_kv``, ``_plan``, ``_settle``, ``process`` and ``draft`` (chained drafters:
    ``_step``, called by ``_chain``)."""

    provides_probs = True
    is_model = True
    kv_what = "drafter KV cache"
    new_seq = DrafterSeq
    trace_x = "x"  # the trace's name of a chain step's input rows

    def _init_drafter(self, n_ctx: int, n_threads, kv_dtype, n_ubatch: int, max_plans: int, n_vocab: int,
                      salt: int) -> None:
        """n_ctx: cells of the drafter's cache; n_threads: threads when not bound to a target
        context (bound, it shares the target's pool); kv_dtype: the cache type (default: the bound
        target's, else F16); n_ubatch: the largest catch-up decode; salt: the draft sampler's seed
        offset (see DraftTokenPicker)."""
        self.n_ctx = int(n_ctx)
        self.n_threads = n_threads
        self.kv_dtype = kv_dtype
        self.n_ubatch = max(1, int(n_ubatch))
        self.max_plans = max_plans
        self.target = None            # the bound target Context
        self.kv = None
        self.pool = None
        self._plans: OrderedDict[tuple, object] = OrderedDict()
        self._seqs: dict[int, DrafterSeq] = {}
        self._picker = DraftTokenPicker(n_vocab, salt=salt)
        self.n_plan_builds = 0
        self.n_decodes = 0            # drafter decodes (catch-up and draft steps)
        self.n_lost = 0               # rows written without the target's rows they need (zeros instead)
        self.trace: list | None = None  # set to a list to record each draft step (tests)

    # --- setup -----------------------------------------------------------------------------
    def _attach(self, ctx) -> None:
        """Run beside the target Context ``ctx`` (its device; its thread pool unless one is set)."""
        self.target = ctx
        if self.pool is None:
            self.pool = ctx.pool

    def _device(self):
        return getattr(self.target, "device", None)

    def _new_kv(self, dtype, dtype_v):
        raise NotImplementedError

    def _ensure(self) -> None:
        if self.kv is None:
            if self.kv_dtype is not None:
                dtype, dtype_v = self.kv_dtype, None
            elif self.target is not None:  # the target's cache types
                dtype, dtype_v = self.target.kv.dtype, self.target.kv.dtype_v
            else:
                dtype, dtype_v = native.DType.F16, None
            self.kv = self._new_kv(dtype, dtype_v)
        if self.pool is None:
            from pyfast.context import default_threads

            self.pool = native.ThreadPool(self.n_threads or default_threads())

    def _free_cells(self, need: int) -> bool:
        return free_cells(self.kv, self._seqs, need)

    def _need_cells(self, need: int) -> None:
        if not self._free_cells(need):
            raise KVCacheFull(f"{self.name}: {self.kv_what} is full ({self.kv.n_ctx} cells, {self.kv.n_used} used, "
                              f"{need} more needed)")

    def _run_rows(self, key, toks, pos, seqs, x, x_name: str, step: int, n_out: int | None = None):
        """Decode rows ``(toks[t] @ pos[t], x[t])`` with the plans of ``key`` in micro-batches of
        ``step`` rows, appending their K/V to the cache; returns the last plan run. n_out: output
        rows per micro-batch (None: all)."""
        T = toks.size
        self._need_cells(T)
        plan = None
        for u0 in range(0, T, step):
            u1 = min(T, u0 + step)
            slots = self.kv.prepare(seqs[u0:u1], pos[u0:u1])
            plan = self._plan(key, u1 - u0, slots.n_kv)
            plan.set_input("tokens", toks[u0:u1])
            plan.set_input("pos", pos[u0:u1])
            plan.set_input("out_ids", np.arange(u1 - u0 if n_out is None else n_out, dtype=np.int32))
            plan.set_input("kv_idx", slots.rows)
            plan.set_input("mask", slots.mask)
            plan.set_input("kv_order", slots.order)
            plan.set_input(x_name, np.ascontiguousarray(x[u0:u1], dtype=np.float32))
            plan.run()
            self.n_decodes += 1
        return plan

    # --- sequences -------------------------------------------------------------------------
    def begin(self, seq: int, prompt) -> None:
        st = self._seqs.get(seq)
        if st is not None:  # keep the rows a reused prompt prefix can resume from (see process)
            st.retired = False
            st.k_next = None
            if st.open_at is not None:
                self._settle(seq, st, None)
            self._resume(seq, st, np.asarray(prompt))
        self._picker.forget(seq)

    def _resume(self, seq: int, st: DrafterSeq, prompt: np.ndarray) -> None:
        """begin() of a sequence the drafter knows: what to drop before the new prompt."""

    def end(self, seq: int) -> None:
        st = self._seqs.get(seq)
        if st is not None:
            st.retired = True
            if st.open_at is not None:
                self._settle(seq, st, None)
        self._picker.forget(seq)

    def _keep(self, seq: int, st: DrafterSeq, n: int) -> None:
        """Forget what the drafter holds for positions >= n (the target's memory went back)."""
        raise NotImplementedError

    def save_state(self, seq: int, n: int) -> np.ndarray | None:
        """The target row of position n - 1 of a sequence holding n tokens, when the drafter keeps
        it (what it reads next: an EAGLE-3 head's deferred row, the MTP block's carry); the rows
        before it are in the drafter's own cache."""
        st = self._seqs.get(seq)
        r = st.row(n - 1) if st is not None and n > 0 else None
        return None if r is None else r.copy()

    def restore_state(self, seq: int, n: int, state: np.ndarray | None) -> None:
        st = self._seqs.get(seq)
        if st is None or self.kv is None:
            return
        st.k_next = None
        if st.open_at is not None:
            self._settle(seq, st, None)
        self._keep(seq, st, n)
        if state is not None:  # the row of position n - 1; later rows belong to the old history
            st.rows, st.pos0 = np.asarray(state, dtype=np.float32)[None, :].copy(), n - 1

    def forget(self, seq: int) -> None:
        """Drop everything kept for a sequence."""
        if self.kv is not None:
            self.kv.remove_seq(seq)
        self._seqs.pop(seq, None)
        self._picker.forget(seq)

    def _settle(self, seq: int, st: DrafterSeq, k: int | None) -> None:
        """Close an open verify batch: keep the rows of its first k accepted tokens and the one
        after (k None: keep all); clears ``st.open_at``."""
        raise NotImplementedError

    def accept(self, seq: int, n_accepted: int, other: bool = False) -> None:
        st = self._seqs.get(seq)
        if st is None:
            return
        if st.open_at is not None:  # the verify batch was processed first: settle it now
            self._settle(seq, st, n_accepted)
        else:                       # process() of the verify batch comes next (SpecDecoder's order)
            st.k_next = int(n_accepted)

    # --- catch-up --------------------------------------------------------------------------
    def _batch_seqs(self, batch: DecodeBatch, check: bool = True):
        """Per sequence of a decoded batch, in order: (seq, its state, first position P, its row
        indices in position order, n rows worth keeping, the accept count k or None). A batch
        at position 0 starts the sequence afresh (its old rows go); an open verify batch of the
        sequence is settled keeping all its rows; for a verify batch, k comes from the batch or
        an earlier accept() and limits n to k + 1. check: refuse non-consecutive positions."""
        seqs = np.asarray(batch.seq_ids, dtype=np.int32).reshape(-1)
        pos = np.asarray(batch.positions, dtype=np.int32).reshape(-1)
        verify = batch.kind == "verify"
        for s, idx, pp in seq_rows(seqs, pos, self.name if check else None):
            P = int(pp[0])
            st = self._seqs.get(s)
            if st is None or P == 0:
                if st is not None:
                    self.kv.remove_seq(s)
                st = self._seqs[s] = self.new_seq()
            elif st.open_at is not None:
                self._settle(s, st, None)
            k = None
            if verify:
                k = (batch.n_accepted or {}).get(s, st.k_next)
                st.k_next = None
            n = idx.size if k is None else min(int(k) + 1, idx.size)
            yield s, st, P, idx, n, k

    # --- drafting --------------------------------------------------------------------------
    def _draft_seq(self, seq: int) -> DrafterSeq:
        """A sequence's state before drafting (new if unknown), its open verify batch settled."""
        st = self._seqs.get(seq)
        if st is None:
            st = self._seqs[seq] = self.new_seq()
        if st.open_at is not None:
            self._settle(seq, st, None)
        return st

    def _step(self, step: int, toks, pos, seqs, x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One chain step's decode: (the rows' logits as traced, the same over the target's
        vocabulary, the output each row carries to the next step)."""
        raise NotImplementedError

    def _chain(self, requests: list[DraftRequest], start: list[tuple]) -> list[Draft | None]:
        """Draft for ``requests`` by chaining one decode per step over all live sequences.
        start: (request, token, position, input row) of each sequence's step 0; step i feeds the
        token drafted at step i-1 at the next position with that step's output row."""
        drafts: dict[int, list[int]] = {r.seq: [] for r in requests}
        probs: dict[int, list[np.ndarray]] = {r.seq: [] for r in requests}
        live = start
        step = 0
        while live:
            if not self._free_cells(len(live)):
                break
            toks = np.asarray([t for _, t, _, _ in live], dtype=np.int32)
            pos = np.asarray([p for _, _, p, _ in live], dtype=np.int32)
            seqs = np.asarray([r.seq for r, _, _, _ in live], dtype=np.int32)
            x = np.ascontiguousarray(np.stack([h for _, _, _, h in live]), dtype=np.float32)
            logits, rows, out = self._step(step, toks, pos, seqs, x)
            if self.trace is not None:
                self.trace.append({"step": step, "seqs": seqs.copy(), "tokens": toks.copy(), "pos": pos.copy(),
                                   self.trace_x: x.copy(), "logits": logits.copy(), "hidden": out.copy()})
            nxt = []
            for i, (r, _, p, _) in enumerate(live):
                t = self._picker.extend(r, rows[i], drafts[r.seq], probs[r.seq])
                if t is not None and len(drafts[r.seq]) < r.n_max:
                    nxt.append((r, t, p + 1, out[i]))
            live = nxt
            step += 1
        return make_drafts(requests, drafts, probs)

