"""SentencePiece-style vocabularies end to end: ``pyfast convert``'s tokenizer metadata from a
Gemma-style ``tokenizer.json`` (BPE over U+2581 pieces with byte fallback) and from a sentencepiece
``tokenizer.model``, read back by pyfast's tokenizer, against the ids transformers and sentencepiece
give (tests/fixtures/tokenizer_spm, built by scripts/make_spm_tokenizer_fixtures.py; neither
transformers nor sentencepiece is needed here).

* ``gemma4`` architecture: llama.cpp's ``gemma4`` vocabulary (merges, no space prefix, BOS always);
* other architectures: a ``llama`` (SentencePiece) vocabulary whose scores reproduce the merge order;
* ``tokenizer.model``: a ``llama`` vocabulary with the pieces' scores and types (dummy prefix kept);
* the tiny Gemma 3 / Gemma 4 model fixtures converted with a Gemma-style tokenizer load and encode
  like transformers.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pyfast.convert.hf_tokenizer import tokenizer_metadata
from pyfast.tokenizer import Tokenizer, TokenType

FIX = Path(__file__).resolve().parents[1] / "fixtures"
SPM = FIX / "tokenizer_spm"
REF = json.loads((SPM / "reference.json").read_text(encoding="utf-8"))
N_VOCAB = {"gemma": 700, "gemma_tiny": 280, "spm": 500}


def metadata(d: Path, n_vocab: int, arch: str) -> dict:
    return {k: v for k, v, _ in tokenizer_metadata(str(d), {}, n_vocab, "default", arch=arch)}


def check_against_reference(tok: Tokenizer, name: str) -> None:
    for text, ids in REF[name]["encode"]:
        assert tok.encode(text, add_bos=False) == ids, text
    for ids, text in REF[name]["decode"]:
        assert tok.decode(ids) == text, ids


@pytest.mark.parametrize("name", ["gemma", "gemma_tiny"])
@pytest.mark.parametrize("arch,model", [("gemma4", "gemma4"), ("gemma3", "llama"), ("llama", "llama")])
def test_gemma_style_tokenizer_json(name, arch, model):
    md = metadata(SPM / name, N_VOCAB[name], arch)
    assert md["tokenizer.ggml.model"] == model
    assert md["tokenizer.ggml.add_space_prefix"] is False  # Gemma's normalizer prepends nothing
    assert md["tokenizer.ggml.add_bos_token"] is True
    assert "tokenizer.ggml.pre" not in md
    assert ("tokenizer.ggml.merges" in md) == (model == "gemma4")
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert types[tokens.index("<0x41>")] == TokenType.BYTE
    assert types[tokens.index("<start_of_turn>")] == TokenType.CONTROL
    assert md["tokenizer.ggml.bos_token_id"] == tokens.index("<bos>")
    assert md["tokenizer.ggml.eos_token_id"] == tokens.index("<eos>")
    tok = Tokenizer.from_gguf_metadata(md)
    check_against_reference(tok, name)
    assert tok.encode("hello")[0] == tok.bos_id  # BOS added by default, as transformers does


def test_gemma4_text_shapes():
    """Spaces are U+2581 pieces, a newline run that is a token stays whole, a character the
    vocabulary lacks becomes its UTF-8 bytes, and decoding gives the text back exactly."""
    tok = Tokenizer.from_gguf_metadata(metadata(SPM / "gemma", N_VOCAB["gemma"], "gemma4"))
    assert tok.kind == "spm-bpe" and not tok.add_space_prefix
    ids = tok.encode("a\n\nb", add_bos=False)
    assert [tok.id_to_piece(i) for i in ids] == ["a", "\n\n", "b"]
    ids = tok.encode(" 🙂", add_bos=False)
    assert [tok.id_to_piece(i) for i in ids] == ["▁"] + [f"<0x{b:02X}>" for b in "🙂".encode()]
    for text, _ in REF["gemma"]["encode"]:
        assert tok.decode(tok.encode(text, add_bos=False)) == text
    # control tokens are parsed in text only with special=True
    chat = "<start_of_turn>user\nhi<end_of_turn>\n"
    assert tok.encode(chat, add_bos=False)[0] == tok.piece_to_id("<start_of_turn>")
    assert tok.piece_to_id("<start_of_turn>") not in tok.encode(chat, add_bos=False, special=False)


def test_gemma4_visible_tokens_are_user_defined(tmp_path):
    """llama.cpp writes Gemma 4's chat-parser tokens (<|channel>, <tool_call|>, ...) USER_DEFINED so
    that they are always rendered."""
    tj = json.loads((SPM / "gemma" / "tokenizer.json").read_text(encoding="utf-8"))
    n = len(tj["model"]["vocab"])
    tj["added_tokens"].append({"id": n, "content": "<|channel>", "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True})
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    shutil.copy(SPM / "gemma" / "tokenizer_config.json", tmp_path)
    for arch, want in (("gemma4", TokenType.USER_DEFINED), ("gemma3", TokenType.CONTROL)):
        md = metadata(tmp_path, n + 1, arch)
        assert md["tokenizer.ggml.token_type"][n] == want


def test_llama_scores_follow_merge_order():
    """For a ``llama`` vocabulary from tokenizer.json, the token made by merge r scores -r, so the
    highest-scoring pair is the first merge, as in the BPE."""
    md = metadata(SPM / "gemma_tiny", N_VOCAB["gemma_tiny"], "gemma3")
    tj = json.loads((SPM / "gemma_tiny" / "tokenizer.json").read_text(encoding="utf-8"))
    tokens, scores = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"]
    for r, (a, b) in enumerate(tj["model"]["merges"]):
        assert scores[tokens.index(a + b)] == -r
    assert scores[tokens.index("a")] < -len(tj["model"]["merges"])


def test_sentencepiece_model(tmp_path):
    """tokenizer.model alone (read without the sentencepiece package): a ``llama`` vocabulary with
    the pieces' scores and types and the dummy prefix; ids as sentencepiece gives them."""
    shutil.copy(SPM / "spm" / "tokenizer.model", tmp_path)
    md = metadata(tmp_path, N_VOCAB["spm"] + 3, "llama")
    assert md["tokenizer.ggml.model"] == "llama" and md["tokenizer.ggml.add_space_prefix"] is True
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and types[:3] == [2, 3, 3]
    assert types[tokens.index("<0x0A>")] == TokenType.BYTE
    assert tokens[-1] == f"[PAD{N_VOCAB['spm'] + 2}]" and types[-1] == TokenType.UNUSED
    assert (md["tokenizer.ggml.unknown_token_id"], md["tokenizer.ggml.bos_token_id"],
            md["tokenizer.ggml.eos_token_id"]) == (0, 1, 2)
    scores = np.array(md["tokenizer.ggml.scores"][3:N_VOCAB["spm"]])
    assert np.all(np.diff(scores[scores < 0]) <= 0)  # sentencepiece BPE scores fall with the id
    tok = Tokenizer.from_gguf_metadata(md)
    check_against_reference(tok, "spm")
    # Gemma 3 is written without the space prefix (as llama.cpp does)
    assert metadata(tmp_path, N_VOCAB["spm"], "gemma3")["tokenizer.ggml.add_space_prefix"] is False


