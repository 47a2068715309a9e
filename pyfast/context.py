"""A decoding context: the model's memory, the compiled plans and ``decode(batch) -> logits``.

Plans are cached by batch shape (n_tokens, visible cache cells, returned rows, and for recurrent
models the number of sequence segments), so decoding replays a compiled plan each step instead of
rebuilding a graph.

Models with recurrent layers (``Model.memory_spec().is_recurrent``) get a ``HybridMemory``: a KV
cache for the attention layers plus recurrent state planes with ``n_seq_max`` sequence slots and
``n_rollback`` snapshot planes. Their batches are reordered so that each sequence's tokens are
contiguous (logits come back in the caller's row order), a sequence's positions must continue
from its last one, and a sequence's last ``n_rollback + 1`` tokens of a batch stay in one
micro-batch (``algorithms.md`` §2.6).
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Sequence

import numpy as np

from pyfast._loader import native
from pyfast.memory.hybrid import HybridMemory, SeqState, plan_ubatches
from pyfast.memory.kv_cache import KVCache, KVCacheFull
from pyfast.memory.recurrent import RecurrentMemory, RollbackError
from pyfast.models import BatchShape, Model

__all__ = ["Context", "RollbackError", "SeqState", "default_threads"]


def default_threads() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        n = os.cpu_count() or 1
    return max(1, n)


def cached_plan(owner, key, build):
    """The compiled plan for `key` from owner._plans, an OrderedDict kept as an LRU of at most
    owner.max_plans plans; a missing one is made by build() and counted in owner.n_plan_builds.
    Contexts and the model-based drafters (MTP, EAGLE-3, DFlash) keep their plans this way."""
    plans = owner._plans
    plan = plans.get(key)
    if plan is not None:
        plans.move_to_end(key)
        return plan
    plan = build()
    owner.n_plan_builds += 1
    plans[key] = plan
    while len(plans) > owner.max_plans:
        plans.popitem(last=False)
    return plan


class Context:
    """Owns the memory of one or more sequences and runs batches through the model.

    n_seq_max:     recurrent models: sequence slots of the recurrent state (sequence ids are free,
                   but at most this many may hold state at once). Ignored for KV-only models.
    n_rollback:    recurrent models: snapshot planes R, the number of trailing tokens of a batch
                   that ``truncate`` can remove without a saved state (speculation: draft_max).
                   Needs n_ubatch >= R + 1. A KV cache truncates anywhere.
    export_hidden: also keep the post-final-norm hidden state of every row of every batch in
                   ``last_hidden`` (float32 [n_tokens, n_embd], caller's row order) for drafters
                   that consume it (MTP). Off by default; costs nothing when off.
    capture_layers: feature capture for drafters that read the target's intermediate rows
                   (EAGLE-3, DFlash): layer ids l (the input of layer l, 0 <= l <= n_layer; id 0
                   is the token embedding, n_layer the final hidden state before the output norm). Every decode then
                   keeps ``last_features``, float32 [n_tokens, len(capture_layers) * n_embd] of
                   every row (caller's row order), layer-major in this order. Empty (default):
                   nothing is captured and the graphs are the plain ones.
    kv_dtype, kv_dtype_v: how K and V rows are stored ("f16" default, "f32", "q8_0"; V as K
                   unless given). Q8_0 halves the cache and the bytes attention reads.
    device:        "cpu" (default), "vulkan:0", ... or an opened native Device: the plans run
                   there (nodes it lacks on the CPU) and the KV cache and recurrent state live
                   in its memory.
    swa_full:      models with sliding-window layers (Gemma): True keeps their K/V in the full
                   cache (any truncation, save / restore); False gives them a cache of their own
                   bounded to the window, n_seq_max * (W - 1) + n_ubatch cells
                   (``pyfast/memory/swa.py``: truncation only back to the window's reach).
    """

    def __init__(self, model: Model, n_ctx: int = 4096, n_threads: int | None = None,
                 n_ubatch: int = 512, kv_dtype: "native.DType | str" = native.DType.F16, max_plans: int = 12,
                 n_seq_max: int = 4, n_rollback: int = 0, export_hidden: bool = False,
                 kv_dtype_v: "native.DType | str | None" = None, device=None, swa_full: bool = True,
                 capture_layers: Sequence[int] = ()):
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be >= 1, got {n_ctx}")
        if n_ubatch < 1:
            raise ValueError(f"n_ubatch must be >= 1, got {n_ubatch}")
        if n_threads is not None and n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        if n_seq_max < 1:
            raise ValueError(f"n_seq_max must be >= 1, got {n_seq_max}")
        if n_rollback < 0:
            raise ValueError(f"n_rollback must be >= 0, got {n_rollback}")
        if export_hidden and not model.supports_hidden:
            raise ValueError(f"export_hidden: architecture {model.arch.ARCH!r} does not export hidden rows")
        from pyfast.device import open_device

        self.device = open_device(device)
        self.model = model
        self.n_ctx = n_ctx
        self.n_threads = n_threads or default_threads()
        self.n_ubatch = n_ubatch
        self.export_hidden = export_hidden
        self.capture_layers = model.check_capture(capture_layers)
        self.last_features: np.ndarray | None = None
        # rows beyond the logits leave each decode: the grouped path (it copies them out)
        self._rows_out = export_hidden or bool(self.capture_layers)
        self._sink = model.needs_sink  # DSA's per-sequence sink: an extra [T, n_kv] input per batch
        self.last_hidden: np.ndarray | None = None
        self.pool = native.ThreadPool(self.n_threads)
        # sliding-window attention layers (Gemma): their mask ("mask_swa") is built per batch
        self.swa_window = int(getattr(model.args, "swa_window", 0) or 0)
        spec = model.memory_spec()
        self.rec: RecurrentMemory | None = None
        if spec.is_recurrent:
            if n_rollback + 1 > n_ubatch:
                raise ValueError(f"n_ubatch ({n_ubatch}) must be >= n_rollback + 1 ({n_rollback + 1}): a "
                                 f"sequence's last n_rollback + 1 tokens of a batch must fit in one micro-batch")
            self.kv = KVCache(len(spec.attn_layers), n_ctx, spec.n_head_kv, spec.head_dim, kv_dtype, spec.head_dim_v,
                              dtype_v=kv_dtype_v, device=self.device)
            self.rec = RecurrentMemory(len(spec.recurrent_layers), spec.recurrent, n_seq_max, n_rollback,
                                       device=self.device)
            self.memory: KVCache | HybridMemory = HybridMemory(self.kv, self.rec)
        else:
            n_layer, n_head_kv, head_dim = model.kv_geometry()
            if not swa_full and spec.swa_layers:
                n_layer -= len(spec.swa_layers)
            self.kv = KVCache(max(n_layer, 1), n_ctx, n_head_kv, head_dim, kv_dtype, spec.head_dim_v,
                              dtype_v=kv_dtype_v, device=self.device, v_in_k=spec.v_in_k)
            self.memory = self.kv
        self.kv_swa: KVCache | None = None  # the sliding-window layers' bounded cache (swa_full=False)
        if not swa_full and spec.swa_layers and self.rec is None:
            from pyfast.memory.swa import SWAMemory

            n_swa = min(n_ctx, n_seq_max * (spec.swa_window - 1) + n_ubatch)
            self.kv_swa = KVCache(len(spec.swa_layers), n_swa, spec.swa_n_head_kv, spec.swa_head_dim, kv_dtype,
                                  dtype_v=kv_dtype_v, device=self.device)
            self.memory = SWAMemory(self.kv, self.kv_swa, spec.swa_window)
        self.n_seq_max, self.n_rollback = n_seq_max, n_rollback
        self._plans: OrderedDict[tuple, object] = OrderedDict()
        # the plans run one at a time and their outputs are read before the next decode, so on the
        # CPU they share one arena (as large as the largest plan's) instead of holding one each
        self.arenas = native.ArenaPool() if self.device is None else None
        self.max_plans = max_plans
        self.n_plan_builds = 0
        self.t_compute = 0.0
        self._out_ids: dict[int, np.ndarray] = {}  # decode_run: rows 0..n-1
        self._last_plan = None
        # told once after the first plan run (models/base.Weights.computed: the huge-page move waits for it)
        self._weights_computed = getattr(getattr(model, "weights", None), "computed", None)

    @property
    def is_recurrent(self) -> bool:
        return self.rec is not None

    @property
    def rollback_limit(self) -> float:
        """The most trailing tokens of one batch that ``truncate`` can remove without a saved
        state: n_rollback for recurrent models, unlimited for a KV cache."""
        return float(self.rec.n_rollback) if self.rec is not None else float("inf")

    # --- plans -----------------------------------------------------------------------------
    def _plan(self, shape: BatchShape):
        key = (shape.n_tokens, shape.n_kv, shape.n_out) if self.rec is None else \
            (shape.n_tokens, shape.n_kv, shape.n_out, shape.n_seg)
        if self.kv_swa is not None:
            key += (shape.n_kv_swa,)

        def build():
            if self.kv_swa is not None:
                b = self.model.build(shape, self.kv, export_hidden=self.export_hidden, kv_swa=self.kv_swa,
                                     capture=self.capture_layers)
            elif self.rec is None and not self._rows_out:
                b = self.model.build(shape, self.kv)
            else:
                b = self.model.build(shape, self.kv, rec=self.rec, export_hidden=self.export_hidden,
                                     capture=self.capture_layers)
            return native.Plan(b.g, self.pool, self.device, self.arenas)

        return cached_plan(self, key, build)

    # --- decoding --------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], positions: Sequence[int] | None = None,
               seq_ids: Sequence[int] | int = 0, logits: str | Sequence[int] | np.ndarray = "last",
               copy: bool = True) -> np.ndarray:
        """Run a batch of tokens and return the logits of the selected rows.

        tokens: token ids; positions: each token's position in its sequence (default: append
        after the sequence's last stored position); seq_ids: a sequence id per token (or one for
        all); logits: "last", "all", "none", or the row indices to return.
        Returns float32 [n_selected, n_vocab], rows in the order requested. copy=False may return
        a view into the plan's output instead (valid until the next decode).
        """
        if (not self._rows_out and positions is not None and isinstance(logits, str)
                and logits == "last"
                and isinstance(seq_ids, (int, np.integer)) and len(tokens) == 1 and len(positions) == 1):
            return self._decode_one(int(tokens[0]), int(positions[0]), int(seq_ids))
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T = toks.size
        if T == 0:
            raise ValueError("decode: empty batch")
        n_vocab = self.model.n_vocab
        if toks.min() < 0 or toks.max() >= n_vocab:
            bad = int(toks[(toks < 0) | (toks >= n_vocab)][0])
            raise ValueError(f"decode: token id {bad} is outside the vocabulary [0, {n_vocab})")
        seqs = np.broadcast_to(np.asarray(seq_ids, dtype=np.int32), (T,)).copy()
        if positions is None:
            pos = np.empty(T, dtype=np.int32)
            nxt: dict[int, int] = {}
            for t, s in enumerate(seqs.tolist()):
                p = nxt.get(s)
                if p is None:
                    p = self.kv.seq_pos_max(s) + 1
                pos[t] = p
                nxt[s] = p + 1
        else:
            pos = np.asarray(positions, dtype=np.int32).reshape(-1)
            if pos.size != T:
                raise ValueError(f"decode: {T} tokens but {pos.size} positions")
            if pos.min() < 0:
                raise ValueError("decode: positions must be >= 0")
        if isinstance(logits, str):
            if logits == "last":
                rows = np.array([T - 1])
            elif logits == "all":
                rows = np.arange(T)
            elif logits == "none":
                rows = np.array([], dtype=np.int64)
            else:
                raise ValueError(f"decode: logits must be 'last', 'all', 'none' or row indices, got {logits!r}")
        else:
            rows = np.asarray(logits, dtype=np.int64).reshape(-1)
            if rows.size and (rows.min() < 0 or rows.max() >= T):
                raise ValueError("decode: logits row index out of range")

        toks32 = toks.astype(np.int32)
        if self.rec is not None or self._rows_out:
            out = np.empty((rows.size, n_vocab), dtype=np.float32)
            return self._decode_grouped(toks32, seqs, pos, rows, out)
        # a short run of one sequence at consecutive positions (a verify batch): native cell
        # bookkeeping into reused buffers (prompts keep the general path)
        run = (isinstance(seq_ids, (int, np.integer)) and T <= min(64, self.n_ubatch)
               and int(pos[-1]) - int(pos[0]) == T - 1 and (T <= 2 or bool(np.all(np.diff(pos) == 1))))
        out = None
        for u0 in range(0, T, self.n_ubatch):
            u1 = min(T, u0 + self.n_ubatch)
            sel = np.flatnonzero((rows >= u0) & (rows < u1))
            n_out = max(1, sel.size)  # a graph always returns at least one row
            out_ids = (rows[sel] - u0).astype(np.int32) if sel.size else np.zeros(1, dtype=np.int32)
            if run:
                slots = self.kv.prepare_run(int(seq_ids), int(pos[0]), T)
            else:
                slots = self.kv.prepare(seqs[u0:u1], pos[u0:u1])
            swa = self._swa_prepare(seqs[u0:u1], pos[u0:u1])
            plan = self._plan(BatchShape(u1 - u0, slots.n_kv, n_out, n_kv_swa=swa.n_kv if swa else 0))
            self._run(plan, toks32[u0:u1], pos[u0:u1], out_ids, slots, swa=swa)
            if not copy and 0 < sel.size == rows.size:  # every requested row is in this micro-batch
                return plan.output("logits", copy=False)
            if out is None:
                out = np.empty((rows.size, n_vocab), dtype=np.float32)
            if sel.size:
                out[sel] = plan.output("logits", copy=False)
        return out

    def _swa_prepare(self, seqs, pos):
        """The bounded sliding-window cache's slots for a micro-batch (None without one)."""
        if self.kv_swa is None:
            return None
        pos = np.asarray(pos, dtype=np.int32)
        return self.memory.prepare(np.broadcast_to(np.asarray(seqs, dtype=np.int32), pos.shape), pos)

    def _run(self, plan, toks: np.ndarray, pos: np.ndarray, out_ids: np.ndarray, slots, seg_rows=None,
             swa=None) -> None:
        """Set one micro-batch's inputs and run its plan (timed into t_compute)."""
        plan.set_input("tokens", toks)
        plan.set_input("pos", pos)
        plan.set_input("out_ids", out_ids)
        plan.set_input("kv_idx", slots.rows)
        plan.set_input("mask", slots.mask)
        plan.set_input("kv_order", slots.order)
        if self._sink:
            from pyfast.models.dsa import sink_boost

            plan.set_input("kv_sink", sink_boost(slots.mask, slots.order))
        if seg_rows is not None:
            plan.set_input("seqs", seg_rows)
        if swa is not None:  # the sliding layers' own cache
            plan.set_input("kv_idx_swa", swa.rows)
            plan.set_input("mask_swa", swa.mask)
            plan.set_input("kv_order_swa", swa.order)
        elif self.swa_window:
            plan.set_input("mask_swa", self._swa_mask(slots, pos))
        t0 = time.perf_counter()
        plan.run()
        self.t_compute += time.perf_counter() - t0
        self._last_plan = plan
        if self._weights_computed is not None:
            self._weights_computed()
            self._weights_computed = None

    def _swa_mask(self, slots, pos: np.ndarray) -> np.ndarray:
        """The sliding-window layers' mask [T, n_kv]: the batch's causal mask without the cells
        swa_window or more positions behind each query (a query at p sees p - W < q <= p)."""
        cp = self.kv.cell_pos[: slots.n_kv]
        m = np.array(slots.mask, dtype=np.float32).reshape(len(pos), slots.n_kv)
        m[(np.asarray(pos, dtype=np.int64)[:, None] - cp[None, :]) >= self.swa_window] = -np.inf
        return m

    def last_argmax(self) -> np.ndarray:
        """int32 [n_out]: the first maximum of each logits row of the last plan run (the rows
        decode_step / decode_run just returned), computed by the plan's threads. A view, valid
        until the next decode."""
        return self._last_plan.output("argmax", copy=False)

    def decode_step(self, token: int, position: int, seq: int = 0) -> np.ndarray:
        """One generation step: decode `token` at `position` of `seq` and return its logits row
        (float32 [n_vocab]). The row is a view into the plan's output, valid until the next
        decode; copy it to keep it."""
        if not self._rows_out:
            return self._decode_one(int(token), int(position), int(seq), copy=False)[0]
        return self.decode([token], positions=[position], seq_ids=seq)[0]

    def decode_run(self, tokens: np.ndarray, pos0: int, seq: int = 0) -> np.ndarray:
        """decode() of n consecutive positions pos0 .. pos0+n-1 of one sequence with logits on every
        row (a speculative verify batch), with the least Python per call. Returns a view into the
        plan's output (float32 [n, n_vocab]), valid until the next decode. Same plans and
        arithmetic as decode()."""
        n = len(tokens)
        if (self._rows_out or n == 0 or n > min(64, self.n_ubatch) or (self.rec is not None and n > 1)
                or type(tokens) is not np.ndarray or tokens.dtype != np.int32):
            return self.decode(tokens, positions=np.arange(pos0, pos0 + n, dtype=np.int32), seq_ids=seq,
                               logits="all", copy=False)
        n_vocab = self.model.n_vocab
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= n_vocab:
            raise ValueError(f"decode: token id {lo if lo < 0 else hi} is outside the vocabulary [0, {n_vocab})")
        if pos0 < 0:
            raise ValueError("decode: positions must be >= 0")
        if n == 1:
            return self._decode_one(int(tokens[0]), pos0, seq, copy=False)
        slots = self.kv.prepare_run(seq, pos0, n)
        pos = np.arange(pos0, pos0 + n, dtype=np.int32)
        swa = self._swa_prepare(seq, pos)
        plan = self._plan(BatchShape(n, slots.n_kv, n, n_kv_swa=swa.n_kv if swa else 0))
        out_ids = self._out_ids.get(n)
        if out_ids is None:
            out_ids = self._out_ids[n] = np.arange(n, dtype=np.int32)
        self._run(plan, tokens, pos, out_ids, slots, swa=swa)
        return plan.output("logits", copy=False)

    def _decode_one(self, tok: int, pos: int, seq: int, copy: bool = True) -> np.ndarray:
        """decode() for the generation step (one token, its position given, last-row logits), with
        the least Python per token; same plan, arithmetic and memory bookkeeping as the general
        path. Recurrent models: a token that continues a sequence holding a recurrent slot, with a
        free cache cell (anything else, and its errors, goes through the general path)."""
        n_vocab = self.model.n_vocab
        if not 0 <= tok < n_vocab:
            raise ValueError(f"decode: token id {tok} is outside the vocabulary [0, {n_vocab})")
        if pos < 0:
            raise ValueError("decode: positions must be >= 0")
        rec = self.rec
        if rec is not None:
            s = rec._slot_of.get(seq)
            if s is None or rec.tail[s] != pos - 1 or self.kv.free_cells(1) < 1:
                out = np.empty((1, n_vocab), dtype=np.float32)
                return self._decode_grouped(np.array([tok], dtype=np.int32), np.array([seq], dtype=np.int32),
                                            np.array([pos], dtype=np.int32), np.zeros(1, dtype=np.int64), out)
            seg_rows = rec.prepare_one(s)
            slots = self.kv.prepare_one(seq, pos)
            plan = self._plan(BatchShape(1, slots.n_kv, 1, 1))
            self._run(plan, np.array([tok], dtype=np.int32), np.array([pos], dtype=np.int32),
                      np.zeros(1, dtype=np.int32), slots, seg_rows)
            return plan.output("logits", copy=copy)
        slots = self.kv.prepare_one(seq, pos)
        swa = self._swa_prepare(seq, [pos])
        plan = self._plan(BatchShape(1, slots.n_kv, 1, n_kv_swa=swa.n_kv if swa else 0))
        self._run(plan, np.array([tok], dtype=np.int32), np.array([pos], dtype=np.int32),
                  np.zeros(1, dtype=np.int32), slots, swa=swa)
        return plan.output("logits", copy=copy)

    def _decode_grouped(self, toks: np.ndarray, seqs: np.ndarray, pos: np.ndarray, rows: np.ndarray,
                        out: np.ndarray) -> np.ndarray:
        """decode() for recurrent models (and hidden export): each sequence's rows are made
        contiguous and in position order, micro-batches keep every sequence's last n_rollback + 1
        tokens together, and results return in the caller's row order."""
        T = toks.size
        uniq, first = np.unique(seqs, return_index=True)
        rank = np.empty(T, dtype=np.int64)
        for r, s in enumerate(uniq[np.argsort(first, kind="stable")].tolist()):
            rank[seqs == s] = r
        perm = np.lexsort((pos, rank))                 # grouped by sequence, positions ascending
        p_pos = pos[perm]
        runs: list[tuple[int, int, int, int]] = []     # (seq, start in perm order, n, first position)
        bounds = (np.flatnonzero(np.diff(rank[perm])) + 1).tolist()
        for a, b in zip([0] + bounds, bounds + [T]):
            s = int(seqs[perm[a]])
            pp = p_pos[a:b]
            if b - a > 1 and not bool(np.all(np.diff(pp) == 1)):
                raise ValueError(f"decode: sequence {s} has positions {pp.tolist()[:16]} in this batch; "
                                 f"a recurrent model needs them consecutive")
            runs.append((s, a, b - a, int(pp[0])))
        n_keep = 1
        if self.rec is not None:
            self.memory.check([(s, p0, n) for s, _, n, p0 in runs])
            if self.n_ctx - self.kv.n_used < T:
                raise KVCacheFull(f"KV cache is full: {self.n_ctx} cells, {self.kv.n_used} used, {T} more needed")
            n_keep = self.rec.n_rollback + 1
        ubatches = plan_ubatches([n for _, _, n, _ in runs], self.n_ubatch, n_keep)
        inv = np.empty(T, dtype=np.int64)
        inv[perm] = np.arange(T)
        rows_p = inv[rows]                             # requested rows as indices in perm order
        hidden = np.empty((T, self.model.args.n_embd), dtype=np.float32) if self.export_hidden else None
        feats = (np.empty((T, len(self.capture_layers) * self.model.args.n_embd), dtype=np.float32)
                 if self.capture_layers else None)
        for ub in ubatches:
            u0 = runs[ub[0][0]][1] + ub[0][1]         # a micro-batch is a contiguous range of perm
            Tu = sum(n for _, _, n in ub)
            idx = perm[u0: u0 + Tu]
            sel = np.flatnonzero((rows_p >= u0) & (rows_p < u0 + Tu))
            n_out = max(1, sel.size)
            out_ids = (rows_p[sel] - u0).astype(np.int32) if sel.size else np.zeros(1, dtype=np.int32)
            u_seq, u_pos = seqs[idx], pos[idx]
            if self.rec is not None:
                segs, t0 = [], 0
                for i, off, n in ub:
                    segs.append((runs[i][0], t0, n, runs[i][3] + off))
                    t0 += n
                slots, seg_rows = self.memory.prepare(u_seq, u_pos, segs)
                swa = None
                shape = BatchShape(Tu, slots.n_kv, n_out, len(segs))
            else:
                slots, seg_rows = self.kv.prepare(u_seq, u_pos), None
                swa = self._swa_prepare(u_seq, u_pos)
                shape = BatchShape(Tu, slots.n_kv, n_out, n_kv_swa=swa.n_kv if swa else 0)
            plan = self._plan(shape)
            self._run(plan, toks[idx], u_pos, out_ids, slots, seg_rows, swa=swa)
            if sel.size:
                out[sel] = plan.output("logits", copy=False)
            if hidden is not None:
                hidden[idx] = plan.output("hidden", copy=False)
            if feats is not None:
                feats[idx] = plan.output("features", copy=False)
        if hidden is not None:
            self.last_hidden = hidden
        if feats is not None:
            self.last_features = feats
        return out

    # --- memory ----------------------------------------------------------------------------
    def truncate(self, seq: int, p: int) -> None:
        """Remove positions >= p of sequence `seq`. Recurrent models raise RollbackError (and
        change nothing) when the state cannot go back that far (see can_rollback)."""
        self.memory.truncate(seq, p)

    def can_rollback(self, seq: int) -> int:
        """How many trailing tokens of `seq` truncate can remove right now (all of them for a KV
        cache). Removing the whole sequence (truncate(seq, 0)) always works."""
        if self.rec is None and self.kv_swa is None:
            return self.kv.seq_len(seq)
        return self.memory.can_rollback(seq)

    def save_state(self, seq: int, kv: bool = True) -> SeqState:
        """A host copy of sequence `seq` (its KV rows unless kv=False, and its recurrent state),
        for restore_state of this context or another one of the same model."""
        if self.kv_swa is not None:
            raise ValueError("save_state: the sliding-window layers' bounded cache (swa_full=False) keeps no "
                             "saved states; use Context(..., swa_full=True)")
        if self.rec is None:
            return SeqState(seq=seq, n_tokens=self.kv.seq_len(seq), kv=self.kv.save_seq(seq) if kv else None,
                            rec=None)
        return self.memory.save_state(seq, kv=kv)

    def restore_state(self, seq: int, state: SeqState) -> None:
        """Make `seq` hold a saved state; other sequences are untouched."""
        if self.kv_swa is not None:
            raise ValueError("restore_state: the sliding-window layers' bounded cache (swa_full=False) keeps no "
                             "saved states; use Context(..., swa_full=True)")
        if self.rec is None:
            if state.kv is not None:
                self.kv.restore_seq(seq, state.kv)
            else:
                self.kv.truncate(seq, state.n_tokens)
            return
        self.memory.restore_state(seq, state)

    def remove_seq(self, seq: int) -> None:
        self.memory.remove_seq(seq)

    def clear(self) -> None:
        self.memory.clear()

    def seq_len(self, seq: int = 0) -> int:
        return self.memory.seq_len(seq)
