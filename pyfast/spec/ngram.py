"""N-gram proposers: drafts copied from earlier text, no model needed.

- ``ngram-simple``: prompt lookup. Find the most recent earlier occurrence of the last ``n``
  tokens and propose the tokens that followed it.
- ``ngram-map-k``: a hashed index (2^18 buckets per sequence) from each n-gram to the position
  it last ended at; proposes what followed, capped by how many tokens were accepted the last time
  that key was used.
- ``ngram-mod``: one table shared by every sequence, indexed by a rolling hash of ``n`` tokens
  and holding the token that followed; drafts by chaining look-ups. The table is cleared when it
  is more than 25% full at ``begin``, or after 5 rounds in a row with acceptance below 25%.

Everything works on numpy views of the sequence; per round the work is a few vectorized passes
over the history (simple) or a handful of dictionary-free table look-ups (map-k, mod).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pyfast._loader import native
from pyfast.spec.base import Draft, DraftRequest, Proposer

_P = np.uint64(0x100000001B3)            # polynomial base of the n-gram hash (odd)
_MIX = 0x9E3779B97F4A7C15                 # multiplicative mixing before taking the top bits
_MASK = (1 << 64) - 1


def ngram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """Polynomial hash (mod 2^64) of every window of n tokens: out[j] hashes tokens[j:j+n]."""
    t = np.asarray(tokens).astype(np.uint64) + np.uint64(1)
    if t.size < n:
        return np.zeros(0, dtype=np.uint64)
    win = sliding_window_view(t, n)
    h = np.zeros(win.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for c in range(n):
            h = h * _P + win[:, c]
    return h


def bucket_of(h: np.ndarray, bits: int) -> np.ndarray:
    """Top ``bits`` bits of the mixed hash: a bucket index in [0, 2^bits)."""
    with np.errstate(over="ignore"):
        return ((h * np.uint64(_MIX)) >> np.uint64(64 - bits)).astype(np.int64)


def _find_last_match(h: np.ndarray, n: int) -> int:
    """Index j (n-1 <= j <= L-2) of the end of the most recent earlier occurrence of the last n
    tokens of h, or -1 (natively for int32 tokens: a backward scan that stops at the first hit)."""
    if h.dtype == np.int32:
        return native.ngram_last_match(h, n)
    return _find_last_match_np(h, n)


def _occurrences_np(h: np.ndarray, n: int) -> np.ndarray:
    """Ends j (n-1 <= j <= L-2, ascending) of the earlier occurrences of the last n tokens."""
    L = h.size
    if L < n + 1:
        return np.zeros(0, dtype=np.int64)
    key = h[L - n:]
    cand = np.flatnonzero(h[n - 1:L - 1] == key[-1]) + (n - 1)
    for o in range(1, n):
        if cand.size == 0:
            break
        cand = cand[h[cand - o] == key[-1 - o]]
    return cand


def _find_last_match_np(h: np.ndarray, n: int) -> int:
    """_find_last_match in numpy (any integer dtype; the reference the tests compare against)."""
    cand = _occurrences_np(h, n)
    return int(cand[-1]) if cand.size else -1


def _find_best_match(h: np.ndarray, n: int, cap: int, limit: int = 64) -> tuple[int, int]:
    """ngram-simple's source: among the earlier occurrences of the last n tokens, the most recent
    of those whose common suffix with the sequence (counted up to ``cap``) is longest. Returns its
    end j and that suffix's length (up to ``limit``), or (-1, 0)."""
    if h.dtype == np.int32:
        j, m = native.ngram_best_match(h, n, cap, limit)
        return int(j), int(m)
    return _find_best_match_np(h, n, cap, limit)


def _find_best_match_np(h: np.ndarray, n: int, cap: int, limit: int = 64) -> tuple[int, int]:
    """_find_best_match in numpy (the reference the tests compare against)."""
    best, best_key, best_len = -1, -1, 0
    for j in _occurrences_np(h, n)[::-1].tolist():  # most recent first: a later one wins only with a longer key
        m = _match_length(h, j, limit)
        if min(m, cap) > best_key:
            best, best_key, best_len = j, min(m, cap), m
    return best, best_len


def _match_length(h: np.ndarray, j: int, limit: int = 64) -> int:
    """How many tokens ending at j equal the tokens ending at the sequence end (<= limit)."""
    if h.dtype == np.int32:
        return native.ngram_match_length(h, j, limit)
    m = min(limit, j + 1)
    a = h[j - m + 1: j + 1][::-1]
    b = h[h.size - m:][::-1]
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else m


