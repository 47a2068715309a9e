"""The native GGUF reader: round trips against files written by the `gguf` package, and every
kind of malformed file raising GGUFError with a message that names the problem."""
from __future__ import annotations

import os
import pathlib
import random
import re
import struct
import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pyfast.gguf import GGUFError, GGUFReader, describe  # noqa: E402
from pyfast._loader import native  # noqa: E402

GT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType


rng = np.random.default_rng(0)
F32 = rng.standard_normal((3, 5, 8)).astype(np.float32)
F16 = rng.standard_normal((4, 6)).astype(np.float16)
Q8_SRC = rng.standard_normal((2, 64)).astype(np.float32)
Q8 = gguf.quants.quantize(Q8_SRC, QT.Q8_0)  # uint8 (2, 68)
I32 = np.arange(-5, 7, dtype=np.int32).reshape(3, 4)
BF16 = rng.integers(0, 2**16, size=(2, 3), dtype=np.uint16)
VEC = np.arange(10, dtype=np.float32)

# key -> (value, writer type, array element type)
METADATA = {
    "test.u8": (200, GT.UINT8, None),
    "test.i8": (-100, GT.INT8, None),
    "test.u16": (60000, GT.UINT16, None),
    "test.i16": (-30000, GT.INT16, None),
    "test.u32": (4_000_000_000, GT.UINT32, None),
    "test.i32": (-2_000_000_000, GT.INT32, None),
    "test.u64": (2**64 - 1, GT.UINT64, None),
    "test.i64": (-(2**63), GT.INT64, None),
    "test.f32": (0.1, GT.FLOAT32, None),
    "test.f64": (0.1, GT.FLOAT64, None),
    "test.true": (True, GT.BOOL, None),
    "test.false": (False, GT.BOOL, None),
    "test.str": ("héllo ✓ wörld", GT.STRING, None),
    "test.empty_str": ("", GT.STRING, None),
    "test.arr_i8": ([-1, 2, -3], GT.ARRAY, GT.INT8),
    "test.arr_u64": ([0, 2**64 - 1], GT.ARRAY, GT.UINT64),
    "test.arr_f32": ([0.5, -1.25, 0.1], GT.ARRAY, GT.FLOAT32),
    "test.arr_f64": ([0.1, 1e300], GT.ARRAY, GT.FLOAT64),
    "test.arr_bool": ([True, False, True], GT.ARRAY, GT.BOOL),
    "test.arr_str": (["a", "", "ĠHello", "<|im_end|>"], GT.ARRAY, GT.STRING),
    "test.nested": ([[1, 2, 3], [4], [5, 6]], GT.ARRAY, None),
    "test.nested_str": ([["x", "y"], ["z"]], GT.ARRAY, None),
}


def _expected(value, vtype, sub):
    """The value as the reader returns it (float32 values rounded to float32)."""
    if vtype == GT.FLOAT32:
        return float(np.float32(value))
    if vtype == GT.ARRAY and sub == GT.FLOAT32:
        return [float(np.float32(v)) for v in value]
    return value


def write_gguf(path, *, metadata=METADATA, tensors=None, alignment=None):
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (value, vtype, sub) in metadata.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    if tensors is None:
        tensors = {
            "t.f32": (F32, None),
            "t.f16": (F16, None),
            "t.q8": (Q8, QT.Q8_0),
            "t.i32": (I32, None),
            "t.bf16": (BF16, QT.BF16),
            "t.vec": (VEC, None),
        }
    for name, (arr, raw) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf")


@pytest.fixture()
def corrupt(good, tmp_path):
    """corrupt(fn) -> path of a copy of the good file with fn(bytearray) applied."""

    def make(fn):
        data = bytearray(good.read_bytes())
        out = fn(data)
        if out is not None:
            data = out
        p = tmp_path / "bad.gguf"
        p.write_bytes(bytes(data))
        return p

    return make


def expect_error(path, pattern):
    with pytest.raises(GGUFError) as ei:
        native.GGUFFile(path)
    msg = str(ei.value)
    assert msg.startswith(str(path) + ": "), msg
    assert re.search(pattern, msg), msg
    assert isinstance(ei.value, ValueError)
    return msg


# --- locating fields in a file written by GGUFWriter ---------------------------------------------

def _gguf_str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def tensor_info_pos(data: bytes, name: str):
    """(offset of n_dims, n_dims) of the tensor-index entry for `name`."""
    key = _gguf_str(name)
    i = bytes(data).rindex(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, i)
    return i, n_dims


