"""DFlash / DSpark block drafters (``pyfast/spec/dflash.py``, ``algorithms.md`` §4) on tiny random
drafters of the three public checkpoint formats, converted with ``pyfast convert --draft``:

- T4.2: slot logits before and after the Markov bias and the confidences equal the float64 numpy
  reference (tests/reference/dflash_numpy.py, which reads the Hugging Face names itself);
- T4.3: three sequences of different n_max in one draft equal three single drafts;
- T4.4: p_min 1 -> empty drafts, p_min 0 -> full blocks; DFlash's top-1 cut;
- T4.5: a d2t table with a duplicate or an out-of-range id is refused (convert and load);
- T4.1 / T4.6: greedy speculation with each kind of drafter (alone and after ngram-simple, one and
  three sequences) equals plain decoding on a llama target and on the hybrid Qwen3.5 target
  (rollback by snapshot planes and by restore + replay), and after every round the drafter's
  cache holds exactly the target's tokens;
- sampling: the drafts' probabilities feed rejection sampling and the emitted tokens follow the
  target's distribution (chi-square).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pyfast._loader import native
from pyfast.context import Context
from pyfast.convert.dflash import convert_draft
from pyfast.models import Model
from pyfast.sampling import Sampler, SamplingParams
from pyfast.spec import SpecConfig
from pyfast.spec.base import DecodeBatch, DraftRequest
from pyfast.spec.decoder import SpecDecoder
from pyfast.spec.dflash import BlockDrafter, BlockDrafterModel
from tests.reference.dflash_numpy import BlockRef
from tests.reference.tiny_gguf import write_tiny_llama
from tests.spec.dflash_helpers import make_hf_drafter

V, D_T, N_LAYER = 96, 64, 4
TOL = 1e-3

# name -> (format, make_hf_drafter keyword arguments)
KINDS = {
    "dflash": ("dflash", dict(target_layers=[0, 2])),
    "dspark": ("deepspec", dict(target_layers=[1, 3], markov_rank=8, conf="hm")),
    "dspark-h": ("deepspec", dict(target_layers=[0, 3], markov_rank=8, conf="h")),
    "dflash-reduced": ("speculators", dict(target_layers=[0, 2], n_vocab_draft=48)),
    "dspark-reduced": ("speculators", dict(target_layers=[0, 2], markov_rank=8, n_vocab_draft=40)),
    "dspark-bonus": ("speculators", dict(target_layers=[2, 3], markov_rank=8, n_vocab_draft=40,
                                         sample_from_anchor=False, conf="h")),
    "dflash-swa": ("dflash", dict(target_layers=[0, 2], swa=(4, [True, False]))),
    "dspark-swa": ("speculators", dict(target_layers=[0, 2], markov_rank=4, swa=(5, [False, True]))),
    "dspark-emb": ("deepspec", dict(target_layers=[-1, 2], markov_rank=4)),   # -1: the embedding output
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("dflash") / "target.gguf"
    write_tiny_llama(path, n_vocab=V, n_embd=D_T, n_layer=N_LAYER, n_head=4, n_head_kv=2, n_ff=96, seed=1,
                     n_ctx=512)
    return Model(path)


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """name -> (HF directory, converted GGUF)."""
    root = tmp_path_factory.mktemp("drafters")
    out = {}
    for i, (name, (fmt, kw)) in enumerate(KINDS.items()):
        hf = make_hf_drafter(root / name, fmt, n_vocab=V, target_n_embd=D_T, n_target_layers=N_LAYER, seed=10 + i,
                             **kw)
        convert_draft(hf, root / f"{name}.gguf")
        out[name] = (hf, root / f"{name}.gguf")
    return out


def _ref(target, hf):
    w = target.weights
    emb = w.f32("token_embd.weight").astype(np.float64)
    head = w.f32("output.weight").astype(np.float64) if "output.weight" in w else emb
    return BlockRef(str(hf), emb, head)


def _prop(target, gguf, **kw) -> BlockDrafter:
    return BlockDrafter(BlockDrafterModel(gguf), target, n_ctx=512, kv_dtype=native.DType.F32, **kw)


def _feed(prop, seq, feats, toks):
    n = feats.shape[0]
    prop.process(DecodeBatch("prompt", np.full(n, seq, np.int32), np.asarray(toks[:n], np.int32),
                             np.arange(n, dtype=np.int32), features=feats, feature_layers=prop.capture_layers))


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


# --- T4.2: the numpy reference --------------------------------------------------------------------
@pytest.mark.parametrize("name", list(KINDS))
def test_logits_match_reference(target, drafters, name):
    hf, gguf = drafters[name]
    ref = _ref(target, hf)
    prop = _prop(target, gguf)
    a = prop.args
    assert a.n_read == ref.n_read and a.is_dspark == (ref.w1 is not None)
    rng = np.random.default_rng(5)
    for n in (9, 1):
        F = rng.standard_normal((n, len(a.target_layers) * D_T)).astype(np.float32)
        toks = rng.integers(0, V, n + 1).astype(np.int32)
        seq = n
        _feed(prop, seq, F, toks)
        prop.trace = []
        d = prop.draft([DraftRequest(seq, toks, 99, 1, 0.0, None)])[0]
        t = prop.trace[0]
        r = ref.forward(F, int(toks[-1]), n)
        base = t.get("base", t["logits"])[:, 0]
        assert _rel(base, r["logits"]) < TOL, "slot logits before the Markov bias"
        assert _rel(t["logits"][:, 0], r["biased"]) < TOL, "slot logits after the Markov bias"
        if r["conf"] is not None:
            got = 1.0 / (1.0 + np.exp(-t["conf"][:, 0].astype(np.float64)))
            assert np.abs(got - r["conf"]).max() < TOL
        assert d is not None and d.tokens.tolist() == r["tokens"].tolist()
        assert prop.cache_len(seq) == n   # the block's scratch rows are gone


def test_markov_bias_matters(target, drafters):
    """The Markov head changes the chain (otherwise the test above proves little)."""
    hf, gguf = drafters["dspark"]
    ref = _ref(target, hf)
    F = np.random.default_rng(1).standard_normal((5, 2 * D_T))
    r = ref.forward(F, 7, 5)
    assert np.abs(r["biased"] - r["logits"]).max() > 0.5
    assert (r["biased"].argmax(-1) != r["logits"].argmax(-1)).any()


# --- T4.3: batching -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dflash", "dspark", "dspark-reduced"])
def test_three_sequences_equal_single_drafts(target, drafters, name):
    _, gguf = drafters[name]
    prop = _prop(target, gguf)
    L = len(prop.args.target_layers)
    rng = np.random.default_rng(7)
    ctxs = []
    for seq, n in ((0, 5), (1, 11), (2, 3)):
        F = rng.standard_normal((n, L * D_T)).astype(np.float32)
        toks = rng.integers(0, V, n + 1).astype(np.int32)
        _feed(prop, seq, F, toks)
        ctxs.append((seq, toks))
    n_max = [1, 3, prop.args.n_read]
    reqs = [DraftRequest(s, t, m, 1, 0.0, None) for (s, t), m in zip(ctxs, n_max)]
    prop.trace = []
    together = prop.draft(reqs)
    batch_logits = prop.trace[0]["logits"]
    for i, r in enumerate(reqs):
        prop.trace = []
        single = prop.draft([dataclasses.replace(r, n_max=prop.args.n_read)])[0]
        assert np.array_equal(prop.trace[0]["logits"][:, 0], batch_logits[:, i]), "batch invariance"
        assert together[i].tokens.tolist() == single.tokens[: n_max[i]].tolist()
        assert len(together[i]) == n_max[i]


# --- T4.4: p_min ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dspark", "dspark-bonus"])
def test_confidence_p_min(target, drafters, name):
    _, gguf = drafters[name]
    prop = _prop(target, gguf)
    F = np.random.default_rng(3).standard_normal((6, len(prop.args.target_layers) * D_T)).astype(np.float32)
    toks = np.arange(10, 17, dtype=np.int32)
    _feed(prop, 0, F, toks)
    prop.trace = []
    full = prop.draft([DraftRequest(0, toks, 99, 1, 0.0, None)])[0]
    assert len(full) == prop.args.n_read
    assert prop.draft([DraftRequest(0, toks, 99, 1, 1.0, None)]) == [None]
    conf = 1.0 / (1.0 + np.exp(-prop.trace[0]["conf"][:, 0].astype(np.float64)))
    for p in sorted(set(np.round(conf, 6).tolist())):
        d = prop.draft([DraftRequest(0, toks, 99, 1, float(p) + 1e-7, None)])[0]
        cut = int(np.argmax(conf < p + 1e-7)) if (conf < p + 1e-7).any() else conf.size
        assert (0 if d is None else len(d)) == cut
        if d is not None:
            assert d.tokens.tolist() == full.tokens[:cut].tolist()


def test_dflash_top1_p_min(target, drafters):
    hf, gguf = drafters["dflash"]
    prop = _prop(target, gguf)
    ref = _ref(target, hf)
    F = np.random.default_rng(4).standard_normal((6, 2 * D_T)).astype(np.float32)
    toks = np.arange(20, 27, dtype=np.int32)
    _feed(prop, 0, F, toks)
    lg = ref.forward(F, int(toks[-1]), 6)["logits"]
    p1 = 1.0 / np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)
    p_min = float(np.sort(p1)[len(p1) // 2])
    d = prop.draft([DraftRequest(0, toks, 99, 1, p_min, None)])[0]
    cut = int(np.argmax(p1 < p_min)) if (p1 < p_min).any() else p1.size
    assert (0 if d is None else len(d)) == cut


# --- T4.5: d2t validation -------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [("dup", "both to target id"), ("range", "outside the target vocabulary")])
def test_bad_d2t_is_refused(tmp_path, bad, match):
    hf = make_hf_drafter(tmp_path / "hf", "speculators", n_vocab=V, target_n_embd=D_T, target_layers=[0, 2],
                         n_target_layers=N_LAYER, markov_rank=4, n_vocab_draft=40, bad_d2t=bad)
    with pytest.raises(ValueError, match=match):
        convert_draft(hf, tmp_path / "x.gguf")


@pytest.mark.parametrize("bad, match", [("dup", "both to target id"), ("range", "outside the target vocabulary")])
def test_bad_d2t_is_refused_at_load(tmp_path, drafters, bad, match):
    from pyfast.gguf import GGUFReader
    from pyfast.gguf.writer import GGUFWriter

    src = GGUFReader(str(drafters["dspark-reduced"][1]))
    w = GGUFWriter(tmp_path / "bad.gguf")
    w.copy_metadata(src)
    for name, info in src.tensors.items():
        data = np.array(src.tensor_bytes(name))
        if name == "d2t":
            t = data.view(np.int32).copy()
            if bad == "dup":
                t[5] = t[4]
            else:
                t[0] = V
            data = t.view(np.uint8)
        w.add_tensor(name, info.type, list(info.shape), data)
    w.write()
    with pytest.raises(ValueError, match=match):
        BlockDrafterModel(tmp_path / "bad.gguf")


# --- T4.1 / T4.6: lossless greedy speculation -----------------------------------------------------
def _oracle_markov(tmp_path, target, n_ctx=64, fmt="deepspec", strength=30.0, trajectories=(), **kw):
    """A DSpark drafter whose Markov head predicts, after each token, the token that most often
    follows it in the target's greedy `trajectories` (else the target's greedy token after that
    single token): drafts are often accepted, fully and partly."""
    ctx = Context(target, n_ctx=n_ctx, n_threads=2)
    V = target.n_vocab
    nxt = np.zeros(V, dtype=np.int64)
    for t in range(V):
        ctx.clear()
        nxt[t] = int(np.argmax(ctx.decode([t], logits="last")[-1]))
    counts = np.zeros((V, V), dtype=np.int64)
    for seq in trajectories:
        for a, b in zip(seq[:-1], seq[1:]):
            counts[a, b] += 1
    seen = counts.sum(1) > 0
    nxt[seen] = counts[seen].argmax(1)
    n_layer = target.args.n_layer
    kw = dict(dict(target_layers=[1, n_layer - 1], markov_rank=V, conf="hm"), **kw)
    hf = make_hf_drafter(tmp_path / "oracle", fmt, n_vocab=V, target_n_embd=target.args.n_embd,
                         n_target_layers=n_layer, seed=3, scale=0.1, **kw)
    from tests.reference.dflash_numpy import load_safetensors
    from tests.spec.dflash_helpers import write_safetensors

    w = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in load_safetensors(str(hf)).items()}
    w["markov_head.markov_w1.weight"] = np.eye(V, dtype=np.float32)
    w2 = np.zeros((V, V), dtype=np.float32)
    w2[nxt, np.arange(V)] = strength
    w["markov_head.markov_w2.weight"] = w2
    w["confidence_head.proj.weight"][:] = 0.0
    w["confidence_head.proj.bias"][:] = 4.0
    write_safetensors(hf / "model.safetensors", w)
    convert_draft(hf, tmp_path / f"oracle{strength:g}.gguf")
    return tmp_path / f"oracle{strength:g}.gguf"


def _run(model, prompts, n_gen, proposers=(), cfg=None, capture=(), n_rollback=0, check=None, sampler=None,
         device=None, hook=None):
    """Greedy (or `sampler`) generation of every prompt in one SpecDecoder (all sequences batched);
    check(decoder, slots) runs after every round; hook(ctx) before the first decode."""
    ctx = Context(model, n_ctx=512, n_threads=2, capture_layers=capture, n_rollback=n_rollback, n_seq_max=4,
                  device=device)
    if hook is not None:
        hook(ctx)
    dec = SpecDecoder(ctx, list(proposers), cfg or SpecConfig())
    slots = [dec.add(i, p, sampler() if sampler else Sampler(SamplingParams(temperature=0), model.n_vocab))
             for i, p in enumerate(prompts)]
    logits = dec.prefill(slots)
    for s, lg in zip(slots, logits):
        dec.start(s, lg)
    while any(s.n - s.n_prompt < n_gen for s in slots):
        live = [s for s in slots if s.n - s.n_prompt < n_gen]
        for s in live:
            s.n_remaining = n_gen - (s.n - s.n_prompt)
        dec.step(live)
        if check is not None:
            check(dec, slots)
    return [s.generated[:n_gen] for s in slots], dec


PROMPTS = [[5, 9, 13, 2, 77, 31, 8], [40, 41, 42, 43, 40, 41, 42, 43, 40, 41], [3]]
N_GEN = 24


@pytest.fixture(scope="module")
def plain(target):
    return _run(target, PROMPTS, N_GEN)[0]


@pytest.fixture(scope="module")
def oracle(target, plain, tmp_path_factory):
    return _oracle_markov(tmp_path_factory.mktemp("oracle"), target,
                          trajectories=[p + g for p, g in zip(PROMPTS, plain)])


def _cache_check(prop):
    def check(dec, slots):
        for s in slots:
            assert prop.cache_len(s.seq) == s.n - 1, "drafter cache length != target length"
    return check


@pytest.mark.parametrize("name", list(KINDS) + ["oracle"])
def test_greedy_identical_llama(target, drafters, plain, oracle, name):
    gguf = oracle if name == "oracle" else drafters[name][1]
    for types in ("block", "ngram,block"):
        for batched in (True, False):
            prop = BlockDrafter(BlockDrafterModel(gguf), target, n_ctx=512)
            props = [prop]
            if types.startswith("ngram"):
                from pyfast.spec.ngram import NgramSimple

                props = [NgramSimple(n=2), prop]
            runs = [PROMPTS] if batched else [[p] for p in PROMPTS]
            got = []
            stats = None
            for ps in runs:
                out, dec = _run(target, ps, N_GEN, props, SpecConfig(draft_max=prop.args.n_read),
                                prop.capture_layers, check=_cache_check(prop))
                got += out
                stats = dec.stats
            assert got == plain, f"{name} {types} batched={batched}: differs from plain decoding"
            assert stats.drafted > 0
            if name == "oracle" and types == "block" and batched:  # drafts accepted whole and in part
                assert stats.accepted > 0.1 * stats.drafted
                assert stats.bonus > 0 and stats.pos_accepted[0] > stats.bonus


@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.parametrize("n_rollback", [5, 2])
def test_greedy_identical_hybrid(tmp_path, n_rollback, oracle):
    """Hybrid Qwen3.5 target (GDN + attention): rollback by snapshot planes (5) and by save /
    restore + replay (2, drafts up to 5)."""
    from tests.models.test_hybrid_common import fixture

    path, _ = fixture("qwen35")
    model = Model(path)
    a = model.args
    hf = make_hf_drafter(tmp_path / "hf", "deepspec", n_vocab=model.n_vocab, target_n_embd=a.n_embd,
                         target_layers=[0, a.n_layer - 1], n_target_layers=a.n_layer, markov_rank=8, block=6,
                         seed=5)
    convert_draft(hf, tmp_path / "d.gguf")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, model.n_vocab, 12).tolist(), [7, 8, 9, 7, 8, 9, 7, 8], [4]]
    want = _run(model, prompts, 16)[0]
    gguf = tmp_path / "d.gguf"
    if oracle:
        gguf = _oracle_markov(tmp_path, model, block=6, trajectories=[p + g for p, g in zip(prompts, want)])
    prop = BlockDrafter(BlockDrafterModel(gguf), model, n_ctx=512)
    from pyfast.spec.ngram import NgramSimple

    restored = []

    def hook(ctx):
        orig = ctx.restore_state
        ctx.restore_state = lambda *a, **k: (restored.append(1), orig(*a, **k))[1]

    got, dec = _run(model, prompts, 16, [NgramSimple(n=1), prop], SpecConfig(draft_max=5), prop.capture_layers,
                    n_rollback=n_rollback, check=_cache_check(prop), hook=hook)
    assert got == want
    assert dec.stats.drafted > 0 and dec.stats.by_proposer["draft-dspark"].drafted > 0
    assert (len(restored) > 0) == (n_rollback < 5), "restore + replay exactly when drafts exceed the rollback"
    if oracle:
        st = dec.stats.by_proposer["draft-dspark"]
        assert 0 < st.accepted < st.drafted


# --- sampling -------------------------------------------------------------------------------------
def test_sampling_follows_target_distribution(target, tmp_path):
    """Two emitted tokens (t1, t2) after a fixed context, verified by rejection sampling against the
    DSpark drafter's q (its sampled drafts and their distributions), follow the target's p0 * p1."""
    from pyfast.spec.verify import verify
    from tests.spec.test_distribution import chi2_goodness

    params = SamplingParams(temperature=1.0, top_k=12, top_p=1.0, min_p=0.0, seed=5)
    soft = _oracle_markov(tmp_path, target, strength=2.0)   # overlapping the target, not equal to it
    prop = BlockDrafter(BlockDrafterModel(soft), target, n_ctx=512)
    ctx = Context(target, n_ctx=128, n_threads=2, capture_layers=prop.capture_layers)
    prompt = np.array([5, 9, 13, 2, 77, 31, 8], dtype=np.int32)
    ctx.decode(prompt, logits="last")
    _feed(prop, 0, np.asarray(ctx.last_features), prompt)
    t0 = 44
    history = np.append(prompt, t0).astype(np.int32)
    # the draft's distributions: one draft call with a sampling target gives q for slots 0 and 1
    s = Sampler(params, V)
    d = prop.draft([DraftRequest(0, history, 2, 1, 0.0, s)])[0]
    assert d.probs is not None and d.probs.shape == (len(d), V)
    q0, q1 = (np.asarray(q, np.float64) / np.sum(q, dtype=np.float64) for q in d.probs[:2])
    # the proposer draws its tokens from q: a few hundred draws of d1
    draws = {}
    for i in range(300):
        si = Sampler(dataclasses.replace(params, seed=100 + i), V)
        t = int(prop.draft([DraftRequest(0, history, 1, 1, 0.0, si)])[0].tokens[0])
        draws[t] = draws.get(t, 0) + 1
    chi2_goodness(draws, {t: 300 * float(q0[t]) for t in range(V) if q0[t] > 0}, 300, 2)
    # target rows: after the context + t0, and after each possible t1
    ctx.clear()
    rows0 = ctx.decode(history, logits="last")[-1]
    p0 = s.probs(rows0)
    p1 = {}
    for t1 in np.flatnonzero(p0):
        ctx.truncate(0, history.size)
        p1[int(t1)] = ctx.decode([int(t1)], positions=[history.size], seq_ids=0)[-1]
    assert 0.05 < np.minimum(p0, q0).sum() < 0.99
    target_s = Sampler(params, V)
    rng = np.random.default_rng(9)
    N = 20000
    counts: dict = {}
    P1 = {t: target_s.probs(r) for t, r in p1.items()}
    for _ in range(N):
        d1 = int(rng.choice(V, p=q0))
        d2 = int(rng.choice(V, p=q1))
        row1 = p1.get(d1)
        if row1 is None:   # d1 outside the target's kept set: it is rejected at row 0 anyway
            row1 = rows0
        rows = np.stack([rows0, row1, row1])
        res = verify(rows, np.array([d1, d2]), target_s, history, np.stack([q0, q1]))
        toks = res.tokens
        if len(toks) == 1:
            toks = toks + [target_s.sample_from_probs(P1[toks[0]])]
        key = (toks[0], toks[1])
        counts[key] = counts.get(key, 0) + 1
    expected = {(a, b): N * float(p0[a]) * float(P1[a][b]) for a in P1 for b in np.flatnonzero(P1[a])}
    chi2_goodness(counts, expected, N, 10)


def test_sampling_run_is_exact_length(target, oracle):
    """A sampling run with the drafter goes through rejection sampling (drafts carry q)."""
    prop = BlockDrafter(BlockDrafterModel(oracle), target, n_ctx=512)
    out, dec = _run(target, PROMPTS, 16, [prop], SpecConfig(draft_max=4), prop.capture_layers,
                    sampler=lambda: Sampler(SamplingParams(temperature=0.3, seed=3), V))
    assert all(len(o) == 16 for o in out)
    assert dec.stats.drafted > 0 and dec.stats.accepted > 0


# --- converter ------------------------------------------------------------------------------------
SFA = {"dflash": False, "dspark": True, "dspark-h": True, "dflash-reduced": False, "dspark-reduced": True,
       "dspark-bonus": False, "dflash-swa": False, "dspark-swa": True, "dspark-emb": True}


@pytest.mark.parametrize("name", list(KINDS))
def test_converted_metadata(target, drafters, name):
    """Block layout by format (z-lab DFlash: bonus-anchor; DeepSpec: anchor-first; speculators:
    sample_from_anchor, default by dflash / dspark), the target layers ("output of layer" ids; the
    speculators file's aux ids minus one), the reduced vocabulary as absolute ids."""
    from tests.reference.dflash_numpy import load_safetensors

    hf, gguf = drafters[name]
    m = BlockDrafterModel(gguf)
    a = m.args
    assert a.sample_from_anchor == SFA[name]
    assert list(a.target_layers) == KINDS[name][1]["target_layers"]
    assert a.capture_ids == tuple(x + 1 for x in a.target_layers)
    assert a.block_size == 6 and a.mask_token_id == 1 and a.n_vocab == V
    w = load_safetensors(str(hf))
    if "d2t" in w:
        assert m.d2t.tolist() == (np.arange(w["d2t"].size) + w["d2t"]).tolist()
        assert a.n_vocab_draft == w["d2t"].size < V
    else:
        assert m.d2t is None and a.n_vocab_draft == V
    assert a.own_embd == (KINDS[name][0] == "deepspec")


def test_cli_convert_draft(tmp_path, target):
    from pyfast.cli import main

    hf = make_hf_drafter(tmp_path / "hf", "speculators", n_vocab=V, target_n_embd=D_T, target_layers=[0, 2],
                         n_target_layers=N_LAYER, markov_rank=4, n_vocab_draft=40)
    out = tmp_path / "d.gguf"
    assert main(["convert", "--draft", str(hf), str(out), "--outtype", "f16", "-q"]) == 0
    m = BlockDrafterModel(out)
    assert m.args.is_dspark and m.weights.dtype("blk.0.attn_q.weight") == native.DType.F16
    assert m.weights.dtype("conf_proj.weight") == native.DType.F32


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(markov_head_type="gated"), "markov_head_type 'gated'"),
    (lambda c: c.pop("mask_token_id"), "mask_token_id is missing"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[1, 1]), "repeat a layer"),
    (lambda c: c["transformer_layer_config"].update(attention_bias=True), "attention_bias"),
    (lambda c: c.pop("speculators_model_type"), "not a drafter checkpoint"),
])
def test_convert_refuses(tmp_path, edit, match):
    import json

    from pyfast.convert import convert_draft as convert_any

    hf = make_hf_drafter(tmp_path / "hf", "speculators", n_vocab=V, target_n_embd=D_T, target_layers=[0, 2],
                         n_target_layers=N_LAYER, markov_rank=4)
    cfg = json.loads((hf / "config.json").read_text())
    edit(cfg)
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        convert_any(hf, tmp_path / "x.gguf")