def _local_search(h: np.ndarray, n: int, n_local: int, expect: int) -> int:
    """The re-sync search of NgramSimple._local_match in Python (the reference for the native
    one): for key lengths m = n-1 .. n_local, the occurrence of the last m tokens ending nearest
    to `expect` (within min(8, 2^m); the lower end on a tie); returns its end + 1, or -1."""
    L = h.size
    lo_all = max(0, expect - 8 - n)
    seg = h[lo_all: min(L - 1, expect + 9)].tolist()  # a few dozen tokens: plain Python
    tail = h[L - n:].tolist()
    for m in range(n - 1, n_local - 1, -1):
        w = min(8, 2 ** m)
        key = tail[n - m:]
        best = -1
        for e in range(max(m - 1, expect - w), min(L - 2, expect + w) + 1):
            i = e - lo_all  # e: where the key would end in the source; keep the nearest hit
            hit = i - m + 1 >= 0 and seg[i - m + 1: i + 1] == key
            if hit and (best < 0 or abs(e - expect) < abs(best - expect)):
                best = e
        if best >= 0:
            return best + 1
    return -1


class NgramSimple(Proposer):
    """Prompt lookup: copy what followed the most recent earlier occurrence of the last n tokens.

    Where the key occurs several times, a more recent occurrence that agrees with the sequence for
    fewer than ``long_match`` tokens gives way to an older one that agrees for more (code repeats
    short phrases: the most recent "    for key, value" is often the wrong place to copy from). On
    the copy prompts this drafts 6% more accepted tokens summed over every position; on chat
    prompts 0.1% fewer (comparing by the full agreement length instead cost chat 1.5%).

    Draft length grows with the evidence: a draft copies at most ``max(n_max_local, match)``
    tokens, where ``match`` is how many tokens before the sequence end agree with the text before
    the occurrence (>= n). A fresh 4-token match gets a short draft; a copy that has been in step
    for 20 tokens gets a full one.

    Re-synchronizing after a deviation: after a round that copied from earlier text, the proposer
    remembers where in that text the sequence should continue (its *anchor*). When the model
    deviates from the text (a changed word, an inserted comma), the last n tokens occur nowhere for
    the next n-1 tokens; then a shorter key (n-1 down to ``n_local`` tokens) found within a few
    tokens of the anchor (+-2 for one token, +-4 for two, +-8 for three or more) is used, with a
    draft of at most ``n_max_local`` tokens; once some are accepted the full key matches again.

    Under the adaptive controller the re-sync cap ``n_max_local`` is 8 instead of 4: the controller
    trims each draft to the length its acceptance estimates for the draft's kind pay for (same-run
    A/B on the copy set, 3 repetitions: 1.53x with 4, 1.59x with 8).

    Fallback (``n_fallback`` > 0, on when the adaptive controller is): when neither finds a
    continuation, the most recent earlier occurrence of the last n-1 .. ``n_fallback`` tokens
    anywhere in the sequence gives a draft of at most ``n_max_fallback`` tokens. Such drafts are
    accepted far less often; an extra verify row costs a fraction of a step, so they pay only while
    the controller's running acceptance for them says so, which is why they stay off without it.

    Drafts are labelled (``Draft.kind``) "local", "short" (match < ``long_match``), "fallback" or
    "" (long) for the adaptive controller, with prior acceptance rates measured on SmolLM2 chat and
    copy prompts.
    """

    name = "ngram-simple"
    default_n_max = 16
    long_match = 6  # a match this long is a "long" draft (acceptance ~95% per token on SmolLM2)
    kind_priors = {"": 0.9, "short": 0.6, "local": 0.5, "fallback": 0.3}

    def __init__(self, n: int = 4, n_local: int = 1, n_max_local: int = 4, grow: bool = True,
                 n_fallback: int = 0, n_max_fallback: int = 2):
        if n < 1:
            raise ValueError(f"ngram-simple: key length n must be >= 1, got {n}")
        self.n = n
        self.n_local = max(0, min(n_local, n - 1))
        self.n_max_local = max(1, n_max_local)
        self.grow = grow
        self.n_fallback = max(0, min(n_fallback, n - 1))
        self.n_max_fallback = max(1, n_max_fallback)
        self._anchor: dict[int, tuple[int, int]] = {}  # seq -> (source index expected next, length then)
        self._last: dict[int, tuple[int, int]] = {}    # seq -> (source start of the draft, length then)

    def begin(self, seq: int, prompt) -> None:
        self.end(seq)

    def end(self, seq: int) -> None:
        self._anchor.pop(seq, None)
        self._last.pop(seq, None)

    def _local_match(self, h: np.ndarray, seq: int) -> int:
        """Source index to copy from after a deviation (see the class docstring), or -1."""
        a = self._anchor.get(seq)
        if a is None or not self.n_local:
            return -1
        L = h.size
        if L - a[1] >= self.n:  # the full key would match again by now if the copy went on
            del self._anchor[seq]
            return -1
        expect = a[0] + (L - a[1]) - 1  # where the sequence's last token sits in the source
        if h.dtype == np.int32:
            return native.ngram_local_match(h, self.n, self.n_local, expect)
        return _local_search(h, self.n, self.n_local, expect)

    def draft(self, requests: list[DraftRequest]) -> list[Draft | None]:
        out: list[Draft | None] = []
        cap = max(self.n, self.long_match)  # agreement counted up to this when choosing a source
        for r in requests:
            h = r.tokens
            self._last.pop(r.seq, None)
            n_max = r.n_max
            j, ml = _find_best_match(h, self.n, cap, max(64, cap))
            if j >= 0:
                start = j + 1
                kind = "short" if ml < self.long_match else ""
                if self.grow:
                    n_max = min(n_max, max(self.n_max_local, ml))
            else:
                start = self._local_match(h, r.seq)
                kind = "local"
                n_max = min(n_max, self.n_max_local)
                if start < 0 and self.n_fallback:
                    for m in range(self.n - 1, self.n_fallback - 1, -1):
                        jf = _find_last_match(h, m)
                        if jf >= 0:
                            start, kind, n_max = jf + 1, "fallback", min(r.n_max, self.n_max_fallback)
                            break
            cont = h[start: start + n_max] if start >= 0 else h[:0]
            if cont.size == 0:
                out.append(None)
                continue
            self._last[r.seq] = (start, h.size)
            out.append(Draft(np.array(cont, dtype=np.int32), kind=kind))
        return out

    def accept(self, seq: int, n_accepted: int, other: bool = False) -> None:
        last = self._last.pop(seq, None)
        if last is not None and not other:
            # k draft tokens matched source[start:start+k]; the token after them (recovered or
            # bonus) takes the place of source[start+k], so source[start+k+1] is expected next
            start, n0 = last
            self._anchor[seq] = (start + n_accepted + 1, n0 + n_accepted + 1)