def tensor_type_pos(data, name):
    i, n = tensor_info_pos(data, name)
    return i + 4 + 8 * n


def tensor_offset_pos(data, name):
    return tensor_type_pos(data, name) + 4


def kv_value_pos(data, key):
    """Offset of the value type (u32) that follows `key`."""
    k = _gguf_str(key)
    return bytes(data).index(k) + len(k)


def header_end(path) -> int:
    f = native.GGUFFile(path)
    last = f.tensors[-1]
    return last.offset + last.nbytes, f.data_offset


# --- round trips ----------------------------------------------------------------------------------

def test_metadata_round_trip(good):
    r = GGUFReader(good)
    assert r.version == 3
    assert r.alignment == 32
    assert r.architecture == "llama"
    assert list(r.metadata)[0] == "general.architecture"
    for key, (value, vtype, sub) in METADATA.items():
        got = r.metadata[key]
        assert got == _expected(value, vtype, sub), key
        assert type(got) is type(_expected(value, vtype, sub)), key
    assert list(r.metadata)[1:] == list(METADATA)  # file order kept
    assert r.get("test.u8") == 200 and r.get("missing", 7) == 7 and r.get("missing") is None
    assert r.metadata_types["test.u32"] == "uint32"
    assert r.metadata_types["test.arr_str"] == "array[string]"
    assert r.metadata_types["test.nested"] == "array[array[int32]]"
    assert "test.str" in r and "nope" not in r


def test_metadata_dict_cached(good):
    f = native.GGUFFile(good)
    assert f.metadata is f.metadata
    assert f.tensors is f.tensors


def test_tensor_index_and_values(good):
    r = GGUFReader(good)
    assert list(r.tensors) == ["t.f32", "t.f16", "t.q8", "t.i32", "t.bf16", "t.vec"]
    expect = {
        "t.f32": (0, "F32", F32.shape, F32.nbytes),
        "t.f16": (1, "F16", F16.shape, F16.nbytes),
        "t.q8": (8, "Q8_0", Q8_SRC.shape, Q8.nbytes),
        "t.i32": (26, "I32", I32.shape, I32.nbytes),
        "t.bf16": (30, "BF16", BF16.shape, BF16.nbytes),
        "t.vec": (0, "F32", VEC.shape, VEC.nbytes),
    }
    data = good.read_bytes()
    for name, (tid, tname, shape, nbytes) in expect.items():
        t = r.tensors[name]
        assert (t.name, t.type, t.type_name, t.shape, t.nbytes) == (name, tid, tname, shape, nbytes)
        assert t.n_elements == int(np.prod(shape))
        assert t.offset % 32 == 0 and t.offset >= r.data_offset
        b = r.tensor_bytes(name)
        assert b.dtype == np.uint8 and b.shape == (nbytes,)
        assert bytes(b) == data[t.offset:t.offset + nbytes]

    np.testing.assert_array_equal(r.tensor_array("t.f32"), F32)
    np.testing.assert_array_equal(r.tensor_array("t.f16"), F16)
    np.testing.assert_array_equal(r.tensor_array("t.i32"), I32)
    np.testing.assert_array_equal(r.tensor_array("t.bf16"), BF16)
    np.testing.assert_array_equal(r.tensor_array("t.vec"), VEC)
    assert r.tensor_array("t.f32").dtype == np.float32
    assert r.tensor_array("t.bf16").dtype == np.uint16
    np.testing.assert_array_equal(r.tensor_bytes("t.q8"), Q8.reshape(-1))
    np.testing.assert_array_equal(
        gguf.quants.dequantize(r.tensor_bytes("t.q8").reshape(Q8.shape), QT.Q8_0),
        gguf.quants.dequantize(Q8, QT.Q8_0),
    )
    with pytest.raises(ValueError, match="quantized type Q8_0"):
        r.tensor_array("t.q8")
    with pytest.raises(KeyError, match="no tensor named 'nope'"):
        r.tensor_bytes("nope")


def test_tensor_data_zero_copy_read_only_and_outlives_close(good):
    r = GGUFReader(good)
    a = r.tensor_array("t.f32")
    b = r.tensor_bytes("t.vec")
    assert not a.flags.writeable and not b.flags.writeable
    with pytest.raises(ValueError):
        a[0, 0, 0] = 1.0
    # Two views of the same tensor share memory (no copy).
    assert np.shares_memory(r.tensor_bytes("t.f32"), r.tensor_bytes("t.f32"))
    r.close()
    del r
    import gc

    gc.collect()
    np.testing.assert_array_equal(a, F32)  # the mapping is still alive through the arrays
    np.testing.assert_array_equal(b.view(np.float32), VEC)

    f = native.GGUFFile(good)
    with f:
        assert not f.closed
    assert f.closed
    with pytest.raises(ValueError, match="closed"):
        f.tensor_data("t.f32")
    with pytest.raises(ValueError, match="closed"):
        f.metadata


