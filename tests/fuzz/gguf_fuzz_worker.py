"""Runs seeded GGUF mutations through ``LLM()`` and the CLI commands, one JSON line per case.

Started by ``test_gguf_fuzz.py`` in a subprocess whose address space is capped
(``resource.setrlimit``), so a loader that tried to allocate without bound would fail here with
MemoryError instead of taking the machine down. Each case has a wall-clock limit (SIGALRM).

    python gguf_fuzz_worker.py OUT_DIR SEED N_CASES FIXTURE...
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import resource
import signal
import struct
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root

CASE_SECONDS = 20  # a case past this is a failure (typical: well under 1 s)
COMMANDS = ("LLM", "generate", "chat", "perplexity", "bench", "info", "quantize", "serve")


class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTimeout(f"case ran past {CASE_SECONDS} s")


# --- mutations -----------------------------------------------------------------------------------
def rewrite(src: str, dst: str, meta: dict | None = None, drop_keys=(), drop_tensors=(), reshape: dict | None = None,
            extra_tensors: dict | None = None) -> None:
    """Copy a GGUF with metadata overrides ({key: (value, type)}), keys / tensors removed,
    tensors given new shapes (data resized to match) or added."""
    from pyfast.gguf import GGUFReader
    from pyfast.gguf.writer import GGUFWriter
    from pyfast._loader import native

    r = GGUFReader(src)
    w = GGUFWriter(dst)
    w.copy_metadata(r, skip=tuple(drop_keys))
    for k, (v, t) in (meta or {}).items():
        w.add(k, v, t)
    for name, info in r.tensors.items():
        if name in drop_tensors:
            continue
        data = bytes(r.tensor_bytes(name))
        shape = tuple(info.shape)
        if reshape and name in reshape:
            shape = reshape[name]
            dt = native.DType(info.type)
            n = int(native.dtype_row_size(dt, shape[-1])) * int(np.prod(shape[:-1], dtype=np.int64))
            data = (data * (n // max(len(data), 1) + 1))[:n]
        w.add_tensor(name, info.type, shape, data)
    for name, (src_name, shape) in (extra_tensors or {}).items():
        info = r.tensors[src_name]
        w.add_tensor(name, info.type, shape, bytes(r.tensor_bytes(src_name)))
    w.write()
    r.close()


ABSURD_INTS = [0, 1, -1, 3, 2**31 - 1, 2**32 - 1, 2**63 - 1, -2**63]
ODD_VALUES = [("30", "string"), (30.0, "float32"), (True, "bool"), ([1, 2], "array[int32]"), ("", "string"),
              (float("nan"), "float32"), (float("inf"), "float32"), (1e-30, "float32"), (-2.0, "float32")]


def int_type(v: int) -> str:
    if v < 0:
        return "int32" if v >= -2**31 else "int64"
    return "uint32" if v < 2**32 else "uint64"


def make_case(rng: random.Random, i: int, fixture: str, tmp: str) -> tuple[str, str]:
    """Write case i's file; returns (path, description)."""
    from pyfast.gguf import GGUFReader

    path = os.path.join(tmp, f"case{i}.gguf")
    data = open(fixture, "rb").read()
    r = GGUFReader(fixture)
    arch = r.architecture
    header_end = r.data_offset
    keys = [k for k in r.metadata if k.startswith(arch + ".") or k.startswith("tokenizer.ggml.")
            and k not in ("tokenizer.ggml.merges",)]
    tensors = list(r.tensors)
    layer_keys = [k for k in keys if k.split(".", 1)[1] in (
        "block_count", "embedding_length", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "attention.key_length", "rope.dimension_count", "context_length",
        "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size", "ssm.conv_kernel",
        "expert_count", "expert_used_count", "full_attention_interval", "vocab_size")]
    n_vocab, n_embd = r.tensors["token_embd.weight"].shape
    r.close()
    kind = rng.choice(["truncate", "flip", "flip", "absurd", "absurd", "odd", "drop_key", "tensor"])
    if kind == "truncate":
        n = rng.randrange(0, len(data))
        open(path, "wb").write(data[:n])
        return path, f"truncated at byte {n} of {len(data)}"
    if kind == "flip":
        buf = bytearray(data)
        where = []
        for _ in range(rng.randint(1, 4)):
            o = rng.randrange(0, header_end)
            buf[o] ^= 1 << rng.randrange(8)
            where.append(o)
        open(path, "wb").write(bytes(buf))
        return path, f"bits flipped at {where} (metadata / tensor table)"
    if kind == "absurd":
        k = rng.choice(layer_keys)
        v = rng.choice(ABSURD_INTS + [r.metadata[k] + 1, r.metadata[k] - 1]) if isinstance(
            r.metadata[k], int) else rng.choice(ABSURD_INTS)
        rewrite(fixture, path, meta={k: (v, int_type(v))})
        return path, f"{k} = {v}"
    if kind == "odd":
        k = rng.choice(keys)
        v, t = rng.choice(ODD_VALUES)
        if k == "tokenizer.ggml.tokens" and rng.random() < 0.5:
            v, t = ["a", "b", "c"], "array[string]"
        rewrite(fixture, path, meta={k: (v, t)})
        return path, f"{k} = {v!r} ({t})"
    if kind == "drop_key":
        k = rng.choice(keys)
        rewrite(fixture, path, drop_keys=(k,))
        return path, f"without {k}"
    # metadata contradicting the tensors
    sub = rng.choice(["drop", "embd_rows", "embd_cols", "extra_layer", "reshape", "invalid_utf8"])
    if sub == "drop":
        t = rng.choice(tensors)
        rewrite(fixture, path, drop_tensors=(t,))
        return path, f"without tensor {t}"
    if sub == "embd_rows":
        rows = rng.choice([n_vocab + 1, n_vocab - 1, 3])
        rewrite(fixture, path, reshape={"token_embd.weight": (rows, n_embd)})
        return path, f"token_embd.weight with {rows} rows for {n_vocab} tokens"
    if sub == "embd_cols":
        rewrite(fixture, path, reshape={"token_embd.weight": (n_vocab, n_embd + 32)})
        return path, "token_embd.weight wider than embedding_length"
    if sub == "extra_layer":
        n = 1 + max(int(t.split(".")[1]) for t in tensors if t.startswith("blk."))
        t0 = [t for t in tensors if t.startswith("blk.0.")][0]
        from pyfast.gguf import GGUFReader as R

        shape = tuple(R(fixture).tensors[t0].shape)
        rewrite(fixture, path, extra_tensors={t0.replace("blk.0.", f"blk.{n}."): (t0, shape)})
        return path, f"an extra layer tensor blk.{n} (block_count unchanged)"
    if sub == "reshape":
        t = rng.choice([t for t in tensors if t.startswith("blk.")])
        from pyfast.gguf import GGUFReader as R

        shape = tuple(R(fixture).tensors[t].shape)
        new = shape[::-1] if len(shape) == 2 and shape[0] != shape[1] else shape[:-1] + (shape[-1] + 32,)
        rewrite(fixture, path, reshape={t: new})
        return path, f"tensor {t} shape {list(shape)} -> {list(new)}"
    # a token that is not valid UTF-8
    from pyfast.gguf import GGUFReader as R

    toks = list(R(fixture).metadata["tokenizer.ggml.tokens"])
    j = rng.randrange(len(toks))
    toks[j] = toks[j] + "\udcff"  # surrogateescape: the byte 0xff in the file
    rewrite(fixture, path, meta={"tokenizer.ggml.tokens": (toks, "array[string]")})
    return path, f"token {j} is not valid UTF-8"


