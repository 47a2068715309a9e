"""Adaptive draft length: pick the draft length that maximizes expected tokens per second.

Two measurements drive it:

- the cost ``c(T)`` of one target decode of T rows with logits on every row, measured once per
  decoder (a short calibration on a scratch sequence, about 80 small decodes);
- the acceptance per position: ``a_i`` = probability that draft position i is accepted given that
  every earlier position was, a running average per sequence and proposer, started from the
  proposer's cumulative counts.

A draft of length N then yields ``E(N) = 1 + sum_{j<=N} prod_{i<=j} a_i`` tokens for ``c(B+N)``
seconds (B rows from the batch's other sequences). The controller picks the N that maximizes
tokens per second, N = 0 (no draft) included. A proposer held at N = 0 has its estimates drift
slowly back towards a neutral prior so that it is probed again now and then: text can turn
copy-heavy halfway through a reply.
"""
from __future__ import annotations

import time

import numpy as np

SCRATCH_SEQ = 2**30  # a sequence id no caller uses: calibration decodes go there


class CostModel:
    """Seconds per target decode of T rows (T = 1 .. t_max), with every row's logits returned.

    Measured once (``calibrate``): a few back-to-back runs of each size (the way decodes of one
    size follow each other), in two passes so that a burst of load on a shared machine does not
    spoil one size, keeping the fastest run of each. The curve is made non-decreasing and kept
    within [c(1), T * c(1)].
    """

    SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)

    def __init__(self, ctx, t_max: int):
        self.ctx = ctx
        self.t_max = max(2, int(t_max))
        self._cost: np.ndarray | None = None  # [t_max + 1]; cost[0] unused
        self._list: list[float] = []  # the same as plain floats (the controller's loop)

    @property
    def cost(self) -> np.ndarray | None:
        return self._cost

    @cost.setter
    def cost(self, c: np.ndarray | None) -> None:
        self._cost = c
        self._list = [] if c is None else np.asarray(c).tolist()

    def calibrate(self, reps: int = 3, passes: int = 2) -> np.ndarray:
        """Time decodes of a few sizes on a scratch sequence; interpolate the rest."""
        ctx = self.ctx
        free = ctx.n_ctx - ctx.kv.n_used
        t_hi = max(1, min(self.t_max, free))
        sizes = sorted({s for s in self.SIZES if s <= t_hi} | {t_hi})
        toks = np.random.default_rng(0).integers(0, ctx.model.n_vocab, size=t_hi)
        best = {T: float("inf") for T in sizes}
        for _ in range(passes):
            for T in sizes:
                for r in range(reps + 1):  # the first run builds the plan and warms the caches
                    t0 = time.perf_counter()
                    ctx.decode(toks[:T], positions=np.arange(T), seq_ids=SCRATCH_SEQ, logits="all")
                    dt = time.perf_counter() - t0
                    ctx.truncate(SCRATCH_SEQ, 0)
                    if r:
                        best[T] = min(best[T], dt)
        meas = np.maximum.accumulate(np.asarray([best[T] for T in sizes]))
        Ts = np.arange(self.t_max + 1)
        cost = np.interp(Ts, sizes, meas)
        if len(sizes) > 1 and self.t_max > sizes[-1]:  # extrapolate linearly
            slope = (meas[-1] - meas[-2]) / (sizes[-1] - sizes[-2])
            over = Ts > sizes[-1]
            cost[over] = meas[-1] + slope * (Ts[over] - sizes[-1])
        c1 = cost[1]
        cost = np.clip(cost, c1, np.maximum(Ts, 1) * c1)
        cost[0] = c1
        self.cost = cost
        return cost

    def costs(self, t0: int, n: int) -> list[float]:
        """c(t0), c(t0 + 1), .., c(t0 + n - 1) as plain floats."""
        if self.cost is None:
            self.calibrate()
        c = self._list
        if t0 + n <= len(c):
            return c[t0: t0 + n]
        return self(t0 + np.arange(n)).tolist()

    def __call__(self, T: np.ndarray | int):
        if self.cost is None:
            self.calibrate()
        T = np.asarray(T)
        c = self.cost
        slope = c[-1] - c[-2]
        return c[np.minimum(T, self.t_max)] + np.maximum(T - self.t_max, 0) * slope