def test_pathlike_and_bytes_path(good):
    assert native.GGUFFile(pathlib.Path(good)).path == str(good)
    assert native.GGUFFile(os.fsencode(good)).path == str(good)


def test_version_2_and_custom_alignment(tmp_path):
    p = write_gguf(tmp_path / "a64.gguf", alignment=64)
    r = GGUFReader(p)
    assert r.alignment == 64 and r.data_offset % 64 == 0
    assert all(t.offset % 64 == 0 for t in r.tensors.values())
    np.testing.assert_array_equal(r.tensor_array("t.f16"), F16)

    data = bytearray(p.read_bytes())
    struct.pack_into("<I", data, 4, 2)
    p2 = tmp_path / "v2.gguf"
    p2.write_bytes(bytes(data))
    r2 = GGUFReader(p2)
    assert r2.version == 2
    assert r2.metadata == r.metadata
    np.testing.assert_array_equal(r2.tensor_array("t.f32"), F32)


def test_no_tensors_and_raw_edge_cases(tmp_path):
    # Built by hand: an empty array and invalid UTF-8, which GGUFWriter cannot write.
    kv = _gguf_str("empty") + struct.pack("<IIQ", GT.ARRAY, GT.INT32, 0)
    kv += _gguf_str("bad_utf8") + struct.pack("<IQ", GT.STRING, 3) + b"a\xffb"
    kv += _gguf_str("nested_empty") + struct.pack("<IIQ", GT.ARRAY, GT.ARRAY, 1)
    kv += struct.pack("<IQ", GT.UINT8, 0)
    p = tmp_path / "raw.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 3) + kv)
    f = native.GGUFFile(p)
    assert f.metadata["empty"] == []
    assert f.metadata["nested_empty"] == [[]]
    s = f.metadata["bad_utf8"]
    assert s.encode("utf-8", "surrogateescape") == b"a\xffb"  # lossless
    assert f.tensors == []


def test_describe(good):
    text = describe(good)
    assert "architecture: llama" in text
    assert "test.arr_str" in text and "t.q8" in text and "Q8_0" in text and "2 x 64" in text
    assert describe(GGUFReader(good)).count("\n") > 10


def test_describe_abbreviates_big_arrays(tmp_path):
    meta = {
        "test.long": (list(range(100_000)), GT.ARRAY, GT.INT32),
        "test.long_str": ("x" * 5000, GT.STRING, None),
    }
    text = describe(write_gguf(tmp_path / "big.gguf", metadata=meta))
    assert "100000 items" in text and "5000 chars" in text
    assert len(text) < 5000


# --- malformed files ------------------------------------------------------------------------------

def test_missing_file_is_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        native.GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(IsADirectoryError):
        native.GGUFFile(tmp_path)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    expect_error(p, "empty file")


def test_bad_magic(corrupt):
    def fn(d):
        d[0:4] = b"GGML"

    expect_error(corrupt(fn), "not a GGUF file .*magic 'GGML'")


@pytest.mark.parametrize("version", [1, 4, 0x03000000])
def test_unsupported_version(corrupt, version):
    p = corrupt(lambda d: struct.pack_into("<I", d, 4, version))
    expect_error(p, "big-endian" if version == 0x03000000 else f"unsupported GGUF version {version}")


def _cut_points(good):
    data = good.read_bytes()
    str_val = kv_value_pos(data, "test.str") + 4 + 8 + 3  # inside the string's bytes
    arr = kv_value_pos(data, "test.arr_str") + 4 + 4 + 8 + 5  # inside the string array
    nested = kv_value_pos(data, "test.nested") + 4 + 4 + 8 + 4 + 8 + 2  # inside a nested array
    ti_name = tensor_info_pos(data, "t.vec")[0] - 2  # inside the last tensor's name
    ti_dims = tensor_info_pos(data, "t.i32")[0] + 6  # inside the dims
    ti_off = tensor_offset_pos(data, "t.vec") + 3  # inside the last offset
    data_end, data_start = header_end(good)
    return {
        "header": (10, "truncated|cannot fit"),
        "string": (str_val, r"truncated.*'test\.str'"),
        "string array": (arr, r"truncated.*'test\.arr_str'"),
        "nested array": (nested, r"truncated.*'test\.nested'"),
        "tensor name": (ti_name, r"truncated.*tensor info #5"),
        "tensor dims": (ti_dims, r"truncated.*tensor 't\.i32'"),
        "tensor offset": (ti_off, r"truncated.*tensor 't\.vec'"),
        "before data": (data_start, r"tensor 't\.f32' data .*runs past the end of the file"),
        "inside data": (data_end - 4, r"tensor 't\.vec' data .*runs past the end of the file"),
    }