# --- running one case ----------------------------------------------------------------------------
def run_cli(argv: list[str], stdin: str = "") -> tuple[int, str]:
    from pyfast import cli

    err = io.StringIO()
    out = io.StringIO()
    old_in = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                rc = cli.main(argv)
            except SystemExit as e:  # argparse
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdin = old_in
    return rc, err.getvalue()


def run_case(cmd: str, path: str, tmp: str) -> dict:
    if cmd == "LLM":
        from pyfast import LLM

        try:
            llm = LLM(path, n_ctx=32, n_threads=1)
        except ValueError as e:
            return {"outcome": "error", "message": str(e), "type": type(e).__name__}
        try:
            res = llm.generate([1, 2, 3], max_tokens=2, temperature=0)
            return {"outcome": "loaded", "tokens": res.tokens, "n_vocab": llm.n_vocab}
        except ValueError as e:  # e.g. flipped bits made a weight NaN: no finite logit
            return {"outcome": "error", "message": str(e), "type": type(e).__name__, "after_load": True}
    text = os.path.join(tmp, "text.txt")
    if not os.path.exists(text):
        with open(text, "w") as f:
            f.write("abc def ghi jkl mno pqr stu vwx yz. " * 40)
    common = ["-m", path, "-t", "1"]
    if cmd == "generate":
        rc, err = run_cli(["generate", *common, "-c", "32", "-n", "2", "--temp", "0", "-p", "hello"])
    elif cmd == "chat":
        rc, err = run_cli(["chat", *common, "-c", "64", "-n", "2", "--temp", "0"], stdin="hi\n")
    elif cmd == "perplexity":
        rc, err = run_cli(["perplexity", *common, "-c", "16", "-f", text])
    elif cmd == "bench":
        rc, err = run_cli(["bench", "-m", path, "-t", "1", "-p", "8", "-n", "2", "-r", "1"])
    elif cmd == "info":
        rc, err = run_cli(["info", path])
    elif cmd == "quantize":
        rc, err = run_cli(["quantize", path, os.path.join(tmp, "q.gguf"), "F16", "-t", "1", "-q"])
    elif cmd == "serve":
        import uvicorn

        # everything up to listening: flags, model, engine, app
        uvicorn.run = lambda *a, **k: None
        uvicorn.Server.run = lambda self, *a, **k: None
        rc, err = run_cli(["serve", *common, "-c", "64", "-np", "2", "--port", "18080"])
    else:
        raise ValueError(cmd)
    return {"outcome": "cli", "rc": rc, "stderr": err}