def test_drafter_target_mismatch_is_named(tmp_path, drafters):
    other = tmp_path / "other.gguf"
    write_tiny_llama(other, n_vocab=V + 8, n_embd=D_T, n_layer=N_LAYER, n_head=4, n_head_kv=2, n_ff=96)
    with pytest.raises(ValueError, match="vocabulary of 96 tokens"):
        BlockDrafter(BlockDrafterModel(drafters["dflash"][1]), Model(other), n_ctx=64)
    short = tmp_path / "short.gguf"
    write_tiny_llama(short, n_vocab=V, n_embd=D_T, n_layer=2, n_head=4, n_head_kv=2, n_ff=96)
    with pytest.raises(ValueError, match="target_layers"):
        BlockDrafter(BlockDrafterModel(drafters["dspark"][1]), Model(short), n_ctx=64)
    with pytest.raises(ValueError, match="Markov head"):
        BlockDrafter(BlockDrafterModel(drafters["dflash"][1]), Model(short), n_ctx=64, require_dspark=True)


# --- LLM / CLI ------------------------------------------------------------------------------------
def test_llm_spec_types(tmp_path):
    """LLM(speculative=SpecConfig(types=..., draft_model=drafter.gguf)) on the hybrid Qwen3.5 target:
    draft-dspark, dflash (alias; auto-detects the DSpark file), ngram-simple before it, several
    prompts in one batch, p_min 1 (no drafts): greedy output equal to plain decoding."""
    from pyfast.llm import LLM
    from tests.models.test_hybrid_common import fixture

    path, _ = fixture("qwen35")
    m = Model(path)
    a = m.args
    hf = make_hf_drafter(tmp_path / "hf", "deepspec", n_vocab=m.n_vocab, target_n_embd=a.n_embd,
                         target_layers=[0, a.n_layer - 1], n_target_layers=a.n_layer, markov_rank=8, block=6)
    convert_draft(hf, tmp_path / "ds.gguf")
    prompts = [[5, 9, 13, 2, 77, 31, 8], [3, 4], [100] * 5]
    base = LLM(path, n_ctx=256, n_threads=2)
    want = [base.generate(p, max_tokens=12, temperature=0, ignore_eos=True).tokens for p in prompts]
    for types, p_min in (("draft-dspark", 0.0), ("ngram-simple,dflash", 0.0), ("dspark", 1.0)):
        cfg = SpecConfig(types=types, draft_model=str(tmp_path / "ds.gguf"), draft_max=4, draft_p_min=p_min)
        llm = LLM(path, n_ctx=256, n_threads=2, speculative=cfg)
        got = [llm.generate(p, max_tokens=12, temperature=0, ignore_eos=True) for p in prompts]
        assert [r.tokens for r in got] == want, types
        drafted = sum(r.spec.by_proposer.get("draft-dspark").drafted for r in got
                      if "draft-dspark" in r.spec.by_proposer)
        assert (drafted == 0) == (p_min == 1.0)
        outs = llm.generate_batch(prompts, max_tokens=12, temperature=0, ignore_eos=True)
        assert [o.tokens for o in outs] == want


def test_cli_generate_with_drafter(tmp_path, capsys):
    from pyfast.cli import main
    from tests.models.test_hybrid_common import fixture

    path, _ = fixture("qwen35")
    m = Model(path)
    hf = make_hf_drafter(tmp_path / "hf", "dflash", n_vocab=m.n_vocab, target_n_embd=m.args.n_embd,
                         target_layers=[1, 2], n_target_layers=m.args.n_layer, block=4)
    assert main(["convert", "--draft", str(hf), str(tmp_path / "d.gguf"), "-q"]) == 0
    assert main(["generate", "-m", str(path), "-md", str(tmp_path / "d.gguf"), "--spec-type", "draft-dflash",
                 "-p", "hello world", "-n", "8", "--temp", "0", "-t", "2"]) == 0
    cap = capsys.readouterr()
    assert "by proposer: draft-dflash" in cap.out + cap.err