@pytest.mark.parametrize(
    "where",
    ["header", "string", "string array", "nested array", "tensor name", "tensor dims",
     "tensor offset", "before data", "inside data"],
)
def test_truncated(good, tmp_path, where):
    cut, pattern = _cut_points(good)[where]
    p = tmp_path / "cut.gguf"
    p.write_bytes(good.read_bytes()[:cut])
    expect_error(p, pattern)


def test_truncated_everywhere(good, tmp_path):
    """Every possible cut either raises GGUFError or (when only trailing padding is cut) opens."""
    data = good.read_bytes()
    data_end, _ = header_end(good)
    p = tmp_path / "cut.gguf"
    for cut in range(1, len(data)):
        p.write_bytes(data[:cut])
        if cut >= data_end:
            native.GGUFFile(p)
        else:
            with pytest.raises(GGUFError):
                native.GGUFFile(p)


def test_offset_past_end(corrupt, good):
    size = good.stat().st_size
    p = corrupt(lambda d: struct.pack_into("<Q", d, tensor_offset_pos(d, "t.f16"), size * 32))
    msg = expect_error(p, r"tensor 't\.f16' data \(offset \d+, 48 bytes\) runs past the end of the "
                          rf"file \(size {size}\)")
    p = corrupt(lambda d: struct.pack_into("<Q", d, tensor_offset_pos(d, "t.f16"), 2**64 - 32))
    expect_error(p, r"tensor 't\.f16' data .* runs past the end")


def test_offset_not_aligned(corrupt):
    def fn(d):
        i = tensor_offset_pos(d, "t.f16")
        struct.pack_into("<Q", d, i, struct.unpack_from("<Q", d, i)[0] + 4)

    expect_error(corrupt(fn), r"tensor 't\.f16' data offset \d+ is not a multiple of the alignment 32")


def test_shape_larger_than_data(corrupt):
    # The last tensor claims more elements than the file holds.
    def fn(d):
        i, n = tensor_info_pos(d, "t.vec")
        struct.pack_into("<Q", d, i + 4, 10_000)

    expect_error(corrupt(fn), r"tensor 't\.vec' data \(offset \d+, 40000 bytes\) runs past the end")


def test_innermost_not_multiple_of_block(corrupt):
    def fn(d):
        i, n = tensor_info_pos(d, "t.q8")
        struct.pack_into("<Q", d, i + 4, 33)  # GGUF order: ne[0] is the innermost dim

    expect_error(corrupt(fn), r"tensor 't\.q8' \(Q8_0\): innermost dimension 33 is not a multiple "
                              r"of the block size 32")


def test_unknown_dtype(corrupt):
    p = corrupt(lambda d: struct.pack_into("<I", d, tensor_type_pos(d, "t.i32"), 99))
    expect_error(p, r"tensor 't\.i32' has unknown ggml type id 99")


def test_too_many_dims(corrupt):
    p = corrupt(lambda d: struct.pack_into("<I", d, tensor_info_pos(d, "t.f32")[0], 5))
    expect_error(p, r"tensor 't\.f32' has 5 dimensions \(at most 4")


@pytest.mark.parametrize("value,shown", [(0, "0"), (2**63, str(-(2**63)))])
def test_bad_dim(corrupt, value, shown):
    def fn(d):
        i, _ = tensor_info_pos(d, "t.f32")
        struct.pack_into("<Q", d, i + 4 + 8, value)

    expect_error(corrupt(fn), rf"tensor 't\.f32' has invalid dimension {shown} \(ne\[1\]\)")


def test_element_count_overflow(corrupt):
    def fn(d):
        i, n = tensor_info_pos(d, "t.f32")
        assert n == 3
        struct.pack_into("<QQQ", d, i + 4, 2**32, 2**31, 2**31)

    expect_error(corrupt(fn), r"tensor 't\.f32'.*overflow")


def test_duplicate_tensor_name(corrupt):
    def fn(d):
        i = bytes(d).rindex(_gguf_str("t.f16"))
        d[i + 8:i + 13] = b"t.f32"

    expect_error(corrupt(fn), r"duplicate tensor name 't\.f32'")


