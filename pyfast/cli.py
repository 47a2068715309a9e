"""The ``pyfast`` command: generate, chat, perplexity, bench, info, pull."""
from __future__ import annotations

import argparse
import sys


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="GGUF path, registry name (smollm2) or hf://owner/repo/file.gguf (default: smollm2)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--n-predict", type=int, default=256, help="tokens to generate")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _sampling_kwargs(a) -> dict:
    return dict(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                repeat_penalty=a.repeat_penalty, seed=a.seed)


def _load(a):
    from pyfast.llm import LLM

    return LLM(a.model, n_ctx=a.ctx_size, n_threads=a.threads, verbose=True)


def _print_timings(res) -> None:
    t = res.timings
    print(f"\n[prompt: {t.n_prompt} tokens, {t.prompt_tps:.1f} t/s | generated: {t.n_gen} tokens, "
          f"{t.gen_tps:.1f} t/s | finish: {res.finish_reason}]", file=sys.stderr)


def _stream(it) -> object:
    result = None
    for chunk in it:
        if chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        if chunk.result is not None:
            result = chunk.result
    sys.stdout.write("\n")
    sys.stdout.flush()
    return result


def cmd_generate(a) -> int:
    llm = _load(a)
    prompt = a.prompt
    if a.file:
        with open(a.file, encoding="utf-8") as f:
            prompt = f.read()
    if prompt is None:
        print("error: give a prompt with -p or -f", file=sys.stderr)
        return 2
    if not a.raw and llm.chat_template is not None:
        msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": prompt}]
        prompt = llm.apply_chat_template(msgs)
    res = _stream(llm.generate(prompt, max_tokens=a.n_predict, stream=True, **_sampling_kwargs(a)))
    _print_timings(res)
    return 0


def cmd_chat(a) -> int:
    llm = _load(a)
    messages = [{"role": "system", "content": a.system}] if a.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        res = _stream(llm.chat(messages, max_tokens=a.n_predict, stream=True, **_sampling_kwargs(a)))
        messages.append({"role": "assistant", "content": res.text})
        if a.verbose:
            _print_timings(res)
    return 0


def cmd_perplexity(a) -> int:
    from pyfast.llm import LLM

    with open(a.file, encoding="utf-8") as f:
        text = f.read()
    llm = LLM(a.model, n_ctx=max(a.ctx_size, 512), n_threads=a.threads, verbose=True)
    res = llm.perplexity(text, n_ctx=a.ctx_size)
    print(f"chunks: {res.n_chunks}, scored tokens: {res.n_scored}")
    print(f"PPL = {res.ppl:.4f}")
    return 0


def cmd_info(a) -> int:
    from pyfast.gguf.info import describe
    from pyfast.hub import resolve_model

    print(describe(str(resolve_model(a.model_path))))
    return 0


def cmd_pull(a) -> int:
    from pyfast.hub import resolve_model

    path = resolve_model(a.name, quiet=False)
    print(path)
    return 0


def cmd_bench(a) -> int:
    from pyfast.bench import format_results, run_bench
    from pyfast.context import default_threads
    from pyfast.hub import resolve_model

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x.strip()]

    threads = ints(a.threads) if a.threads else [default_threads()]
    res = run_bench(str(resolve_model(a.model)), ints(a.n_prompt), ints(a.n_gen), threads, reps=a.repetitions)
    print(format_results(res, a.output))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pyfast", description="Fast LLM inference on GGUF models")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("generate", help="complete a prompt (chat template applied unless --raw)")
    _add_model(p)
    _add_sampling(p)
    p.add_argument("-p", "--prompt", default=None)
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--system", default=None, help="system message (chat template mode)")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat (reads user turns from stdin)")
    _add_model(p)
    _add_sampling(p)
    p.add_argument("--system", default=None)
    p.add_argument("-v", "--verbose", action="store_true", help="print timings after each reply")
    p.set_defaults(fn=cmd_chat)

    p = sub.add_parser("perplexity", help="perplexity of a text file (llama-perplexity chunking)")
    p.add_argument("-m", "--model", default=None)
    p.add_argument("-f", "--file", required=True)
    p.add_argument("-c", "--ctx-size", type=int, default=512)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.set_defaults(fn=cmd_perplexity)

    p = sub.add_parser("bench", help="prompt processing / generation speed (llama-bench style)")
    p.add_argument("-m", "--model", default=None)
    p.add_argument("-p", "--n-prompt", default="512", help="comma-separated prompt sizes")
    p.add_argument("-n", "--n-gen", default="128", help="comma-separated generation lengths")
    p.add_argument("-t", "--threads", default=None, help="comma-separated thread counts")
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("-o", "--output", choices=["md", "json"], default="md")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("info", help="print a GGUF file's metadata and tensor table")
    p.add_argument("model_path", nargs="?", default=None)
    p.set_defaults(fn=cmd_info)

    p = sub.add_parser("pull", help="download a model into the cache")
    p.add_argument("name", nargs="?", default="smollm2")
    p.set_defaults(fn=cmd_pull)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args) or 0
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
