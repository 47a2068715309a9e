"""The draft-model proposer: a second, smaller GGUF with the target's vocabulary.

It owns its own ``Context`` (and so its own KV cache, holding every sequence it drafts for) and
drafts for all sequences of a round together: each drafting step is one decode of the draft model
with one row per sequence (the first step also catches up on the tokens the target accepted since
the last round). With a sampling target it draws each draft token from its own distribution q
(the user's sampler chain on the draft's logits) and passes q to the verifier for rejection
sampling; with a greedy target it drafts the argmax.

Its cache is kept as a prefix of each sequence: at each round the longest common prefix of what
it holds and the sequence is kept and the rest is decoded again, so rejected draft tokens and
rounds won by other proposers need no special handling.
"""
from __future__ import annotations

import os

import numpy as np

from pyfast.context import Context
from pyfast.models import Model
from pyfast.spec.base import Draft, DraftRequest, DraftTokenPicker, Proposer, make_drafts


def check_vocab_compatible(target: Model, draft: Model) -> None:
    """Raise ValueError unless ``draft`` tokenizes exactly as ``target`` does.

    Checks the vocabulary size, the tokenizer type, every token string and the special token ids.
    """
    tn, dn = target.path, draft.path
    if target.n_vocab != draft.n_vocab:
        raise ValueError(
            f"draft model {dn} has a vocabulary of {draft.n_vocab} tokens but the target {tn} has "
            f"{target.n_vocab}; speculative decoding needs the same vocabulary")
    mt, md = target.metadata, draft.metadata
    a, b = mt.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.model")
    if a != b:
        raise ValueError(f"draft model {dn} uses tokenizer {b!r} but the target {tn} uses {a!r}; "
                         "speculative decoding needs the same vocabulary")
    ta, tb = mt.get("tokenizer.ggml.tokens"), md.get("tokenizer.ggml.tokens")
    if ta is not None and tb is not None and ta != tb:
        i = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        xa = ta[i] if i < len(ta) else "<none>"
        xb = tb[i] if i < len(tb) else "<none>"
        raise ValueError(f"draft model {dn} has an incompatible vocabulary: token {i} is {xb!r} there "
                         f"but {xa!r} in the target {tn}")
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if key in mt and key in md and mt[key] != md[key]:
            raise ValueError(f"draft model {dn} has {key} = {md[key]} but the target {tn} has {mt[key]}")


def context_length(model: Model) -> int | None:
    """The context length a model was trained for (``<arch>.context_length``), if stated."""
    arch = model.metadata.get("general.architecture")
    v = model.metadata.get(f"{arch}.context_length")
    return int(v) if isinstance(v, int) else None


class DraftModelProposer(Proposer):
    """Drafts with a second model; see the module docstring.

    draft: a Model or a GGUF path; target: the target Model (for the vocabulary check);
    n_ctx: cells of the draft's KV cache (the target's context size: it holds the same sequences).
    """

    name = "draft-model"
    provides_probs = True
    is_model = True
    default_n_max = 3

    def __init__(self, draft: Model | str | os.PathLike, target: Model, n_ctx: int,
                 n_threads: int | None = None):
        self.model = draft if isinstance(draft, Model) else Model(draft)
        check_vocab_compatible(target, self.model)
        n_train = context_length(self.model)
        if n_train is not None and n_train < n_ctx:
            raise ValueError(
                f"draft model {self.model.path} was trained for a context of {n_train} tokens, smaller "
                f"than the context size {n_ctx}; lower the context size (-c) or use another draft model")
        self.ctx = Context(self.model, n_ctx=n_ctx, n_threads=n_threads)
        self.ctx.max_plans = max(self.ctx.max_plans, 32)
        self._cached: dict[int, np.ndarray] = {}  # seq -> tokens in the draft cache (positions 0..)
        self._picker = DraftTokenPicker(self.model.n_vocab, salt=0x5EED)
        self.n_decodes = 0

    def begin(self, seq: int, prompt) -> None:
        self.end(seq)

    def end(self, seq: int) -> None:
        self.ctx.remove_seq(seq)
        self._cached.pop(seq, None)
        self._picker.forget(seq)

    def draft(self, requests: list[DraftRequest]) -> list[Draft | None]:
        n_vocab = self.model.n_vocab
        # Catch the cache up: keep the common prefix (at most L-1 tokens: id_last's logits are needed).
        feed: dict[int, np.ndarray] = {}
        start: dict[int, int] = {}
        for r in requests:
            h = np.asarray(r.tokens, dtype=np.int32)
            old = self._cached.get(r.seq)
            m = 0
            if old is not None and old.size:
                k = min(old.size, h.size - 1)
                diff = np.flatnonzero(old[:k] != h[:k])
                m = int(diff[0]) if diff.size else k
            self.ctx.truncate(r.seq, m)
            feed[r.seq] = h[m:]
            start[r.seq] = m
            self._cached[r.seq] = h.copy() if r.n_max > 0 else h[:m].copy()

        drafts: dict[int, list[int]] = {r.seq: [] for r in requests}
        probs: dict[int, list[np.ndarray]] = {r.seq: [] for r in requests}
        live = [r for r in requests if r.n_max > 0]
        while live:
            toks, pos, seqs, rows = [], [], [], []
            off = 0
            for r in live:
                f = feed[r.seq]
                toks.append(f)
                pos.append(np.arange(start[r.seq], start[r.seq] + f.size, dtype=np.int32))
                seqs.append(np.full(f.size, r.seq, dtype=np.int32))
                off += f.size
                rows.append(off - 1)
            logits = self.ctx.decode(np.concatenate(toks), positions=np.concatenate(pos),
                                     seq_ids=np.concatenate(seqs), logits=np.asarray(rows))
            self.n_decodes += 1
            nxt = []
            for i, r in enumerate(live):
                t = self._picker.extend(r, logits[i], drafts[r.seq], probs[r.seq])
                if t is None:
                    continue
                start[r.seq] += feed[r.seq].size
                if len(drafts[r.seq]) < r.n_max:
                    feed[r.seq] = np.array([t], dtype=np.int32)
                    self._cached[r.seq] = np.append(self._cached[r.seq], np.int32(t))
                    nxt.append(r)
            live = nxt

        return make_drafts(requests, drafts, probs, n_vocab)