def test_duplicate_metadata_key(corrupt):
    def fn(d):
        i = bytes(d).index(_gguf_str("test.i8"))
        d[i + 8:i + 15] = b"test.u8"

    expect_error(corrupt(fn), r"duplicate metadata key 'test\.u8'")


def test_huge_string_length(corrupt):
    p = corrupt(lambda d: struct.pack_into("<Q", d, kv_value_pos(d, "test.str") + 4, 2**63))
    expect_error(p, rf"'test\.str'.* has length {2**63}.*bytes are left")
    # a key's length
    p = corrupt(lambda d: struct.pack_into("<Q", d, bytes(d).index(_gguf_str("test.u16")), 2**64 - 1))
    expect_error(p, r"metadata pair #\d+.* has length 18446744073709551615")
    # a tensor name's length
    p = corrupt(lambda d: struct.pack_into("<Q", d, bytes(d).rindex(_gguf_str("t.q8")), 10**12))
    expect_error(p, r"tensor info #2.* has length 1000000000000")


def test_huge_array_count(corrupt):
    for key in ("test.arr_str", "test.arr_u64", "test.nested"):
        p = corrupt(lambda d: struct.pack_into("<Q", d, kv_value_pos(d, key) + 8, 2**62))
        expect_error(p, rf"array of {2**62} \w+ elements \(metadata '{re.escape(key)}'\)")


def test_huge_counts_in_header(corrupt):
    expect_error(corrupt(lambda d: struct.pack_into("<Q", d, 8, 2**60)), "cannot fit")
    expect_error(corrupt(lambda d: struct.pack_into("<Q", d, 16, 2**60)), "cannot fit")


def test_unknown_value_types(corrupt):
    p = corrupt(lambda d: struct.pack_into("<I", d, kv_value_pos(d, "test.u32"), 13))
    expect_error(p, r"metadata 'test\.u32' has unknown value type 13")
    p = corrupt(lambda d: struct.pack_into("<I", d, kv_value_pos(d, "test.arr_i8") + 4, 77))
    expect_error(p, r"unknown array element type 77 \(metadata 'test\.arr_i8'\)")


@pytest.mark.parametrize("align", [0, 3, 48])
def test_bad_alignment(tmp_path, align):
    p = write_gguf(tmp_path / "a.gguf", alignment=64)
    data = bytearray(p.read_bytes())
    struct.pack_into("<I", data, kv_value_pos(data, "general.alignment") + 4, align)
    p.write_bytes(bytes(data))
    expect_error(p, rf"general\.alignment {align} is not a power of two")


def test_random_corruption_never_crashes(good, tmp_path):
    """Random byte flips in the header region: each file opens or raises GGUFError, and when
    it opens, its metadata and tensors convert without error."""
    data = good.read_bytes()
    _, data_start = header_end(good)
    r = random.Random(1234)
    p = tmp_path / "fuzz.gguf"
    n_err = 0
    for _ in range(1500):
        d = bytearray(data)
        for _ in range(r.randint(1, 4)):
            i = r.randrange(data_start)
            d[i] = r.choice([0, 0xFF, 0x7F, 0x80, r.randrange(256)])
        p.write_bytes(bytes(d))
        try:
            f = native.GGUFFile(p)
        except GGUFError:
            n_err += 1
            continue
        f.metadata, f.metadata_types
        for t in f.tensors:
            assert f.tensor_data(t.name).nbytes == t.nbytes
    assert n_err > 100


# --- the real model -------------------------------------------------------------------------------

def test_smollm2_metadata(smollm2_path):
    t0 = time.perf_counter()
    r = GGUFReader(smollm2_path)
    md = r.metadata
    dt = time.perf_counter() - t0
    print(f"\nSmolLM2 GGUFReader open + metadata: {dt * 1e3:.1f} ms")
    assert r.architecture == "llama"
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and all(isinstance(t, str) for t in tokens[:100])
    assert tokens[0] == "<|endoftext|>"
    assert len(md["tokenizer.ggml.token_type"]) == 49152
    assert md["llama.block_count"] == 30 and md["llama.embedding_length"] == 576
    emb = r.tensors["token_embd.weight"]
    assert (emb.type_name, emb.shape) == ("Q8_0", (49152, 576))
    assert emb.nbytes == 49152 * 576 // 32 * 34
    assert r.tensor_array("output_norm.weight").shape == (576,)
    assert len(describe(r)) < 100_000
