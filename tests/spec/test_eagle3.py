"""draft-eagle3 (``pyfast/spec/eagle3.py``, ``algorithms.md`` §5) on tiny random heads:

- the head's logits (reduced vocabulary through d2t, and a full-vocabulary head with its own
  embedding, norm before fc and norm before residual) and a chained step match the float64 torch
  reference of scripts/make_eagle3_fixtures.py within 1e-3;
- the converter stores d2t as absolute ids and rejects duplicate / out-of-range tables, a t2d
  that disagrees, and a GGUF whose d2t is bad;
- greedy output with draft-eagle3 (alone, after ngram-simple) equals plain decoding on a llama
  target and the hybrid Qwen3.5 target (recurrent rollback), one and three sequences at once;
- after speculative rounds (partial accepts, rounds won by the n-gram proposer) the head's cache
  equals a catch-up of the whole sequence in one batch (pairing / deferred row / rollback);
- sampling: the head's draft probabilities reach rejection sampling, and the first two emitted
  tokens follow the target's distribution (chi-square).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyfast.llm import LLM
from pyfast.models import Model
from pyfast.spec import SpecConfig
from tests.reference.tiny_gguf import write_tiny_llama
from tests.spec.eagle3_helpers import convert, make_eagle3, write_safetensors

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "eagle3"
TARGET = dict(n_vocab=96, n_embd=64, n_layer=6, n_head=4, n_head_kv=2, n_ff=96)
TARGET_SEED = 11     # scripts/make_eagle3_fixtures.py
N_GEN = 24


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The fixtures' target, both fixture heads converted, and a random head for lossless tests."""
    td = tmp_path_factory.mktemp("eagle3")
    write_tiny_llama(td / "target.gguf", wtype="f32", seed=TARGET_SEED, **TARGET)
    out = {"target": td / "target.gguf"}
    for name in ("reduced", "full"):
        out[name] = convert(FIX / "hf" / name, td / f"{name}.gguf")
    make_eagle3(td / "hf_rand", n_vocab=96, target_n_embd=64, layers=None, n_vocab_draft=48, seed=5, scale=2.0)
    out["rand"] = convert(td / "hf_rand", td / "rand.gguf")
    out["dir"] = td
    return out


def _proposer(head, target_path, **kw):
    from pyfast.spec.eagle3 import Eagle3Proposer

    return Eagle3Proposer(str(head), Model(target_path), n_ctx=128, n_threads=2, **kw)


# --- the head against the torch reference --------------------------------------------------------
@pytest.mark.parametrize("name", ["reduced", "full"])
def test_logits_match_torch_reference(files, name):
    from pyfast._loader import native

    ref = dict(np.load(FIX / f"{name}.npz"))
    p = _proposer(files[name], files["target"], kv_dtype=native.DType.F32)
    assert p.capture_layers == (1, 3, 6)
    logits, z = p.forward(ref["tokens"], ref["positions"], 0, ref["features"], mode="feat")
    assert rel(logits, ref["logits_draft"]) < 1e-3
    assert rel(z, ref["hidden"]) < 1e-3
    full = p.scatter(logits)
    fin = np.isfinite(ref["logits"])
    assert np.array_equal(np.isfinite(full), fin)           # -inf exactly off the d2t rows
    assert rel(full[fin], ref["logits"][fin]) < 1e-3
    step, _ = p.forward([int(ref["step_token"])], [int(ref["step_pos"])], 0, z[-1:], mode="hid")
    assert rel(step[0], ref["step_logits"]) < 1e-3
    if name == "reduced":
        assert p.d2t is not None and p.d2t.size == 40 and logits.shape[1] == 40
        # the argmax of the scattered row is the d2t image of the draft row's argmax
        assert np.array_equal(full.argmax(1), p.d2t[logits.argmax(1)])
    else:
        assert p.d2t is None and logits.shape[1] == 96


def test_catchup_kv_only_rows_equal_full_rows(files):
    """Pairs written by process() (K/V only) give the same next-step logits as full rows."""
    from pyfast._loader import native

    ref = dict(np.load(FIX / "reduced.npz"))
    a = _proposer(files["reduced"], files["target"], kv_dtype=native.DType.F32)
    b = _proposer(files["reduced"], files["target"], kv_dtype=native.DType.F32)
    t, pos, f = ref["tokens"], ref["positions"], ref["features"]
    a.forward(t, pos, 0, f, mode="feat")
    b._ensure()
    b._decode("kv", t.astype(np.int32), pos.astype(np.int32), np.zeros(len(t), np.int32), f)
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    la, _ = a.forward([3], [len(t)], 0, x, mode="hid")
    lb, _ = b.forward([3], [len(t)], 0, x, mode="hid")
    assert rel(lb, la) < 1e-6


