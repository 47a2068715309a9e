"""Tiny random llama (Llama 3 rope scaling), qwen2 (biases, YaRN), qwen3 (q/k norms), qwen3moe
and glm4moe (sigmoid router with selection bias, shared expert, leading dense layer) checkpoints (tests/fixtures/decoder/hf, built by scripts/make_decoder_fixtures.py) converted with
``pyfast convert`` and compared with transformers' float64 logits: full prompt, incremental
decode, batch invariance; plus pre-merged gate/up experts and the unsupported-architecture error."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyfast._loader import native
from pyfast.context import Context
from pyfast.models import Model

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "decoder"
NAMES = ("llama3", "qwen2", "qwen3", "qwen3moe", "glm4moe", "gemma3", "gemma4", "gemma4moe")
ARCH = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3moe", "glm4moe": "glm4moe",
        "gemma3": "gemma3", "gemma4": "gemma4", "gemma4moe": "gemma4"}
TOL = 1e-3


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """name -> (GGUF path converted from the committed checkpoint, reference npz)."""
    from pyfast.convert import convert

    out = {}
    d = tmp_path_factory.mktemp("decoder")
    for name in NAMES:
        res = convert(FIX / "hf" / name, d / f"{name}.gguf", outtype="f32")
        assert res.arch == ARCH[name]
        out[name] = (d / f"{name}.gguf", dict(np.load(FIX / f"{name}.npz")))
    return out


def ctx_of(model, **kw):
    return Context(model, n_ctx=64, n_threads=2, kv_dtype=native.DType.F32, **kw)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_and_decode_match_transformers(converted, name):
    path, ref = converted[name]
    model = Model(path)
    for s in (0, 1):
        got = ctx_of(model).decode(ref[f"tokens_{s}"], logits="all")
        assert rel_err(got, ref[f"logits_{s}"]) < TOL
    toks, n0 = ref["tokens_0"], int(ref["n_prefill"])
    ctx = ctx_of(model)
    rows = [ctx.decode(toks[:n0], logits="all")] + [ctx.decode([t]) for t in toks[n0:]]
    assert rel_err(np.concatenate(rows), ref["decode_logits_0"]) < TOL


@pytest.mark.parametrize("name", NAMES)
def test_batch_invariance(converted, name):
    """A sequence's logits are bit-identical alone, token by token, in micro-batches and next to
    another sequence."""
    path, ref = converted[name]
    model = Model(path)
    a, b = ref["tokens_0"], ref["tokens_1"]
    one = ctx_of(model).decode(a, logits="all")
    ctx = ctx_of(model)
    steps = np.concatenate([ctx.decode([t]) for t in a])
    split = ctx_of(model, n_ubatch=3).decode(a, logits="all")
    both = ctx_of(model).decode(np.concatenate([b, a]), positions=list(range(b.size)) + list(range(a.size)),
                                seq_ids=[1] * b.size + [0] * a.size, logits="all")[b.size:]
    assert np.array_equal(one, steps) and np.array_equal(one, split) and np.array_equal(one, both)


def test_rope_scaling_is_read(converted):
    """llama3 carries rope_freqs.weight; qwen2 carries YaRN; dropping either changes the logits."""
    llama = Model(converted["llama3"][0])
    assert llama.args.rope.freq_factors == "rope_freqs.weight"
    ff = llama.weights.f32("rope_freqs.weight")
    assert ff.min() == 1.0 and ff.max() == 8.0
    qwen2 = Model(converted["qwen2"][0])
    r = qwen2.args.rope
    assert r.ext_factor == 1.0 and r.freq_scale == 0.25 and 0 <= r.corr_low < r.corr_high
    # without the scaling the model is measurably different: the test above checks the scaling
    from dataclasses import replace

    ref = converted["qwen2"][1]
    plain = replace(qwen2.args, rope=replace(r, ext_factor=0.0, freq_scale=1.0))
    qwen2.args = plain
    assert rel_err(ctx_of(qwen2).decode(ref["tokens_0"], logits="all"), ref["logits_0"]) > 1e-2


def test_merged_gate_up_experts(converted, tmp_path):
    """A GGUF with pre-merged ffn_gate_up_exps [E, 2F, d] gives the same logits as split stacks."""
    from pyfast.gguf import GGUFReader
    from pyfast.gguf.writer import GGUFWriter

    path, ref = converted["qwen3moe"]
    model = Model(path)
    rd = GGUFReader(str(path))
    w = GGUFWriter(tmp_path / "merged.gguf")
    w.copy_metadata(rd)
    for n, info in rd.tensors.items():
        if ".ffn_gate_exps." in n or ".ffn_up_exps." in n:
            continue
        w.add_tensor(n, info.type, tuple(info.shape), rd.tensor_bytes(n))
    for i in range(model.args.n_layer):
        gu = np.concatenate([model.weights.f32(f"blk.{i}.ffn_gate_exps.weight"),
                             model.weights.f32(f"blk.{i}.ffn_up_exps.weight")], axis=1)
        w.add_tensor(f"blk.{i}.ffn_gate_up_exps.weight", 0, gu.shape, np.ascontiguousarray(gu))
    w.write()
    merged = Model(tmp_path / "merged.gguf")
    assert merged.args.merged_gate_up and not model.args.merged_gate_up
    toks = ref["tokens_0"]
    assert np.array_equal(ctx_of(merged).decode(toks, logits="all"), ctx_of(model).decode(toks, logits="all"))


def test_unsupported_architecture_lists_supported(converted, tmp_path):
    from pyfast.gguf import GGUFReader
    from pyfast.gguf.writer import GGUFWriter
    from pyfast.models import ARCHITECTURES

    rd = GGUFReader(str(converted["qwen3"][0]))
    w = GGUFWriter(tmp_path / "other.gguf")
    w.copy_metadata(rd)
    w.add("general.architecture", "falcon-h9", "string")
    for n, info in rd.tensors.items():
        w.add_tensor(n, info.type, tuple(info.shape), rd.tensor_bytes(n))
    w.write()
    with pytest.raises(ValueError, match="unsupported architecture 'falcon-h9'") as e:
        Model(tmp_path / "other.gguf")
    for arch in ("llama", "qwen2", "qwen3", "qwen3moe", "qwen35"):
        assert arch in ARCHITECTURES and arch in str(e.value)


def test_gemma3_layer_types_and_window(converted):
    """gemma3: sliding layers (window 4 over 13-token prompts), their own rope base, the attention
    scale from query_pre_attn_scalar and the final soft-cap are all read, and each one matters."""
    from dataclasses import replace

    path, ref = converted["gemma3"]
    model = Model(path)
    a = model.args
    assert a.swa_layers == (True, True, False, True) and a.swa_window == 4
    assert a.rope_swa.base == 10000.0 and a.rope.base == 1e6 and a.rope.freq_scale == 0.5
    assert abs(a.attn_scale - 24 ** -0.5) < 1e-7 and a.final_softcap == 5.0
    toks = ref["tokens_0"]
    base = ctx_of(model).decode(toks, logits="all")
    assert rel_err(base, ref["logits_0"]) < TOL
    assert np.abs(base).max() < 5.0                     # soft-capped
    for change in (dict(swa_window=64), dict(swa_layers=(False,) * 4, swa_window=0), dict(final_softcap=0.0),
                   dict(rope_swa=a.rope), dict(attn_scale=0.25)):
        model.args = replace(a, **change)
        assert rel_err(ctx_of(model).decode(toks, logits="all"), ref["logits_0"]) > 1e-2, change
    model.args = a


def test_pre_tokenizer_detected_from_the_split_regex():
    """Llama 3's split regex converts to llama-bpe (a GLM checkpoint's to glm4), Qwen's to qwen2 /
    qwen35 whatever the model type."""
    from pyfast.convert.hf_tokenizer import detect_pre
    from pyfast.tokenizer import PRE_TOKENIZER_REGEXES

    def tj(rx):
        return {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": rx}}, {"type": "ByteLevel", "use_regex": False}]}}

    llama3, qwen2 = PRE_TOKENIZER_REGEXES["llama3"][0], PRE_TOKENIZER_REGEXES["qwen2"][0]
    assert detect_pre(tj(llama3), "llama-bpe") == "llama-bpe"
    assert detect_pre(tj(llama3), "glm4") == "glm4"
    assert detect_pre(tj(llama3), "qwen2") == "llama3"
    assert detect_pre(tj(qwen2), "llama-bpe") == "qwen2"
    assert detect_pre(tj(PRE_TOKENIZER_REGEXES["qwen35"][0]), "qwen2") == "qwen35"
    assert detect_pre({}, "llama-bpe") == "llama-bpe"


def _rewrite(src, out, md=None, drop=(), add=None):
    """Copy a GGUF with metadata overrides (key -> (value, type)), tensors dropped or added (f32)."""
    from pyfast.gguf import GGUFReader
    from pyfast.gguf.writer import GGUFWriter

    rd = GGUFReader(str(src))
    w = GGUFWriter(out)
    w.copy_metadata(rd)
    for k, (v, t) in (md or {}).items():
        w.add(k, v, t)
    for n, info in rd.tensors.items():
        if n not in drop:
            w.add_tensor(n, info.type, tuple(info.shape), rd.tensor_bytes(n))
    for n, a in (add or {}).items():
        w.add_tensor(n, 0, a.shape, np.ascontiguousarray(a, dtype=np.float32))
    w.write()
    return out


@pytest.mark.parametrize("name, md, add, match", [
    ("gemma3", {"gemma3.attention.sliding_window_pattern": ([True, False], "array[bool]")}, None,
     "sliding_window_pattern.*4 entries"),
    ("glm4moe", {"glm4moe.expert_gating_func": (1, "uint32")}, None, "expert_gating_func.*sigmoid"),
    ("qwen3", {"qwen3.rope.scaling.type": ("longrope", "string")}, None, "rope.scaling.type.*'yarn'"),
    ("qwen2", {"qwen2.rope.scaling.original_context_length": (0, "uint32")}, None, "original_context_length"),
    ("llama3", None, {"rope_freqs.weight": np.ones(3)}, "rope_freqs.weight' has shape \\[3\\], expected \\[8\\]"),
])
def test_bad_metadata_is_named(converted, tmp_path, name, md, add, match):
    path = _rewrite(converted[name][0], tmp_path / "bad.gguf", md=md, add=add,
                    drop=("rope_freqs.weight",) if add else ())
    with pytest.raises(ValueError, match=match):
        Model(path)


def test_cli_convert_bf16(tmp_path):
    """pyfast convert from the command line, BF16 weights: the model loads and stays within bf16
    rounding of the reference."""
    from pyfast.cli import main

    out = tmp_path / "qwen3-bf16.gguf"
    assert main(["convert", str(FIX / "hf" / "qwen3"), str(out), "--outtype", "bf16", "-q"]) == 0
    ref = dict(np.load(FIX / "qwen3.npz"))
    model = Model(out)
    assert model.weights.dtype("blk.0.attn_q.weight") == native.DType.BF16
    assert model.weights.dtype("blk.0.attn_q_norm.weight") == native.DType.F32
    assert rel_err(ctx_of(model).decode(ref["tokens_0"], logits="all"), ref["logits_0"]) < 3e-2


def test_gemma4_features_are_read(converted):
    """gemma4: per-type head sizes and kv heads (the cache takes the widest: 2 heads of 32), shared
    KV layers (3 and 4 attend over 2 and 1), k = v on the global layers, double-wide FFN on the
    shared layers, per-layer embeddings, proportional rope (4 of 16 pairs rotate) and the soft-cap;
    dropping each changes the logits."""
    from dataclasses import replace

    path, ref = converted["gemma4"]
    model = Model(path)
    a = model.args
    assert a.swa_layers == (True, False, True, True, False) and a.kv_source == (0, 1, 2, 2, 1)
    assert a.n_head_kv == (2, 1, 2, 2, 1) and (a.head_dim, a.head_dim_swa) == (32, 16)
    assert a.n_ff == (96, 96, 96, 192, 192) and a.n_embd_per_layer == 8
    spec = model.memory_spec()
    assert spec.attn_layers == (0, 1, 2) and (spec.n_head_kv, spec.head_dim) == (2, 32)
    assert "blk.1.attn_v.weight" not in model.weights and "blk.0.attn_v.weight" in model.weights
    ff = model.weights.f32("rope_freqs.weight")
    assert (ff[:4] == 1).all() and (ff[4:] > 1e29).all()
    toks = ref["tokens_0"]
    assert rel_err(ctx_of(model).decode(toks, logits="all"), ref["logits_0"]) < TOL
    for change in (dict(n_embd_per_layer=0), dict(final_softcap=0.0), dict(swa_window=64),
                   dict(rope=replace(a.rope, freq_factors=None))):
        model.args = replace(a, **change)
        assert rel_err(ctx_of(model).decode(toks, logits="all"), ref["logits_0"]) > 1e-2, change
    model.args = a


@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
def test_bounded_sliding_window_cache(converted, name):
    """Context(swa_full=False): the sliding layers get their own cache of n_seq_max * (W - 1) +
    n_ubatch cells (W = 4 here), holding only what the window still sees, and every result equals
    the full cache's bit for bit: prompts split into micro-batches, token-by-token decoding, two
    interleaved sequences. Truncation works back to the window's reach and raises past it."""
    from pyfast.context import RollbackError

    path, ref = converted[name]
    model = Model(path)
    a, b = ref["tokens_0"], ref["tokens_1"]
    want_a = ctx_of(model).decode(a, logits="all")
    want_b = ctx_of(model).decode(b, logits="all")

    def bounded(n_ubatch=4):
        return ctx_of(model, swa_full=False, n_seq_max=2, n_ubatch=n_ubatch)

    ctx = bounded()
    assert ctx.kv_swa.n_ctx == 2 * 3 + 4 and ctx.kv.n_layer + ctx.kv_swa.n_layer == len(model.memory_spec().attn_layers)
    assert np.array_equal(ctx.decode(a, logits="all"), want_a)
    assert ctx.kv_swa.n_used <= 3 + 4
    ctx = bounded(8)
    steps = np.concatenate([ctx.decode(a[:5], logits="all")] + [ctx.decode([t]) for t in a[5:]])
    assert np.array_equal(steps, want_a) and ctx.kv_swa.n_used == 4
    # two sequences interleaved, one token of each per batch after the first rows
    ctx = bounded(8)
    got_a, got_b = [ctx.decode(a[:3], seq_ids=0, logits="all")], [ctx.decode(b[:2], seq_ids=1, logits="all")]
    for i in range(3, a.size):
        toks, seqs, pos = [a[i]], [0], [i]
        if i - 1 < b.size:
            toks, seqs, pos = toks + [b[i - 1]], seqs + [1], pos + [i - 1]
        out = ctx.decode(toks, positions=pos, seq_ids=seqs, logits="all")
        got_a.append(out[:1])
        if len(toks) > 1:
            got_b.append(out[1:])
    assert np.array_equal(np.concatenate(got_a), want_a) and np.array_equal(np.concatenate(got_b), want_b)
    # rollback: within the last batch (a speculative verify) it works, further back it cannot
    ctx = bounded(8)
    ctx.decode(a[:8], logits="none")
    ctx.decode(a[8:12], logits="none")
    assert ctx.can_rollback(0) == 4
    ctx.truncate(0, 9)
    assert np.array_equal(ctx.decode(a[9:13], logits="all"), want_a[9:13])
    with pytest.raises(RollbackError, match="sliding-window cache"):
        ctx.truncate(0, 6)
    with pytest.raises(ValueError, match="swa_full"):
        ctx.save_state(0)
    ctx.truncate(0, 0)
    assert ctx.seq_len(0) == 0 and ctx.kv_swa.n_used == 0
    assert np.array_equal(ctx.decode(a, logits="all"), want_a)


