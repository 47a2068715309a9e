"""The metadata edits issue 21 found: each is a ValueError naming the key, the value and what
was expected, raised before anything is allocated."""
from __future__ import annotations

import os
import sys
import tracemalloc

import pytest

pytest.importorskip("gguf")

from pyfast import LLM  # noqa: E402
from tests.fuzz.gguf_fuzz_worker import rewrite  # noqa: E402
from tests.reference.tiny_gguf import write_tiny_llama  # noqa: E402

HYBRID = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hybrid", "qwen35.gguf")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("meta") / "tiny.gguf"
    write_tiny_llama(p, n_vocab=64, n_embd=32, n_layer=2, n_head=4, n_head_kv=2, n_ff=32)
    return str(p)


def _load_error(path: str) -> str:
    with pytest.raises(ValueError) as ei:
        LLM(path, n_ctx=32, n_threads=1)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("value, typ, expected", [
    (0, "uint32", "'llama.block_count' = 0 (uint32): expected an integer in [1, 4096]"),
    (1, "uint32", "'llama.block_count' = 1: expected 2, the number of layers"),
    (3, "uint32", "'llama.block_count' = 3: expected 2, the number of layers"),
    (2**32 - 1, "uint32", "'llama.block_count' = 4294967295 (uint32): expected an integer in [1, 4096]"),
    (-1, "int32", "'llama.block_count' = -1 (int32): expected an integer in [1, 4096]"),
    ("2", "string", "'llama.block_count' = '2' (string): expected an integer"),
    (2.0, "float32", "'llama.block_count' = 2.0 (float32): expected an integer"),
    (True, "bool", "'llama.block_count' = True (bool): expected an integer"),
])
def test_block_count(tiny, tmp_path, value, typ, expected):
    p = str(tmp_path / "m.gguf")
    rewrite(tiny, p, meta={"llama.block_count": (value, typ)})
    assert expected in _load_error(p)


