"""`pyfast quantize`: the GGUF writer (read back by gguf-py and by our reader), the native tensor
quantizer (round-trip error against ggml's reference quantizers), llama-quantize's type-mix
rules, quantized tiny models against the numpy reference, and the quantized SmolLM2's perplexity.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pyfast import quantize as Q  # noqa: E402
from pyfast._loader import native as N  # noqa: E402
from pyfast.gguf import GGUFReader  # noqa: E402
from pyfast.gguf.writer import GGUFWriter, infer_type  # noqa: E402
from tests.reference.llama_numpy import LlamaRef  # noqa: E402
from tests.reference.tiny_gguf import write_tiny_llama  # noqa: E402

QT = gguf.GGMLQuantizationType
GT = gguf.GGUFValueType
DT = N.DType
REF_TYPES = (DT.Q4_0, DT.Q4_1, DT.Q5_0, DT.Q5_1, DT.Q8_0)
K_TYPES = (DT.Q4_K, DT.Q5_K, DT.Q6_K)


def rmse(a, b) -> float:
    return float(np.sqrt(np.mean((np.asarray(a, np.float64) - b) ** 2)))


def roundtrip(dt, x: np.ndarray) -> np.ndarray:
    raw = N.quantize_tensor(dt, x, 2)
    return np.asarray(N.dequantize_tensor(dt, raw, x.shape[0], x.shape[1]))


def _sample_data():
    rng = np.random.default_rng(3)
    return {
        "gauss": (rng.standard_normal((64, 1024)) * 0.02).astype(np.float32),
        "student_t3": (rng.standard_t(3, (64, 1024)) * 0.02).astype(np.float32),
    }


# --------------------------------------------------------------------------------------------
# the writer
# --------------------------------------------------------------------------------------------

META = {
    "t.u8": (200, "uint8", GT.UINT8), "t.i8": (-100, "int8", GT.INT8), "t.u16": (60000, "uint16", GT.UINT16),
    "t.i16": (-30000, "int16", GT.INT16), "t.u32": (4_000_000_000, "uint32", GT.UINT32),
    "t.i32": (-2_000_000_000, "int32", GT.INT32), "t.f32": (1.5, "float32", GT.FLOAT32),
    "t.bool": (True, "bool", GT.BOOL), "t.str": ("héllo \udcff", "string", GT.STRING),
    "t.u64": (2**64 - 1, "uint64", GT.UINT64), "t.i64": (-2**62, "int64", GT.INT64),
    "t.f64": (0.1, "float64", GT.FLOAT64), "t.arr_i32": ([1, -2, 3], "array[int32]", GT.ARRAY),
    "t.arr_str": (["a", "", "ü"], "array[string]", GT.ARRAY), "t.arr_f32": ([0.5, 2.0], "array[float32]", GT.ARRAY),
    "t.arr_empty": ([], "array[uint8]", GT.ARRAY), "t.arr_bool": ([True, False], "array[bool]", GT.ARRAY),
    "t.nested": ([[1, 2], [3]], "array[array[uint16]]", GT.ARRAY),
}


def test_writer_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f16 = rng.standard_normal((4, 64)).astype(np.float16)
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), QT.Q8_0)
    q4k = np.asarray(N.quantize_tensor(DT.Q4_K, rng.standard_normal((3, 256)).astype(np.float32)))
    path = tmp_path / "w.gguf"
    w = GGUFWriter(path)
    w.add("general.alignment", 64, "uint32")
    for k, (v, t, _) in META.items():
        w.add(k, v, t)
    w.add("t.inferred", [1, 2])
    w.add_tensor("a", DT.F32, f32.shape, f32)
    w.add_tensor("b", DT.F16, f16.shape, f16)
    w.add_tensor("c", DT.Q8_0, (2, 64), q8)
    w.add_tensor("d", DT.Q4_K, (3, 256), lambda: q4k)  # produced while writing
    w.write()

    r = gguf.GGUFReader(str(path))
    for k, (v, t, gt) in META.items():
        f = r.fields[k]
        assert f.types[0] == gt, k
        if gt == GT.ARRAY and k != "t.nested":
            got = f.contents()
            assert (got == v) if not isinstance(v[0] if v else 0, float) else np.allclose(got, v), k
        elif gt not in (GT.ARRAY, GT.STRING, GT.FLOAT32, GT.FLOAT64):
            assert f.contents() == v, k
    assert r.fields["t.inferred"].types == [GT.ARRAY, GT.INT32]
    assert r.alignment == 64
    by = {t.name: t for t in r.tensors}
    for name, typ, shape, data in (("a", QT.F32, (3, 5), f32), ("b", QT.F16, (4, 64), f16), ("c", QT.Q8_0, (2, 64), q8),
                                   ("d", QT.Q4_K, (3, 256), q4k)):
        t = by[name]
        assert t.tensor_type == typ and tuple(int(s) for s in reversed(t.shape)) == shape, name
        assert (t.data_offset - r.data_offset) % 64 == 0
        assert np.asarray(t.data).tobytes() == np.asarray(data).tobytes(), name

    ours = GGUFReader(path)
    for k, (v, t, _) in META.items():
        assert ours.metadata_types[k] == t, k
        if t.endswith("float32"):
            assert ours.metadata[k] == pytest.approx(v)
        elif t.endswith("array[float32]"):
            assert ours.metadata[k] == pytest.approx(v)
        else:
            assert ours.metadata[k] == v, k
    assert ours.tensors["d"].type_name == "Q4_K" and ours.tensors["d"].shape == (3, 256)
    assert ours.tensor_bytes("d").tobytes() == q4k.tobytes()


def test_writer_rejects_bad_input(tmp_path):
    w = GGUFWriter(tmp_path / "x.gguf")
    with pytest.raises(ValueError):
        w.add("k", 300, "uint8")
    with pytest.raises(TypeError):
        w.add("k", "s", "uint32")
    with pytest.raises(TypeError):
        w.add("k", 1, "nope")
    with pytest.raises(TypeError):
        infer_type(object())
    w.add_tensor("a", DT.F32, (2, 3), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="duplicate"):
        w.add_tensor("a", DT.F32, (2, 3), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="bytes"):
        w.add_tensor("b", DT.F32, (2, 3), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="block size"):
        w.add_tensor("c", DT.Q6_K, (2, 128), np.zeros(2 * 105, np.uint8))
    w.add_tensor("lazy", DT.F32, (4,), lambda: np.zeros(3, np.float32))  # wrong size, found at write
    with pytest.raises(ValueError, match="lazy"):
        w.write()
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.tmp").exists()


def test_writer_copies_real_metadata(tmp_path, smollm2_path):
    src = GGUFReader(smollm2_path)
    w = GGUFWriter(tmp_path / "m.gguf")
    w.copy_metadata(src)
    w.add_tensor("x", DT.F32, (4,), np.arange(4, dtype=np.float32))
    w.write()
    out = GGUFReader(tmp_path / "m.gguf")
    assert out.metadata_types == src.metadata_types
    assert out.metadata == src.metadata  # tokenizer vocab, merges, token types, chat template
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert len(r.fields["tokenizer.ggml.tokens"].data) == len(src.metadata["tokenizer.ggml.tokens"])


# --------------------------------------------------------------------------------------------
# the native quantizer
# --------------------------------------------------------------------------------------------


def test_quantize_tensor_threads_and_errors():
    x = np.random.default_rng(1).standard_normal((37, 512)).astype(np.float32)
    for dt in REF_TYPES + K_TYPES:
        one = np.asarray(N.quantize_tensor(dt, x, 1))
        assert one.shape == (37, N.dtype_row_size(dt, 512))
        assert np.asarray(N.quantize_tensor(dt, x, 3)).tobytes() == one.tobytes()
        assert np.asarray(N.quantize_tensor(dt, x.reshape(37, 2, 256)[:, :, :].reshape(37, 512), 2)).tobytes() \
            == one.tobytes()
    with pytest.raises(ValueError, match="multiple"):
        N.quantize_tensor(DT.Q4_K, x[:, :96], 1)
    with pytest.raises(ValueError):
        N.quantize_tensor(DT.Q8_1, x, 1)
    with pytest.raises(ValueError):
        N.dequantize_tensor(DT.Q4_K, np.zeros(10, np.uint8), 1, 256)


@pytest.mark.parametrize("dt", REF_TYPES, ids=lambda d: d.name)
def test_32block_quantizers_reach_reference_error(dt):
    """The tensor quantizer's round trip error is at most that of ggml's reference quantizer
    (gguf.quants, bit-exact with ggml): Q8_0 is the reference itself; Q4_0/Q4_1/Q5_0/Q5_1 search
    the block scale (and min) and come out lower."""
    for name, x in _sample_data().items():
        ref = gguf.quants.quantize(x, getattr(QT, dt.name))
        e_ref = rmse(gguf.quants.dequantize(ref, getattr(QT, dt.name)), x)
        e_ours = rmse(roundtrip(dt, x), x)
        if dt == DT.Q8_0:
            assert np.asarray(N.quantize_tensor(dt, x, 2)).tobytes() == ref.tobytes()
        else:
            assert e_ours < 0.99 * e_ref, (name, e_ours, e_ref)


def _libggml():
    """llama.cpp's ggml-base library when a build is around (PYFAST_LLAMACPP_LIB or the usual
    build folders), for comparing with its reference K-quant quantizers."""
    cands = [os.environ.get("PYFAST_LLAMACPP_LIB", ""), "/work/llamacpp/build/bin/libggml-base.so",
             str(Path.home() / "llama.cpp/build/bin/libggml-base.so")]
    for c in cands:
        if c and os.path.exists(c):
            lib = ctypes.CDLL(c)
            lib.ggml_quantize_chunk.restype = ctypes.c_size_t
            lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            return lib
    return None


@pytest.mark.parametrize("dt", K_TYPES, ids=lambda d: d.name)
def test_kquant_error_vs_llamacpp(dt, smollm2_path):
    """The K-quant quantizers reach llama.cpp's reference round-trip error (within 5%; they come
    out slightly lower) on random data and on SmolLM2 ffn_down matrices."""
    lib = _libggml()
    if lib is None:
        pytest.skip("no llama.cpp build (libggml-base.so) found; set PYFAST_LLAMACPP_LIB to compare")
    r = GGUFReader(smollm2_path)
    data = _sample_data()
    for name in ("blk.0.ffn_down.weight", "blk.17.ffn_down.weight"):
        t = r.tensors[name]
        data[name] = np.asarray(N.dequantize_tensor(DT(t.type), r.tensor_bytes(name), *t.shape))
    for name, x in data.items():
        x = np.ascontiguousarray(x, np.float32)
        theirs = np.zeros(x.shape[0] * N.dtype_row_size(dt, x.shape[1]), np.uint8)
        lib.ggml_quantize_chunk(int(dt), x.ctypes.data, theirs.ctypes.data, 0, x.shape[0], x.shape[1], None)
        e_theirs = rmse(N.dequantize_tensor(dt, theirs, *x.shape), x)
        e_ours = rmse(roundtrip(dt, x), x)
        assert e_ours <= 1.05 * e_theirs, (name, e_ours, e_theirs)


# --------------------------------------------------------------------------------------------
# type mixes
# --------------------------------------------------------------------------------------------


def _types(path, ftype, **kw) -> dict:
    return {p.name: p.dst_type for p in Q.tensor_types(GGUFReader(path), ftype, **kw)}


def test_mix_rules_q4_k_m(tmp_path):
    p = tmp_path / "t.gguf"
    write_tiny_llama(p, n_vocab=64, n_embd=256, n_layer=8, n_head=4, n_head_kv=2, n_ff=512, tied=True)
    t = _types(p, "Q4_K_M")
    more = [i for i in range(8) if Q.use_more_bits(i, 8)]
    assert more == [0, 3, 6, 7]
    assert t["token_embd.weight"] == "Q6_K"  # tied: the output rule
    for i in range(8):
        want = "Q6_K" if i in more else "Q4_K"
        assert t[f"blk.{i}.attn_v.weight"] == want and t[f"blk.{i}.ffn_down.weight"] == want, i
        assert t[f"blk.{i}.attn_q.weight"] == t[f"blk.{i}.ffn_up.weight"] == "Q4_K"
        assert t[f"blk.{i}.attn_norm.weight"] == "F32"
    t5 = _types(p, "Q5_K_M")
    assert t5["blk.1.attn_q.weight"] == "Q5_K" and t5["blk.0.ffn_down.weight"] == "Q6_K"
    ts = _types(p, "Q4_K_S")
    assert [ts[f"blk.{i}.attn_v.weight"] for i in range(8)] == ["Q5_K"] * 4 + ["Q4_K"] * 4
    assert ts["blk.0.ffn_down.weight"] == "Q5_K" and ts["blk.1.ffn_down.weight"] == "Q4_K"
    assert set(_types(p, "Q8_0").values()) == {"Q8_0", "F32"}
    t40 = _types(p, "Q4_0")
    assert t40["token_embd.weight"] == "Q6_K" and t40["blk.0.attn_v.weight"] == "Q4_0"
    assert set(_types(p, "F16").values()) == {"F16", "F32"}


def test_mix_rules_fallbacks_and_quantized_sources(tmp_path):
    p = tmp_path / "t96.gguf"  # 96 columns: no 256-element super-blocks
    write_tiny_llama(p, n_vocab=64, n_embd=96, n_layer=8, n_head=4, n_head_kv=2, n_ff=128, tied=False)
    t = _types(p, "Q4_K_M")
    assert t["output.weight"] == "Q8_0" and t["token_embd.weight"] == "Q5_0"
    assert t["blk.0.attn_v.weight"] == "Q8_0" and t["blk.1.attn_v.weight"] == "Q5_0"
    assert t["blk.1.ffn_down.weight"] == "Q5_0"  # 128 columns
    assert _types(p, "Q5_K_M")["blk.1.attn_q.weight"] == "Q5_1"
    # A Q4_1 source: the fallbacks / upgrades would not be smaller than Q4_1, so it is kept
    # unless llama-quantize's exact choice is asked for.
    pq = tmp_path / "t96q.gguf"
    write_tiny_llama(pq, n_vocab=64, n_embd=96, n_layer=8, n_head=4, n_head_kv=2, n_ff=128, wtype="q4_1")
    kept = _types(pq, "Q4_K_M")
    assert kept["blk.1.attn_q.weight"] == "Q4_1" and kept["blk.0.attn_v.weight"] == "Q4_1"
    exact = _types(pq, "Q4_K_M", keep_quantized=False)
    assert exact["blk.1.attn_q.weight"] == "Q5_0" and exact["blk.0.attn_v.weight"] == "Q8_0"
    assert _types(pq, "Q8_0")["blk.1.attn_q.weight"] == "Q8_0"  # the base type is always produced
    with pytest.raises(ValueError, match="unknown quantization type"):
        _types(p, "Q3_K_XL")


@pytest.fixture(scope="module")
def tiny256(tmp_path_factory):
    p = tmp_path_factory.mktemp("q") / "tiny256-f32.gguf"
    write_tiny_llama(p, n_vocab=96, n_embd=256, n_layer=4, n_head=4, n_head_kv=2, n_ff=512, tied=False, seed=4)
    return p


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q5_0", "Q5_1"])
def test_quantized_tiny_model_matches_reference(tiny256, tmp_path, ftype):
    """Quantize a tiny model; the file reads back with gguf-py with the planned types, and
    pyfast's logits match the numpy reference run on the same (dequantized) weights."""
    from pyfast.context import Context
    from pyfast.models import Model

    out = tmp_path / f"tiny-{ftype}.gguf"
    res = Q.quantize(str(tiny256), str(out), ftype, 2, with_rmse=True)
    planned = {p.name: p.dst_type for p in res.plans}
    r = gguf.GGUFReader(str(out))
    assert {t.name: t.tensor_type.name for t in r.tensors} == planned
    assert r.fields["general.file_type"].contents() == Q.FTYPES[ftype][0]
    assert all(e > 0 for e in res.rmse.values())
    ctx = Context(Model(out), n_ctx=64, n_threads=2, kv_dtype=N.DType.F32)
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    got = ctx.decode(toks, logits="all")
    want = LlamaRef(out).logits(toks)
    assert np.abs(got - want).max() / np.abs(want).max() < 3e-2


