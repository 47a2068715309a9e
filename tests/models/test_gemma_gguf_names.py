"""Gemma 3 / Gemma 4 GGUF metadata keys and tensor names: what ``pyfast convert`` writes and what
pyfast's loaders read must be spelled as llama.cpp spells them, so that files move both ways.

The lists below are facts read from llama.cpp's source (vendored in llama-cpp-python 0.3.36):
``src/llama-arch.cpp`` (LLM_KV_NAMES / LLM_TENSOR_NAMES), ``src/llama-model.cpp``
(llama_model_base::load_hparams, the keys every architecture may read), ``src/models/gemma3.cpp`` and
``src/models/gemma4.cpp`` (load_arch_hparams / load_arch_tensors), ``conversion/gemma.py``
(Gemma3Model / Gemma4Model.set_gguf_parameters, what its converter writes). Checked beyond these
tests: llama.cpp's libllama loads every file the converter writes for the tiny fixtures below and
tokenizes like pyfast (scripts/check_llamacpp_vocab.py).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pyfast.models import Model

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "decoder"

# --- keys ----------------------------------------------------------------------------------------
# llama_model_base::load_hparams (src/llama-model.cpp): keys any architecture may read
LLAMACPP_COMMON_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
    "attention.key_length_swa", "attention.value_length_swa", "rope.dimension_count_swa", "expert_count",
    "expert_used_count", "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.attn_factor", "rope.scaling.finetuned",
    "vocab_size",  # LLM_KV_VOCAB_SIZE, read by src/llama-vocab.cpp
}
# src/models/gemma3.cpp load_arch_hparams
LLAMACPP_GEMMA3_KEYS = LLAMACPP_COMMON_KEYS | {
    "attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
    "final_logit_softcapping", "attention.layer_norm_rms_epsilon"}
# src/models/gemma4.cpp load_arch_hparams; the ones it reads without a default are required
LLAMACPP_GEMMA4_KEYS = LLAMACPP_COMMON_KEYS | {
    "attention.sliding_window_pattern", "attention.shared_kv_layers", "rope.freq_base_swa",
    "expert_feed_forward_length", "attention.sliding_window", "attention.layer_norm_rms_epsilon",
    "embedding_length_per_layer_input", "final_logit_softcapping"}
LLAMACPP_GEMMA4_REQUIRED = {
    "context_length", "embedding_length", "block_count", "attention.sliding_window_pattern",
    "attention.sliding_window", "attention.layer_norm_rms_epsilon", "embedding_length_per_layer_input",
    "attention.key_length_swa", "attention.value_length_swa"}
# written by pyfast, not read by llama.cpp's gemma3 (which computes the same scale from the shape):
# attention.scale is llama.cpp's own key name (LLM_KV_ATTENTION_SCALE) for it
PYFAST_EXTRA_GEMMA3_KEYS = {"attention.scale"}

# --- tensors (per-layer names without the "blk.N." prefix) ------------------------------------
# optional in pyfast's shared decoder spec, never in a Gemma file (llama.cpp's gemma3 has no biases)
PYFAST_OPTIONAL_EXTRA = {"attn_q.bias", "attn_k.bias", "attn_v.bias"}
# src/models/gemma3.cpp load_arch_tensors (q / k / v through create_tensor_qkv: attn_qkv or split)
LLAMACPP_GEMMA3_TENSORS = {
    "token_embd.weight", "output_norm.weight", "output.weight", "dense_2.weight", "dense_3.weight",
    "attn_norm.weight", "attn_qkv.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
    "attn_output.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
    "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "post_ffw_norm.weight"}
# src/models/gemma4.cpp load_arch_tensors, and the per-expert scale loaded for every MoE layer in
# src/llama-model.cpp (ffn_down_exps.scale, shape [n_expert])
LLAMACPP_GEMMA4_TENSORS = {
    "token_embd.weight", "output.weight", "output_norm.weight", "rope_freqs.weight",
    "per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight",
    "attn_norm.weight", "attn_qkv.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
    "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight",
    "layer_output_scale.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
    "post_ffw_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp.scale", "pre_ffw_norm_2.weight",
    "post_ffw_norm_1.weight", "post_ffw_norm_2.weight", "ffn_gate_up_exps.weight", "ffn_gate_exps.weight",
    "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_down_exps.scale", "inp_gate.weight", "proj.weight",
    "post_norm.weight"}
# gemma4.cpp: required in a layer with experts (ffn_gate_inp present); gate / up may come merged
LLAMACPP_GEMMA4_MOE_REQUIRED = {
    "ffn_gate_inp.scale", "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight", "post_ffw_norm_2.weight",
    "ffn_down_exps.weight"}

CASES = {"gemma3": ("gemma3", LLAMACPP_GEMMA3_KEYS | PYFAST_EXTRA_GEMMA3_KEYS, LLAMACPP_GEMMA3_TENSORS),
         "gemma4": ("gemma4", LLAMACPP_GEMMA4_KEYS, LLAMACPP_GEMMA4_TENSORS),
         "gemma4moe": ("gemma4", LLAMACPP_GEMMA4_KEYS, LLAMACPP_GEMMA4_TENSORS)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from pyfast.convert import convert

    d = tmp_path_factory.mktemp("gemma_names")
    return {name: convert(FIX / "hf" / name, d / f"{name}.gguf", outtype="f32").path for name in CASES}


def _short(name: str) -> str:
    return re.sub(r"^blk\.\d+\.", "", name)


class _Recording(dict):
    """Metadata that records every key looked up."""

    def __init__(self, *a):
        super().__init__(*a)
        self.seen: set[str] = set()

    def get(self, k, *d):
        self.seen.add(k)
        return super().get(k, *d)

    def __contains__(self, k):
        self.seen.add(k)
        return super().__contains__(k)

    def __getitem__(self, k):
        self.seen.add(k)
        return super().__getitem__(k)


@pytest.mark.parametrize("name", list(CASES))
def test_written_keys_are_llamacpp_keys(converted, name):
    arch, keys, _ = CASES[name]
    model = Model(converted[name])
    written = {k[len(arch) + 1:] for k in model.metadata if k.startswith(arch + ".")}
    assert written <= keys, sorted(written - keys)
    if arch == "gemma4":
        assert LLAMACPP_GEMMA4_REQUIRED <= written, sorted(LLAMACPP_GEMMA4_REQUIRED - written)


@pytest.mark.parametrize("name", list(CASES))
def test_loader_reads_llamacpp_keys(converted, name):
    """Every architecture key pyfast's loader looks up is one llama.cpp reads (same spelling)."""
    from pyfast.models import Weights

    arch, keys, _ = CASES[name]
    model = Model(converted[name])
    md = _Recording(model.metadata)
    index = Weights(model.reader, in_memory=False)
    type(model.args).from_gguf(md, index, path=model.path, types=model.reader.metadata_types)
    read = {k[len(arch) + 1:] for k in md.seen if k.startswith(arch + ".")}
    assert read <= keys | PYFAST_EXTRA_GEMMA3_KEYS, sorted(read - keys)
    assert {"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa"} <= read


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_names_are_llamacpp_names(converted, name):
    """The converter's tensors and every tensor the loader knows carry llama.cpp's names."""
    _, _, names = CASES[name]
    model = Model(converted[name])
    written = {_short(t) for t in model.reader.tensors}
    assert written <= names, sorted(written - names)
    known = {_short(s.name) for s in model.arch.tensors(model.args)}
    assert known <= names | PYFAST_OPTIONAL_EXTRA, sorted(known - names)
    required = {_short(s.name) for s in model.arch.tensors(model.args) if not s.optional}
    assert required <= names, sorted(required - names)
    if name == "gemma4moe":
        assert LLAMACPP_GEMMA4_MOE_REQUIRED <= written


