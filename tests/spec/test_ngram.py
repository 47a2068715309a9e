"""N-gram proposers on crafted token histories: matches, boundaries, caps, sharing and resets."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast.spec.base import DraftRequest
from pyfast.spec.ngram import NgramMapK, NgramMod, NgramSimple, bucket_of, ngram_hashes


def req(tokens, n_max=16, seq=0, n_min=1):
    return DraftRequest(seq=seq, tokens=np.asarray(tokens, dtype=np.int32), n_max=n_max, n_min=n_min)


def draft1(p, tokens, **kw):
    d = p.draft([req(tokens, **kw)])[0]
    return None if d is None else d.tokens.tolist()


# --- ngram-simple ---------------------------------------------------------------------------

def test_simple_copies_after_most_recent_occurrence():
    p = NgramSimple(n=3, grow=False)
    h = [1, 2, 3, 10, 11, 7, 1, 2, 3, 20, 21, 22, 9, 1, 2, 3]
    assert draft1(p, h) == [20, 21, 22, 9, 1, 2, 3]   # the later of the two occurrences
    assert draft1(p, h, n_max=2) == [20, 21]


def test_simple_prefers_an_older_occurrence_that_agrees_for_longer():
    """A more recent occurrence of the key that agrees with the sequence for fewer than
    long_match tokens gives way to an older one that agrees for more; among occurrences that both
    reach long_match, the most recent wins."""
    p = NgramSimple(n=3, grow=False)
    assert p.long_match == 6
    text = list(range(100, 130))
    decoy = [50] + text[5:8] + [99, 98]          # the key text[5:8] again, after a different token
    h = text + decoy + [1] + text[:8]             # the sequence copies text: 8 tokens in step
    assert draft1(p, h) == text[8:24]
    d = p.draft([req(h)])[0]
    assert d.kind == ""                           # a long match
    # a decoy in step for 8 tokens as well: the most recent occurrence is taken again
    decoy = text[:8] + [99, 98]
    assert draft1(p, text + decoy + [1] + text[:8]) == [99, 98, 1] + text[:8]
    # agreement below long_match on both sides: the longer one still wins ("short" kind)
    h = text + [50] + text[5:8] + [99] + [1] + text[3:8]
    d = p.draft([req(h)])[0]
    assert d.tokens.tolist()[:3] == text[8:11] and d.kind == "short"


def test_best_match_native_equals_numpy_and_brute_force():
    """The native source choice equals the numpy version and a plain loop on short random token
    strings over small alphabets (many occurrences of each key)."""
    from pyfast.spec.ngram import _find_best_match, _find_best_match_np

    rng = np.random.default_rng(13)
    for trial in range(400):
        L = int(rng.integers(1, 60))
        h = rng.integers(0, int(rng.integers(2, 5)), size=L).astype(np.int32)
        for n, cap, limit in ((1, 1, 64), (2, 4, 8), (3, 6, 64), (4, 6, 6), (3, 40, 64)):
            want, want_len, best_key = -1, 0, -1
            for j in range(L - 2, n - 2, -1):
                if j - n + 1 < 0 or list(h[j - n + 1:j + 1]) != list(h[L - n:]):
                    continue
                m = 0
                while m < min(limit, j + 1) and h[j - m] == h[L - 1 - m]:
                    m += 1
                if min(m, cap) > best_key:
                    want, want_len, best_key = j, m, min(m, cap)
            if L < n + 1:
                want, want_len = -1, 0
            assert _find_best_match(h, n, cap, limit) == (want, want_len), (h.tolist(), n, cap, limit)
            assert _find_best_match_np(h, n, cap, limit) == (want, want_len), (h.tolist(), n, cap, limit)
            assert _find_best_match_np(h.astype(np.int64), n, cap, limit) == (want, want_len)
    with pytest.raises(ValueError, match="cap"):
        _find_best_match(np.zeros(8, np.int32), 4, 3, 64)


def test_simple_boundaries():
    p = NgramSimple(n=3, n_local=0, grow=False)
    assert draft1(p, [1, 2, 3]) is None                   # the key itself is the whole history
    assert draft1(p, [1, 2, 3, 1, 2, 3]) == [1, 2, 3]     # overlapping copy (periodic text)
    assert draft1(p, [5, 1, 2, 3, 4, 2, 3]) is None       # only 2 of 3 key tokens occur earlier
    assert draft1(p, [1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2, 3]
    assert draft1(p, [7, 7]) is None


def test_simple_draft_length_grows_with_match_length():
    p = NgramSimple(n=3, n_max_local=2, grow=True)
    text = list(range(100, 140))
    # 3 tokens of the text repeated: a short match, short draft
    assert len(draft1(p, text + [1] + text[:3])) == 3
    # 12 tokens in step with the text: a draft of 12
    assert len(draft1(p, text + [1] + text[:12])) == 12
    assert len(draft1(p, text + [1] + text[:30])) == 16   # capped by n_max


def test_simple_resyncs_near_anchor_after_a_deviation():
    p = NgramSimple(n=4, n_local=1, n_max_local=4, grow=False)
    src = list(range(100, 130))
    h = src + [1] + src[:10]
    d = p.draft([req(h)])[0]
    assert d.tokens.tolist() == src[10:26]
    p.accept(0, 5)                        # 5 accepted, then the model wrote 77 instead of src[15]
    h = h + src[10:15] + [77]
    assert draft1(p, h) is None           # the key [.., 77] occurs nowhere, 77 is not near the anchor
    # the model goes on with src[16]: its one-token key is found at the anchor, copy resumes
    h = h + [src[16]]
    d = p.draft([req(h)])[0]
    assert d is not None and d.kind == "local" and d.tokens.tolist() == src[17:21]
    # without the anchor (n_local=0) nothing is drafted
    q = NgramSimple(n=4, n_local=0, grow=False)
    assert draft1(q, h) is None


# --- ngram-map-k ------------------------------------------------------------------------------

def test_simple_fallback_uses_shorter_keys_only_when_enabled():
    # the last 4 tokens (5 6 7 8) occur nowhere earlier, nor do 6 7 8; 7 8 does (then 30 31 32)
    h = [7, 8, 30, 31, 32, 1, 2, 3, 5, 6, 7, 8]
    assert draft1(NgramSimple(n=4, n_local=0), h) is None
    p = NgramSimple(n=4, n_local=0, n_fallback=2, n_max_fallback=2)
    d = p.draft([req(h)])[0]
    assert d.tokens.tolist() == [30, 31] and d.kind == "fallback"
    # the longest shorter key wins: 6 7 8 occurs too once added, with a different continuation
    h2 = [7, 8, 30, 31, 6, 7, 8, 40, 41, 42, 5, 6, 7, 8]
    assert draft1(p, h2) == [40, 41]
    # a full-key match is never replaced by a fallback
    h3 = [5, 6, 7, 8, 50, 51, 7, 8, 60, 5, 6, 7, 8]
    assert draft1(p, h3)[:2] == [50, 51]
    assert draft1(p, [1, 2, 3, 4, 5]) is None  # nothing repeats at all


def test_adaptive_config_turns_fallback_on():
    from pyfast.spec.config import SpecConfig, make_proposers

    (plain,) = make_proposers(SpecConfig(types=["ngram-simple"]), None, 512)
    (adaptive,) = make_proposers(SpecConfig(types=["ngram-simple"], adaptive=True), None, 512)
    assert plain.n_fallback == 0 and adaptive.n_fallback == 2
    assert "fallback" in adaptive.kind_priors


def test_map_k_matches_and_caps_by_last_accepted_length():
    p = NgramMapK(n=3)
    p.begin(0, [])
    h = [1, 2, 3, 10, 11, 12, 13, 14, 5, 1, 2, 3]
    assert draft1(p, h) == [10, 11, 12, 13, 14, 5, 1, 2, 3]
    p.accept(0, 2)                               # 2 of 9 accepted: this key is capped at 2
    assert draft1(p, h) == [10, 11]
    p.accept(0, 2)                               # all (2) accepted: the cap is lifted
    assert draft1(p, h) == [10, 11, 12, 13, 14, 5, 1, 2, 3]
    p.accept(0, 0)                               # none accepted: keep probing with one token
    assert draft1(p, h) == [10]
    p.accept(0, 5, other=True)                   # another proposer's round changes nothing
    assert draft1(p, h) == [10]


def test_map_k_boundaries_and_collisions():
    p = NgramMapK(n=3, bits=1)                   # 2 buckets: collisions everywhere
    p.begin(0, [])
    assert draft1(p, [1, 2, 3]) is None
    assert draft1(p, [4, 5, 6, 7, 8, 9, 1, 2, 3]) is None   # a colliding bucket is checked, not trusted
    q = NgramMapK(n=3)
    q.begin(0, [])
    assert draft1(q, [1, 2, 3, 1, 2, 3]) == [1, 2, 3]


def test_map_k_indexes_incrementally():
    p = NgramMapK(n=2)
    p.begin(0, [])
    h = [1, 2, 3, 4]
    assert draft1(p, h) is None
    h += [1, 2]
    assert draft1(p, h) == [3, 4, 1, 2]
    h += [9, 3, 4]
    assert draft1(p, h) == [1, 2, 9, 3, 4]       # after the only earlier (3, 4)
    h += [7, 1, 2]
    assert draft1(p, h) == [9, 3, 4, 7, 1, 2]    # (1, 2) now last seen before 9


# --- ngram-mod --------------------------------------------------------------------------------

def test_mod_chains_lookups_and_respects_n_min():
    p = NgramMod(n=2, size_bits=16)
    p.begin(0, [])
    h = [1, 2, 3, 4, 5, 6, 1, 2]
    assert draft1(p, h, n_max=3) == [3, 4, 5]
    assert draft1(p, h, n_max=10) == [3, 4, 5, 6, 1, 2, 3, 4, 5, 6]  # chains through its own output
    assert draft1(p, [8, 9, 8, 9, 7, 1], n_max=4, seq=1) is None      # (7, 1) unseen
    # sequence 2 reaches what sequence 3 indexed; the chain ends at (13, 14), whose follower is unknown
    draft1(p, [11, 12, 13, 14], seq=3)
    assert draft1(p, [9, 11, 12], seq=2, n_max=8) == [13, 14]
    assert draft1(p, [9, 11, 12], seq=2, n_max=8, n_min=3) is None


def test_mod_table_is_shared_across_sequences():
    p = NgramMod(n=3, size_bits=16)
    p.begin(0, [])
    p.begin(1, [])
    assert draft1(p, [1, 2, 3, 4, 5, 6, 7], seq=0) is None
    # sequence 1 never saw (4, 5, 6) followed by 7, sequence 0 did
    assert draft1(p, [9, 9, 4, 5, 6], seq=1, n_max=1) == [7]


def test_mod_resets_when_full_at_begin_and_after_bad_rounds():
    p = NgramMod(n=2, size_bits=4)               # 16 entries
    p.begin(0, [])
    draft1(p, list(range(1, 12)))
    assert p.occupancy > 0.25
    p.begin(1, [])
    assert p.n_resets == 1 and p.n_used == 0
    q = NgramMod(n=2, size_bits=16)
    q.begin(0, [])
    h = [1, 2, 3, 4, 5, 1, 2]
    for _ in range(NgramMod.RESET_ROUNDS):
        assert draft1(q, h, n_max=4) is not None
        assert q.n_resets == 0
        q.accept(0, 0)
    assert q.n_resets == 1
    assert draft1(q, h, n_max=4) == [3, 4, 5, 1]  # the active sequence is indexed again


def test_hash_helpers_agree_with_rolling_hash():
    toks = np.array([5, 9, 1, 0, 44, 7], dtype=np.int32)
    hs = ngram_hashes(toks, 3)
    assert hs.size == 4
    again = ngram_hashes(toks[2:5], 3)
    assert again[0] == hs[2]
    b = bucket_of(hs, 10)
    assert b.min() >= 0 and b.max() < 1024


@pytest.mark.parametrize("cls", [NgramSimple, NgramMapK, NgramMod])
def test_bad_key_length(cls):
    with pytest.raises(ValueError, match="key length"):
        cls(n=0)


def test_last_match_native_equals_numpy_and_brute_force():
    """The native prompt-lookup scan finds the same occurrence as the numpy version and a plain
    loop, on short random token strings over small alphabets (many repeats)."""
    from pyfast.spec.ngram import _find_last_match, _find_last_match_np

    rng = np.random.default_rng(7)
    for trial in range(400):
        L = int(rng.integers(1, 60))
        h = rng.integers(0, int(rng.integers(2, 6)), size=L).astype(np.int32)
        for n in (1, 2, 3, 4, 6):
            want = -1
            for j in range(L - 2, n - 2, -1):
                if j - n + 1 >= 0 and list(h[j - n + 1:j + 1]) == list(h[L - n:]):
                    want = j
                    break
            if L < n + 1:
                want = -1
            assert _find_last_match(h, n) == want, (h.tolist(), n)
            assert _find_last_match_np(h, n) == want, (h.tolist(), n)
            assert _find_last_match_np(h.astype(np.int64), n) == want


def test_resync_search_and_match_length_native_equal_python():
    """The native re-sync search and suffix-match length give the Python versions' answers on
    random short token strings (small alphabets, so keys recur near the expected position)."""
    from pyfast.spec import ngram as NG

    rng = np.random.default_rng(11)
    for trial in range(500):
        L = int(rng.integers(2, 50))
        h = rng.integers(0, int(rng.integers(2, 5)), size=L).astype(np.int32)
        for n in (2, 3, 4, 5):
            if L < n + 1:  # an anchor exists only after a match, so the history is longer than the key
                continue
            for n_local in range(1, n):
                expect = int(rng.integers(-2, L + 3))
                assert NG.native.ngram_local_match(h, n, n_local, expect) == NG._local_search(h, n, n_local, expect), \
                    (h.tolist(), n, n_local, expect)
        for j in range(L):
            for limit in (1, 4, 64):
                want = NG._match_length(h.astype(np.int64), j, limit)
                assert NG._match_length(h, j, limit) == want, (h.tolist(), j, limit)
