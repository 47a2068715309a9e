"""Weights read into memory with some tensors left in the file's mapping (models/base.py,
Weights._keep_mapped): the copy holds only the other tensors, every tensor still reads as the
file's bytes, and the logits do not change."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast._loader import native

PROMPT = [1, 504, 3458, 282, 2940, 30]


@pytest.fixture(scope="module")
def q6k_untied(smollm2_path, tmp_path_factory):
    """SmolLM2 with every ffn_down re-quantized to Q6_K and a separate output matrix (the token
    embedding's bytes), the shape of a K-quant mix: both are left mapped by default."""
    from pyfast.gguf import GGUFReader
    from pyfast.gguf.writer import GGUFWriter
    from pyfast.models.base import Weights

    rd = GGUFReader(str(smollm2_path))
    src = Weights(rd, in_memory=False)
    out = tmp_path_factory.mktemp("mapped") / "q6k-untied.gguf"
    w = GGUFWriter(out)
    w.copy_metadata(rd)
    for n, info in rd.tensors.items():
        if n.endswith("ffn_down.weight"):
            q = native.quantize_tensor(native.DType.Q6_K, src.f32(n))
            w.add_tensor(n, native.DType.Q6_K, tuple(info.shape), q)
        else:
            w.add_tensor(n, info.type, tuple(info.shape), rd.tensor_bytes(n))
    emb = rd.tensors["token_embd.weight"]
    w.add_tensor("output.weight", emb.type, tuple(emb.shape), rd.tensor_bytes("token_embd.weight"))
    w.write()
    return out


def _copy(path, tmp_path, name):
    """A copy of the file (a Model of a file already in memory shares that copy and its layout)."""
    import shutil
    dst = tmp_path / name
    shutil.copyfile(path, dst)
    return dst


def _logits(model):
    from pyfast.context import Context
    ctx = Context(model, n_ctx=64, n_threads=2)
    la = ctx.decode(PROMPT, seq_ids=0)
    return np.concatenate([np.ravel(la), np.ravel(ctx.decode_step(2940, len(PROMPT)))])


def test_segments():
    from pyfast.models.base import _segments
    assert _segments(100, []) == [(0, 100, 0)]
    assert _segments(100, [(0, 100)]) == []
    # holes in any order, touching, at the ends
    assert _segments(100, [(60, 70), (0, 10), (70, 75), (95, 100)]) == [(10, 60, 0), (75, 95, 50)]
    assert _segments(0, []) == []


@pytest.mark.skipif(native.cpu_isa() != "avx512", reason="tensors are left mapped where weights are packed")
def test_mapped_tensors_read_as_the_file_and_give_the_same_logits(q6k_untied, tmp_path, monkeypatch):
    """Default policy on a K-quant-like mix: the Q6_K matrices and the untied token embedding
    stay in the mapping (their bytes are not in the copy, which is that much smaller), every
    tensor reads as the file's bytes, and prompt and decode logits equal those of a full copy and
    of the mapped file, also when eight loader threads read the copy in parts."""
    from pyfast.models import Model, base

    seen = []
    base_cuts = base._read_cuts

    def cuts(total, packs):
        c = base_cuts(total, packs, part_bytes=8 << 20)
        seen.append((total, c))
        return c

    monkeypatch.setattr(base, "_read_cuts", cuts)
    monkeypatch.setattr(base, "_MAPPED_Q6K_MIN_BYTES", 1 << 20)  # this file's Q6_K: 21.8 MB
    mem = Model(_copy(q6k_untied, tmp_path, "auto.gguf"), mmap=False)
    w = mem.weights
    q6k = {n for n in w.info if n.endswith("ffn_down.weight")}
    assert q6k and w._pack.mapped == q6k | {"token_embd.weight"}
    mapped_bytes = sum(int(w.info[n].nbytes) for n in w._pack.mapped)
    data_bytes = int(w.reader.file_size) - int(w.reader.data_offset)
    mapped_model = Model(q6k_untied, mmap=True)
    for name in w.info:  # every tensor, before and after the copy is ready
        a = w.data(name)
        assert np.array_equal(a, mapped_model.weights.data(name)), name
    host = w._host
    assert host.size == data_bytes - mapped_bytes
    assert len(seen) == 1 and seen[0][0] == host.size and len(seen[0][1]) == base._LOAD_THREADS + 1
    lo, hi = host.ctypes.data, host.ctypes.data + host.size
    for name in w.info:
        p = w._raw(name).ctypes.data  # (data() of a packed tensor is an unpacked copy)
        assert (lo <= p < hi) == (name not in w._pack.mapped), name
    monkeypatch.setenv("PYFAST_KEEP_MAPPED", "none")
    full = Model(_copy(q6k_untied, tmp_path, "none.gguf"), mmap=False)
    full.weights._wait_loaded()
    assert full.weights._pack.mapped == frozenset() and full.weights._host.size == data_bytes
    la, lb, lc = _logits(mem), _logits(full), _logits(mapped_model)
    assert np.array_equal(la, lb) and np.array_equal(la, lc)


@pytest.mark.skipif(native.cpu_isa() != "avx512", reason="tensors are left mapped where weights are packed")
def test_keep_mapped_policy(q6k_untied, smollm2_path, tmp_path, monkeypatch):
    """Q6_K matrices are copied (and packed: the row-major kernel is slower at 1 thread) when they
    are under the size floor or over a third of the bytes, while an untied embedding stays
    mapped; a tied embedding is the output matrix and is copied; nothing is left mapped where
    weights are not packed; a bad PYFAST_KEEP_MAPPED is named."""
    from pyfast.models import Model, base

    small = Model(_copy(q6k_untied, tmp_path, "small.gguf"), mmap=False)  # 21.8 MB of Q6_K
    assert small.weights._pack.mapped == {"token_embd.weight"}
    monkeypatch.setattr(base, "_MAPPED_Q6K_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(base, "_MAPPED_Q6K_SHARE", 0.01)
    m = Model(_copy(q6k_untied, tmp_path, "share.gguf"), mmap=False)
    assert m.weights._pack.mapped == {"token_embd.weight"}
    monkeypatch.undo()
    tied = Model(_copy(smollm2_path, tmp_path, "tied.gguf"), mmap=False)
    assert tied.weights._pack.mapped == frozenset()
    monkeypatch.setenv("PYFAST_PACK", "0")
    row_major = Model(_copy(q6k_untied, tmp_path, "rowmajor.gguf"), mmap=False)
    assert row_major.weights._pack.mapped == frozenset()
    monkeypatch.delenv("PYFAST_PACK")
    monkeypatch.setenv("PYFAST_KEEP_MAPPED", "some")
    with pytest.raises(ValueError, match="PYFAST_KEEP_MAPPED='some'"):
        Model(_copy(q6k_untied, tmp_path, "bad.gguf"), mmap=False)


def test_prefetch_ranges(smollm2_path):
    """GGUFReader.prefetch: no ranges pages in the whole data section, an empty list nothing (a
    file with no mapped tensors), and ranges past the end of the file or running over it are
    clamped, not read out of bounds (the reader's close joins its prefetch thread, so a bad read
    would crash this test)."""
    import gc
    from pyfast.gguf import GGUFReader

    r = GGUFReader(str(smollm2_path))
    calls = []
    native_file = r._file
    r._file = type("F", (), {"prefetch": lambda self, ranges: calls.append(ranges)})()
    r.prefetch()
    r.prefetch([])
    r.prefetch([(10, 20)])
    assert calls == [[], [(10, 20)]]  # [] is the native call's "whole section"; the empty list made none
    r._file = native_file
    size = int(r.file_size)
    r.prefetch([(size + 4096, 100), (size - 10, 1 << 40), (int(r.data_offset), 4096)])
    r.close()
    del r, native_file
    gc.collect()
