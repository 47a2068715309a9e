"""Tokenizer from GGUF metadata: SmolLM2 against llama.cpp's token ids, plus synthetic BPE and
SentencePiece vocabularies whose expected ids are derived by hand."""
from __future__ import annotations

import json
import random
import time
import warnings
from pathlib import Path

import pytest

from pyfast.tokenizer import PRE_TOKENIZER_REGEXES, StreamDecoder, Tokenizer, TokenType

REFS = Path(__file__).parents[2].parent / "shared/refs/smollm2/llamacpp.json"


# ---------------------------------------------------------------------------------------------
# SmolLM2 (real vocabulary, compared with llama.cpp)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_md(smollm2_metadata):
    return smollm2_metadata


@pytest.fixture(scope="module")
def smol(smol_md):
    return Tokenizer.from_gguf_metadata(smol_md)


@pytest.fixture(scope="module")
def refs():
    if not REFS.exists():
        pytest.skip(f"{REFS} not present")
    return json.loads(REFS.read_text())


def test_smollm2_builds_fast(smol_md):
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf_metadata(smol_md)
    dt = time.perf_counter() - t0
    assert tok.n_vocab == 49152
    assert dt < 3.0, f"building the SmolLM2 tokenizer took {dt:.2f}s"  # ~0.15s normally


def test_smollm2_properties(smol):
    assert smol.n_vocab == 49152
    assert smol.bos_id == 1 and smol.id_to_piece(1) == "<|im_start|>"
    assert smol.eos_id == 2 and smol.id_to_piece(2) == "<|im_end|>"
    assert smol.eot_id == 2  # found by its text, as llama.cpp does
    assert smol.add_bos is False
    assert smol.is_eog(2) and smol.is_eog(0)  # <|im_end|>, <|endoftext|>
    assert not smol.is_eog(1) and not smol.is_eog(28)
    assert smol.token_type(1) == TokenType.CONTROL
    assert smol.piece_to_id("<|im_start|>") == 1


def test_smollm2_prompt_tokens_match_llamacpp(smol, refs):
    cases = refs["greedy_cases"]["cases"]
    assert cases
    for case in cases:
        assert smol.encode(case["prompt"]) == case["prompt_tokens"], case["id"]


def test_smollm2_decode_matches_llamacpp(smol, refs):
    for case in refs["greedy_cases"]["cases"]:
        text = smol.decode(case["greedy_tokens"])
        expect = case["greedy_text"]
        if expect.endswith("\ufffd"):  # generation stopped inside a UTF-8 character
            assert text.startswith(expect.rstrip("\ufffd")), case["id"]
        else:
            assert text == expect, case["id"]
        for top in case.get("top_logprobs", []):
            piece = smol.token_piece(top["id"])
            try:
                piece_text = piece.decode("utf-8")
            except UnicodeDecodeError:
                continue
            assert piece_text == top["token"], top


def test_smollm2_chat_prompt_roundtrip(smol, refs):
    prompt = refs["speculative_ngram"]["results"]["prompt"]
    ids = smol.encode(prompt)
    assert ids[0] == smol.bos_id and smol.eos_id in ids  # <|im_start|> / <|im_end|> parsed
    assert smol.decode(ids) == prompt


def test_smollm2_perplexity_text_token_count(smol, refs):
    # llama.cpp reports 3799 tokens for the perplexity text
    path = REFS.parent.parent / "ppl_text.txt"
    if not path.exists():
        pytest.skip(f"{path} not present")
    note = refs["perplexity"]["note"]
    assert "3799 tokens" in note
    text = path.read_text(encoding="utf-8")
    ids = smol.encode(text)
    assert len(ids) == 3799
    assert smol.decode(ids) == text


def test_invalid_unicode_raises(smol):
    with pytest.raises(ValueError, match="surrogate"):
        smol.encode("a\ud800b")


ROUNDTRIP_TEXTS = [
    "Hello, world!",
    "unicode: naïve café — Ωμέγα, Привет, 日本語のテキスト, 한국어, العربية",
    "emoji: 🦙🚀👨‍👩‍👧‍👦 🇫🇷 ✅",
    "def f(x):\n\tif x  >=  10:\n\t\treturn {'a': [1, 2, 3]}\n    # comment\n",
    "whitespace    runs\n\n\n\t\t  \r\n   trailing   ",
    "digits 0 12 345 6789 3.14159 1e-10 -42 1,000,000",
    "   leading spaces",
    "it's they're we've I'm you'll he'd IT'S",
    "",
    " ",
    "\n",
    "<not|special> <|im_start",
]


