"""``SpecDecoder``: the decode round of ``LLM.generate``, ``LLM.generate_batch`` and the server.

Per round and sequence (``algorithms.md`` §0.1): the sequence has ``n`` tokens, the last one,
``id_last``, sampled but not yet in the target's cache (``n_past = n - 1``).

1. ask the proposers, in order, for a draft ``d1..dN`` (the first non-empty one wins);
2. put ``[id_last, d1..dN]`` at positions ``n_past .. n_past+N`` into the verify batch; the
   batches of all sequences form ONE decode with logits on every row;
3. verify (``verify.py``): k accepted tokens plus one recovered or bonus token (rejection
   sampling when the draft carries probabilities and the target samples, row-by-row sampling
   when it does not, argmax when greedy);
4. truncate the target's cache to ``n_past + k + 1`` tokens, record the statistics, tell the
   winning proposer ``accept(k)`` and the others ``accept(k, other=True)``, then ``process`` the
   batch.

Recurrent targets roll back only ``ctx.rollback_limit`` tokens (snapshot planes). A draft longer
than that has the sequence's state saved before the verify decode; when the truncation then
raises ``RollbackError``, the saved state is restored and the kept tokens ``[id_last, d1..dk]``
are decoded again (one replay decode for all such sequences, no logits).

A sequence without a draft just decodes ``[id_last]``: plain decoding is the N = 0 case, and a
decoder without proposers is a plain multi-sequence decoder.

``step`` runs a whole round (the decode included). A caller that puts other rows into the same
decode splits it: ``begin_round`` (drafts, the verify batch, saved states), its own decode with the
round's rows first, then ``end_round`` (everything after the decode). The server does this: its
prompt chunks share the decode, and its ``take`` callback consumes each sequence's new tokens
(stop strings, EOS, streaming) so that the cache keeps only the tokens it used.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from pyfast.memory.kv_cache import KVCacheFull
from pyfast.memory.recurrent import RollbackError
from pyfast.sampling import Sampler
from pyfast.spec.adaptive import AdaptiveController, CostModel
from pyfast.spec.base import DecodeBatch, Draft, DraftRequest, Proposer
from pyfast.spec.config import SpecConfig
from pyfast.spec.stats import SpecStats
from pyfast.spec.verify import verify

log = logging.getLogger("pyfast.spec")

_EMPTY = np.zeros(0, dtype=np.int32)


class Slot:
    """One sequence in a decoder: its tokens, sampler, statistics and per-proposer estimates.

    tokens: prompt + generated tokens so far (the last one not yet in the target's cache once the
    slot has started). n_remaining: set by the caller to the number of tokens it still wants;
    drafts are capped so a round produces no more than that. n_ctx: the most positions the
    sequence may use (the context's size unless the caller gives it less, as a server slot).
    """

    def __init__(self, seq: int, prompt: Sequence[int], sampler: Sampler, capacity: int, n_ctx: int):
        self.seq = seq
        self.sampler = sampler
        self._buf = np.zeros(max(capacity, len(prompt) + 1), dtype=np.int32)
        self.n = len(prompt)
        self._buf[: self.n] = np.asarray(prompt, dtype=np.int32)
        self.n_prompt = self.n
        self.n_ctx = n_ctx
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


@dataclass
class Round:
    """One round of some slots, from ``begin_round`` to ``end_round``.

    The verify batch holds ``[id_last, d1..dN]`` per slot, slot after slot: ``toks``, ``pos`` and
    ``seqs`` (int32 [n_rows]); ``lens[i]`` = N + 1 of slot i. ``saved``: seq -> the recurrent
    state saved before the decode (drafts longer than the rollback limit). ``end_round`` fills in
    the counters: draft tokens verified and accepted, states restored, tokens replayed and the
    replay decode's seconds.
    """

    slots: list[Slot]
    drafts: list[Draft | None]
    winners: list[Proposer | None]
    keys: list[str | None]
    lens: list[int]
    toks: np.ndarray
    pos: np.ndarray
    seqs: np.ndarray
    saved: dict
    t0: float            # round start
    t1: float            # drafts done
    n_drafted: int = 0
    n_accepted: int = 0
    n_restored: int = 0
    n_replayed: int = 0
    t_replay: float = 0.0

    @property
    def n_rows(self) -> int:
        return int(self.toks.size)


# take(slot, tokens, rows) -> how many of the round's new tokens the caller uses (>= 1)
Take = Callable[[Slot, list, np.ndarray], int]


class SpecDecoder:
    """Runs prompt, plain and speculative decoding for a set of sequences over one Context.

    safe_drafts: a proposer that raises costs the round its drafts (logged) instead of failing it
    (the server: a broken drafter must not fail requests).
    """

    def __init__(self, ctx, proposers: Sequence[Proposer] = (), config: SpecConfig | None = None,
                 safe_drafts: bool = False):
        self.ctx = ctx
        self.proposers = list(proposers)
        self.config = config or SpecConfig()
        self.safe_drafts = safe_drafts
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
    def add(self, seq: int, prompt: Sequence[int], sampler: Sampler, n_ctx: int | None = None) -> Slot:
        """Register a sequence whose prompt is (or will be, via ``prefill``) in the cache.
        n_ctx: the most positions it may use (default: the context's size)."""
        if seq in self.slots:
            raise ValueError(f"sequence {seq} is already active")
        if len(prompt) == 0:
            raise ValueError("a sequence needs at least one prompt token")
        n_ctx = self.ctx.n_ctx if n_ctx is None else min(n_ctx, self.ctx.n_ctx)
        slot = Slot(seq, prompt, sampler, n_ctx + self.n_max + 2, n_ctx)
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

    def save_state(self, seq: int, n: int) -> tuple | None:
        """The proposers' part of a context checkpoint of a sequence holding ``n`` tokens (see
        ``Proposer.save_state``); None when none of them needs anything."""
        states = tuple(p.save_state(seq, n) for p in self.proposers)
        return states if any(s is not None for s in states) else None

    def restore_state(self, seq: int, n: int, states: tuple | None) -> None:
        """Tell the proposers that the target's memory of ``seq`` went back to its first ``n``
        tokens; states: what ``save_state(seq, n)`` returned."""
        for i, p in enumerate(self.proposers):
            p.restore_state(seq, n, None if states is None else states[i])

    def calibrate(self) -> None:
        """Measure verify-batch costs now (adaptive mode does it on first use otherwise)."""
        if self.adaptive is not None:
            self.adaptive.cost.calibrate()

    # --- prompts ---------------------------------------------------------------------------
    def prefill(self, slots: Sequence[Slot]) -> list[np.ndarray]:
        """Decode the prompts of fresh slots in one batch; returns each one's last-row logits."""
        toks = np.concatenate([s.tokens for s in slots]).astype(np.int32)
        seqs = np.concatenate([np.full(s.n, s.seq, dtype=np.int32) for s in slots])
        pos = np.concatenate([np.arange(s.n, dtype=np.int32) for s in slots])
        rows = np.cumsum([s.n for s in slots]) - 1
        logits = self.ctx.decode(toks, positions=pos, seq_ids=seqs, logits=rows)
        self.process_prompt(seqs, toks, pos)
        return [logits[i] for i in range(len(slots))]

    def notify_prompt(self, slot: Slot, start: int = 0) -> None:
        """Tell the proposers that the caller decoded tokens [start:] of a slot's prompt itself."""
        n = slot.n - start
        if n > 0:
            self.process_prompt(np.full(n, slot.seq, dtype=np.int32), slot.tokens[start:].copy(),
                                np.arange(start, slot.n, dtype=np.int32))

    def process_prompt(self, seqs, toks, pos, hidden: np.ndarray | None = None,
                       features: np.ndarray | None = None) -> None:
        """Tell the proposers that the caller decoded these prompt rows (hidden / features: the
        target's hidden / captured rows of exactly these tokens, when the decode held other rows
        too; features default to the last decode's when it held exactly these rows)."""
        if self._processing and len(toks):
            layers = tuple(getattr(self.ctx, "capture_layers", ()) or ())
            if features is None and layers:
                f = self.ctx.last_features
                if f is not None and f.shape[0] == len(toks):
                    features = f
            batch = DecodeBatch("prompt", np.asarray(seqs, dtype=np.int32), np.asarray(toks, dtype=np.int32),
                                np.asarray(pos, dtype=np.int32), hidden=hidden, features=features,
                                feature_layers=layers)
            for p in self._processing:
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

    # --- rounds ----------------------------------------------------------------------------
    def _draft(self, slots: Sequence[Slot]):
        """Each slot's draft, the proposer that made it and its adaptive-statistics key."""
        B = len(slots)
        if not self.proposers:
            return [None] * B, [None] * B, [None] * B
        if not self.safe_drafts:
            return self._draft_all(slots)
        try:
            return self._draft_all(slots)
        except Exception:  # a failing proposer costs speed, never output
            log.exception("drafting failed; this round runs without drafts")
            return [None] * B, [None] * B, [None] * B

    def _draft_all(self, slots: Sequence[Slot]):
        ctx, cfg = self.ctx, self.config
        B = len(slots)
        drafts: list[Draft | None] = [None] * B
        winners: list[Proposer | None] = [None] * B
        keys: list[str | None] = [None] * B
        free = ctx.kv.free_cells(B * (self.n_max + 1)) - B  # cells left after one per sequence
        caps = []
        for s in slots:
            cap = min(self.n_max, s.n_ctx - s.n - 1, max(free, 0))
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

    def begin_round(self, slots: Sequence[Slot]) -> Round:
        """Draft for every slot and build the round's verify batch; save the recurrent state of
        slots whose draft is longer than the memory can roll back. The caller decodes
        ``rnd.toks`` at ``rnd.pos`` of ``rnd.seqs`` (logits on every row; other rows may follow
        in the same decode) and hands the logits to ``end_round``."""
        ctx = self.ctx
        self._check_room(len(slots))
        t0 = time.perf_counter()
        drafts, winners, keys = self._draft(slots)
        t1 = time.perf_counter()
        lens = [1 + (len(d) if d is not None else 0) for d in drafts]
        toks: list[int] = []  # (plain lists: a few sequences of a few rows each)
        pos: list[int] = []
        seqs: list[int] = []
        for s, d, m in zip(slots, drafts, lens):
            toks.append(int(s._buf[s.n - 1]))
            if m > 1:
                toks.extend(d.tokens.tolist())
            pos.extend(range(s.n - 1, s.n - 1 + m))
            seqs.extend([s.seq] * m)
        # a draft longer than the memory can roll back: keep the state to restore (recurrent only)
        limit = ctx.rollback_limit
        saved = {s.seq: ctx.save_state(s.seq, kv=False) for s, m in zip(slots, lens) if m - 1 > limit}
        return Round(list(slots), drafts, winners, keys, lens, np.array(toks, dtype=np.int32),
                     np.array(pos, dtype=np.int32), np.array(seqs, dtype=np.int32), saved, t0, t1)

    def end_round(self, rnd: Round, logits: np.ndarray, hidden: np.ndarray | None = None,
                  take: Take | None = None, on_error: Callable[[Slot, Exception], None] | None = None,
                  features: np.ndarray | None = None) -> list[list[int]]:
        """Finish a round after its decode: verify every slot, roll its cache back to the tokens
        it keeps (restoring and replaying recurrent state where needed), record the statistics,
        tell the proposers (accept, then process of the verify batch). Returns each slot's new
        tokens: its accepted draft tokens and one recovered or bonus token.

        logits: the round's rows (float32 [rnd.n_rows, n_vocab], in the batch's order); hidden:
        the target's hidden rows of the same tokens (default: the first rows the context
        exported); features: their captured layer rows (default: the first rows the context
        captured). take(slot, tokens, rows): the caller consumes the tokens (rows: their logits)
        and returns how many it used (>= 1; fewer after a stop); the rest are dropped from the
        slot and its cache. on_error(slot, exc): a verification that raises (e.g. non-finite
        logits) is reported there and the slot gets no tokens; without it the error propagates.
        """
        ctx = self.ctx
        if hidden is None and ctx.export_hidden and ctx.last_hidden is not None:
            hidden = ctx.last_hidden[: rnd.n_rows]
        layers = tuple(getattr(ctx, "capture_layers", ()) or ())
        if features is None and layers and ctx.last_features is not None:
            features = ctx.last_features[: rnd.n_rows]
        accepted: dict[int, int] = {}
        replay: list[np.ndarray] = []
        out: list[list[int]] = []
        o = 0
        for s, d, w, key, m in zip(rnd.slots, rnd.drafts, rnd.winners, rnd.keys, rnd.lens):
            new, k = self._verify(s, d, w, logits[o: o + m], None, take, on_error)
            kept = max(len(new) - 1, 0)  # the cache keeps id_last and the used draft tokens but the last
            if kept < m - 1:
                try:
                    ctx.truncate(s.seq, s.n + kept)
                except RollbackError:
                    if s.seq not in rnd.saved:
                        raise
                    ctx.restore_state(s.seq, rnd.saved[s.seq])  # back to n_past, then replay the kept rows
                    replay.append(np.arange(o, o + kept + 1))
                    rnd.n_restored += 1
            accepted[s.seq] = kept
            if new:  # (not after a failed verification)
                rnd.n_drafted += m - 1
                rnd.n_accepted += k
            self._settle(s, w, key, m - 1, new, k)
            out.append(new)
            o += m
        if replay:
            r = np.concatenate(replay)
            t = time.perf_counter()
            ctx.decode(rnd.toks[r], positions=rnd.pos[r], seq_ids=rnd.seqs[r], logits="none")
            rnd.t_replay = time.perf_counter() - t
            rnd.n_replayed = int(r.size)
        if self._processing:
            batch = DecodeBatch("verify", rnd.seqs, rnd.toks, rnd.pos, accepted, hidden, features, layers)
            for p in self._processing:
                p.process(batch)
        t2 = time.perf_counter()
        for s in rnd.slots:
            s.stats.t_draft += rnd.t1 - rnd.t0
            s.stats.t_verify += t2 - rnd.t1
        self.stats.t_draft += rnd.t1 - rnd.t0
        self.stats.t_verify += t2 - rnd.t1
        return out

    def step(self, slots: Sequence[Slot]) -> list[list[int]]:
        """One round for each slot (all in one target decode); returns each slot's new tokens:
        its accepted draft tokens followed by one recovered or bonus token."""
        ctx = self.ctx
        if len(slots) == 1 and ctx.rec is None and not ctx.export_hidden and not getattr(ctx, "capture_layers", ()):
            self._check_room(1)
            return [self._step_one(slots[0])]
        rnd = self.begin_round(slots)
        if len(slots) == 1:  # one sequence of a recurrent model (KV-only ones take _step_one)
            s = slots[0]
            if rnd.n_rows == 1:
                logits = ctx.decode_step(int(rnd.toks[0]), int(rnd.pos[0]), s.seq)[None]
            else:
                logits = ctx.decode_run(rnd.toks, int(rnd.pos[0]), s.seq)
        else:
            logits = ctx.decode(rnd.toks, positions=rnd.pos, seq_ids=rnd.seqs, logits="all")
        return self.end_round(rnd, logits)

    def _check_room(self, n: int) -> None:
        """KVCacheFull unless the cache has a cell for each of n sequences' next token."""
        kv = self.ctx.kv
        if kv.free_cells(n) < n:
            raise KVCacheFull(f"KV cache is full: {self.ctx.n_ctx} cells, {kv.n_used} used, "
                              f"{n} sequences to advance")

    def _verify(self, s: Slot, d: Draft | None, w: Proposer | None, rows: np.ndarray, argmax,
                take: Take | None, on_error) -> tuple[list[int], int]:
        """Verify one slot's rows, count the round in the statistics and let ``take`` consume the
        tokens; returns (the tokens the slot keeps, k accepted draft tokens)."""
        try:
            res = verify(rows, d.tokens if d is not None else _EMPTY, s.sampler, s.tokens,
                         d.probs if d is not None else None, argmax)
        except Exception as e:
            if on_error is None:
                raise
            on_error(s, e)
            return [], 0
        k = res.n_accepted
        name = w.name if w is not None else None
        n = len(d) if d is not None else 0
        s.stats.record_round(name, n, k)
        self.stats.record_round(name, n, k)
        new = res.tokens
        if take is not None:
            u = take(s, new, rows)
            if u < len(new):
                new = new[: max(u, 1)]
        return new, k

    def _settle(self, s: Slot, w: Proposer | None, key: str | None, n_drafted: int, tokens: list[int],
                k: int) -> None:
        """After a slot's verification: its new tokens, the proposers' accept (the accepted
        tokens the slot keeps) and the adaptive estimates of the winning proposer (k)."""
        s._push(tokens)
        kept = max(len(tokens) - 1, 0)
        for p in self.proposers:
            p.accept(s.seq, kept, other=p is not w)
        if self.adaptive is not None and w is not None:
            self.adaptive.update(s.estimates, key, n_drafted, k)

    def _step_one(self, s: Slot) -> list[int]:
        """step() for one sequence of a KV-cache model (the usual case), with the least Python
        per round: the same drafting, verification (``_verify``) and bookkeeping (``_settle``),
        with the single-sequence decode calls and the plan's argmax for greedy verification."""
        ctx = self.ctx
        t0 = time.perf_counter()
        drafts, winners, keys = self._draft([s])
        t1 = time.perf_counter()
        d, w = drafts[0], winners[0]
        n_past = s.n - 1
        if d is None:
            m = 1
            toks = None  # (built below only for proposers that read decoded batches)
            logits = ctx.decode_step(int(s._buf[n_past]), n_past, s.seq)[None]
        else:
            m = 1 + len(d)
            toks = np.empty(m, dtype=np.int32)
            toks[0] = s._buf[n_past]
            toks[1:] = d.tokens
            logits = ctx.decode_run(toks, n_past, s.seq)
        new, k = self._verify(s, d, w, logits, ctx.last_argmax(), None, None)
        if k < m - 1:
            ctx.truncate(s.seq, s.n + k)  # keep id_last and the k accepted tokens
        self._settle(s, w, keys[0], m - 1, new, k)
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
        return new