class NgramMapK(Proposer):
    """A hashed n-gram -> last position index per sequence, with a per-key accepted-length cap."""

    name = "ngram-map-k"
    default_n_max = 16

    def __init__(self, n: int = 4, bits: int = 18):
        if n < 1:
            raise ValueError(f"ngram-map-k: key length n must be >= 1, got {n}")
        self.n = n
        self.bits = bits
        self._seqs: dict[int, dict] = {}

    def begin(self, seq: int, prompt) -> None:
        size = 1 << self.bits
        self._seqs[seq] = dict(pos=np.full(size, -1, dtype=np.int32),
                               cap=np.zeros(size, dtype=np.int16),  # 0 = no cap yet
                               indexed=0, last=None)

    def end(self, seq: int) -> None:
        self._seqs.pop(seq, None)

    def _index(self, st: dict, h: np.ndarray, upto: int) -> None:
        """Insert the n-grams ending at positions [indexed, upto)."""
        n = self.n
        lo = max(st["indexed"], n - 1)
        if upto <= lo:
            return
        hs = ngram_hashes(h[lo - n + 1: upto], n)  # windows ending at lo..upto-1
        b = bucket_of(hs, self.bits)
        # later positions overwrite earlier ones (numpy assigns in order for repeated indices)
        st["pos"][b] = np.arange(lo, upto, dtype=np.int32)
        st["indexed"] = upto

    def draft(self, requests: list[DraftRequest]) -> list[Draft | None]:
        out: list[Draft | None] = []
        n = self.n
        for r in requests:
            st = self._seqs.get(r.seq)
            if st is None:
                self.begin(r.seq, ())
                st = self._seqs[r.seq]
            h = r.tokens
            L = h.size
            st["last"] = None
            if L < n + 1:
                out.append(None)
                continue
            self._index(st, h, L - 1)  # every n-gram ending before the key itself
            b = int(bucket_of(ngram_hashes(h[L - n:], n), self.bits)[0])
            j = int(st["pos"][b])
            if j < 0 or not np.array_equal(h[j - n + 1: j + 1], h[L - n:]):
                out.append(None)
                continue
            cap = int(st["cap"][b]) or r.n_max
            cont = h[j + 1: j + 1 + min(r.n_max, cap)]
            if cont.size == 0:
                out.append(None)
                continue
            st["last"] = (b, int(cont.size))
            out.append(Draft(np.array(cont, dtype=np.int32)))
        return out

    def accept(self, seq: int, n_accepted: int, other: bool = False) -> None:
        st = self._seqs.get(seq)
        if other or st is None or st["last"] is None:
            return
        b, n_drafted = st["last"]
        # all accepted: lift the cap; otherwise cap the key at what was accepted (>= 1 to keep probing)
        st["cap"][b] = 0 if n_accepted >= n_drafted else max(1, n_accepted)
        st["last"] = None


