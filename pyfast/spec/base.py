"""The proposer interface every drafter implements (n-gram, draft model, later MTP, EAGLE3, ...).

One proposer object serves every sequence of a decoder; it keeps per-sequence state keyed by the
sequence id, and ``draft`` is called once per round with the requests of all sequences that want
a draft, so model drafters can batch them into one decode.

Lifecycle per sequence::

    begin(seq, prompt)                      once, before the first round
    draft([DraftRequest, ...]) -> drafts    each round (batched over sequences)
    accept(seq, k, other)                   after verification: k of this proposer's draft tokens
                                            were accepted (other=True: another proposer won)
    process(batch)                          after every target decode (prompt and verify)
    end(seq)                                when the sequence is released

A server's context checkpoint (hybrid models: the recurrent state at a prompt position n) also
keeps ``save_state(seq, n)``, what a proposer needs beyond its own caches to draft on from n;
restoring the checkpoint hands it back to ``restore_state(seq, n, state)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from pyfast.sampling import Sampler


@dataclass
class DraftRequest:
    """What a proposer needs to draft for one sequence.

    tokens: the sequence so far, prompt and generated, ending with ``id_last`` (the last sampled
            token, not yet in the target's cache). A read-only view: copy what you keep.
    n_max:  draft at most this many tokens (>= 1).
    n_min:  a draft shorter than this is discarded by the decoder.
    p_min:  model drafters stop when their top-1 probability falls below this (0 = off).
    sampler: the target's sampler (its params tell a model drafter how to sample; greedy means
            draft the argmax and supply no probabilities).
    """

    seq: int
    tokens: np.ndarray
    n_max: int
    n_min: int = 1
    p_min: float = 0.0
    sampler: "Sampler | None" = None

    @property
    def greedy(self) -> bool:
        return self.sampler is None or self.sampler.params.greedy


@dataclass
class Draft:
    """A proposed continuation.

    tokens: the draft token ids d1..dN.
    probs:  optional [N, n_vocab] float array: row i is the distribution d(i+1) was drawn from
            (q). When present and the target samples (temperature > 0), the verifier uses
            rejection sampling; when absent it samples the target and stops at the first mismatch.
    kind:   an optional label of how the draft was made (e.g. "local" for an n-gram re-sync);
            the adaptive controller keeps separate acceptance estimates per kind.
    """

    tokens: np.ndarray
    probs: np.ndarray | None = None
    kind: str = ""

    def __len__(self) -> int:
        return int(self.tokens.size)


@dataclass
class DecodeBatch:
    """A target decode as proposers see it in ``process``: one row per token.

    kind: "prompt" or "verify"; n_accepted maps seq -> accepted draft tokens (verify only).
    hidden: the target's hidden rows of exactly these tokens (float32 [n_tokens, n_embd]) when the
    target exports them and the decode held other rows too; None: read ``ctx.last_hidden``.
    features: the target's captured layer rows of exactly these tokens (float32 [n_tokens,
    L * n_embd], layer-major in ``feature_layers`` order; ``Context(capture_layers=...)``), None
    when the target captures none (or the caller could not tell which rows were these).
    """

    kind: str
    seq_ids: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray
    n_accepted: dict[int, int] | None = None
    hidden: np.ndarray | None = None
    features: np.ndarray | None = None
    feature_layers: tuple[int, ...] = ()

    def layer_features(self, layers: Sequence[int]) -> np.ndarray | None:
        """The captured rows of the given layer ids, concatenated in that order ([n_tokens,
        len(layers) * n_embd]; the array itself when it is exactly the captured set in order).
        None without features; ValueError for a layer the target does not capture."""
        f = self.features
        if f is None:
            return None
        layers = tuple(layers)
        if layers == tuple(self.feature_layers):
            return f
        L = len(self.feature_layers)
        d = f.shape[1] // max(L, 1)
        cols = []
        for l in layers:
            if l not in self.feature_layers:
                raise ValueError(f"layer {l} is not captured by the target (it captures {list(self.feature_layers)})")
            j = self.feature_layers.index(l)
            cols.append(f[:, j * d:(j + 1) * d])
        return np.concatenate(cols, axis=1) if cols else f[:, :0]


class Proposer:
    """Base class: a proposer that never drafts. Subclasses override ``draft`` and what else they
    need. ``name`` identifies it in statistics; ``provides_probs`` says whether its drafts carry
    the probabilities the stochastic verifier needs for rejection sampling; ``is_model`` marks
    drafters whose every token costs a model evaluation: the adaptive controller fixes their
    draft length before drafting, while cheap proposers draft at full length and are trimmed."""

    name: str = "proposer"
    provides_probs: bool = False
    is_model: bool = False
    default_n_max: int = 16
    default_n_min: int = 1
    kind_priors: dict[str, float] = {}  # Draft.kind -> acceptance the adaptive controller assumes first
    # target layers whose input rows this proposer reads (feature capture, see DecodeBatch.features;
    # id l = input of layer l, n_layer = the final hidden state before the output norm)
    capture_layers: tuple[int, ...] = ()

    def begin(self, seq: int, prompt: Sequence[int] | np.ndarray) -> None:
        pass

    def draft(self, requests: list[DraftRequest]) -> list[Draft | None]:
        return [None] * len(requests)

    def accept(self, seq: int, n_accepted: int, other: bool = False) -> None:
        pass

    def process(self, batch: DecodeBatch) -> None:
        pass

    def end(self, seq: int) -> None:
        pass

    def save_state(self, seq: int, n: int) -> object | None:
        """What this proposer needs to draft on for ``seq`` after the target's memory of it goes
        back to its first ``n`` tokens (the sequence holds exactly n tokens now), beyond what its
        own caches keep for those tokens; None: nothing. Kept with a context checkpoint."""
        return None

    def restore_state(self, seq: int, n: int, state: object | None) -> None:
        """The target's memory of ``seq`` went back to its first ``n`` tokens (a context
        checkpoint); ``state``: what ``save_state(seq, n)`` returned when it was taken."""
        pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class DraftTokenPicker:
    """How a model drafter (draft model, MTP) turns one row of its logits into a draft token.

    Greedy targets draft the argmax and stop when its probability is below p_min. Sampling
    targets draw from the draft's own copy of the target's sampler chain (seeded from the
    target's seed plus ``salt``, so draft and target draws are independent), and the draw's
    distribution goes to the stochastic verifier.
    """

    def __init__(self, n_vocab: int, salt: int):
        self.n_vocab = n_vocab
        self.salt = salt
        self._samplers: dict[int, tuple["Sampler", "Sampler"]] = {}  # seq -> (target's, draft's)

    def forget(self, seq: int) -> None:
        self._samplers.pop(seq, None)

    def sampler(self, r: DraftRequest) -> "Sampler":
        import dataclasses

        from pyfast.sampling import Sampler

        ent = self._samplers.get(r.seq)
        if ent is None or ent[0] is not r.sampler:
            seed = r.sampler.params.seed
            # drafts are proposals: no grammar (its matcher follows the target's sampler only)
            params = dataclasses.replace(r.sampler.params, constraint=None,
                                         seed=None if seed is None else (seed + self.salt) % 2**63)
            ent = self._samplers[r.seq] = (r.sampler, Sampler(params, self.n_vocab))
        return ent[1]

    def extend(self, r: DraftRequest, row: np.ndarray, drafted: list[int], probs: list[np.ndarray]) -> int | None:
        """pick() and append the token to ``drafted`` (its distribution, when sampling, to
        ``probs``); returns the token, or None when the chain stops."""
        got = self.pick(r, row, drafted)
        if got is None:
            return None
        t, q = got
        if q is not None:
            probs.append(q)
        drafted.append(t)
        return t

    def pick(self, r: DraftRequest, row: np.ndarray, drafted: Sequence[int]) -> tuple[int, np.ndarray | None] | None:
        """(token, its draft distribution or None when greedy), or None to stop this chain."""
        if r.greedy:
            t = int(np.argmax(row))
            if r.p_min > 0.0 and 1.0 / float(np.exp(row.astype(np.float64) - float(row[t])).sum()) < r.p_min:
                return None
            return t, None
        s = self.sampler(r)
        q = s.probs(row, np.concatenate([r.tokens, np.asarray(drafted, dtype=r.tokens.dtype)]))
        if r.p_min > 0.0 and float(q.max()) < r.p_min:
            return None
        return s.sample_from_probs(q), q


def make_drafts(requests: list[DraftRequest], drafts: dict[int, list[int]], probs: dict[int, list[np.ndarray]],
                n_vocab: int | None = None) -> list[Draft | None]:
    """Each request's Draft (None when it drafted nothing), with the stacked probabilities when
    there are any (dropped unless they are n_vocab wide, when given)."""
    out: list[Draft | None] = []
    for r in requests:
        d = drafts[r.seq]
        if not d:
            out.append(None)
            continue
        q = np.stack(probs[r.seq]) if probs[r.seq] else None
        if q is not None and n_vocab is not None and q.shape[1] != n_vocab:
            q = None
        out.append(Draft(np.asarray(d, dtype=np.int32), q))
    return out


def free_cells(kv, seqs: dict, need: int) -> bool:
    """Whether a drafter's KV cache has `need` free cells, after dropping the rows of retired
    sequences (seqs: id -> state with a ``retired`` flag; dropped ones leave `seqs`) when it had
    not: the model-based drafters keep a finished sequence's rows until the room is needed."""
    if kv.n_ctx - kv.n_used >= need:
        return True
    for s in [s for s, st in seqs.items() if st.retired]:
        kv.remove_seq(s)
        del seqs[s]
        if kv.n_ctx - kv.n_used >= need:
            return True
    return False


def seq_rows(seqs, pos, who: str | None = None):
    """For each sequence of a batch, in order of first appearance: (seq, its row indices in
    position order, their positions). who: the proposer's name, to refuse a sequence whose
    positions in the batch are not consecutive (None: no check)."""
    for s in dict.fromkeys(seqs.tolist()):
        idx = np.flatnonzero(seqs == s)
        idx = idx[np.argsort(pos[idx], kind="stable")]
        pp = pos[idx]
        if who is not None and idx.size > 1 and not bool(np.all(np.diff(pp) == 1)):
            raise ValueError(f"{who}: sequence {s} has non-consecutive positions in a batch")
        yield s, idx, pp
