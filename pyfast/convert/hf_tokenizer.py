"""Tokenizer metadata for GGUF from a Hugging Face ``tokenizer.json`` (byte-level BPE) or a
SentencePiece-style vocabulary (``tokenizer.json`` BPE over U+2581 pieces with byte fallback, or
``tokenizer.model``: see :mod:`pyfast.convert.spm_tokenizer`, which writes ``llama`` / ``gemma4``
vocabularies).

For byte-level BPE it writes what llama.cpp's loader reads for ``gpt2``-type vocabularies:

* ``tokenizer.ggml.model`` = ``gpt2`` and ``tokenizer.ggml.pre`` (the pre-tokenizer name);
* ``tokenizer.ggml.tokens`` / ``token_type``: one entry per id up to the model's vocabulary size.
  Ids the tokenizer does not use become ``[PAD<id>]`` with type UNUSED; added tokens are CONTROL
  when special (or shaped like ``<|...|>``), USER_DEFINED otherwise; the rest NORMAL;
* ``tokenizer.ggml.merges`` as ``"left right"`` strings (a space inside a part is written as
  U+0120, the byte-level stand-in for a space);
* special token ids (bos / eos / unknown / seperator / padding / mask) from
  ``tokenizer_config.json``'s ``*_token`` entries, then ``config.json``'s ``*_token_id`` for the
  ones still missing; ``add_bos_token`` / ``add_eos_token`` from the post-processor and
  ``tokenizer_config.json``;
* ``tokenizer.chat_template`` from ``tokenizer_config.json``, else ``chat_template.jinja``, else
  ``chat_template.json``.
"""
from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["detect_pre", "tokenizer_metadata"]

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
_SPECIAL_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
                 "sep": "seperator_token_id", "pad": "padding_token_id", "mask": "mask_token_id"}

Meta = list[tuple[str, Any, str]]   # (key, value, GGUF type name)


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable JSON: {e}") from None


def _split_regexes(pre: Any) -> list[str]:
    """Every Split regex of a tokenizer.json pre_tokenizer (nested Sequences included)."""
    if not isinstance(pre, dict):
        return []
    if pre.get("type") == "Sequence":
        return [r for p in pre.get("pretokenizers", []) for r in _split_regexes(p)]
    pattern = pre.get("pattern")
    if pre.get("type") == "Split" and isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
        return [pattern["Regex"]]
    return []


def detect_pre(tokenizer_json: dict[str, Any], default: str) -> str:
    """The ``tokenizer.ggml.pre`` name for the split regexes: ``default`` when there are none or
    they are exactly default's (``llama-bpe`` and ``glm4`` share Llama 3's split), else the
    pre-tokenizer whose regexes they are exactly (``llama3``, ``qwen2``, ``qwen35``, ``gpt-4o``, ...),
    else ``qwen35`` when the split groups combining marks with letters (``[\\p{L}\\p{M}]+``) and
    ``qwen2`` otherwise."""
    from pyfast.tokenizer import PRE_TOKENIZER_REGEXES, _PRE_ALIASES

    regexes = _split_regexes(tokenizer_json.get("pre_tokenizer"))
    if not regexes:
        return default
    canon = _PRE_ALIASES.get(default, (None,))[0]
    if canon is not None and PRE_TOKENIZER_REGEXES.get(canon) == regexes:
        return default
    for name, rx in PRE_TOKENIZER_REGEXES.items():
        if rx == regexes and name != "default":
            return {"gpt4o": "gpt-4o"}.get(name, name)
    return "qwen35" if any(r"\p{M}" in r for r in regexes) else "qwen2"


def _looks_special(tok: str) -> bool:
    return (tok.startswith("<|") and tok.endswith("|>")) or (tok.startswith("<｜") and tok.endswith("｜>"))


def _merge_str(m: Any) -> str:
    if isinstance(m, str):
        return m
    if isinstance(m, (list, tuple)) and len(m) == 2 and all(isinstance(p, str) for p in m):
        return " ".join(p.replace(" ", "\u0120") for p in m)
    raise ValueError(f"unknown merges entry {m!r} in tokenizer.json")