class NgramMod(Proposer):
    """A rolling-hash table shared across sequences: hash(n tokens) -> the token that followed.

    size_bits: log2 of the table size (22 = 4M int32 entries, 16 MiB).
    """

    name = "ngram-mod"
    default_n_max = 16
    default_n_min = 2

    RESET_OCCUPANCY = 0.25
    RESET_ROUNDS = 5
    RESET_ACCEPTANCE = 0.25

    def __init__(self, n: int = 8, size_bits: int = 22):
        if n < 1:
            raise ValueError(f"ngram-mod: key length n must be >= 1, got {n}")
        self.n = n
        self.bits = size_bits
        self.table = np.zeros(1 << size_bits, dtype=np.int32)  # token + 1; 0 = empty
        self.n_used = 0
        self.n_resets = 0
        self._indexed: dict[int, int] = {}     # seq -> positions whose follower is in the table
        self._bad_rounds: dict[int, int] = {}
        self._last: dict[int, int] = {}        # seq -> drafted length of its last draft
        self._pow = pow(int(_P), n - 1, 1 << 64)

    @property
    def occupancy(self) -> float:
        return self.n_used / self.table.size

    def reset(self) -> None:
        """Clear the table; active sequences are indexed again from their start."""
        self.table[:] = 0
        self.n_used = 0
        self.n_resets += 1
        for s in self._indexed:
            self._indexed[s] = 0

    def begin(self, seq: int, prompt) -> None:
        if self.occupancy > self.RESET_OCCUPANCY:
            self.reset()
        self._indexed[seq] = 0
        self._bad_rounds[seq] = 0

    def end(self, seq: int) -> None:
        self._indexed.pop(seq, None)
        self._bad_rounds.pop(seq, None)
        self._last.pop(seq, None)

    def _insert(self, seq: int, h: np.ndarray) -> None:
        """Add (n tokens -> following token) for every follower position not yet indexed."""
        n = self.n
        lo = max(self._indexed.get(seq, 0), n)
        L = h.size
        if L <= lo:
            return
        hs = ngram_hashes(h[lo - n: L - 1], n)  # windows ending just before positions lo..L-1
        idx = bucket_of(hs, self.bits)
        self.n_used += int(np.count_nonzero(self.table[idx] == 0))
        self.table[idx] = h[lo:L].astype(np.int32) + 1
        self._indexed[seq] = L

    def draft(self, requests: list[DraftRequest]) -> list[Draft | None]:
        out: list[Draft | None] = []
        n, bits, P, table = self.n, self.bits, int(_P), self.table
        shift = 64 - bits
        for r in requests:
            h = r.tokens
            self._last.pop(r.seq, None)
            if r.seq not in self._indexed:
                self.begin(r.seq, ())
            self._insert(r.seq, h)
            if h.size < n:
                out.append(None)
                continue
            win = [int(x) + 1 for x in h[h.size - n:]]
            hv = 0
            for x in win:
                hv = (hv * P + x) & _MASK
            toks: list[int] = []
            while len(toks) < r.n_max:
                v = int(table[((hv * _MIX) & _MASK) >> shift])
                if v == 0:
                    break
                toks.append(v - 1)
                # roll the window: drop its first token, append v (= token + 1)
                hv = (((hv - win[0] * self._pow) * P) + v) & _MASK
                win.pop(0)
                win.append(v)
            if not toks or len(toks) < r.n_min:
                out.append(None)
                continue
            self._last[r.seq] = len(toks)
            out.append(Draft(np.array(toks, dtype=np.int32)))
        return out

    def accept(self, seq: int, n_accepted: int, other: bool = False) -> None:
        if other:
            return
        n_drafted = self._last.pop(seq, 0)
        if n_drafted <= 0:
            return
        if n_accepted < self.RESET_ACCEPTANCE * n_drafted:
            self._bad_rounds[seq] = self._bad_rounds.get(seq, 0) + 1
            if self._bad_rounds[seq] >= self.RESET_ROUNDS:
                self._bad_rounds[seq] = 0
                self.reset()
        else:
            self._bad_rounds[seq] = 0