def test_gemma4_moe_old_norm_names_still_load(converted, tmp_path):
    """Files from pyfast's earlier converter named the MoE block's norms ffn_pre_norm_2 /
    ffn_post_norm_1 / ffn_post_norm_2; they load and give the same logits."""
    from pyfast.context import Context
    from pyfast.gguf import GGUFReader
    from pyfast.gguf.writer import GGUFWriter

    src = converted["gemma4moe"]
    rename = {"pre_ffw_norm_2": "ffn_pre_norm_2", "post_ffw_norm_1": "ffn_post_norm_1",
              "post_ffw_norm_2": "ffn_post_norm_2"}
    rd = GGUFReader(str(src))
    out = tmp_path / "old.gguf"
    w = GGUFWriter(str(out))
    for k, v in rd.metadata.items():
        w.add(k, v, rd.metadata_types[k])
    for n, info in rd.tensors.items():
        blk, i, short, suffix = (n.split(".") + ["", "", ""])[:4] if n.count(".") == 3 else ("", "", n, "")
        new = f"{blk}.{i}.{rename[short]}.{suffix}" if short in rename else n
        w.add_tensor(new, info.type, tuple(info.shape), rd.tensor_bytes(n))
    w.write()
    assert "blk.0.ffn_pre_norm_2.weight" in GGUFReader(str(out)).tensors
    toks = np.array([1, 5, 9, 200, 7, 3], dtype=np.int32)
    want = Context(Model(src), n_ctx=32, n_threads=2).decode(toks, logits="all")
    got = Context(Model(out), n_ctx=32, n_threads=2).decode(toks, logits="all")
    assert np.array_equal(got, want)


def test_gemma3_integer_sliding_window_pattern(converted, tmp_path):
    """llama.cpp also reads gemma3.attention.sliding_window_pattern as a period n (layer i slides
    when i % n < n - 1); the converted fixture's per-layer pattern written as its period loads
    with the same layer types."""
    from pyfast.gguf import GGUFReader
    from pyfast.gguf.writer import GGUFWriter

    src = converted["gemma3"]
    rd = GGUFReader(str(src))
    pat = list(rd.metadata["gemma3.attention.sliding_window_pattern"])
    n = next(p for p in range(1, len(pat) + 1) if all((i % p < p - 1) == s for i, s in enumerate(pat)))
    out = tmp_path / "period.gguf"
    w = GGUFWriter(str(out))
    for k, v in rd.metadata.items():
        if k == "gemma3.attention.sliding_window_pattern":
            w.add(k, n, "uint32")
        else:
            w.add(k, v, rd.metadata_types[k])
    for name, info in rd.tensors.items():
        w.add_tensor(name, info.type, tuple(info.shape), rd.tensor_bytes(name))
    w.write()
    assert Model(out).args.swa_layers == Model(src).args.swa_layers == tuple(pat)
