"""``SpecDecoder``: advances a set of sequences by one speculative round per target decode.

Per round and sequence (``algorithms.md`` §0.1): the sequence has ``n`` tokens, the last one,
``id_last``, sampled but not yet in the target's cache (``n_past = n - 1``).

1. ask the proposers, in order, for a draft ``d1..dN`` (the first non-empty one wins);
2. put ``[id_last, d1..dN]`` at positions ``n_past .. n_past+N`` into the verify batch; the
   batches of all sequences form ONE decode with logits on every row;
3. verify (``verify.py``): k accepted tokens plus one recovered or bonus token;
4. truncate the target's cache to ``n_past + k + 1`` tokens, tell the winning proposer
   ``accept(k)`` and the others ``accept(k, other=True)``, then ``process`` the batch.

Recurrent targets roll back only ``ctx.rollback_limit`` tokens (snapshot planes). A draft longer
than that has the sequence's state saved before the verify decode; when the truncation then
raises ``RollbackError``, the saved state is restored and the kept tokens ``[id_last, d1..dk]``
are decoded again (one replay decode for all such sequences, no logits).

A sequence without a draft just decodes ``[id_last]``: plain decoding is the N = 0 case, and a
decoder without proposers is a plain multi-sequence decoder. The server reuses this class: one
``Slot`` per request, ``step`` over the active slots.
"""
from __future__ import annotations

import time
from typing import Iterator, Sequence

import numpy as np

from pyfast.memory.kv_cache import KVCacheFull
from pyfast.memory.recurrent import RollbackError
from pyfast.sampling import Sampler
from pyfast.spec.adaptive import AdaptiveController, CostModel
from pyfast.spec.base import DecodeBatch, Draft, DraftRequest, Proposer
from pyfast.spec.config import SpecConfig
from pyfast.spec.stats import SpecStats
from pyfast.spec.verify import verify

_EMPTY = np.zeros(0, dtype=np.int32)


class Slot:
    """One sequence in a decoder: its tokens, sampler, statistics and per-proposer estimates.

    tokens: prompt + generated tokens so far (the last one not yet in the target's cache once the
    slot has started). n_remaining: set by the caller to the number of tokens it still wants;
    drafts are capped so a round produces no more than that.
    """

    def __init__(self, seq: int, prompt: Sequence[int], sampler: Sampler, capacity: int):
        self.seq = seq
        self.sampler = sampler
        self._buf = np.zeros(max(capacity, len(prompt) + 1), dtype=np.int32)
        self.n = len(prompt)
        self._buf[: self.n] = np.asarray(prompt, dtype=np.int32)
        self.n_prompt = self.n
        self.n_remaining: int | None = None
        self.stats = SpecStats()
        self.estimates: dict[str, np.ndarray] = {}  # adaptive: proposer -> acceptance per position
        self.started = False
        self._view: np.ndarray | None = None  # tokens' view, until the next _push

    @property
    def tokens(self) -> np.ndarray:
        """A read-only view of the sequence's tokens."""
        v = self._view
        if v is None:
            v = self._view = self._buf[: self.n]
            v.flags.writeable = False
        return v

    @property
    def generated(self) -> list[int]:
        return self._buf[self.n_prompt: self.n].tolist()

    def _push(self, toks: Sequence[int]) -> None:
        m = len(toks)
        if self.n + m > self._buf.size:
            self._buf = np.concatenate([self._buf, np.zeros(max(m, self._buf.size), dtype=np.int32)])
        self._buf[self.n: self.n + m] = toks
        self.n += m
        self._view = None