# --- the converter and the loader ---------------------------------------------------------------
def test_converter_stores_absolute_d2t(files):
    from pyfast.gguf import GGUFReader
    from pyfast.spec.eagle3 import Eagle3Model

    from pyfast.convert.safetensors import SafetensorsDir

    off = np.load(FIX / "reduced.npz")
    m = Eagle3Model(files["reduced"])

    st = SafetensorsDir(str(FIX / "hf" / "reduced"))
    offsets = np.array(st.raw("d2t"))
    assert np.array_equal(m.d2t, np.arange(40) + offsets)
    assert np.all(np.diff(m.d2t) > 0) and m.d2t.max() < 96 and off["logits"].shape[1] == 96
    md = GGUFReader(str(files["reduced"])).metadata
    assert md["general.architecture"] == "eagle3" and md["eagle3.draft_vocab_size"] == 40
    assert list(md["eagle3.target_layers"]) == [1, 3, 6]


@pytest.mark.parametrize("bad", ["duplicate", "range", "t2d"])
def test_converter_rejects_bad_d2t(tmp_path, bad):
    from pyfast.convert.eagle3 import convert_eagle3

    info = make_eagle3(tmp_path / "hf", n_vocab=96, target_n_embd=64, layers=[1, 3, 6], n_vocab_draft=8, seed=1)
    w = dict(info["weights"])
    absolute = info["d2t"].copy()
    if bad == "duplicate":
        absolute[5] = absolute[2]
    elif bad == "range":
        absolute[7] = 96
    if bad == "t2d":
        w["t2d"] = w["t2d"].copy()
        w["t2d"][int(np.flatnonzero(~w["t2d"])[0])] = True
    else:
        w["d2t"] = absolute - np.arange(8)
    write_safetensors(tmp_path / "hf" / "model.safetensors", w)
    msg = {"duplicate": r"d2t maps draft rows 2 and 5 both to target id", "range": r"draft row 7 to target id 96",
           "t2d": "t2d does not mark"}[bad]
    with pytest.raises(ValueError, match=msg):
        convert_eagle3(tmp_path / "hf", tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_loader_rejects_bad_gguf_d2t(files, tmp_path):
    from pyfast.gguf import GGUFReader
    from pyfast.gguf.writer import GGUFWriter
    from pyfast.spec.eagle3 import Eagle3Model

    r = GGUFReader(str(files["reduced"]))
    for what, edit in {"duplicate": lambda d: d.__setitem__(3, d[1]), "range": lambda d: d.__setitem__(0, 500)}.items():
        w = GGUFWriter(tmp_path / f"{what}.gguf")
        w.copy_metadata(r)
        for name, info in r.tensors.items():
            data = np.array(r.tensor_bytes(name))
            if name == "d2t":
                ids = data.view("<i4").copy()
                edit(ids)
                data = ids
            w.add_tensor(name, info.type, tuple(info.shape), data)
        w.write()
        with pytest.raises(ValueError, match="d2t maps draft row"):
            Eagle3Model(tmp_path / f"{what}.gguf")


def test_bad_settings(files, tmp_path):
    from pyfast.spec.eagle3 import Eagle3Model

    with pytest.raises(ValueError, match="needs its drafter GGUF"):
        SpecConfig(types="eagle3").validate()
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        Eagle3Model(files["target"])
    # a head for another target width / vocabulary
    make_eagle3(tmp_path / "hf", n_vocab=96, target_n_embd=32, layers=[1, 2, 3], d=64, seed=1)
    with pytest.raises(ValueError, match="rows of width 32"):
        LLM(files["target"], n_ctx=128, speculative=SpecConfig(types="eagle3", draft_model=str(
            convert(tmp_path / "hf", tmp_path / "w.gguf"))))
    make_eagle3(tmp_path / "hf2", n_vocab=96, target_n_embd=64, layers=[1, 3, 9], seed=1)
    with pytest.raises(ValueError, match="do not fit the target"):
        LLM(files["target"], n_ctx=128, speculative=SpecConfig(types="eagle3", draft_model=str(
            convert(tmp_path / "hf2", tmp_path / "l.gguf"))))


# --- lossless greedy ---------------------------------------------------------------------------------
def _prompts(V: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    rep = rng.integers(0, V, 5).tolist()
    return [rng.integers(0, V, 14).tolist(), rep * 3 + rep[:2], rng.integers(0, V, 4).tolist()]


def _check_lossless(target, head, types, draft_max, n_prompts=3, n_gen=N_GEN, **llm_kw):
    V = Model(target).n_vocab
    prompts = _prompts(V)[:n_prompts]
    plain = LLM(target, n_ctx=256, n_threads=2, **llm_kw)
    want = [plain.generate(p, max_tokens=n_gen, temperature=0, ignore_eos=True).tokens for p in prompts]
    llm = LLM(target, n_ctx=256, n_threads=2, speculative=SpecConfig(types=types, draft_model=str(head),
                                                                      draft_max=draft_max, ngram_n=1), **llm_kw)
    e = next(p for p in llm._spec.proposers if p.name == "draft-eagle3")
    assert set(e.capture_layers) <= set(llm.ctx.capture_layers)
    for p, w in zip(prompts, want):
        assert llm.generate(p, max_tokens=n_gen, temperature=0, ignore_eos=True).tokens == w, types
    got = llm.generate_batch(prompts, max_tokens=n_gen, temperature=0, ignore_eos=True)
    assert [r.tokens for r in got] == want
    st = llm.spec_stats
    assert st.accepted <= st.drafted and st.by_proposer["draft-eagle3"].drafted > 0
    assert e.n_lost == 0
    return llm, e


@pytest.mark.parametrize("types", ["eagle3", "ngram-simple,eagle3"])
def test_greedy_identical_llama(files, types):
    _check_lossless(files["target"], files["rand"], types, 4)


@pytest.fixture(scope="module")
def hybrid_head(tmp_path_factory):
    from tests.models.test_hybrid_common import fixture

    path, ref = fixture("qwen35")
    m = Model(path)
    td = tmp_path_factory.mktemp("e3h")
    make_eagle3(td / "hf", n_vocab=m.n_vocab, target_n_embd=m.args.n_embd, layers=None, n_vocab_draft=100,
                seed=7, scale=2.0)
    return path, convert(td / "hf", td / "h.gguf")


@pytest.mark.parametrize("types", ["eagle3", "ngram-simple,eagle3"])
def test_greedy_identical_hybrid(hybrid_head, types):
    path, head = hybrid_head
    llm, _ = _check_lossless(path, head, types, 3)
    assert llm.ctx.n_rollback == 3


def test_head_cache_equals_one_batch_catchup(files):
    """After speculative rounds the head's state for a sequence equals a catch-up of the whole
    sequence in one prompt batch: the next draft's step-0 and step-1 logits agree."""
    from pyfast._loader import native
    from pyfast.context import Context
    from pyfast.spec.base import DecodeBatch, DraftRequest

    llm = LLM(files["target"], n_ctx=256, n_threads=2, cache_type_k="f32",
              speculative=SpecConfig(types="ngram-simple,eagle3", draft_model=str(files["rand"]), draft_max=4,
                                     ngram_n=1))
    e = next(p for p in llm._spec.proposers if p.name == "draft-eagle3")
    prompt = _prompts(96)[1]
    res = llm.generate(prompt, max_tokens=N_GEN, temperature=0, ignore_eos=True)
    by = res.spec.by_proposer
    assert by["ngram-simple"].accepted > 0 and by["ngram-simple"].accepted < by["ngram-simple"].drafted
    seq = list(prompt) + res.tokens[:-1]            # in the target's cache; id_last = res.tokens[-1]
    toks = np.asarray(seq + [res.tokens[-1]], dtype=np.int32)
    # the live proposer: its state after the last round (the last token is the next id_last)
    e.trace = []
    e.draft([DraftRequest(0, toks, 2)])
    live = e.trace
    # a fresh proposer and target fed the whole sequence at once
    f = _proposer(files["rand"], files["target"], kv_dtype=native.DType.F32)
    ctx = Context(f.model, n_ctx=256, n_threads=2, kv_dtype=native.DType.F32,
                  capture_layers=tuple(dict.fromkeys(f.capture_layers)))
    f.bind_target(ctx)
    ctx.decode(np.asarray(seq, np.int32), positions=np.arange(len(seq)), seq_ids=0, logits="last")
    f.process(DecodeBatch("prompt", np.zeros(len(seq), np.int32), np.asarray(seq, np.int32),
                          np.arange(len(seq), dtype=np.int32), features=ctx.last_features,
                          feature_layers=ctx.capture_layers))
    f.trace = []
    f.draft([DraftRequest(0, toks, 2)])
    assert len(live) == len(f.trace) >= 1
    for a, b in zip(live, f.trace):
        assert a["pos"].tolist() == b["pos"].tolist() and a["tokens"].tolist() == b["tokens"].tolist()
        assert rel(a["logits"], b["logits"]) < 1e-4


# --- sampling: rejection sampling with the head's probabilities ---------------------------------
def test_sampled_drafts_keep_target_distribution(files):
    from pyfast._loader import native
    from pyfast.context import Context
    from pyfast.sampling import Sampler, SamplingParams
    from pyfast.spec.base import DecodeBatch, DraftRequest
    from pyfast.spec.verify import verify
    from tests.spec.test_distribution import chi2_goodness

    f = _proposer(files["rand"], files["target"], kv_dtype=native.DType.F32)
    ctx = Context(f.model, n_ctx=256, n_threads=2, kv_dtype=native.DType.F32,
                  capture_layers=tuple(dict.fromkeys(f.capture_layers)))
    f.bind_target(ctx)
    prompt = np.asarray(_prompts(96)[0], np.int32)
    id_last = 17
    n = prompt.size
    ctx.decode(prompt, positions=np.arange(n), seq_ids=0, logits="last")
    f.process(DecodeBatch("prompt", np.zeros(n, np.int32), prompt, np.arange(n, dtype=np.int32),
                          features=ctx.last_features, feature_layers=ctx.capture_layers))
    # the target's rows: p0 after id_last, p1[d] after (id_last, d) for every token d
    V = 96
    p1 = np.empty((V, V), np.float32)
    for d in range(V):
        ctx.truncate(0, n)
        rows = ctx.decode([id_last, d], positions=[n, n + 1], seq_ids=0, logits="all")
        p0_row, p1[d] = rows[0], rows[1]
    ctx.truncate(0, n)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=1)
    sp = Sampler(params, V)
    hist = np.concatenate([prompt, [id_last]]).astype(np.int32)
    P0 = sp.probs(p0_row, hist).astype(np.float64)
    N = 3000
    counts: dict = {}
    n_acc = n_q = 0
    # one draft sampler for all rounds (its own RNG stream), one verifier sampler
    req_sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=2), V)
    for i in range(N):
        d = f.draft([DraftRequest(0, hist, 1, sampler=req_sampler)])[0]
        assert d is not None and d.probs is not None and d.probs.shape == (1, V)
        q = d.probs[0]
        assert q[d.tokens[0]] > 0 and np.all(q[np.setdiff1d(np.arange(V), f.d2t)] == 0)  # reduced vocabulary
        n_q += 1
        t0 = int(d.tokens[0])
        res = verify(np.stack([p0_row, p1[t0]]), d.tokens, sp, hist, d.probs)
        t1 = res.tokens[0]
        t2 = res.tokens[1] if len(res.tokens) > 1 else sp.sample(p1[t1], np.append(hist, t1))
        n_acc += res.n_accepted
        counts[(t1, t2)] = counts.get((t1, t2), 0) + 1
    assert 0.01 * N < n_acc < 0.99 * N     # both branches of rejection sampling ran
    expected = {}
    for a in range(V):
        if P0[a] * N < 0.05:
            continue
        pa = sp.probs(p1[a], np.append(hist, a)).astype(np.float64)
        for b in np.flatnonzero(pa * P0[a] * N >= 0.05):
            expected[(a, int(b))] = P0[a] * pa[b] * N
    counts = {k: v for k, v in counts.items() if k in expected} if sum(
        v for k, v in counts.items() if k not in expected) <= 3 else counts
    chi2_goodness(counts, expected, sum(counts.values()), min_bins=10)


# --- a device ------------------------------------------------------------------------------------
def test_greedy_identical_on_vulkan(files):
    import pyfast

    if not any(d["kind"] == "vulkan" for d in pyfast.devices()):
        pytest.skip("no Vulkan device")
    # (lavapipe runs on the CPU: two sequences, a few rounds)
    _check_lossless(files["target"], files["rand"], "eagle3", 3, n_prompts=2, n_gen=10, device="vulkan:0")