@pytest.mark.parametrize("text", ROUNDTRIP_TEXTS)
def test_smollm2_roundtrip(smol, text):
    ids = smol.encode(text)
    assert smol.decode(ids) == text
    assert smol.decode(smol.encode(text, special=False)) == text


def test_smollm2_special_parsing(smol):
    text = "<|im_start|>user\nhi<|im_end|>\n"
    ids = smol.encode(text)
    assert ids[0] == 1 and ids[-2] == 2
    assert ids[1:-2] == smol.encode("user\nhi")
    assert ids[-1:] == smol.encode("\n")
    plain = smol.encode(text, special=False)
    assert 1 not in plain and 2 not in plain
    assert len(plain) > len(ids)
    assert smol.decode(plain) == text
    # decode can drop control tokens
    assert smol.decode(ids, skip_special=True) == "user\nhi\n"


def test_plain_twin_is_the_same_tokenizer(smol_md):
    """encode(special=False) uses a twin of the encoder built from the same model, normalizer and
    pre-tokenizer objects (not a serialize + parse of the vocabulary): its configuration equals the
    encoder's round trip through JSON, control tokens aside."""
    from tokenizers import Tokenizer as HF

    tok = Tokenizer.from_gguf_metadata(smol_md)
    plain = tok._plain()
    assert plain.to_str() == HF.from_str(tok._hf.to_str()).to_str()
    assert plain.encode_special_tokens and not tok._hf.encode_special_tokens
    assert plain.model.__class__ is tok._hf.model.__class__


def test_smollm2_bos_option(smol):
    assert smol.encode("hi")[0] != smol.bos_id
    assert smol.encode("hi", add_bos=True) == [smol.bos_id] + smol.encode("hi")
    assert smol.encode("", add_bos=True) == [smol.bos_id]
    assert smol.encode("") == []


def test_smollm2_batch(smol):
    texts = ["a b c", "", "<|im_start|>x"]
    assert smol.encode_batch(texts) == [smol.encode(t) for t in texts]
    assert smol.encode_batch(texts, special=False) == [smol.encode(t, special=False) for t in texts]


def test_smollm2_pieces(smol):
    ids = smol.encode(" hello")
    assert len(ids) == 1
    assert smol.id_to_piece(ids[0]) == "Ġhello"
    assert smol.token_piece(ids[0]) == b" hello"
    assert smol.token_piece(1) == b"<|im_start|>"
    with pytest.raises(ValueError):
        smol.token_piece(smol.n_vocab)
    with pytest.raises(ValueError):
        smol.decode([smol.n_vocab])


@pytest.mark.parametrize("text", ["🦙", "x🦙y 👨‍👩‍👧 日本", "é🚀"])
def test_smollm2_stream_decoder_never_breaks_utf8(smol, text):
    ids = smol.encode(text)
    # the check only means something if some token holds a partial character
    partial = False
    for i in ids:
        try:
            smol.token_piece(i).decode("utf-8")
        except UnicodeDecodeError:
            partial = True
    assert partial, "expected at least one token to be a partial UTF-8 sequence"
    sd = smol.stream_decoder()
    chunks = [sd.feed(i) for i in ids]
    chunks.append(sd.flush())
    for c in chunks:
        assert "\ufffd" not in c
    assert "".join(chunks) == text
    # a list of ids at once works too
    sd2 = StreamDecoder(smol)
    assert sd2.feed(ids) + sd2.flush() == text
    np = pytest.importorskip("numpy")
    sd3 = StreamDecoder(smol)
    assert sd3.feed(np.array(ids[:1])) + sd3.feed(np.array(ids[1:])) + sd3.flush() == text
    assert "".join(sd3.feed(np.int64(i)) for i in ids) + sd3.flush() == text


def test_stream_decoder_incomplete_tail(smol):
    ids = smol.encode("🦙")
    sd = smol.stream_decoder()
    assert sd.feed(ids[:-1]) == ""
    assert sd.pending
    assert sd.flush() == "\ufffd"  # the stream ended inside a character


# ---------------------------------------------------------------------------------------------
# synthetic byte-level BPE
# ---------------------------------------------------------------------------------------------

BPE_SPECIAL = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool>", 4)]
BPE_CHARS = ["h", "e", "l", "o", "Ġ", "w", "r", "d", "!", "1", "2", "3", "4", "Ċ", "'", "s"]
BPE_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d",
              "1 2", "12 3", "! !", "' s"]