class SpecDecoder:
    """Runs prompt, plain and speculative decoding for a set of sequences over one Context."""

    def __init__(self, ctx, proposers: Sequence[Proposer] = (), config: SpecConfig | None = None):
        self.ctx = ctx
        self.proposers = list(proposers)
        self.config = config or SpecConfig()
        self.n_max = max((self.config.n_max_for(p) for p in self.proposers), default=0)
        if self.proposers:
            # a rejected draft is removed from the target's memory: ask how far it can roll back
            rollback = ctx.kv.can_rollback() if hasattr(ctx.kv, "can_rollback") else float("inf")
            if rollback < 1:
                raise ValueError("speculative decoding needs a memory that can remove trailing tokens; "
                                 "this model's cannot")
            self.n_max = int(min(self.n_max, rollback))
        for p in self.proposers:  # hidden-carry proposers (draft-mtp) read the target's exported rows
            bind = getattr(p, "bind_target", None)
            if bind is not None:
                bind(ctx)
        # the proposers that look at decoded batches (Proposer.process overridden)
        self._processing = [p for p in self.proposers if type(p).process is not Proposer.process]
        self.stats = SpecStats()  # cumulative over every slot and request
        self.slots: dict[int, Slot] = {}
        self.adaptive: AdaptiveController | None = None
        if self.proposers:
            # verify batches come in many sizes: keep their plans instead of rebuilding them
            ctx.max_plans = max(ctx.max_plans, 2 * self.n_max + 16)
            if self.config.adaptive:
                priors = {p.name + (":" + k if k else ""): v for p in self.proposers
                          for k, v in getattr(p, "kind_priors", {}).items()}
                self.adaptive = AdaptiveController(CostModel(ctx, self.n_max + 4), max(self.n_max, 1),
                                                   priors=priors)

    # --- slots -----------------------------------------------------------------------------
    def add(self, seq: int, prompt: Sequence[int], sampler: Sampler) -> Slot:
        """Register a sequence whose prompt is (or will be, via ``prefill``) in the cache."""
        if seq in self.slots:
            raise ValueError(f"sequence {seq} is already active")
        if len(prompt) == 0:
            raise ValueError("a sequence needs at least one prompt token")
        slot = Slot(seq, prompt, sampler, self.ctx.n_ctx + self.n_max + 2)
        self.slots[seq] = slot
        for p in self.proposers:
            p.begin(seq, slot.tokens)
        return slot

    def release(self, slot: Slot, n_keep: int | None = None) -> None:
        """Forget a sequence; keep its first n_keep tokens in the target's cache (None = keep all)."""
        for p in self.proposers:
            p.end(slot.seq)
        if n_keep is not None:
            try:
                self.ctx.truncate(slot.seq, n_keep)
            except RollbackError:  # recurrent state cannot go back that far: drop the sequence
                self.ctx.remove_seq(slot.seq)
        self.slots.pop(slot.seq, None)

    def calibrate(self) -> None:
        """Measure verify-batch costs now (adaptive mode does it on first use otherwise)."""
        if self.adaptive is not None:
            self.adaptive.cost.calibrate()

    # --- decoding --------------------------------------------------------------------------
    def prefill(self, slots: Sequence[Slot]) -> list[np.ndarray]:
        """Decode the prompts of fresh slots in one batch; returns each one's last-row logits."""
        toks = np.concatenate([s.tokens for s in slots]).astype(np.int32)
        seqs = np.concatenate([np.full(s.n, s.seq, dtype=np.int32) for s in slots])
        pos = np.concatenate([np.arange(s.n, dtype=np.int32) for s in slots])
        rows = np.cumsum([s.n for s in slots]) - 1
        logits = self.ctx.decode(toks, positions=pos, seq_ids=seqs, logits=rows)
        batch = DecodeBatch("prompt", seqs, toks, pos)
        for p in self.proposers:
            p.process(batch)
        return [logits[i] for i in range(len(slots))]

    def notify_prompt(self, slot: Slot, start: int = 0) -> None:
        """Tell the proposers that the caller decoded tokens [start:] of a slot's prompt itself."""
        n = slot.n - start
        if n > 0 and self.proposers:
            batch = DecodeBatch("prompt", np.full(n, slot.seq, dtype=np.int32), slot.tokens[start:].copy(),
                                np.arange(start, slot.n, dtype=np.int32))
            for p in self.proposers:
                p.process(batch)

    def start(self, slot: Slot, logits: np.ndarray) -> int:
        """Sample a slot's first generated token from its prompt's last logits."""
        t = slot.sampler.sample(logits, slot.tokens)
        slot._push([t])
        slot.started = True
        return t

    def tokens(self, slot: Slot, logits: np.ndarray, remaining=None) -> Iterator[int]:
        """Generate one sequence's tokens lazily: the first from ``logits``, then one round at a
        time. ``remaining()`` (optional) returns how many tokens the consumer still wants."""
        yield self.start(slot, logits)
        while True:
            if remaining is not None:
                slot.n_remaining = remaining()
            yield from self.step([slot])[0]

    def _draft(self, slots: Sequence[Slot]):
        """Each slot's draft, the proposer that made it and its adaptive-statistics key."""
        ctx, cfg = self.ctx, self.config
        B = len(slots)
        drafts: list[Draft | None] = [None] * B
        winners: list[Proposer | None] = [None] * B
        keys: list[str | None] = [None] * B
        if not self.proposers:
            return drafts, winners, keys
        free = ctx.kv.free_cells(B * (self.n_max + 1)) - B  # cells left after one per sequence
        caps = []
        for s in slots:
            cap = min(self.n_max, ctx.n_ctx - s.n - 1, max(free, 0))
            if s.n_remaining is not None:
                cap = min(cap, s.n_remaining - 1)
            cap = max(cap, 0)
            free -= cap
            caps.append(cap)
        pending = [i for i in range(B) if caps[i] > 0]
        ad = self.adaptive
        for p in self.proposers:
            if not pending:
                break
            p_max, p_min = cfg.n_max_for(p), max(1, cfg.n_min_for(p))
            reqs, idx = [], []
            for i in pending:
                n = min(caps[i], p_max)
                if ad is not None and p.is_model:  # each draft token costs: fix the length first
                    n = ad.choose(slots[i].estimates, p.name, n, B)
                if n < p_min:
                    continue
                s = slots[i]
                reqs.append(DraftRequest(s.seq, s.tokens, n, p_min, cfg.draft_p_min, s.sampler))
                idx.append(i)
            if reqs:
                n_vocab = ctx.model.n_vocab
                for i, r, d in zip(idx, reqs, p.draft(reqs)):
                    if d is None or len(d) < r.n_min:
                        continue
                    n = min(len(d), r.n_max)
                    key = p.name + (":" + d.kind if d.kind else "")
                    if ad is not None and not p.is_model:  # cheap drafts: trim to the best length
                        n = ad.choose(slots[i].estimates, key, n, B)
                        if n < r.n_min:
                            continue
                    if n < len(d):
                        d = Draft(d.tokens[:n], None if d.probs is None else d.probs[:n], d.kind)
                    if d.tokens.min() < 0 or d.tokens.max() >= n_vocab:
                        raise ValueError(f"proposer {p.name} drafted a token id outside [0, {n_vocab})")
                    drafts[i], winners[i], keys[i] = d, p, key
            pending = [i for i in pending if drafts[i] is None]
        return drafts, winners, keys

    def step(self, slots: Sequence[Slot]) -> list[list[int]]:
        """One round for each slot (all in one target decode); returns each slot's new tokens:
        its accepted draft tokens followed by one recovered or bonus token."""
        ctx = self.ctx
        if ctx.kv.free_cells(len(slots)) < len(slots):
            raise KVCacheFull(f"KV cache is full: {ctx.n_ctx} cells, {ctx.kv.n_used} used, "
                              f"{len(slots)} sequences to advance")
        if len(slots) == 1 and ctx.rec is None and not ctx.export_hidden:
            return [self._step_one(slots[0])]
        t0 = time.perf_counter()
        drafts, winners, keys = self._draft(slots)
        t1 = time.perf_counter()

        lens = [1 + (len(d) if d is not None else 0) for d in drafts]
        T = sum(lens)
        toks = np.empty(T, dtype=np.int32)
        pos = np.empty(T, dtype=np.int32)
        seqs = np.empty(T, dtype=np.int32)
        o = 0
        for s, d, m in zip(slots, drafts, lens):
            toks[o] = s._buf[s.n - 1]
            if m > 1:
                toks[o + 1: o + m] = d.tokens
            pos[o: o + m] = np.arange(s.n - 1, s.n - 1 + m, dtype=np.int32)
            seqs[o: o + m] = s.seq
            o += m
        # a draft longer than the memory can roll back: keep the state to restore (recurrent only)
        limit = getattr(ctx, "rollback_limit", float("inf"))
        saved = {s.seq: ctx.save_state(s.seq, kv=False) for s, m in zip(slots, lens) if m - 1 > limit}
        if len(slots) == 1:  # one sequence of a recurrent model (KV-only ones take _step_one)
            if T == 1:
                logits = ctx.decode_step(int(toks[0]), int(pos[0]), slots[0].seq)[None]
            else:
                logits = ctx.decode_run(toks, int(pos[0]), slots[0].seq)
        else:
            logits = ctx.decode(toks, positions=pos, seq_ids=seqs, logits="all")
        hidden = getattr(ctx, "last_hidden", None)  # the verify rows' (export_hidden), for process()

        out: list[list[int]] = []
        accepted: dict[int, int] = {}
        replay: list[np.ndarray] = []
        o = 0
        for s, d, w, key, m in zip(slots, drafts, winners, keys, lens):
            res = verify(logits[o: o + m], d.tokens if d is not None else _EMPTY, s.sampler, s.tokens,
                         d.probs if d is not None else None)
            k = res.n_accepted
            if k < m - 1:
                try:
                    ctx.truncate(s.seq, s.n + k)  # keep id_last and the k accepted tokens
                except RollbackError:
                    if s.seq not in saved:
                        raise
                    ctx.restore_state(s.seq, saved[s.seq])  # back to n_past, then replay the kept rows
                    replay.append(np.arange(o, o + k + 1))
            o += m
            accepted[s.seq] = k
            self._settle(s, w, key, m - 1, res.tokens, k)
            out.append(res.tokens)
        if replay:
            r = np.concatenate(replay)
            ctx.decode(toks[r], positions=pos[r], seq_ids=seqs[r], logits="none")
            if hidden is not None:
                ctx.last_hidden = hidden
        batch = DecodeBatch("verify", seqs, toks, pos, accepted)
        for p in self._processing:
            p.process(batch)
        t2 = time.perf_counter()
        for s in slots:
            s.stats.t_draft += t1 - t0
            s.stats.t_verify += t2 - t1
        self.stats.t_draft += t1 - t0
        self.stats.t_verify += t2 - t1
        return out

    def _settle(self, s: Slot, w: Proposer | None, key: str | None, n_drafted: int, tokens: list[int],
                k: int) -> None:
        """After a slot's verification: its new tokens, statistics, the proposers' accept(k) and
        the adaptive estimates of the winning proposer."""
        s._push(tokens)
        name = w.name if w is not None else None
        s.stats.record_round(name, n_drafted, k)
        self.stats.record_round(name, n_drafted, k)
        for p in self.proposers:
            p.accept(s.seq, k, other=p is not w)
        if self.adaptive is not None and w is not None:
            self.adaptive.update(s.estimates, key, n_drafted, k)

    def _step_one(self, s: Slot) -> list[int]:
        """step() for one sequence of a KV-cache model (the usual case), with the least Python
        per round: the same draft, decode, verification and bookkeeping."""
        ctx = self.ctx
        t0 = time.perf_counter()
        drafts, winners, keys = self._draft([s])
        t1 = time.perf_counter()
        d, w = drafts[0], winners[0]
        n_past = s.n - 1
        if d is None:
            m, dt, probs = 1, _EMPTY, None
            toks = None  # (built below only for proposers that read decoded batches)
            logits = ctx.decode_step(int(s._buf[n_past]), n_past, s.seq)[None]
        else:
            dt, probs = d.tokens, d.probs
            m = 1 + len(dt)
            toks = np.empty(m, dtype=np.int32)
            toks[0] = s._buf[n_past]
            toks[1:] = dt
            logits = ctx.decode_run(toks, n_past, s.seq)
        res = verify(logits, dt, s.sampler, s.tokens, probs, ctx.last_argmax())
        k = res.n_accepted
        if k < m - 1:
            ctx.truncate(s.seq, s.n + k)  # keep id_last and the k accepted tokens
        self._settle(s, w, keys[0], m - 1, res.tokens, k)
        if self._processing:
            if toks is None:
                toks = s._buf[n_past: n_past + 1].copy()
            batch = DecodeBatch("verify", np.full(m, s.seq, dtype=np.int32), toks,
                                np.arange(n_past, n_past + m, dtype=np.int32), {s.seq: k})
            for p in self._processing:
                p.process(batch)
        t2 = time.perf_counter()
        s.stats.t_draft += t1 - t0
        s.stats.t_verify += t2 - t1
        self.stats.t_draft += t1 - t0
        self.stats.t_verify += t2 - t1
        return res.tokens
