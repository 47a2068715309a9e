#!/usr/bin/env python3
"""Dev check (not part of the tests): load GGUF files with a llama.cpp shared library (libllama.so)
and compare its tokenization with pyfast's, optionally loading the weights too (which checks that
llama.cpp accepts every metadata key and tensor name and shape of the file) and comparing the
logits of a token sequence decoded one token at a time.

Usage: ``python scripts/check_llamacpp_vocab.py --lib /path/to/libllama.so [--weights] [--logits]
FILE.gguf ...``

Prints one line per file: how many of the strings gave the same ids (with and without special
tokens), whether the full model loaded, and the largest logit difference relative to the largest
logit. The ``llama_model_params`` / ``llama_batch`` layouts below are those of llama.h at the
llama.cpp version the library was built from (``llama_context_params`` is passed through as
returned); check them when pointing at another.
"""
from __future__ import annotations

import argparse
import ctypes as C
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STRINGS = [
    "Hello world", " leading space", "two  spaces and   three", "trailing space ", "line one\nline two\n\nthree\n\n\n",
    "\n\nstarts with newlines", "tab\tseparated\r\nwindows line", "naïve café façade", "日本語のテキスト",
    "emoji 🙂 and ✨", "prices 9.99 and 100.50 in 2024", "abc cab", "aab  bba\n\ncde", " dead bead",
    "ab\n\n\n\nba", "<start_of_turn>user\nabc<end_of_turn>\n", "", " ", "\n", "a",
]


class Batch(C.Structure):
    _fields_ = [("n_tokens", C.c_int32), ("token", C.c_void_p), ("embd", C.c_void_p), ("pos", C.c_void_p),
                ("n_seq_id", C.c_void_p), ("seq_id", C.c_void_p), ("logits", C.c_void_p)]


class ContextParams(C.Structure):  # opaque: large enough for llama_context_params, passed back as is
    _fields_ = [("n_ctx", C.c_uint32), ("rest", C.c_uint8 * 1020)]


def llamacpp_logits(lib, model, tokens: list[int], n_vocab: int):
    import numpy as np

    cp = lib.llama_context_default_params()
    cp.n_ctx = 256
    # type_k / type_v (offsets 104 / 108 in llama_context_params) = GGML_TYPE_F32 (0): an F16 cache
    # would move logits by ~1e-3 and can flip a near-tie MoE routing
    for off in range(100, 108):
        cp.rest[off] = 0
    ctx = lib.llama_init_from_model(model, cp)
    if not ctx:
        return None
    rows = []
    for t in tokens:
        arr = (C.c_int32 * 1)(t)
        if lib.llama_decode(ctx, lib.llama_batch_get_one(arr, 1)) != 0:
            lib.llama_free(ctx)
            return None
        ptr = lib.llama_get_logits_ith(ctx, -1)
        rows.append(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy())
    lib.llama_free(ctx)
    return np.stack(rows)


class ModelParams(C.Structure):
    _fields_ = [("devices", C.c_void_p), ("tensor_buft_overrides", C.c_void_p), ("n_gpu_layers", C.c_int32),
                ("split_mode", C.c_int), ("load_mode", C.c_int), ("lazy_mode", C.c_int), ("main_gpu", C.c_int32),
                ("tensor_split", C.c_void_p), ("progress_callback", C.c_void_p),
                ("progress_callback_user_data", C.c_void_p), ("kv_overrides", C.c_void_p),
                ("vocab_only", C.c_bool), ("check_tensors", C.c_bool), ("use_extra_bufts", C.c_bool),
                ("no_host", C.c_bool), ("no_alloc", C.c_bool), ("load_mtp", C.c_bool)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True, help="libllama.so")
    ap.add_argument("--weights", action="store_true", help="also load the full model")
    ap.add_argument("--logits", action="store_true", help="also compare logits (implies --weights)")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    lib = C.CDLL(a.lib)
    lib.llama_model_default_params.restype = ModelParams
    lib.llama_model_load_from_file.restype = C.c_void_p
    lib.llama_model_load_from_file.argtypes = [C.c_char_p, ModelParams]
    lib.llama_model_get_vocab.restype = C.c_void_p
    lib.llama_model_get_vocab.argtypes = [C.c_void_p]
    lib.llama_model_free.argtypes = [C.c_void_p]
    lib.llama_tokenize.restype = C.c_int32
    lib.llama_tokenize.argtypes = [C.c_void_p, C.c_char_p, C.c_int32, C.POINTER(C.c_int32), C.c_int32, C.c_bool,
                                   C.c_bool]
    lib.llama_context_default_params.restype = ContextParams
    lib.llama_init_from_model.restype = C.c_void_p
    lib.llama_init_from_model.argtypes = [C.c_void_p, ContextParams]
    lib.llama_batch_get_one.restype = Batch
    lib.llama_batch_get_one.argtypes = [C.POINTER(C.c_int32), C.c_int32]
    lib.llama_decode.restype = C.c_int32
    lib.llama_decode.argtypes = [C.c_void_p, Batch]
    lib.llama_get_logits_ith.restype = C.POINTER(C.c_float)
    lib.llama_get_logits_ith.argtypes = [C.c_void_p, C.c_int32]
    lib.llama_free.argtypes = [C.c_void_p]
    lib.llama_backend_init()

    from pyfast.gguf import GGUFReader  # noqa: F401  (the tokenizer reads metadata through the model)
    from pyfast.models import Model
    from pyfast.tokenizer import Tokenizer

    bad_total = 0
    for f in a.files:
        p = lib.llama_model_default_params()
        p.vocab_only = True
        m = lib.llama_model_load_from_file(f.encode(), p)
        if not m:
            print(f"{f}: llama.cpp could not load the vocabulary")
            bad_total += 1
            continue
        vocab = lib.llama_model_get_vocab(m)
        tok = Tokenizer.from_gguf_metadata(Model(f).metadata)
        same = n = 0
        for s in STRINGS:
            for special in (False, True):
                raw = s.encode()
                buf = (C.c_int32 * (4 * len(raw) + 8))()
                k = lib.llama_tokenize(vocab, raw, len(raw), buf, len(buf), special, special)
                want = list(buf[:k])
                got = tok.encode(s, add_bos=None if special else False, special=special)
                n += 1
                if got == want:
                    same += 1
                else:
                    print(f"  {s!r} special={special}: pyfast {got} llama.cpp {want}")
        lib.llama_model_free(m)
        line = f"{f}: {tok.model} vocabulary, {same}/{n} strings tokenized alike"
        bad_total += n - same
        if a.weights or a.logits:
            p = lib.llama_model_default_params()
            m = lib.llama_model_load_from_file(f.encode(), p)
            line += ", full model " + ("loaded" if m else "NOT loaded")
            bad_total += not m
            if m and a.logits:
                import numpy as np

                from pyfast.context import Context

                model = Model(f)
                toks = tok.encode("abc cab dead bead. Hello world, hello there!")[:24]
                want = llamacpp_logits(lib, m, toks, model.args.n_vocab)
                if want is None:
                    line += ", llama.cpp could not decode"
                    bad_total += 1
                else:
                    got = Context(model, n_ctx=64, n_threads=2).decode(np.array(toks, np.int32), logits="all")
                    rel = float(np.abs(got - want).max() / np.abs(want).max())
                    same_argmax = int((got.argmax(1) == want.argmax(1)).sum())
                    line += f", logits of {len(toks)} tokens: max rel diff {rel:.2e}, argmax equal {same_argmax}/{len(toks)}"
            if m:
                lib.llama_model_free(m)
        print(line)
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())
