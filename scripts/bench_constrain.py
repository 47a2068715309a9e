"""Cost of the constraint stage (pyfast.constrain) against a decode step, on SmolLM2 (49k vocab).

Generates greedily under several constraints and times, per token: the mask (llguidance's
``compute mask`` into a bitmask), applying it to the logits (unpack + where), consuming the token,
and the model's decode step, measured in the same run. Prints per-constraint medians and the mask
cost as a fraction of a decode step.

    python scripts/bench_constrain.py [-m MODEL] [-t THREADS] [-n TOKENS]
    python scripts/bench_constrain.py --xgrammar     # also time xgrammar's matcher, if installed
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                      "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "address"]}
CASES = {
    "json_object": ("json", None),
    "json_schema": ("json_schema", SCHEMA),
    "gbnf": ("gbnf", 'root ::= item (", " item)*\nitem ::= [a-z]+ " = " [0-9]+'),
    "regex": ("regex", r"([A-Z][a-z]+ ){2,6}[0-9]{1,4}\."),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--xgrammar", action="store_true")
    a = ap.parse_args()

    from pyfast.constrain import Constraint, compile_constraint
    from pyfast.llm import LLM

    llm = LLM(a.model, n_ctx=1024, n_threads=a.threads)
    tok, ctx = llm.tokenizer, llm.ctx
    prompt = llm.tokenize("Write something: ")
    print(f"model {llm.model.path} n_vocab {llm.n_vocab} threads {a.threads}")
    for name, (kind, src) in CASES.items():
        t0 = time.perf_counter()
        g = compile_constraint(Constraint(kind, src), tok, llm.n_vocab)
        t_compile = time.perf_counter() - t0
        m = g.matcher()
        ctx.clear()
        logits = ctx.decode(prompt, logits="last")[0]
        mask_s, apply_s, consume_s, step_s = [], [], [], []
        n = 0
        while n < a.tokens:
            t0 = time.perf_counter()
            ok = m.allowed()
            t1 = time.perf_counter()
            x = np.where(ok, logits, np.float32(-np.inf))
            t2 = time.perf_counter()
            t = int(np.argmax(x))
            if tok.is_eog(t):
                break
            m.consume(t)
            t3 = time.perf_counter()
            logits = ctx.decode_step(t, len(prompt) + n, 0)[0]
            t4 = time.perf_counter()
            mask_s.append(t1 - t0)
            apply_s.append(t2 - t1)
            consume_s.append(t3 - t2)
            step_s.append(t4 - t3)
            n += 1
        med = statistics.median
        stage = med(mask_s) + med(apply_s) + med(consume_s)
        print(f"{name:12s} compile {t_compile * 1e3:7.1f} ms | per token (median of {n}): mask "
              f"{med(mask_s) * 1e6:6.1f} us, apply {med(apply_s) * 1e6:5.1f} us, consume {med(consume_s) * 1e6:5.1f} us"
              f" | decode step {med(step_s) * 1e3:6.2f} ms | stage / step = {stage / med(step_s) * 100:4.1f}% "
              f"(mean {(sum(mask_s) + sum(apply_s) + sum(consume_s)) / sum(step_s) * 100:4.1f}%)")
    if a.xgrammar:
        _xgrammar(llm, a)


def _xgrammar(llm, a) -> None:
    """The same JSON-schema mask with xgrammar, when its package is importable."""
    try:
        import xgrammar as xgr
    except ImportError as e:
        print(f"xgrammar not available ({e})")
        return
    import json

    tok = llm.tokenizer
    enc = [tok.token_piece(i) for i in range(tok.n_vocab)]
    info = xgr.TokenizerInfo(enc, vocab_size=llm.n_vocab, stop_token_ids=sorted(tok.eog_ids))
    t0 = time.perf_counter()
    cg = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    t_compile = time.perf_counter() - t0
    m = xgr.GrammarMatcher(cg)
    bm = xgr.allocate_token_bitmask(1, llm.n_vocab)
    ts = []
    for t in tok.encode(json.dumps({"name": "Ann", "age": 3, "tags": ["a"], "address": {"city": "X", "zip": "12345"}}),
                        add_bos=False):
        t1 = time.perf_counter()
        m.fill_next_token_bitmask(bm)
        ts.append(time.perf_counter() - t1)
        m.accept_token(t)
    print(f"xgrammar json_schema compile {t_compile * 1e3:.1f} ms, mask median {statistics.median(ts) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