def test_absurd_block_count_fails_before_allocating(tiny, tmp_path):
    """2**32 - 1 layers once grew memory at ~100 MB/s (a per-layer list) until the OOM killer."""
    p = str(tmp_path / "m.gguf")
    rewrite(tiny, p, meta={"llama.block_count": (2**32 - 1, "uint32")})
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="block_count"):
            LLM(p, n_ctx=32, n_threads=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20, peak


@pytest.mark.parametrize("key, value, typ, expected", [
    ("llama.attention.head_count", 0, "uint32", "'llama.attention.head_count' = 0 (uint32): expected an integer in [1,"),
    ("llama.attention.head_count", 6, "uint32", "'llama.attention.head_count' = 6 (uint32): expected a divisor of "
                                                "embedding_length (32)"),
    ("llama.attention.head_count_kv", 3, "uint32", "'llama.attention.head_count_kv' = 3 (uint32): expected a divisor"),
    ("llama.attention.head_count_kv", 0, "uint32", "'llama.attention.head_count_kv' = 0 (uint32): expected an integer"),
    ("llama.embedding_length", 0, "uint32", "'llama.embedding_length' = 0 (uint32): expected an integer in [1,"),
    ("llama.embedding_length", 64, "uint32", "tensor 'token_embd.weight' has shape [64, 32], expected [n_vocab, 64]"),
    ("llama.rope.dimension_count", 3, "uint32", "'llama.rope.dimension_count' = 3 (uint32): expected an even number"),
    ("llama.rope.dimension_count", 1000, "uint32", "'llama.rope.dimension_count' = 1000 (uint32): expected an integer "
                                                   "in [2, 8]"),
    ("llama.attention.layer_norm_rms_epsilon", 0.0, "float32", "layer_norm_rms_epsilon' = 0.0 (float32): expected a "
                                                              "finite number > 0"),
    ("llama.rope.freq_base", float("nan"), "float32", "'llama.rope.freq_base' = nan (float32): expected a finite"),
    ("llama.feed_forward_length", "32", "string", "'llama.feed_forward_length' = '32' (string): expected an integer"),
    ("llama.context_length", -5, "int32", "'llama.context_length' = -5 (int32): expected an integer in [1,"),
    ("llama.vocab_size", 65, "uint32", "'llama.vocab_size' = 65: expected 64, the rows of 'token_embd.weight'"),
])
def test_bad_hyper_parameters(tiny, tmp_path, key, value, typ, expected):
    p = str(tmp_path / "m.gguf")
    rewrite(tiny, p, meta={key: (value, typ)})
    assert expected in _load_error(p)


def test_rope_scaling_factor_zero(tiny, tmp_path):
    p = str(tmp_path / "m.gguf")
    rewrite(tiny, p, meta={"llama.rope.scaling.type": ("linear", "string"),
                           "llama.rope.scaling.factor": (0.0, "float32")})
    assert "'llama.rope.scaling.factor' = 0.0 (float32): expected a finite number > 0" in _load_error(p)


def test_missing_token_embd(tiny, tmp_path):
    p = str(tmp_path / "m.gguf")
    rewrite(tiny, p, drop_tensors=("token_embd.weight",))
    assert "missing tensor 'token_embd.weight' (expected shape [n_vocab, 32])" in _load_error(p)


def test_embedding_rows_must_match_the_token_list(tiny, tmp_path):
    p = str(tmp_path / "m.gguf")
    rewrite(tiny, p, reshape={"token_embd.weight": (65, 32), "output.weight": (65, 32)})
    assert "'tokenizer.ggml.tokens' has 64 entries: expected 65, the rows of 'token_embd.weight'" in _load_error(p)


def test_short_token_list(tiny, tmp_path):
    p = str(tmp_path / "m.gguf")
    rewrite(tiny, p, meta={"tokenizer.ggml.tokens": (["a", "b", "c"], "array[string]")})
    assert "'tokenizer.ggml.tokens' has 3 entries: expected 64" in _load_error(p)


def test_invalid_utf8_token_is_named(tiny, tmp_path):
    from pyfast.gguf import GGUFReader

    toks = list(GGUFReader(tiny).metadata["tokenizer.ggml.tokens"])
    toks[7] = "ab\udcff"  # the byte 0xff in the file
    p = str(tmp_path / "m.gguf")
    rewrite(tiny, p, meta={"tokenizer.ggml.tokens": (toks, "array[string]")})
    assert "'tokenizer.ggml.tokens'[7] = b'ab\\xff': expected valid UTF-8" in _load_error(p)


def test_extra_layer_tensors_contradict_block_count(tiny, tmp_path):
    p = str(tmp_path / "m.gguf")
    rewrite(tiny, p, extra_tensors={"blk.2.attn_norm.weight": ("blk.0.attn_norm.weight", (32,))})
    assert "'llama.block_count' = 2: expected 3, the number of layers" in _load_error(p)


@pytest.mark.skipif(not os.path.exists(HYBRID), reason="hybrid fixture missing")
@pytest.mark.parametrize("key, value, typ, expected", [
    ("qwen35.block_count", 2**32 - 1, "uint32", "expected an integer in [1, 4096]"),
    ("qwen35.block_count", 2, "uint32", "the file holds tensors for"),
    ("qwen35.ssm.group_count", 0, "uint32", "'qwen35.ssm.group_count' = 0 (uint32): expected an integer in [1,"),
    ("qwen35.attention.recurrent_layers", 7, "uint32", "'qwen35.attention.recurrent_layers' = 7 (uint32): expected "
                                                       "an array"),
    ("qwen35.nextn_predict_layers", 9, "uint32", "'qwen35.nextn_predict_layers' = 9 (uint32): expected an integer"),
])
def test_hybrid_hyper_parameters(tmp_path, key, value, typ, expected):
    p = str(tmp_path / "m.gguf")
    rewrite(HYBRID, p, meta={key: (value, typ)})
    assert expected in _load_error(p)


def test_unmodified_fixture_still_loads(tiny):
    llm = LLM(tiny, n_ctx=32, n_threads=1)
    assert llm.n_vocab == 64 and len(llm.generate([1, 2], max_tokens=3, temperature=0, ignore_eos=True).tokens) == 3


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