def test_llm_bounded_swa_matches_full(converted):
    """LLM(swa_full=False) on gemma3 generates the same greedy tokens as the full cache: plain, with
    n-gram speculation (rejected drafts roll back within the verify batch) and with a prompt that
    reuses part of the previous one (a prefix past the window's reach is decoded afresh)."""
    from pyfast.llm import LLM
    from pyfast.spec import SpecConfig

    path, ref = converted["gemma3"]
    p1 = ref["tokens_0"].tolist()
    p2 = p1[:10] + ref["tokens_1"][:3].tolist()
    full = LLM(path, n_ctx=128, n_threads=2)
    want = [full.generate(p, max_tokens=20, temperature=0, ignore_eos=True).tokens for p in (p1, p2)]
    for spec in (None, SpecConfig(types="ngram-simple", draft_max=4, ngram_n=1)):
        llm = LLM(path, n_ctx=128, n_threads=2, swa_full=False, speculative=spec)
        assert llm.ctx.kv_swa is not None
        assert [llm.generate(p, max_tokens=20, temperature=0, ignore_eos=True).tokens for p in (p1, p2)] == want


def test_gemma4_moe_block(converted, tmp_path):
    """gemma4 with its MoE block (4 experts, top 2, router scale and per-expert scales, GeGLU
    experts beside the dense FFN): the block matters, and pre-merged ffn_gate_up_exps give the
    same logits as split stacks."""
    from dataclasses import replace

    path, ref = converted["gemma4moe"]
    model = Model(path)
    a = model.args
    assert (a.n_expert, a.n_expert_used, a.n_ff_exp) == (4, 2, 16) and not a.merged_gate_up
    toks = ref["tokens_0"]
    base = ctx_of(model).decode(toks, logits="all")
    model.args = replace(a, n_expert=0)
    assert rel_err(ctx_of(model).decode(toks, logits="all"), ref["logits_0"]) > 1e-2
    model.args = a
    add, drop = {}, set()
    for i in range(a.n_layer):
        g, u = f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.ffn_up_exps.weight"
        add[f"blk.{i}.ffn_gate_up_exps.weight"] = np.concatenate([model.weights.f32(g), model.weights.f32(u)], axis=1)
        drop |= {g, u}
    merged = Model(_rewrite(path, tmp_path / "merged.gguf", drop=drop, add=add))
    assert merged.args.merged_gate_up
    assert np.array_equal(ctx_of(merged).decode(toks, logits="all"), base)


def test_gemma3_default_attention_scale():
    """Without attention.scale (llama.cpp's files) the scale is query_pre_attn_scalar ** -0.5 as
    llama.cpp assumes it: n_embd / n_head for the 62-layer 27B, the head size otherwise."""
    from pyfast.models.gemma3 import default_attn_scale

    assert abs(default_attn_scale(62, 5376, 32, 128) - 168 ** -0.5) < 1e-12
    assert default_attn_scale(34, 2560, 8, 256) == 256 ** -0.5
