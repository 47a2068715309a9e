"""Speculation statistics, per request and cumulative.

The terms follow the verifier (``verify.py``): in one round a proposer drafts ``N`` tokens, the
target accepts the first ``k`` of them (*accepted* tokens) and adds one token of its own: the
*recovered* token sampled where the first draft token was rejected, or the *bonus* token sampled
after the last draft token when all ``N`` were accepted.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProposerStats:
    rounds: int = 0    # rounds this proposer won (its draft was verified)
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class SpecStats:
    """Counters of speculative decoding.

    steps:        target decodes after the prompt (verify rounds, with or without a draft)
    draft_rounds: rounds that verified a non-empty draft
    drafted:      draft tokens verified; accepted: those the target accepted (accepted <= drafted)
    recovered:    rounds ending in a recovered token (a draft token was rejected)
    bonus:        rounds with a draft that ended in a bonus token (every draft token accepted)
    n_tokens:     tokens the target produced in these steps (accepted + recovered + bonus + plain)
    pos_drafted[i] / pos_accepted[i]: rounds whose draft reached / had accepted position i
                  (pos_accepted is non-increasing: position i+1 is accepted only after i)
    t_draft, t_verify: seconds spent drafting, and decoding + verifying
    by_proposer:  the same counters split by the proposer that won each round
    """

    steps: int = 0
    draft_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0
    n_tokens: int = 0
    pos_drafted: list[int] = field(default_factory=list)
    pos_accepted: list[int] = field(default_factory=list)
    t_draft: float = 0.0
    t_verify: float = 0.0
    by_proposer: dict[str, ProposerStats] = field(default_factory=dict)

    # --- updates ---------------------------------------------------------------------------
    def record_round(self, proposer: str | None, n_drafted: int, n_accepted: int) -> None:
        """One verify round of one sequence: n_drafted draft tokens, n_accepted of them kept."""
        self.steps += 1
        self.n_tokens += n_accepted + 1
        if n_drafted <= 0:
            return
        self.draft_rounds += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        if n_accepted < n_drafted:
            self.recovered += 1
        else:
            self.bonus += 1
        _grow(self.pos_drafted, n_drafted)
        _grow(self.pos_accepted, n_drafted)
        for i in range(n_drafted):
            self.pos_drafted[i] += 1
        for i in range(n_accepted):
            self.pos_accepted[i] += 1
        ps = self.by_proposer.get(proposer or "?")
        if ps is None:
            ps = self.by_proposer[proposer or "?"] = ProposerStats()
        ps.rounds += 1
        ps.drafted += n_drafted
        ps.accepted += n_accepted

    def merge(self, other: "SpecStats") -> "SpecStats":
        """Add another SpecStats' counters into this one (returns self)."""
        for name in ("steps", "draft_rounds", "drafted", "accepted", "recovered", "bonus", "n_tokens",
                     "t_draft", "t_verify"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.pos_drafted, other.pos_drafted), (self.pos_accepted, other.pos_accepted)):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v
        for k, v in other.by_proposer.items():
            ps = self.by_proposer.setdefault(k, ProposerStats())
            ps.rounds += v.rounds
            ps.drafted += v.drafted
            ps.accepted += v.accepted
        return self

    # --- derived ---------------------------------------------------------------------------
    @property
    def acceptance(self) -> float:
        """Accepted / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per round that had a draft."""
        return self.accepted / self.draft_rounds if self.draft_rounds else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens produced per target decode."""
        return self.n_tokens / self.steps if self.steps else 0.0

    def position_acceptance(self) -> list[float]:
        """Fraction of rounds that drafted position i and had it accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted)]

    def to_dict(self) -> dict:
        return {
            "steps": self.steps, "draft_rounds": self.draft_rounds, "drafted": self.drafted,
            "accepted": self.accepted, "recovered": self.recovered, "bonus": self.bonus,
            "n_tokens": self.n_tokens, "acceptance": self.acceptance, "mean_accepted": self.mean_accepted,
            "tokens_per_step": self.tokens_per_step, "pos_drafted": list(self.pos_drafted),
            "pos_accepted": list(self.pos_accepted), "t_draft": self.t_draft, "t_verify": self.t_verify,
            "by_proposer": {k: {"rounds": v.rounds, "drafted": v.drafted, "accepted": v.accepted,
                                "acceptance": v.acceptance} for k, v in self.by_proposer.items()},
        }

    def summary(self) -> str:
        """A short human-readable report (used by the CLI)."""
        hist = " ".join(str(a) for a in self.pos_accepted[:16])
        more = " ..." if len(self.pos_accepted) > 16 else ""
        s = (f"drafted {self.drafted}, accepted {self.accepted} ({100 * self.acceptance:.1f}%), "
             f"mean accepted length {self.mean_accepted:.2f}, {self.tokens_per_step:.2f} tokens/step "
             f"over {self.steps} steps | draft {1000 * self.t_draft:.0f} ms, verify {1000 * self.t_verify:.0f} ms")
        if self.pos_accepted:
            s += f"\n  accepted per position: {hist}{more}"
        if len(self.by_proposer) > 1 or (self.by_proposer and "?" not in self.by_proposer):
            parts = [f"{k}: {v.rounds} rounds, {v.accepted}/{v.drafted}" for k, v in self.by_proposer.items()]
            s += "\n  by proposer: " + "; ".join(parts)
        return s


def _grow(a: list[int], n: int) -> None:
    if len(a) < n:
        a.extend([0] * (n - len(a)))

