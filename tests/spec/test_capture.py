"""Target feature capture (``Context(capture_layers=...)``, EAGLE-3 / DFlash drafters): the input
rows of the chosen layers for every row, against the float64 numpy llama reference and the
transformers reference of the hybrid Qwen3.5 fixture (id n_layer = the final hidden state before
the output norm); per sequence in the caller's row order; and nothing changes without it."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast._loader import native
from pyfast.context import Context
from pyfast.models import BatchShape, Model
from pyfast.spec.base import DecodeBatch
from pyfast.spec.config import capture_layers
from tests.models import test_hybrid_common as H
from tests.reference.llama_numpy import LlamaRef
from tests.reference.tiny_gguf import write_tiny_llama


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    path = tmp_path_factory.mktemp("cap") / "tiny4.gguf"
    write_tiny_llama(path, n_vocab=96, n_embd=64, n_layer=4, n_head=4, n_head_kv=2, n_ff=96, wtype="f32", seed=3)
    return path


def test_llama_layers_match_reference_two_sequences(tiny4):
    model = Model(tiny4)
    ref = LlamaRef(tiny4)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 96, 9), rng.integers(0, 96, 6)
    refs = []
    for t in (a, b):
        ref.forward(t)
        refs.append(dict(ref.layer_inputs))
    layers = (2, 0, 4)   # any order; 0: the embedding, 4 = n_layer: before the output norm
    ctx = Context(model, n_ctx=64, n_threads=2, kv_dtype=native.DType.F32, capture_layers=layers)
    # the two sequences interleaved, prompt split over two decodes
    toks = np.concatenate([b[:2], a[:5], b[2:4]])
    seqs = [1, 1] + [0] * 5 + [1, 1]
    pos = [0, 1] + list(range(5)) + [2, 3]
    ctx.decode(toks, positions=pos, seq_ids=seqs, logits=[6])
    f = ctx.last_features
    d = model.args.n_embd
    assert f.shape == (9, 3 * d) and f.dtype == np.float32
    for j, l in enumerate(layers):
        assert rel(f[2:7, j * d:(j + 1) * d], refs[0][l][:5]) < 1e-4
        assert rel(f[[0, 1, 7, 8], j * d:(j + 1) * d], refs[1][l][:4]) < 1e-4
    ctx.decode(np.concatenate([a[5:], b[4:]]), positions=list(range(5, 9)) + [4, 5],
               seq_ids=[0] * 4 + [1] * 2, logits="none")
    f = ctx.last_features
    assert f.shape == (6, 3 * d)
    assert rel(f[:4, 2 * d:], refs[0][4][5:]) < 1e-4
    assert rel(f[4:, :d], refs[1][2][4:]) < 1e-4
    # one token (the generation step) goes through the same export
    ctx.decode_step(int(a[0]), 9, 0)
    assert ctx.last_features.shape == (1, 3 * d)


def test_hybrid_final_layer_matches_transformers():
    model, ref = H.load("qwen35")
    n = model.args.n_layer
    ctx = H.make_ctx(model, capture_layers=(n, 0))
    a, b = ref["tokens_0"][:7], ref["tokens_1"][:5]
    ctx.decode(np.concatenate([a, b]), positions=list(range(7)) + list(range(5)), seq_ids=[0] * 7 + [1] * 5,
               logits="none")
    d = model.args.n_embd
    f = ctx.last_features
    assert rel(f[:7, :d], ref["hidden_prenorm_0"][:7]) < 1e-3
    assert rel(f[7:, :d], ref["hidden_prenorm_1"][:5]) < 1e-3
    # a recurrent target captures the same rows incrementally (verify-like runs) as in one prompt
    whole = f[:7].copy()
    ctx2 = H.make_ctx(model, capture_layers=(n, 0))
    ctx2.decode(a[:3], seq_ids=0, logits="none")
    parts = [ctx2.last_features.copy()]
    ctx2.decode(a[3:], positions=list(range(3, 7)), seq_ids=0, logits="all")
    parts.append(ctx2.last_features.copy())
    assert rel(np.concatenate(parts), whole) < 1e-5


def test_plain_graph_unchanged_and_bad_ids(tiny4):
    model = Model(tiny4)
    ctx = Context(model, n_ctx=32, n_threads=1)
    shape = BatchShape(3, 32, 1)
    plain = len(model.build(shape, ctx.kv).g)
    assert len(model.build(shape, ctx.kv, capture=()).g) == plain
    with_cap = model.build(shape, ctx.kv, capture=(1, 3))
    assert len(with_cap.g) > plain
    assert ctx.capture_layers == () and not ctx._rows_out
    ctx.decode([1, 2, 3])
    assert ctx.last_features is None
    for bad in [(-1,), (5,), (2, 2)]:
        with pytest.raises(ValueError, match="feature capture"):
            Context(model, n_ctx=32, capture_layers=bad)


def test_decode_batch_layer_features_and_union():
    class P:
        def __init__(self, layers):
            self.capture_layers = layers

    assert capture_layers([P((2, 5, 9)), P(()), P((9, 3))]) == (2, 5, 9, 3)
    assert capture_layers([]) == ()
    f = np.arange(2 * 12, dtype=np.float32).reshape(2, 12)
    batch = DecodeBatch("prompt", np.zeros(2, np.int32), np.zeros(2, np.int32), np.arange(2, dtype=np.int32),
                        features=f, feature_layers=(2, 5, 9))
    assert batch.layer_features((2, 5, 9)) is f
    np.testing.assert_array_equal(batch.layer_features((9, 2)), np.concatenate([f[:, 8:], f[:, :4]], 1))
    with pytest.raises(ValueError, match="not captured"):
        batch.layer_features((3,))