def bpe_md(pre="gpt-2", **extra):
    tokens, types = [], []
    for t, ty in BPE_SPECIAL:
        tokens.append(t)
        types.append(ty)
    for c in BPE_CHARS:
        tokens.append(c)
        types.append(1)
    for m in BPE_MERGES:
        tokens.append(m.replace(" ", ""))
        types.append(1)
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(BPE_MERGES),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    if pre is None:
        del md["tokenizer.ggml.pre"]
    md.update(extra)
    return md


@pytest.fixture
def bpe():
    return Tokenizer.from_gguf_metadata(bpe_md())


def ids_of(tok, *pieces):
    return [tok.piece_to_id(p) for p in pieces]


def test_bpe_ids_by_hand(bpe):
    # ids: 0-3 specials, 4.. chars in BPE_CHARS order, then merged tokens in BPE_MERGES order
    assert bpe.piece_to_id("h") == 4 and bpe.piece_to_id("hello") == 4 + 16 + 3
    # "hello world!" -> "hello" | " world" | "!"
    assert bpe.encode("hello world!") == [23, 28, 12]
    assert bpe.encode("hello world!") == ids_of(bpe, "hello", "Ġworld", "!")
    # GPT-2 split keeps digit runs together: "1234" -> 12+3 merge, then 4
    assert bpe.encode("1234") == ids_of(bpe, "123", "4")
    # newline is its own byte-level character
    assert bpe.encode("he\nhe") == ids_of(bpe, "he", "Ċ", "he")
    assert bpe.encode("hello's") == ids_of(bpe, "hello", "'s")
    assert bpe.decode(bpe.encode("hello world!")) == "hello world!"


def test_bpe_special_tokens(bpe):
    assert bpe.encode("<|im_start|>hello<|im_end|>") == [1] + ids_of(bpe, "hello") + [2]
    # with special=False the control tokens are text; '<', '|' are not in this vocab and drop
    plain = bpe.encode("<|im_start|>hello<|im_end|>", special=False)
    assert 1 not in plain and 2 not in plain
    # user-defined tokens are always matched, as in llama.cpp and HF
    assert bpe.encode("he<tool>he", special=False) == ids_of(bpe, "he") + [3] + ids_of(bpe, "he")
    assert bpe.decode([3, 1], skip_special=True) == "<tool>"
    assert bpe.decode([3, 1]) == "<tool><|im_start|>"
    assert bpe.is_eog(0) and bpe.is_eog(2) and not bpe.is_eog(1)
    assert bpe.eot_id == 2  # <|im_end|> preferred over <|endoftext|>


@pytest.mark.parametrize("pre,text,pieces", [
    ("gpt-2", "1234", ["123", "4"]),
    ("smollm", "1234", ["1", "2", "3", "4"]),  # every digit alone
    ("qwen2", "1234", ["1", "2", "3", "4"]),
    ("llama-bpe", "1234", ["123", "4"]),  # groups of up to three digits
    ("llama-bpe", "12341", ["123", "4", "1"]),
    # punctuation runs are split off first; "world" without a space has no Ġw merge
    ("default", "hello!!world", ["hello", "!!", "w", "or", "l", "d"]),
    ("gpt-2", " world!!", ["Ġworld", "!!"]),
    ("qwen2", "hello\n\nhello", ["hello", "Ċ", "Ċ", "hello"]),
])
def test_bpe_pre_tokenizers(pre, text, pieces):
    tok = Tokenizer.from_gguf_metadata(bpe_md(pre))
    expect = []
    for p in pieces:
        i = tok.piece_to_id(p)
        if i is None:  # not a token: spelled out by characters
            expect += [tok.piece_to_id(c) for c in p]
        else:
            expect.append(i)
    assert tok.encode(text, add_bos=False) == expect


def test_bpe_llama3_adds_bos_by_default():
    tok = Tokenizer.from_gguf_metadata(bpe_md("llama-bpe"))
    assert tok.add_bos and tok.encode("he") == [1] + ids_of(tok, "he")
    md = bpe_md("llama-bpe", **{"tokenizer.ggml.add_bos_token": False})
    tok = Tokenizer.from_gguf_metadata(md)
    assert tok.encode("he") == ids_of(tok, "he")


def test_bpe_unknown_pre_warns_and_uses_default():
    with pytest.warns(UserWarning, match="unknown pre-tokenizer"):
        tok = Tokenizer.from_gguf_metadata(bpe_md("no-such-pre"))
    assert tok.pre == "default"
    with pytest.warns(UserWarning, match="tokenizer.ggml.pre"):
        tok = Tokenizer.from_gguf_metadata(bpe_md(None))
    assert tok.pre == "default"


