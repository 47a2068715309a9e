"""A tiny random-weight llama GGUF against the independent numpy implementation
(tests/reference/llama_numpy.py): prefill, incremental decode, two sequences in one batch."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast._loader import native
from pyfast.context import Context
from pyfast.models import Model
from tests.reference.llama_numpy import LlamaRef
from tests.reference.tiny_gguf import write_tiny_llama


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf"
    write_tiny_llama(path, n_vocab=96, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96, wtype="f32", seed=1)
    return path


@pytest.fixture(params=["scalar", "best"])
def isa(request):
    name = native.cpu_best_isa() if request.param == "best" else "scalar"
    old = native.cpu_isa()
    native.set_cpu_isa(name)
    yield name
    native.set_cpu_isa(old)


def make_ctx(path, n_threads=2, **kw):
    return Context(Model(path), n_ctx=128, n_threads=n_threads, kv_dtype=native.DType.F32, **kw)


def test_prefill_matches_reference(tiny_f32, isa):
    ref = LlamaRef(tiny_f32)
    toks = [3, 17, 5, 90, 42, 8, 8, 61, 0]
    ctx = make_ctx(tiny_f32)
    got = ctx.decode(toks, logits="all")
    assert rel_err(got, ref.logits(toks)) < 1e-4


def test_incremental_decode_matches_reference(tiny_f32, isa):
    ref = LlamaRef(tiny_f32)
    toks = [11, 4, 77, 23, 9, 54, 31, 2]
    want, _ = ref.forward(toks)
    ctx = make_ctx(tiny_f32, n_threads=3)
    got = [ctx.decode(toks[:4], logits="all")]
    for t in toks[4:]:
        got.append(ctx.decode([t], logits="last"))
    assert rel_err(np.concatenate(got), want) < 1e-4


def test_two_sequences_in_one_batch(tiny_f32, isa):
    ref = LlamaRef(tiny_f32)
    a = [5, 6, 7, 8, 9]
    b = [60, 50, 40]
    ctx = make_ctx(tiny_f32)
    # interleave the two prompts in one batch
    toks = [a[0], b[0], a[1], b[1], a[2], b[2], a[3], a[4]]
    seqs = [0, 1, 0, 1, 0, 1, 0, 0]
    pos = [0, 0, 1, 1, 2, 2, 3, 4]
    got = ctx.decode(toks, positions=pos, seq_ids=seqs, logits="all")
    ra = ref.logits(a)
    rb = ref.logits(b)
    ia = [i for i, s in enumerate(seqs) if s == 0]
    ib = [i for i, s in enumerate(seqs) if s == 1]
    assert rel_err(got[ia], ra) < 1e-4
    assert rel_err(got[ib], rb) < 1e-4
    # then one more token for each sequence, in one batch
    got2 = ctx.decode([1, 2], positions=[5, 3], seq_ids=[0, 1], logits="all")
    assert rel_err(got2[0:1], ref.logits(a + [1])[-1:]) < 1e-4
    assert rel_err(got2[1:2], ref.logits(b + [2])[-1:]) < 1e-4


def test_truncate_then_redecode(tiny_f32):
    ref = LlamaRef(tiny_f32)
    toks = [1, 2, 3, 4, 5, 6]
    ctx = make_ctx(tiny_f32)
    ctx.decode(toks, logits="none")
    ctx.truncate(0, 3)
    assert ctx.seq_len(0) == 3
    got = ctx.decode([40, 41], logits="all")
    assert rel_err(got, ref.logits([1, 2, 3, 40, 41])[3:]) < 1e-4


def test_saved_kv_rows_match_reference_and_restore_elsewhere(tiny_f32):
    # The cache is head-major ([n_head_kv, n_ctx, head_dim] per layer): a sequence interleaved
    # with another one in the cells must still save as its own rows in position order, each
    # cell's heads side by side, equal to the reference's K (after rope) and V; restored into
    # other cells of another cache, decoding goes on exactly as the reference.
    ref = LlamaRef(tiny_f32)
    a, b = [5, 6, 7, 8, 9], [60, 50, 40]
    ctx = make_ctx(tiny_f32)
    ctx.decode([a[0], b[0], a[1], b[1], a[2], b[2], a[3], a[4]], positions=[0, 0, 1, 1, 2, 2, 3, 4],
               seq_ids=[0, 1, 0, 1, 0, 1, 0, 0], logits="none")
    rows = ctx.kv.save_seq(0)
    _, state = ref.forward(a)
    n_layer, H, D = ctx.kv.n_layer, ctx.kv.n_head_kv, ctx.kv.head_dim
    assert rows.pos.tolist() == [0, 1, 2, 3, 4]
    k = rows.k.view(np.float32).reshape(n_layer, len(a), H, D)
    v = rows.v.view(np.float32).reshape(n_layer, len(a), H, D)
    for il in range(n_layer):
        assert rel_err(k[il], state.k[il]) < 1e-5
        assert rel_err(v[il], state.v[il]) < 1e-5
    other = make_ctx(tiny_f32)
    other.decode([1, 2, 3], seq_ids=7, logits="none")  # seq 0 lands in cells 3.. of this cache
    other.kv.restore_seq(0, rows)
    got = other.decode([11], positions=[5], seq_ids=0, logits="last")
    assert rel_err(got, ref.logits(a + [11])[-1:]) < 1e-4


@pytest.mark.parametrize("wtype", ["f16", "q8_0", "q4_0", "q4_1"])
def test_quantized_weights_match_dequantized_reference(tmp_path, wtype):
    # The reference reads the same file and dequantizes the weights; the kernels quantize the
    # activations to 8 bits for quantized weights, so allow a few 1e-3 of relative error.
    path = tmp_path / f"tiny-{wtype}.gguf"
    write_tiny_llama(path, n_vocab=96, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96, wtype=wtype, seed=2)
    ref = LlamaRef(path)
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    got = make_ctx(path).decode(toks, logits="all")
    tol = 1e-3 if wtype == "f16" else 3e-2
    assert rel_err(got, ref.logits(toks)) < tol


def test_bad_token_and_position_rejected(tiny_f32):
    ctx = make_ctx(tiny_f32)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ctx.decode([96])
    with pytest.raises(ValueError, match="positions"):
        ctx.decode([1], positions=[-1])
    with pytest.raises(ValueError, match="same"):
        ctx.decode([1, 2], positions=[0, 0], seq_ids=[0, 0])


@pytest.fixture(scope="module")
def tiny_hd32(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny32") / "tiny-hd32-f32.gguf"
    write_tiny_llama(path, n_vocab=96, n_embd=128, n_layer=2, n_head=4, n_head_kv=2, n_ff=96, wtype="f32", seed=5)
    return path


@pytest.mark.parametrize("ctk, ctv", [("q8_0", "q8_0"), ("q8_0", "f16"), ("f16", "q8_0")])
def test_q8_0_kv_cache_matches_reference(tiny_hd32, isa, ctk, ctv):
    # K/V rows quantized to Q8_0 when written: the logits stay within Q8_0's rounding of the
    # exact reference, and a sequence gives the same bits alone or interleaved with another one.
    ref = LlamaRef(tiny_hd32)
    a, b = [5, 6, 7, 8, 9, 10, 11], [60, 50, 40]
    ctx = Context(Model(tiny_hd32), n_ctx=128, n_threads=2, kv_dtype=ctk, kv_dtype_v=ctv)
    got = [ctx.decode(a[:4], logits="all")]
    for t in a[4:]:
        got.append(ctx.decode([t], logits="last"))
    got = np.concatenate(got)
    assert rel_err(got, ref.logits(a)) < 2e-2
    both = Context(Model(tiny_hd32), n_ctx=128, n_threads=3, kv_dtype=ctk, kv_dtype_v=ctv)
    both.decode(b, seq_ids=1, logits="none")
    lg = [both.decode(a[:4], seq_ids=0, logits="all")] + [both.decode([t], seq_ids=0, logits="last") for t in a[4:]]
    np.testing.assert_array_equal(np.concatenate(lg), got)
    # saved and restored into other cells of another cache, decoding goes on bit for bit
    rows = ctx.kv.save_seq(0)
    nxt = ctx.decode([3], positions=[len(a)], seq_ids=0, logits="last")
    other = Context(Model(tiny_hd32), n_ctx=128, n_threads=2, kv_dtype=ctk, kv_dtype_v=ctv)
    other.decode([1, 2], seq_ids=4, logits="none")
    other.kv.restore_seq(0, rows)
    np.testing.assert_array_equal(other.decode([3], positions=[len(a)], seq_ids=0, logits="last"), nxt)


def test_bad_cache_types_are_clear_errors(tiny_f32, tiny_hd32):
    with pytest.raises(ValueError, match="multiple of 32"):
        Context(Model(tiny_f32), n_ctx=64, kv_dtype="q8_0")  # head dim 16
    with pytest.raises(ValueError, match="unknown type 'q4_0'"):
        Context(Model(tiny_hd32), n_ctx=64, kv_dtype="q4_0")
    with pytest.raises(ValueError, match="V cache type"):
        Context(Model(tiny_hd32), n_ctx=64, kv_dtype_v="bf16")