def test_cli_quantize(tiny256, tmp_path, capsys):
    from pyfast.cli import main

    out = tmp_path / "cli.gguf"
    assert main(["quantize", str(tiny256), str(out), "q4_k_m", "-t", "2"]) == 0
    text = capsys.readouterr().out
    assert "Q4_K: " in text and "Q6_K: " in text and "blk.0.ffn_down.weight" in text
    assert GGUFReader(out).tensors["blk.1.attn_q.weight"].type_name == "Q4_K"
    assert main(["quantize", str(tiny256), str(tiny256), "q8_0"]) == 1  # same file: refused
    assert main(["quantize", str(tiny256), str(tmp_path / "bad.gguf"), "q9_z"]) == 1
    assert "unknown quantization type" in capsys.readouterr().err and not (tmp_path / "bad.gguf").exists()


# --------------------------------------------------------------------------------------------
# SmolLM2: quantized files keep the perplexity
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
def test_smollm2_quantized_perplexity(smollm2_path, shared_dir, llamacpp_ref, tmp_path, ftype):
    """The Q4_1 SmolLM2 re-quantized keeps its perplexity within 2% (Q8_0: every matrix
    re-encoded; Q4_K_M: ffn_down in Q4_K, the rest kept since no fallback type is smaller than
    the Q4_1 source)."""
    from pyfast.llm import LLM

    out = tmp_path / f"smollm2-{ftype}.gguf"
    Q.quantize(str(smollm2_path), str(out), ftype, 2)
    text = (shared_dir / "refs" / "ppl_text.txt").read_text(encoding="utf-8")
    res = LLM(out, n_ctx=512, n_threads=2).perplexity(text, n_ctx=512)
    base = llamacpp_ref["perplexity"]["ppl"]  # the Q4_1 file's figure
    assert abs(res.ppl - base) / base < 0.02, (ftype, res.ppl, base)