class AdaptiveController:
    """Chooses each round's draft length per (sequence, proposer); see the module docstring.

    Per sequence and proposer (and draft kind) it keeps decayed counts of the rounds that reached
    and accepted each draft position. Where a sequence has little data its estimate leans on a
    fallback: at position 0 the proposer's acceptance over all sequences so far (starting from an
    optimistic prior, so a proposer is tried), at position i the sequence's own estimate at i-1
    (so lengths never tried inherit the acceptance of the ones tried, and a run of fully accepted
    drafts lets the length grow). While held at N = 0 the counts fade, the estimate returns to
    the fallback and the proposer is probed again.
    """

    def __init__(self, cost: CostModel, n_max: int, decay: float = 0.8, skip_decay: float = 0.97,
                 prior: float = 0.8, pseudo: float = 1.0, priors: dict[str, float] | None = None):
        self.cost = cost
        self.n_max = n_max
        self.decay = decay            # per drafted round: weight of older rounds
        self.skip_decay = skip_decay  # per round held at N = 0
        self.prior = prior            # acceptance assumed before any data
        self.priors = dict(priors or {})  # the same, per key ("proposer" or "proposer:kind")
        self.pseudo = pseudo          # pseudo-count pulling each position towards its fallback
        self._glob: dict[str, np.ndarray] = {}  # key -> [2, n_max] (accepted, reached) counts

    def _global(self, key: str) -> np.ndarray:
        g = self._glob.get(key)
        if g is None:
            g = self._glob[key] = np.zeros((2, self.n_max))
        return g

    def _state(self, state: dict, key: str) -> np.ndarray:
        """[2, n_max] decayed (accepted, reached) counts of one sequence."""
        st = state.get(key)
        if st is None:
            st = state[key] = np.zeros((2, self.n_max))
        return st

    def _acceptance(self, st: np.ndarray, key: str, n: int) -> list[float]:
        """a_0..a_{n-1} from one sequence's counts st: position i leans on i-1, position 0 on the
        proposer's acceptance over all sequences (plain floats: a round runs this once per
        sequence, and numpy calls on 16 numbers cost more than the arithmetic)."""
        hit, seen = st[0, :n].tolist(), st[1, :n].tolist()
        g = self._global(key)
        prev = (float(g[0, 0]) + 2.0 * self.priors.get(key, self.prior)) / (float(g[1, 0]) + 2.0)
        out = []
        for h, s in zip(hit, seen):
            prev = (h + self.pseudo * prev) / (s + self.pseudo)
            out.append(prev)
        return out

    def estimate(self, state: dict, key: str) -> np.ndarray:
        """Acceptance per position a_0..a_{n_max-1} of one sequence and proposer."""
        return np.asarray(self._acceptance(self._state(state, key), key, self.n_max))

    def choose(self, state: dict, key: str, cap: int, n_rows: int = 1) -> int:
        """Draft length in [0, cap] maximizing expected tokens / second; n_rows = rows of the
        batch without this draft (one per sequence)."""
        if cap <= 0:
            return 0
        cap = min(cap, self.n_max)
        # E(N) = 1 + sum_{j<=N} prod_{i<=j} a_i; the best (E(N) + n_rows - 1) / c(n_rows + N),
        # first maximum on ties (plain floats, as in _acceptance)
        st = self._state(state, key)
        cost = self.cost.costs(n_rows, cap + 1)
        extra = float(n_rows - 1)
        best_n, best = 0, (1.0 + extra) / cost[0]
        prod, cum = 1.0, 0.0
        for i, a in enumerate(self._acceptance(st, key, cap)):
            prod *= a
            cum += prod
            v = (1.0 + cum + extra) / cost[i + 1]
            if v > best:
                best_n, best = i + 1, v
        if best_n == 0:  # held back: forget slowly, so the proposer is probed again later
            st[:] *= self.skip_decay
        return best_n

    def update(self, state: dict, key: str, n_drafted: int, n_accepted: int) -> None:
        if n_drafted <= 0:
            return
        st = self._state(state, key)
        st *= self.decay
        k = min(n_accepted, n_drafted, self.n_max)
        g = self._global(key)
        st[:, :k] += 1.0
        g[:, :k] += 1.0
        if k < min(n_drafted, self.n_max):
            st[1, k] += 1.0
            g[1, k] += 1.0