def test_sentencepiece_model_errors(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\xff\xff")
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        metadata(tmp_path, 10, "llama")
    shutil.copy(SPM / "spm" / "tokenizer.model", tmp_path)
    with pytest.raises(ValueError, match="do not fit"):
        metadata(tmp_path, 100, "llama")
    # a Unigram model is refused by name: trainer_spec (field 2) gets model_type (field 3) = 1
    # appended, and a repeated scalar field's last value wins
    from pyfast.convert.spm_tokenizer import _fields

    data = (SPM / "spm" / "tokenizer.model").read_bytes()
    body = b"".join(_field_bytes(n, w, v + _field_bytes(3, 0, 1) if n == 2 else v) for n, w, v in _fields(data))
    (tmp_path / "tokenizer.model").write_bytes(body)
    with pytest.raises(ValueError, match="Unigram"):
        metadata(tmp_path, 600, "llama")


def _field_bytes(num: int, wt: int, v) -> bytes:
    def varint(x: int) -> bytes:
        out = bytearray()
        while True:
            b = x & 0x7F
            x >>= 7
            out.append(b | (0x80 if x else 0))
            if not x:
                return bytes(out)
    key = varint(num << 3 | wt)
    if wt == 0:
        return key + varint(v)
    if wt == 2:
        return key + varint(len(v)) + v
    return key + v


def test_tokenizer_json_wins_for_gemma4_and_model_for_others(tmp_path):
    """With both files, llama.cpp reads tokenizer.model except for Gemma 4 (tokenizer.json's merges)."""
    shutil.copytree(SPM / "gemma", tmp_path / "m")
    shutil.copy(SPM / "spm" / "tokenizer.model", tmp_path / "m")
    assert metadata(tmp_path / "m", 700, "gemma4")["tokenizer.ggml.model"] == "gemma4"
    md = metadata(tmp_path / "m", 700, "gemma3")
    assert md["tokenizer.ggml.model"] == "llama" and md["tokenizer.ggml.tokens"][1] == "<s>"


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_converted_gemma_model_encodes_like_transformers(family, tmp_path):
    """The tiny Gemma checkpoint with a Gemma-style tokenizer: `pyfast convert` writes the
    vocabulary llama.cpp would (gemma4 / llama), LLM loads it, encodes the reference strings as
    transformers does (BOS first), renders its chat template with one BOS and generates."""
    from pyfast.convert import convert
    from pyfast.llm import LLM

    src = FIX / "decoder" / "hf" / family
    d = tmp_path / family
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SPM / "gemma_tiny" / f, d / f)
    out = tmp_path / f"{family}.gguf"
    convert(d, out, outtype="f32")
    llm = LLM(out, n_ctx=64, n_threads=2)
    md = llm.model.metadata
    assert md["tokenizer.ggml.model"] == ("gemma4" if family == "gemma4" else "llama")
    tok = llm.tokenizer
    check_against_reference(tok, "gemma_tiny")
    # the template writes {{ bos_token }} and the vocabulary adds BOS: the rendered text drops its
    # own (as llama.cpp does), so the prompt holds one BOS, as transformers' apply_chat_template gives
    prompt = llm.apply_chat_template([{"role": "user", "content": "abc"}])
    assert prompt == "<start_of_turn>user\nabc<end_of_turn>\n<start_of_turn>model\n"
    ids = llm.tokenize(prompt)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    res = llm.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True)
    assert len(res.tokens) == 4