def peak_rss_kb() -> int:
    """This process's peak resident memory in KiB: VmHWM, which starts afresh at exec (ru_maxrss
    can carry the parent's peak: a test process that had grown to 1.7 GB passed it on)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> int:
    out_dir, seed, n_cases = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    fixtures = sys.argv[4:]
    limit = int(os.environ.get("FUZZ_AS_LIMIT", str(6 << 30)))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _alarm)
    rng = random.Random(seed)
    rss0 = peak_rss_kb()
    results = open(os.path.join(out_dir, "results.jsonl"), "w")
    for i in range(n_cases):
        fixture = fixtures[i % len(fixtures)]
        cmd = COMMANDS[i % len(COMMANDS)]
        rec = {"case": i, "fixture": os.path.basename(fixture), "cmd": cmd}
        t0 = time.perf_counter()
        signal.alarm(CASE_SECONDS)
        try:
            path, desc = make_case(rng, i, fixture, out_dir)
            rec["desc"] = desc
            rec.update(run_case(cmd, path, out_dir))
        except BaseException as e:  # anything but a ValueError from the loader is a finding
            import traceback

            rec.update(outcome="crash", type=type(e).__name__, message=str(e)[:500],
                       traceback=traceback.format_exc()[-3000:])
        finally:
            signal.alarm(0)
        rec["seconds"] = time.perf_counter() - t0
        rec["maxrss_kb"] = peak_rss_kb()
        results.write(json.dumps(rec) + "\n")
        results.flush()
        for f in os.listdir(out_dir):
            if f.startswith("case") or f == "q.gguf":
                os.unlink(os.path.join(out_dir, f))
    results.write(json.dumps({"done": True, "maxrss_kb_start": rss0}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