def _token_content(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def tokenizer_metadata(hf_dir: str, config: dict[str, Any], n_vocab: int, default_pre: str,
                       arch: str | None = None) -> Meta | None:
    """The tokenizer metadata entries for ``hf_dir``, or None when it has neither ``tokenizer.json``
    nor ``tokenizer.model``.

    ``config`` is the model's config.json (special token ids are looked up in it, and in its
    ``text_config``); ``n_vocab`` is the model's vocabulary size (the embedding rows); ``arch`` the
    GGUF architecture (Gemma 4 gets llama.cpp's ``gemma4`` vocabulary, Gemma 3 no space prefix).
    """
    from pyfast.convert.spm_tokenizer import is_spm_style, spm_vocab_from_json, spm_vocab_from_model

    tj_path = os.path.join(hf_dir, "tokenizer.json")
    sp_path = os.path.join(hf_dir, "tokenizer.model")
    has_sp = os.path.isfile(sp_path)
    if not os.path.isfile(tj_path):
        if not has_sp:
            return None
        tj: Any = {}
        spm = spm_vocab_from_model(sp_path, n_vocab, arch, _looks_special)
    else:
        tj = _read_json(tj_path)
        model = tj.get("model") if isinstance(tj, dict) else None
        if not isinstance(model, dict) or model.get("type", "BPE") != "BPE" or not isinstance(model.get("vocab"), dict):
            raise ValueError(f"{tj_path}: only BPE tokenizers are supported (byte-level or SentencePiece-style)")
        spm = None
        if is_spm_style(tj):
            # as llama.cpp: the sentencepiece model when there is one, except for Gemma 4 (merges)
            spm = (spm_vocab_from_model(sp_path, n_vocab, arch, _looks_special) if has_sp and arch != "gemma4"
                   else spm_vocab_from_json(tj, tj_path, n_vocab, arch, _looks_special))
    if spm is not None:
        return _spm_metadata(hf_dir, tj, config, n_vocab, spm)

    # ---- tokens and their types
    id_to_tok: dict[int, str] = {}
    for tok, i in model["vocab"].items():
        id_to_tok[int(i)] = tok
    added: dict[int, dict[str, Any]] = {}
    for a in tj.get("added_tokens") or []:
        i = int(a["id"])
        added[i] = a
        id_to_tok[i] = a["content"]
    if id_to_tok and max(id_to_tok) >= n_vocab:
        raise ValueError(f"{tj_path}: token id {max(id_to_tok)} does not fit the model's vocabulary "
                         f"of {n_vocab}")
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        tok = id_to_tok.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(tok)
            types.append(CONTROL if added[i].get("special") or _looks_special(tok) else USER_DEFINED)
        else:
            tokens.append(tok)
            types.append(NORMAL)
    merges = [_merge_str(m) for m in model.get("merges") or []]

    meta: Meta = [
        ("tokenizer.ggml.model", "gpt2", "string"),
        ("tokenizer.ggml.pre", detect_pre(tj, default_pre), "string"),
        ("tokenizer.ggml.tokens", tokens, "array[string]"),
        ("tokenizer.ggml.token_type", types, "array[int32]"),
    ]
    if merges:
        meta.append(("tokenizer.ggml.merges", merges, "array[string]"))
    content_to_id = {a["content"]: int(a["id"]) for a in (tj.get("added_tokens") or [])}
    return meta + _common_metadata(hf_dir, tj, config, n_vocab, content_to_id, {})


def _spm_metadata(hf_dir: str, tj: Any, config: dict[str, Any], n_vocab: int, spm: dict[str, Any]) -> Meta:
    meta: Meta = [
        ("tokenizer.ggml.model", spm["model"], "string"),
        ("tokenizer.ggml.tokens", spm["tokens"], "array[string]"),
        ("tokenizer.ggml.scores", spm["scores"], "array[float32]"),
        ("tokenizer.ggml.token_type", spm["types"], "array[int32]"),
    ]
    if spm.get("merges"):
        meta.append(("tokenizer.ggml.merges", spm["merges"], "array[string]"))
    meta.append(("tokenizer.ggml.add_space_prefix", bool(spm["add_space_prefix"]), "bool"))
    content_to_id: dict[str, int] = {}
    for i, t in enumerate(spm["tokens"]):
        content_to_id.setdefault(t, i)
    defaults = {k[:-3]: v for k, v in (spm.get("special") or {}).items()}  # tokenizer.model's unk / bos / eos / pad
    forced = {"bos": True} if spm["model"] == "gemma4" else {}  # llama.cpp always adds BOS for Gemma 4
    return meta + _common_metadata(hf_dir, tj, config, n_vocab, content_to_id, defaults, forced)


def _common_metadata(hf_dir: str, tj: Any, config: dict[str, Any], n_vocab: int, content_to_id: dict[str, int],
                     defaults: dict[str, int], forced_add: dict[str, bool] | None = None) -> Meta:
    """Special token ids, add_bos / add_eos and the chat template."""
    tj = tj if isinstance(tj, dict) else {}
    # ---- special tokens
    tc_path = os.path.join(hf_dir, "tokenizer_config.json")
    tc = _read_json(tc_path) if os.path.isfile(tc_path) else {}
    if not isinstance(tc, dict):
        tc = {}
    special: dict[str, int] = {}
    bos = _token_content(tc.get("bos_token")) or _token_content(tc.get("cls_token"))
    eos = _token_content(tc.get("eos_token")) or _token_content(tc.get("sep_token"))
    for typ, content in (("bos", bos), ("eos", eos), ("unk", _token_content(tc.get("unk_token"))),
                         ("sep", _token_content(tc.get("sep_token"))), ("pad", _token_content(tc.get("pad_token"))),
                         ("mask", _token_content(tc.get("mask_token")))):
        if content is not None and content in content_to_id:
            special[typ] = content_to_id[content]
    text_cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for typ in _SPECIAL_KEYS:
        if typ in special:
            continue
        tid = config.get(f"{typ}_token_id")
        if tid is None:
            tid = text_cfg.get(f"{typ}_token_id")
        if isinstance(tid, int) and not isinstance(tid, bool) and 0 <= tid < n_vocab:
            special[typ] = tid
    for typ, tid in defaults.items():
        special.setdefault(typ, tid)

    add: dict[str, bool] = {}
    post = tj.get("post_processor")
    for proc in (post.get("processors", [post]) if isinstance(post, dict) else []):
        kind = proc.get("type") if isinstance(proc, dict) else None
        if kind == "ByteLevel":
            add.setdefault("bos", False)
            add.setdefault("eos", False)
        elif kind == "TemplateProcessing":
            single = proc.get("single") or []
            if single:
                add["bos"] = "SpecialToken" in single[0]
                add["eos"] = len(single) > 1 and "SpecialToken" in single[-1]
    for typ in ("bos", "eos"):
        v = tc.get(f"add_{typ}_token")
        if isinstance(v, bool) and typ not in add:
            add[typ] = v
    add.update(forced_add or {})

    # ---- chat template
    template = tc.get("chat_template")
    if template is None:
        jinja = os.path.join(hf_dir, "chat_template.jinja")
        cj = os.path.join(hf_dir, "chat_template.json")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        elif os.path.isfile(cj):
            template = (_read_json(cj) or {}).get("chat_template")

    meta: Meta = []
    for typ, key in _SPECIAL_KEYS.items():
        if typ in special:
            meta.append((f"tokenizer.ggml.{key}", special[typ], "uint32"))
    for typ in ("bos", "eos"):
        if typ in add:
            meta.append((f"tokenizer.ggml.add_{typ}_token", add[typ], "bool"))
    if isinstance(template, str):
        meta.append(("tokenizer.chat_template", template, "string"))
    elif isinstance(template, list):
        names = []
        for choice in template:
            if not isinstance(choice, dict) or not isinstance(choice.get("template"), str):
                continue
            name = "".join(c if c.isascii() and c.isalnum() else "_" for c in str(choice.get("name", "")))
            if name == "default":
                meta.append(("tokenizer.chat_template", choice["template"], "string"))
            elif name:
                names.append(name)
                meta.append((f"tokenizer.chat_template.{name}", choice["template"], "string"))
        if names:
            meta.append(("tokenizer.chat_templates", names, "array[string]"))
    return meta
