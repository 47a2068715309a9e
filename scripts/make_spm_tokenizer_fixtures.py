#!/usr/bin/env python3
"""Build the small SentencePiece-style tokenizers under tests/fixtures/tokenizer_spm/ and the token
ids the reference implementations give for a set of strings (needs ``tokenizers``, transformers and
sentencepiece; the tests read the results without transformers or sentencepiece).

* ``gemma/``: a BPE trained with ``tokenizers`` on the corpus below and saved with Gemma's
  pipeline (transformers' ``GemmaTokenizer``: spaces replaced by U+2581, byte fallback to the 256
  ``<0xXX>`` tokens, ``<bos>`` added, no space prefix); 7 special tokens first
  (``<pad> <eos> <bos> <unk> <mask> <start_of_turn> <end_of_turn>``), then the byte tokens;
* ``gemma_tiny/``: the same kind of tokenizer in 280 ids (the vocabulary of the tiny Gemma model
  fixtures in tests/fixtures/decoder/hf), over a 6-letter alphabet, so most text goes through
  byte fallback;
* ``spm/tokenizer.model``: a sentencepiece BPE model (byte fallback, identity normalization, no
  whitespace collapsing) with the dummy prefix (Llama 2 style);
* ``reference.json``: ``{name: {"encode": [[text, ids], ...], "decode": [[ids, text], ...]}}``,
  ids from transformers' ``AutoTokenizer`` (``gemma``, ``gemma_tiny``; without special tokens)
  and from sentencepiece (``spm``).

Usage: ``python scripts/make_spm_tokenizer_fixtures.py [--out DIR]``.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPACE = "\u2581"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]

CORPUS = """\
The small tokenizer learns its pieces from these lines, which are written for this test only.
It sees words like token, tokens, tokenizer, tokenized and tokenization many times over.
A sentence piece model treats the space as a normal symbol and marks it with a low line.
Numbers such as 12, 345 and 2024 appear, and so do prices like 9.99 and 100.50.
Some words carry accents: café, naïve, façade, résumé, über, señor, jalapeño.
Line breaks matter too.

Two blank lines separate the next paragraph.


Indented text keeps its spaces:    four of them, and a tab\tbetween words.
Questions? Answers! Lists: one, two, three; and quotes "like this" or 'that'.
The quick brown fox jumps over the lazy dog while the tokenizer counts the pieces.
Hello world, hello there, hello again; the world says hello back.
Speculative decoding drafts tokens and the target model verifies them in one batch.
Sliding window attention keeps the last few positions of each sequence in its cache.
"""

TINY_CORPUS_SEED = 7
TINY_ALPHABET = "abcde"

STRINGS = [
    "Hello world",
    "hello world, hello there",
    " leading space",
    "two  spaces and   three",
    "trailing space ",
    "line one\nline two\n\nline three\n\n\n",
    "\n\nstarts with newlines",
    "tab\tseparated\r\nwindows line",
    "naïve café façade",
    "日本語のテキスト",
    "emoji 🙂 and ✨ sparkles",
    "tokenizer tokenization tokens",
    "prices 9.99 and 100.50 in 2024",
    "Mixed: ünïcödé ⟨x⟩ ∑",
    "",
    " ",
    "\n",
    "a",
]
CHAT = "<start_of_turn>user\nhello world<end_of_turn>\n<start_of_turn>model\n"
TINY_STRINGS = ["abc cab", "aab  bba\n\ncde", " dead bead", "ab\n\n\n\nba", "café é ü", "xyz 123", "",
                "e 🙂 d", "<start_of_turn>user\nabc<end_of_turn>\n"]


def _gemma_like(vocab: dict[str, int], merges: list[tuple[str, str]]):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", vocab["<bos>"])])
    return tok


def train_gemma_like(lines: list[str], vocab_size: int):
    """A BPE trained on ``lines`` (words split at U+2581 and at newline runs), rebuilt with the
    special tokens, then the byte tokens, then the learned pieces."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
        pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True)])
    n_learn = vocab_size - len(SPECIALS) - len(BYTES)
    trainer = trainers.BpeTrainer(vocab_size=n_learn, special_tokens=[], show_progress=False, min_frequency=1)
    t.train_from_iterator(lines, trainer=trainer)
    learned = json.loads(t.to_str())["model"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + BYTES)}
    for tok, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        if tok not in vocab:
            vocab[tok] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in learned["merges"]]
    return _gemma_like(vocab, merges)


def save_gemma_dir(tok, d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
           "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
           "mask_token": "<mask>", "clean_up_tokenization_spaces": False, "model_max_length": 1024,
           "chat_template": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                            "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False) + "\n")


def hf_reference(d: Path, strings: list[str]) -> dict:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(d))
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    enc, dec = [], []
    for s in strings:
        ids = hf.encode(s, add_special_tokens=False)
        assert ids == raw.encode(s, add_special_tokens=False).ids, (d, s)
        assert hf.encode(s)[:1] == [hf.bos_token_id]
        enc.append([s, ids])
        dec.append([ids, hf.decode(ids, skip_special_tokens=False)])
    return {"encode": enc, "decode": dec}


def train_spm(lines: list[str], d: Path, vocab_size: int) -> dict:
    import sentencepiece as spm

    d.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        txt = Path(tmp) / "corpus.txt"
        txt.write_text("\n".join(lines) + "\n", encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(txt), model_prefix=str(Path(tmp) / "m"), model_type="bpe", vocab_size=vocab_size,
            byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=True, character_coverage=1.0, split_digits=False, unk_id=0, bos_id=1, eos_id=2,
            pad_id=-1, minloglevel=2)
        shutil.copy(Path(tmp) / "m.model", d / "tokenizer.model")
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    strings = [s for s in STRINGS if "\n" not in s and "\t" not in s]  # whole lines, as sentencepiece sees them
    enc = [[s, sp.encode(s)] for s in strings]
    dec = [[ids, sp.decode(ids)] for _, ids in enc]
    return {"encode": enc, "decode": dec}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "tokenizer_spm"))
    out = Path(ap.parse_args().out)
    lines = CORPUS.splitlines(keepends=True)
    lines = ["".join(lines)] * 3 + lines  # whole text (newline runs) and each line
    ref = {}

    save_gemma_dir(train_gemma_like(lines, 700), out / "gemma")
    ref["gemma"] = hf_reference(out / "gemma", STRINGS + [CHAT])

    rng = random.Random(TINY_CORPUS_SEED)
    words = ["".join(rng.choice(TINY_ALPHABET) for _ in range(rng.randint(1, 5))) for _ in range(400)]
    tiny = [" ".join(words[i:i + 8]) + "\n" * rng.randint(1, 3) for i in range(0, len(words), 8)]
    save_gemma_dir(train_gemma_like(tiny, 280), out / "gemma_tiny")
    ref["gemma_tiny"] = hf_reference(out / "gemma_tiny", TINY_STRINGS)

    ref["spm"] = train_spm([ln.rstrip("\n") for ln in CORPUS.splitlines() if ln.strip()], out / "spm", 500)
    (out / "reference.json").write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