def test_pre_tokenizer_table_covers_required_types():
    for name in ("default", "smollm", "llama-bpe", "qwen2", "gpt-2"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tok = Tokenizer.from_gguf_metadata(bpe_md(name))
        assert tok.pre in PRE_TOKENIZER_REGEXES


@pytest.mark.parametrize("mutate,match", [
    (lambda md: md.pop("tokenizer.ggml.model"), "tokenizer.ggml.model"),
    (lambda md: md.__setitem__("tokenizer.ggml.model", "bert"), "unsupported tokenizer model"),
    (lambda md: md.pop("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
    (lambda md: md.__setitem__("tokenizer.ggml.tokens", []), "empty"),
    (lambda md: md.pop("tokenizer.ggml.merges"), "tokenizer.ggml.merges"),
    (lambda md: md.__setitem__("tokenizer.ggml.token_type", [1, 1]), "token_type"),
    (lambda md: md.__setitem__("tokenizer.ggml.bos_token_id", 10_000), "bos_token_id"),
    (lambda md: md["tokenizer.ggml.tokens"].__setitem__(5, "h"), "duplicate token"),
    (lambda md: md.__setitem__("tokenizer.ggml.tokens", "abc"), "array"),
    (lambda md: (md.pop("tokenizer.ggml.bos_token_id"),
                 md.__setitem__("tokenizer.ggml.add_bos_token", True)), "add_bos_token"),
])
def test_bad_metadata_raises(mutate, match):
    md = bpe_md()
    mutate(md)
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_gguf_metadata(md)


def test_bad_merges_are_skipped_with_warning():
    md = bpe_md(**{"tokenizer.ggml.merges": BPE_MERGES + ["nospace", "x y"]})
    with pytest.warns(UserWarning, match="merges"):
        tok = Tokenizer.from_gguf_metadata(md)
    assert tok.encode("hello") == ids_of(tok, "hello")


def test_merges_split_in_bulk_match_the_checked_split(monkeypatch):
    """Valid str merges are split in bulk and left to tokenizers to check (start-up time); the
    result must be the tokenizer the per-merge split builds (bytes merges take that path)."""
    fast = Tokenizer.from_gguf_metadata(bpe_md())
    checked = Tokenizer.from_gguf_metadata(bpe_md(**{"tokenizer.ggml.merges": [m.encode() for m in BPE_MERGES]}))
    for text in ("hello world!!", "hell o'sw 1234", "world hello\n12 3", "<|im_start|>hello<|im_end|>"):
        assert fast.encode(text) == checked.encode(text), text
    calls = []
    real = Tokenizer._merge_pairs
    monkeypatch.setattr(Tokenizer, "_merge_pairs", lambda self, m: calls.append(1) or real(self, m))
    Tokenizer.from_gguf_metadata(bpe_md())
    assert calls == []  # nothing to drop: no per-merge pass
    # a merge whose left part starts with a space: the separator is the first space after it
    md = bpe_md(**{"tokenizer.ggml.merges": BPE_MERGES + [" h ello"]})
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + [" h", "ello", " hello"]
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"] + [1, 1, 1]
    tok = Tokenizer.from_gguf_metadata(md)
    assert calls == [1]
    assert tok._merge_pairs([" h ello"]) == [(" h", "ello")]


def test_tokenizer_cannot_be_built_directly():
    with pytest.raises(TypeError):
        Tokenizer()


# ---------------------------------------------------------------------------------------------
# synthetic SentencePiece (llama) vocabulary
# ---------------------------------------------------------------------------------------------

SPM_NORMAL = [("▁", -1.0), ("h", -2.0), ("e", -3.0), ("l", -4.0), ("o", -5.0), ("w", -6.0),
              ("r", -7.0), ("d", -8.0), ("ll", -9.0), ("he", -10.0), ("▁h", -11.0),
              ("llo", -12.0), ("hello", -13.0), ("▁hello", -14.0), ("or", -15.0),
              ("▁w", -16.0), ("ld", -17.0), ("▁wor", -18.0), ("▁world", -19.0)]
N_SPM_HEAD = 3 + 256  # <unk> <s> </s> and 256 byte tokens


def spm_md(**extra):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for t, s in SPM_NORMAL:
        tokens.append(t)
        types.append(1)
        scores.append(s)
    tokens.append("<|user|>")
    types.append(4)
    scores.append(0.0)
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    md.update(extra)
    return md


def spm_id(piece):
    if piece.startswith("<0x"):
        return 3 + int(piece[3:5], 16)
    return N_SPM_HEAD + [t for t, _ in SPM_NORMAL].index(piece)


@pytest.fixture
def spm():
    return Tokenizer.from_gguf_metadata(spm_md())


def test_spm_ids_by_hand(spm):
    assert spm.add_bos and spm.add_space_prefix
    # " hello world" -> ▁hello ▁world (the space prefix is added by the tokenizer)
    assert spm.encode("hello world") == [1, spm_id("▁hello"), spm_id("▁world")]
    # an extra leading space stays: "▁▁hello" -> ▁ + ▁hello
    assert spm.encode(" hello", add_bos=False) == [spm_id("▁"), spm_id("▁hello")]
    # "é" is not in the vocab: byte fallback to its two UTF-8 bytes;
    # merges by score: ll(-9) > ▁h(-11) > llo(-12); 'e' stays cut off by é
    assert spm.encode("héllo", add_bos=False) == [
        spm_id("▁h"), spm_id("<0xC3>"), spm_id("<0xA9>"), spm_id("llo")]
    # without the prefix "hello" merges he(-10) + llo(-12) -> hello(-13)
    nosp = Tokenizer.from_gguf_metadata(spm_md(**{"tokenizer.ggml.add_space_prefix": False}))
    assert nosp.encode("hello", add_bos=False) == [spm_id("hello")]
    assert spm.encode("") == [1]


def test_spm_special_and_user_tokens(spm):
    user = N_SPM_HEAD + len(SPM_NORMAL)
    # a space prefix is added to each text fragment after a special token, as llama.cpp does
    assert spm.encode("hello<|user|>world", add_bos=False) == [
        spm_id("▁hello"), user, spm_id("▁world")]
    assert spm.encode("<s>hello", add_bos=False) == [1, spm_id("▁hello")]
    plain = spm.encode("<s>hello", add_bos=False, special=False)
    assert plain == [spm_id("▁"), spm_id("<0x3C>"), spm_id("<0x73>"), spm_id("<0x3E>"),
                     spm_id("hello")]
    assert spm.decode(plain) == "<s>hello"


def test_spm_decode(spm):
    ids = spm.encode("hello world")
    assert spm.decode(ids) == "<s> hello world"  # BOS rendered: the space stays (llama.cpp)
    assert spm.decode(ids, skip_special=True) == "hello world"
    assert spm.decode(ids[1:]) == "hello world"
    assert spm.decode(ids[1:], strip_space_prefix=False) == " hello world"
    assert spm.token_piece(spm_id("▁world")) == b" world"
    assert spm.token_piece(spm_id("<0xC3>")) == b"\xc3"
    sd = spm.stream_decoder(skip_special=True)
    out = "".join(sd.feed(i) for i in spm.encode("héllo world")) + sd.flush()
    assert out == " héllo world"
    assert spm.is_eog(2) and not spm.is_eog(1)


def _ref_spm_encode(text, vocab, scores):
    """llama.cpp's SPM algorithm, written plainly: repeatedly merge the adjacent pair whose
    concatenation is the best-scoring token (leftmost on ties), then spell leftovers as bytes."""
    syms = list(text)
    while True:
        best = None
        for i in range(len(syms) - 1):
            t = vocab.get(syms[i] + syms[i + 1])
            if t is not None and (best is None or scores[t] > best[0]):
                best = (scores[t], i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    out = []
    for s in syms:
        if s in vocab:
            out.append(vocab[s])
        else:
            out += [vocab[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return out


def test_spm_matches_reference_algorithm_on_random_text():
    rng = random.Random(1234)
    alphabet = "abcde "  # 'e' is in no token: byte fallback
    # a random vocabulary of substrings with distinct scores; as in real SentencePiece
    # vocabularies, every character used in a piece is also a piece by itself
    pieces = set("abcd▁")
    while len(pieces) < 60:
        n = rng.randint(2, 5)
        pieces.add("".join(rng.choice("abcd▁") for _ in range(n)))
    pieces = sorted(pieces)
    rng.shuffle(pieces)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * N_SPM_HEAD + [-float(i) for i in range(len(pieces))]
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
          "tokenizer.ggml.add_bos_token": False}
    tok = Tokenizer.from_gguf_metadata(md)
    vocab = {t: i for i, t in enumerate(tokens)}
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        expect = _ref_spm_encode(("▁" + text).replace(" ", "▁"), vocab, scores)
        assert tok.encode(text) == expect, text
        assert tok.decode(expect) == text


def test_spm_bad_scores():
    md = spm_md(**{"tokenizer.ggml.scores": [0.0] * 5})
    with pytest.raises(ValueError, match="scores"):
        Tokenizer.from_gguf_metadata(md)
