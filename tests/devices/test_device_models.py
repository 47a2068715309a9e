"""End to end on every non-CPU device this build and machine have (Vulkan on Mesa's lavapipe in
CI): the tiny hybrid models against transformers, batch invariance, rollback and lossless
speculation, SmolLM2 perplexity against the CPU, and device errors. Lavapipe runs shaders on the
CPU, so the texts and fixtures are kept small."""
from __future__ import annotations

import os

import numpy as np
import pytest

import pyfast
from pyfast._loader import native
from tests.models import test_hybrid_common as hc

DEVICES = [d["name"] for d in native.devices() if d["kind"] != "cpu"]
if os.environ.get("PYFAST_TEST_DEVICES") is not None:  # comma-separated names (scripts/gpu_check.sh)
    DEVICES = [n for n in DEVICES if n in os.environ["PYFAST_TEST_DEVICES"].split(",")]
WHY = "; ".join(f"{b['kind']}: {b['unavailable'] or 'no device found'}" for b in native.backends())


def dev_param(f):
    """Run the test once per non-CPU device (skipped, with the reason, when there is none)."""
    f = pytest.mark.parametrize("dev", DEVICES or ["none"])(f)
    return pytest.mark.skipif(not DEVICES, reason=f"no non-CPU device ({WHY})")(f)


@dev_param
@pytest.mark.parametrize("name", hc.NAMES)
def test_hybrid_logits_match_transformers(dev, name):
    """Prefill, token-by-token decode, uneven chunks and two interleaved sequences within 1e-3
    (relative) of the float64 transformers reference, on the device."""
    with hc.on_device(dev):
        err = max(hc.check_prefill(name), hc.check_decode(name), hc.check_prefill_then_decode(name),
                  hc.check_two_sequences(name))
    assert err < hc.TOL, f"{name} on {dev}: relative error {err:.3g}"


@dev_param
@pytest.mark.parametrize("name", ["qwen35", "qwen35kv2"])
def test_hybrid_rollback_and_restore(dev, name):
    """Rollback through the snapshot planes, save / restore of device state, and the decoder's
    restore-and-replay fallback reproduce fresh runs on the device."""
    with hc.on_device(dev):
        err = max(hc.check_rollback(name), hc.check_save_restore(name))
        hc.check_spec_fallback(name)
    assert err < hc.TOL_SELF, f"{name} on {dev}: {err:.3g}"


@dev_param
@pytest.mark.parametrize("name", ["qwen35", "qwen35kv2"])
def test_hybrid_batch_invariance(dev, name):
    with hc.on_device(dev):
        hc.check_batch_invariance(name)


@dev_param
@pytest.mark.parametrize("wtype", ["f16", "q8_0", "q4_1"])
def test_llama_batch_invariance(dev, tmp_path, wtype):
    """A sequence's logits are bit-identical alone, batched with others, split differently and
    after cell reuse, on the device (tiny llama)."""
    from pyfast.models import Model
    from tests.models.test_batch_invariance import run_invariance_checks
    from tests.reference.tiny_gguf import write_tiny_llama

    path = tmp_path / f"tiny-{wtype}.gguf"
    write_tiny_llama(path, n_vocab=50000, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96, wtype=wtype)
    run_invariance_checks(Model(path, mmap=True), device=dev)


@dev_param
def test_llama_matches_numpy_reference(dev, tmp_path):
    """The tiny llama's logits on the device against the numpy reference implementation."""
    from pyfast.models import Model
    from pyfast.context import Context
    from tests.reference.llama_numpy import LlamaRef
    from tests.reference.tiny_gguf import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, n_vocab=2000, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96, wtype="f32")
    toks = [5, 17, 3, 999, 42, 7, 1500, 8]
    got = Context(Model(path, mmap=True), n_ctx=64, device=dev, kv_dtype="f32").decode(toks, logits="all")
    want = LlamaRef(path).logits(toks)
    assert hc.rel_err(got, want) < 1e-4


@dev_param
@pytest.mark.parametrize("types", ["ngram-simple", "draft-mtp"])
def test_speculation_lossless_on_device(dev, types):
    """Greedy output with n-gram or MTP drafts (rollback through the planes) equals plain
    decoding on the same device, for one prompt and a batch."""
    from pyfast.spec import SpecConfig

    path, ref = hc.fixture("qwen35kv2")
    rng = np.random.default_rng(3)
    V = int(ref["logits_0"].shape[1])
    prompts = [rng.permutation(V)[:40].tolist(), ref["tokens_0"][:6].tolist() * 3]
    plain = pyfast.LLM(path, n_ctx=256, n_threads=2, device=dev)
    want = [plain.generate(p, max_tokens=10, temperature=0, ignore_eos=True).tokens for p in prompts]
    llm = pyfast.LLM(path, n_ctx=256, n_threads=2, device=dev,
                     speculative=SpecConfig(types=types, draft_max=3, ngram_n=1))
    for p, w in zip(prompts, want):
        assert llm.generate(p, max_tokens=10, temperature=0, ignore_eos=True).tokens == w
    assert [r.tokens for r in llm.generate_batch(prompts, max_tokens=10, temperature=0, ignore_eos=True)] == want
    assert llm.spec_stats.drafted > 0


