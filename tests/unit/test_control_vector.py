"""Control vectors (llama.cpp's --control-vector): the file format and how files sum, which layers
they reach, logits against the numpy reference, llama.cpp's perplexity figures on SmolLM2, and
clear errors for bad files and settings."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast._loader import native
from pyfast.context import Context
from pyfast.control_vector import ControlVector, parse_scaled
from pyfast.gguf.writer import GGUFWriter
from pyfast.models import Model
from tests.reference.llama_numpy import LlamaRef
from tests.reference.tiny_gguf import write_tiny_llama

F32, F16 = 0, 1
N_EMBD = 64


def write_cv(path, tensors: dict, dtype: int = F32):
    """A control-vector GGUF with the given tensors, written without pyfast's ControlVector."""
    w = GGUFWriter(path)
    w.add("general.architecture", "controlvector")
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=np.float16 if dtype == F16 else np.float32)
        w.add_tensor(name, dtype, arr.shape, arr)
    w.write()
    return path


def vec(seed: int, n: int = N_EMBD, scale: float = 1.0) -> np.ndarray:
    return (scale * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


# --------------------------------------------------------------------------------------------
# the file format
# --------------------------------------------------------------------------------------------

def test_files_sum_scaled_by_layer(tmp_path):
    v1, v3, u1, u2 = vec(1), vec(3), vec(11), vec(12)
    a = write_cv(tmp_path / "a.gguf", {"direction.1": v1, "direction.3": v3})
    b = write_cv(tmp_path / "b.gguf", {"direction.2": u2, "direction.1": u1})
    cv = ControlVector.combine([(a, 2.0), (b, -0.5)])
    assert cv.n_embd == N_EMBD and sorted(cv.directions) == [1, 2, 3]
    np.testing.assert_allclose(cv.directions[1], 2.0 * v1 - 0.5 * u1, rtol=1e-6)
    np.testing.assert_allclose(cv.directions[2], -0.5 * u2, rtol=1e-6)
    np.testing.assert_allclose(cv.directions[3], 2.0 * v3, rtol=1e-6)
    # direction.N follows layer N: a 3-layer model has outputs 1 and 2 to add to (0 never)
    assert sorted(cv.layers(3, N_EMBD)) == [1, 2]
    assert sorted(cv.layers(8, N_EMBD)) == [1, 2, 3]
    assert sorted(cv.layers(8, N_EMBD, start=2, end=3)) == [2, 3]
    assert sorted(cv.layers(8, N_EMBD, start=3, end=0)) == [3]  # end <= 0: the last layer
    # written and read back
    cv.save(tmp_path / "sum.gguf", model_hint="tiny")
    back = ControlVector.load(tmp_path / "sum.gguf")
    assert sorted(back.directions) == [1, 2, 3]
    for k in back.directions:
        np.testing.assert_array_equal(back.directions[k], cv.directions[k])


@pytest.mark.parametrize("tensors,dtype,match", [
    ({"direction.0": vec(0)}, F32, "direction.0"),
    ({"dir.1": vec(0)}, F32, "not named direction"),
    ({"direction.x": vec(0)}, F32, "not named direction"),
    ({"direction.1": vec(0)}, F16, "expected F32"),
    ({"direction.1": np.zeros((2, N_EMBD))}, F32, "one dimension"),
    ({"direction.1": vec(0), "direction.2": vec(1, n=32)}, F32, "32 elements"),
    ({}, F32, "no direction tensors"),
])
def test_bad_files_are_refused(tmp_path, tensors, dtype, match):
    p = write_cv(tmp_path / "bad.gguf", tensors, dtype)
    with pytest.raises(ValueError, match=match):
        ControlVector.load(p)


def test_bad_inputs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        ControlVector.load(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + b"\0" * 60)
    with pytest.raises(ValueError, match="junk.gguf"):
        ControlVector.load(junk)
    a = write_cv(tmp_path / "a.gguf", {"direction.1": vec(0)})
    b = write_cv(tmp_path / "b.gguf", {"direction.1": vec(0, n=32)})
    with pytest.raises(ValueError, match="earlier files"):
        ControlVector.combine([(a, 1.0), (b, 1.0)])
    with pytest.raises(ValueError, match="finite"):
        ControlVector.load(a, float("nan"))
    cv = ControlVector.load(a)
    with pytest.raises(ValueError, match="embedding length is 576"):
        cv.layers(30, 576)
    with pytest.raises(ValueError, match="empty"):
        cv.layers(30, N_EMBD, start=5, end=3)


def test_parse_scaled():
    assert parse_scaled("a.gguf:0.5,dir/b.gguf:-2") == [("a.gguf", 0.5), ("dir/b.gguf", -2.0)]
    assert parse_scaled("c:/x.gguf:1.5") == [("c:/x.gguf", 1.5)]  # the scale follows the last colon
    for bad in ("a.gguf", "a.gguf:x", ":1.0"):
        with pytest.raises(ValueError, match="FNAME:SCALE"):
            parse_scaled(bad)


# --------------------------------------------------------------------------------------------
# the model: against the numpy reference
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cvec")
    path = d / "tiny.gguf"
    write_tiny_llama(path, n_vocab=96, n_embd=N_EMBD, n_layer=3, n_head=4, n_head_kv=2, n_ff=96, wtype="f32",
                     seed=5)
    # direction.3 lies past the last layer (2) and must be ignored
    cvp = write_cv(d / "cv.gguf", {"direction.1": vec(21, scale=0.7), "direction.2": vec(22, scale=0.7),
                                   "direction.3": vec(23, scale=50.0)})
    return path, cvp


@pytest.mark.parametrize("strength,layer_range,want_layers", [
    (1.5, None, [1, 2]),
    (-2.0, (2, 2), [2]),
    (1.0, (1, 1), [1]),
])
def test_logits_match_the_reference(tiny, strength, layer_range, want_layers):
    path, cvp = tiny
    model = Model(path)
    cv = ControlVector.load(cvp, strength)
    model.set_control_vector(cv, *(layer_range or (None, None)))
    assert sorted(model.control) == want_layers
    ctx = Context(model, n_ctx=64, n_threads=2, kv_dtype=native.DType.F32)
    toks = [3, 17, 5, 90, 42, 8, 8, 61, 0]
    got = ctx.decode(toks, logits="all")
    ref = LlamaRef(path)
    plain = ref.logits(toks)
    ref.layer_add = {il: strength * vec(20 + il, scale=0.7).astype(np.float64) for il in want_layers}
    want = ref.logits(toks)
    assert rel_err(plain, want) > 1e-2  # the vectors change the logits ...
    assert rel_err(got, want) < 1e-4    # ... and pyfast changes them as the reference does
    # one more token, decoded on its own, continues the same way
    step = ctx.decode([33], positions=[len(toks)], logits="last")
    assert rel_err(step, ref.logits(toks + [33])[-1:]) < 1e-4


def test_batch_invariance_holds_with_a_control_vector(tiny):
    path, cvp = tiny
    model = Model(path)
    model.set_control_vector(ControlVector.load(cvp))
    alone = Context(model, n_ctx=64, n_threads=2).decode([5, 6, 7, 8], logits="all")
    ctx = Context(model, n_ctx=64, n_threads=3)
    both = ctx.decode([5, 60, 6, 50, 7, 8], positions=[0, 0, 1, 1, 2, 3], seq_ids=[0, 1, 0, 1, 0, 0], logits="all")
    np.testing.assert_array_equal(both[[0, 2, 4, 5]], alone)


def test_llm_arguments(tiny, tmp_path):
    from pyfast.llm import LLM

    path, cvp = tiny
    narrow = write_cv(tmp_path / "narrow.gguf", {"direction.1": vec(0, n=32)})
    with pytest.raises(ValueError, match="embedding length is 64"):
        LLM(path, n_ctx=64, n_threads=1, control_vectors=[narrow])
    with pytest.raises(ValueError, match="needs control_vectors"):
        LLM(path, n_ctx=64, n_threads=1, control_vector_layer_range=(1, 2))
    with pytest.raises(ValueError, match="path or a"):
        LLM(path, n_ctx=64, n_threads=1, control_vectors=[(cvp, "strong")])
    with pytest.raises(ValueError, match="not found"):
        LLM(tmp_path / "never-loaded.gguf", control_vectors=[tmp_path / "missing.gguf"])  # before the model
    llm = LLM(path, n_ctx=64, n_threads=1, control_vectors=[(cvp, 0.5), cvp], control_vector_layer_range=(2, 5))
    assert sorted(llm.model.control) == [2]
    np.testing.assert_allclose(llm.model.control[2], 1.5 * vec(22, scale=0.7), rtol=1e-6)


# --------------------------------------------------------------------------------------------
# SmolLM2 against llama.cpp
# --------------------------------------------------------------------------------------------

# llama.cpp 0c1e57098's llama-perplexity on ../shared/refs/ppl_text.txt, -c 512 -t 2, with the
# control vector below (`--control-vector-scaled cats.gguf:0.5 [--control-vector-layer-range
# 5 12]`): 36.1074 on every layer, 23.7197 on layers 5-12. Without one: 21.6665.
LLAMACPP_PPL = {None: 36.1074, (5, 12): 23.7197}


def cats_vector(model: Model) -> ControlVector:
    """6 x the unit direction of token 7680 (" cats") in the Q8_0 embedding, on layers 1-29."""
    raw = model.weights.f32("token_embd.weight")[7680].astype(np.float32)
    d = raw / np.linalg.norm(raw)
    return ControlVector(model.args.n_embd, {i: (6.0 * d).astype(np.float32) for i in range(1, 30)})


@pytest.mark.parametrize("layer_range", [None, (5, 12)], ids=["all-layers", "layers-5-12"])
def test_smollm2_perplexity_matches_llamacpp(smollm2_path, smollm2_model, shared_dir, tmp_path, layer_range):
    from pyfast.llm import LLM

    text = shared_dir / "refs" / "ppl_text.txt"
    cvp = tmp_path / "cats.gguf"
    cats_vector(smollm2_model).save(cvp)
    llm = LLM(smollm2_path, n_ctx=512, n_threads=2, control_vectors=[(cvp, 0.5)],
              control_vector_layer_range=layer_range)
    ppl = llm.perplexity(text.read_text(encoding="utf-8"), n_ctx=512).ppl
    assert ppl == pytest.approx(LLAMACPP_PPL[layer_range], rel=0.01)


# --------------------------------------------------------------------------------------------
# command line and server
# --------------------------------------------------------------------------------------------

def test_flags_parse_alike_for_every_command():
    from pyfast.cli import build_parser, control_vector_kwargs

    for cmd in (["generate", "-p", "x"], ["chat"], ["perplexity", "-f", "x.txt"], ["serve"]):
        a = build_parser().parse_args(cmd + ["--control-vector", "a.gguf,b.gguf", "--control-vector", "c.gguf",
                                             "--control-vector-scaled", "d.gguf:0.5,e.gguf:-1",
                                             "--control-vector-layer-range", "2", "9"])
        kw = control_vector_kwargs(a)
        assert kw["control_vectors"] == [("a.gguf", 1.0), ("b.gguf", 1.0), ("c.gguf", 1.0), ("d.gguf", 0.5),
                                         ("e.gguf", -1.0)], cmd
        assert kw["control_vector_layer_range"] == (2, 9)
        assert control_vector_kwargs(build_parser().parse_args(cmd)) == dict(control_vectors=None,
                                                                            control_vector_layer_range=None)


def test_cli_generate_with_a_control_vector(smollm2_path, smollm2_model, tmp_path):
    from tests.unit.test_cli import run

    cvp = tmp_path / "cats.gguf"
    cats_vector(smollm2_model).save(cvp)
    args = ("generate", "-m", str(smollm2_path), "-p", "Write one sentence about your morning.", "--temp", "0",
            "-n", "24", "-t", "2")
    base = run(*args)
    zero = run(*args, "--control-vector-scaled", f"{cvp}:0")
    steered = run(*args, "--control-vector-scaled", f"{cvp}:0.5")
    assert base.returncode == zero.returncode == steered.returncode == 0, steered.stderr
    assert zero.stdout == base.stdout      # a zero vector adds exactly nothing
    assert steered.stdout != base.stdout
    for extra, msg in [(("--control-vector-layer-range", "1", "2"), "needs --control-vector"),
                       (("--control-vector", str(tmp_path / "missing.gguf")), "not found"),
                       (("--control-vector-scaled", str(cvp)), "FNAME:SCALE")]:
        r = run(*args, *extra)
        assert r.returncode == 1 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_server_config(smollm2_path, smollm2_model, tmp_path):
    from pyfast.server.engine import Engine, EngineConfig

    with pytest.raises(ValueError, match="not found"):
        EngineConfig(control_vectors=[(str(tmp_path / "missing.gguf"), 1.0)]).validate()
    with pytest.raises(ValueError, match="needs --control-vector"):
        EngineConfig(control_vector_layer_range=(1, 2)).validate()
    cvp = tmp_path / "cats.gguf"
    cats_vector(smollm2_model).save(cvp)
    engine = Engine(EngineConfig(model=str(smollm2_path), n_parallel=1, n_ctx=256, n_threads=1,
                                 control_vectors=[(str(cvp), 0.5)], control_vector_layer_range=(5, 12)))
    assert sorted(engine.model.control) == list(range(5, 13))


def test_setting_a_vector_after_the_first_decode_is_refused(tiny):
    path, cvp = tiny
    model = Model(path)
    Context(model, n_ctx=64, n_threads=1).decode([1, 2, 3])
    with pytest.raises(ValueError, match="before the first decode"):
        model.set_control_vector(ControlVector.load(cvp))


def test_hybrid_model_speculation_stays_lossless_with_a_control_vector(tmp_path):
    """Qwen3.5 (Gated DeltaNet + attention, MTP head): the vector changes greedy output, and
    speculation with rollback of the recurrent state still reproduces it token for token."""
    from pathlib import Path

    from pyfast.llm import LLM
    from pyfast.spec import SpecConfig

    path = Path(__file__).resolve().parents[1] / "fixtures" / "hybrid" / "qwen35kv2.gguf"
    m = Model(path)
    cv = ControlVector(m.args.n_embd, {i: vec(40 + i, m.args.n_embd, 3.0) for i in range(1, m.args.n_layer)})
    cvp = tmp_path / "cv.gguf"
    cv.save(cvp)
    rep = [5, 9, 14, 3, 27]
    prompt = rep * 3 + rep[:2]
    kw = dict(max_tokens=24, temperature=0, ignore_eos=True)
    steered = LLM(path, n_ctx=256, n_threads=2, control_vectors=[cvp]).generate(prompt, **kw).tokens
    plain = LLM(path, n_ctx=256, n_threads=2).generate(prompt, **kw).tokens
    assert steered != plain
    for types in ("ngram-simple", "draft-mtp,ngram-simple"):
        llm = LLM(path, n_ctx=256, n_threads=2, control_vectors=[cvp],
                  speculative=SpecConfig(types=types, draft_max=3, ngram_n=1))
        res = llm.generate(prompt, **kw)
        assert res.tokens == steered, types
        assert res.spec.drafted > 0