@dev_param
def test_smollm2_perplexity_matches_cpu(dev, smollm2_path, shared_dir):
    """SmolLM2-135M Q4_1 perplexity within 0.5% of the CPU figure (378 scored tokens: on much
    shorter texts the two differ by more, because each quantizes activations in its own way;
    96 scored tokens differed by 1.4%)."""
    text = (shared_dir / "refs" / "ppl_text.txt").read_text()[:3000]
    cpu = pyfast.LLM(smollm2_path, n_ctx=256).perplexity(text, n_ctx=128)
    gpu = pyfast.LLM(smollm2_path, n_ctx=256, device=dev).perplexity(text, n_ctx=128)
    assert cpu.n_scored == gpu.n_scored and cpu.n_scored >= 300
    assert abs(gpu.ppl / cpu.ppl - 1) < 0.005, (cpu.ppl, gpu.ppl)


@dev_param
def test_smollm2_logits_match_float64_reference(dev, smollm2_path):
    """SmolLM2 logits on the device against the float64 numpy implementation: the mean KL
    divergence per token stays at the level 8-bit activations give (the CPU's is ~0.005)."""
    from tests.reference.llama_numpy import LlamaRef

    llm = pyfast.LLM(smollm2_path, n_ctx=128, device=dev)
    toks = llm.tokenize("The quick brown fox jumps over the lazy dog. Rivers flow to the sea, and "
                        "the sea gives the rain back to the mountains.")[:32]
    ref = LlamaRef(str(smollm2_path), cache_weights=False).logits(toks)  # no 1 GB float64 copy
    got = llm.logits(toks).astype(np.float64)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lr, lg = log_softmax(ref), log_softmax(got)
    kl = float((np.exp(lr) * (lr - lg)).sum(-1).mean())
    assert kl < 0.01, kl


@dev_param
def test_device_plan_runs_on_device(dev, smollm2_path):
    """A SmolLM2 decode runs every node on the device: no CPU fallback and no copy but the logits."""
    llm = pyfast.LLM(smollm2_path, n_ctx=128, device=dev)
    llm.generate("Hi", max_tokens=1, temperature=0)
    steps = llm.ctx._last_plan.device_steps
    assert steps["host_nodes"] == 0, steps["steps"]
    assert steps["device_nodes"] > 100


@dev_param
@pytest.mark.parametrize("name", hc.NAMES)
def test_hybrid_plan_runs_on_device(dev, name):
    """The hybrid graphs (ssm_conv, gated_delta_net with its snapshot planes, MoE routing with
    topk / gather / matmul_id) run with no CPU node; only outputs are copied back."""
    model, ref = hc.load(name)
    ctx = hc.make_ctx(model, device=dev)
    ctx.decode(ref["tokens_0"], logits="all")
    steps = ctx._last_plan.device_steps
    assert steps["host_nodes"] == 0, steps["steps"]
    assert all(line.startswith(("device ", "  copy device->host")) for line in steps["steps"].splitlines())


def test_devices_lists_cpu_first():
    devs = pyfast.devices()
    assert devs[0]["name"] == "cpu" and devs[0]["kind"] == "cpu"
    assert all(d["name"] == f"{d['kind']}:{d['index']}" for d in devs[1:])


def test_missing_device_is_a_clear_error(smollm2_path):
    n = sum(1 for d in native.devices() if d["kind"] == "vulkan")
    with pytest.raises(ValueError, match=f"vulkan:{n + 3}"):
        pyfast.LLM(smollm2_path, device=f"vulkan:{n + 3}")
    with pytest.raises(ValueError, match="unknown device kind 'tpu'"):
        pyfast.LLM(smollm2_path, device="tpu:0")
    with pytest.raises(ValueError, match="KIND:INDEX"):
        pyfast.LLM(smollm2_path, device="vulkan:x")


def test_cuda_without_device_is_a_clear_error(smollm2_path):
    """With no CUDA device (not compiled in, or no driver / GPU on this machine) devices() lists
    none and cuda:0 is a ValueError that says why, never a crash."""
    if any(d["kind"] == "cuda" for d in native.devices()):
        pytest.skip("this machine has a CUDA device")
    why = next(b["unavailable"] for b in native.backends() if b["kind"] == "cuda")
    assert why
    with pytest.raises(ValueError, match=r"device 'cuda:0' does not exist: .+"):
        pyfast.LLM(smollm2_path, device="cuda:0")
    assert not [d for d in pyfast.devices() if d["kind"] == "cuda"]


@dev_param
def test_server_on_device(dev):
    """`pyfast serve --device DEV` on the tiny hybrid model: two concurrent greedy completions
    equal LLM on the same device, and the CLI flag reaches the engine."""
    import concurrent.futures

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from tests.server.helpers import ServerProcess

    path, ref = hc.fixture("qwen35kv2")
    prompts = [ref["tokens_0"][:7].tolist(), ref["tokens_1"][:5].tolist()]
    llm = pyfast.LLM(path, n_ctx=256, n_threads=2, device=dev)
    want = [llm.generate(p, max_tokens=8, temperature=0, ignore_eos=True).tokens for p in prompts]
    with ServerProcess("-m", str(path), "--parallel", "2", "--ctx-size", "512", "--device", dev) as srv:
        def ask(p):
            r = httpx.post(srv.url + "/v1/completions", timeout=120,
                           json={"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            got = list(ex.map(ask, prompts))
    texts = [llm.detokenize(w) for w in want]
    assert [g["choices"][0]["text"] for g in got] == texts
