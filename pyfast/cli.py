"""The ``pyfast`` command: generate, chat, serve, perplexity, bench, info, pull, quantize, convert."""
from __future__ import annotations

import argparse
import os
import sys


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="GGUF path, registry name (smollm2) or hf://owner/repo/file.gguf (default: smollm2)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens")
    add_cache_type_arguments(p)
    add_control_vector_arguments(p)
    add_device_argument(p)
    add_tp_argument(p)


def add_tp_argument(p: argparse.ArgumentParser) -> None:
    """--tp (generate, chat, perplexity, serve): tensor parallelism under mpirun."""
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="split the model over N processes started by `mpirun -np N pyfast ... --tp N` "
                        "(rank 0 tokenizes, samples and serves; docs/tensor-parallel.md)")


def add_device_argument(p: argparse.ArgumentParser) -> None:
    """--device (generate, chat, perplexity, bench, serve)."""
    p.add_argument("--device", default=None, metavar="NAME",
                   help="where the model runs: cpu (default) or a device from `pyfast devices`, e.g. vulkan:0")


def add_control_vector_arguments(p: argparse.ArgumentParser) -> None:
    """llama.cpp's control vector flags (generate, chat, perplexity, serve)."""
    p.add_argument("--control-vector", action="append", default=None, metavar="FNAME",
                   help="add a control vector (a GGUF of direction.N tensors; comma-separated or repeated "
                        "for several)")
    p.add_argument("--control-vector-scaled", action="append", default=None, metavar="FNAME:SCALE",
                   help="add a control vector scaled by SCALE (comma-separated or repeated)")
    p.add_argument("--control-vector-layer-range", nargs=2, type=int, default=None, metavar=("START", "END"),
                   help="layers whose outputs get the control vectors, inclusive (default: 1 to the last)")


def control_vector_kwargs(a: argparse.Namespace) -> dict:
    """LLM / EngineConfig keyword arguments from the control vector flags."""
    from pyfast.control_vector import parse_scaled

    items = [(path, 1.0) for v in (a.control_vector or []) for path in v.split(",") if path]
    items += [it for v in (a.control_vector_scaled or []) for it in parse_scaled(v)]
    rng = a.control_vector_layer_range
    if rng is not None and not items:
        raise ValueError("--control-vector-layer-range needs --control-vector or --control-vector-scaled")
    return dict(control_vectors=items or None, control_vector_layer_range=tuple(rng) if rng else None)


def add_cache_type_arguments(p: argparse.ArgumentParser) -> None:
    """llama.cpp's KV cache type flags (generate, chat, perplexity, serve), and its sparse attention
    flags that come with them."""
    p.add_argument("-ctk", "--cache-type-k", default="f16", help="KV cache type for K: f16, f32, q8_0")
    p.add_argument("-ctv", "--cache-type-v", default=None, help="KV cache type for V (default: as K)")
    p.add_argument("--dsa", choices=("on", "off"), default=None,
                   help="DeepSeek sparse attention of deepseek32 / glm-dsa models (default: on)")
    p.add_argument("--dsa-top-k", type=int, default=-1, metavar="N",
                   help="cells each query keeps under sparse attention (-1: the model's)")
    p.add_argument("--swa-full", action=argparse.BooleanOptionalAction, default=True,
                   help="models with sliding-window layers (Gemma 3 / 4): keep those layers' K/V for the whole "
                        "context (default); --no-swa-full bounds their cache to the window (less memory; a "
                        "sequence then cannot be cut back to an arbitrary earlier position)")


def dsa_kwargs(a: argparse.Namespace) -> dict:
    """LLM / EngineConfig keyword arguments from --dsa / --dsa-top-k."""
    on = getattr(a, "dsa", None)
    return dict(dsa=None if on is None else on == "on", dsa_top_k=getattr(a, "dsa_top_k", -1))


def swa_kwargs(a: argparse.Namespace) -> dict:
    """LLM / EngineConfig keyword arguments from --swa-full / --no-swa-full."""
    return dict(swa_full=bool(getattr(a, "swa_full", True)))


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--n-predict", type=int, default=256, help="tokens to generate")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    g = p.add_argument_group("constrained output (one of)")
    g.add_argument("--grammar", default=None, help="GBNF grammar the output must match (root rule 'root')")
    g.add_argument("--grammar-file", default=None, help="file holding a GBNF grammar")
    g.add_argument("-j", "--json-schema", default=None, help="JSON schema the output must match ('{}' = any JSON)")
    g.add_argument("--json-schema-file", default=None, help="file holding a JSON schema")


def _add_spec(p: argparse.ArgumentParser, bench: bool = False) -> None:
    """Speculative decoding flags (llama.cpp's names)."""
    g = p.add_argument_group("speculative decoding")
    if not bench:
        g.add_argument("--spec-type", default=None,
                       help="proposers, comma-separated in the order asked: ngram-simple, ngram-map-k, "
                            "ngram-mod, draft-model, draft-mtp (the model's own MTP layers), draft-eagle3 / "
                            "draft-dflash / draft-dspark (-md: the drafter GGUF from pyfast convert --draft) "
                            "(default: off; -md alone means draft-model)")
    g.add_argument("-md", "--model-draft", default=None, help="draft model GGUF (same vocabulary as -m)")
    g.add_argument("--draft-max", type=int, default=None,
                   help="longest draft (default: 16 for n-gram proposers, 3 for a draft model)")
    g.add_argument("--draft-min", type=int, default=None, help="discard drafts shorter than this")
    g.add_argument("--draft-p-min", type=float, default=0.0,
                   help="a draft model stops drafting when its top-1 probability is below this")
    g.add_argument("--spec-adaptive", action="store_true",
                   help="choose each round's draft length from measured verify costs and acceptance")


def _spec_config(a, types: str | None = None):
    """The SpecConfig the flags ask for (validated), or None when speculation is off."""
    from pyfast.spec import SpecConfig

    types = types if types is not None else getattr(a, "spec_type", None)
    if types is not None and types.strip().lower() == "none":
        types = None
    if types is None and a.model_draft is None:
        for flag, v in (("--draft-max", a.draft_max), ("--draft-min", a.draft_min)):
            if v is not None:
                raise ValueError(f"{flag} needs speculative decoding: give --spec-type or -md")
        return None
    cfg = SpecConfig(types=types or (), draft_model=a.model_draft, draft_max=a.draft_max,
                     draft_min=a.draft_min, draft_p_min=a.draft_p_min, adaptive=a.spec_adaptive)
    return cfg.validate(getattr(a, "ctx_size", None))


def _sampling_kwargs(a) -> dict:
    kw = dict(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
              repeat_penalty=a.repeat_penalty, seed=a.seed)
    grammar, schema = getattr(a, "grammar", None), getattr(a, "json_schema", None)
    given = [f for f in ("grammar", "grammar_file", "json_schema", "json_schema_file") if getattr(a, f, None)]
    if len(given) > 1:
        raise ValueError("give at most one of --grammar, --grammar-file, --json-schema, --json-schema-file")
    if getattr(a, "grammar_file", None):
        with open(a.grammar_file, encoding="utf-8") as f:
            grammar = f.read()
    if getattr(a, "json_schema_file", None):
        with open(a.json_schema_file, encoding="utf-8") as f:
            schema = f.read()
    if grammar is not None:
        kw["grammar"] = grammar
    if schema is not None:
        kw["json_schema"] = schema
    return kw


def _load(a):
    from pyfast.llm import LLM

    spec = _spec_config(a)  # checked before the model loads
    return LLM(a.model, n_ctx=a.ctx_size, n_threads=a.threads, verbose=True, speculative=spec, tp=a.tp,
               cache_type_k=a.cache_type_k, cache_type_v=a.cache_type_v, device=a.device, **control_vector_kwargs(a),
              **dsa_kwargs(a), **swa_kwargs(a))


def _print_timings(res) -> None:
    t = res.timings
    print(f"\n[prompt: {t.n_prompt} tokens, {t.prompt_tps:.1f} t/s | generated: {t.n_gen} tokens, "
          f"{t.gen_tps:.1f} t/s | finish: {res.finish_reason}]", file=sys.stderr)
    if getattr(res, "spec", None) is not None:
        print(f"[speculative: {res.spec.summary()}]", file=sys.stderr)


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
    llm = LLM(a.model, n_ctx=max(a.ctx_size, 512), n_threads=a.threads, verbose=True, tp=a.tp,
              cache_type_k=a.cache_type_k, cache_type_v=a.cache_type_v, device=a.device, **control_vector_kwargs(a),
              **dsa_kwargs(a), **swa_kwargs(a))
    res = llm.perplexity(text, n_ctx=a.ctx_size)
    print(f"chunks: {res.n_chunks}, scored tokens: {res.n_scored}")
    print(f"PPL = {res.ppl:.4f}")
    return 0


def cmd_info(a) -> int:
    from pyfast.gguf.info import describe
    from pyfast.hub import resolve_model

    print(describe(str(resolve_model(a.model_path))))
    return 0


def cmd_devices(a) -> int:
    from pyfast._loader import native

    for d in native.devices():
        mem = f"{d['memory_bytes'] / 2**30:.1f} GiB" if d["memory_bytes"] else ""
        print(f"{d['name']:<10} {d['description']}" + (f"  ({mem})" if mem else ""))
    for b in native.backends():
        if b["unavailable"]:
            print(f"{b['kind']}: {b['unavailable']}")
    return 0


def cmd_pull(a) -> int:
    from pyfast.hub import resolve_model

    path = resolve_model(a.name, quiet=False)
    print(path)
    return 0


def cmd_serve(a) -> int:
    from pyfast.server.main import serve_from_args

    return serve_from_args(a)


def cmd_bench(a) -> int:
    from pyfast.bench import format_results, run_bench
    from pyfast.context import default_threads
    from pyfast.hub import resolve_model

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x.strip()]

    threads = ints(a.threads) if a.threads else [default_threads()]
    if a.spec:
        return _bench_spec(a, threads, ints(a.n_gen)[0] if a.n_gen else 256)
    if a.n_gen is None:
        a.n_gen = "128"
    res = run_bench(str(resolve_model(a.model)), ints(a.n_prompt), ints(a.n_gen), threads, reps=a.repetitions,
                    device=a.device)
    print(format_results(res, a.output))
    return 0


def _bench_spec(a, threads: list[int], n_gen: int) -> int:
    from pyfast.bench import format_spec_results, run_spec_bench
    from pyfast.hub import resolve_model

    a.ctx_size = a.ctx_size_spec
    configs = []
    for types in a.spec:
        cfg = _spec_config(a, types)
        if cfg is None:
            raise ValueError(f"--spec {types!r}: give proposer names (plain decoding is always measured)")
        label = types + (f" ({os.path.basename(str(cfg.draft_model))})" if cfg.draft_model else "")
        configs.append((label + (" adaptive" if cfg.adaptive else ""), cfg))
    rows = run_spec_bench(str(resolve_model(a.model)), configs, prompts=a.prompts, n_gen=n_gen,
                          threads=threads, reps=a.repetitions, temperature=a.temp, n_ctx=a.ctx_size,
                          log=lambda m: print(m, file=sys.stderr))
    print(format_spec_results(rows, a.output, per_prompt=a.per_prompt))
    return 0


def cmd_quantize(a) -> int:
    from pyfast.quantize import quantize

    res = quantize(a.input, a.output, a.type, a.threads or 0, keep_quantized=not a.requantize_all,
                   with_rmse=a.rmse, log=None if a.quiet else print)
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(res.type_counts().items()))
    print(f"{a.output}: {res.in_bytes / 2**20:.1f} MiB -> {res.out_bytes / 2**20:.1f} MiB in "
          f"{res.seconds:.1f} s ({counts})")
    return 0


def cmd_convert(a) -> int:
    import warnings

    from pyfast.convert import convert, convert_draft

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if a.draft:
            res = convert_draft(a.hf_dir, a.output, outtype=a.outtype, log=None if a.quiet else print)
        else:
            res = convert(a.hf_dir, a.output, mtp=a.mtp, outtype=a.outtype, log=None if a.quiet else print)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if a.draft:
        print(f"{res.path}: drafter {res.arch}, {res.n_tensors} tensors, {res.out_bytes / 2**20:.1f} MiB in "
              f"{res.seconds:.1f} s")
        return 0
    print(f"{res.path}: {res.arch}, {res.n_tensors} tensors ({res.n_mtp} MTP layer(s)), "
          f"{res.out_bytes / 2**20:.1f} MiB in {res.seconds:.1f} s"
          + ("" if res.has_tokenizer else " (no tokenizer)"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pyfast", description="Fast LLM inference on GGUF models")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("generate", help="complete a prompt (chat template applied unless --raw)")
    _add_model(p)
    _add_sampling(p)
    _add_spec(p)
    p.add_argument("-p", "--prompt", default=None)
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--system", default=None, help="system message (chat template mode)")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat (reads user turns from stdin)")
    _add_model(p)
    _add_sampling(p)
    _add_spec(p)
    p.add_argument("--system", default=None)
    p.add_argument("-v", "--verbose", action="store_true", help="print timings after each reply")
    p.set_defaults(fn=cmd_chat)

    p = sub.add_parser("perplexity", help="perplexity of a text file (llama-perplexity chunking)")
    p.add_argument("-m", "--model", default=None)
    p.add_argument("-f", "--file", required=True)
    p.add_argument("-c", "--ctx-size", type=int, default=512)
    add_cache_type_arguments(p)
    add_control_vector_arguments(p)
    add_device_argument(p)
    add_tp_argument(p)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.set_defaults(fn=cmd_perplexity)

    p = sub.add_parser("bench", help="prompt processing / generation speed (llama-bench style)")
    p.add_argument("-m", "--model", default=None)
    p.add_argument("-p", "--n-prompt", default="512", help="comma-separated prompt sizes")
    p.add_argument("-n", "--n-gen", default=None,
                   help="comma-separated generation lengths (default 128; with --spec: max tokens, 256)")
    p.add_argument("-t", "--threads", default=None, help="comma-separated thread counts")
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("-o", "--output", choices=["md", "json"], default="md")
    p.add_argument("--spec", action="append", default=None, metavar="TYPES",
                   help="benchmark speculative decoding with these comma-separated proposers against plain "
                        "decoding in the same run (repeat for several configurations)")
    p.add_argument("--prompts", default="copy",
                   help="prompt set for --spec: copy (repeat/rewrite a passage or code), chat, all, or a file "
                        "(.json list, or prompts separated by lines '---')")
    p.add_argument("--temp", type=float, default=0.0, help="temperature for --spec (0 = greedy)")
    p.add_argument("--per-prompt", action="store_true",
                   help="with --spec: also print each prompt's speedup (median over repetitions)")
    p.add_argument("-c", "--ctx-size", dest="ctx_size_spec", type=int, default=2048,
                   help="context size for --spec")
    _add_spec(p, bench=True)
    add_device_argument(p)
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    from pyfast.server.main import add_serve_arguments

    add_serve_arguments(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("devices", help="list the devices models can run on (--device NAME)")
    p.set_defaults(fn=cmd_devices)

    p = sub.add_parser("info", help="print a GGUF file's metadata and tensor table")
    p.add_argument("model_path", nargs="?", default=None)
    p.set_defaults(fn=cmd_info)

    p = sub.add_parser("quantize", help="re-quantize a GGUF model (llama-quantize's type mixes)")
    p.add_argument("input", help="source GGUF file")
    p.add_argument("output", help="destination GGUF file")
    p.add_argument("type", type=str.upper, metavar="TYPE",
                   help="file type: Q4_K_M, Q5_K_M, Q4_K_S, Q5_K_S, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                        "F16, BF16, F32 (see pyfast/quantize.py)")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--rmse", action="store_true", help="print each tensor's round-trip RMSE")
    p.add_argument("--allow-requantize", action="store_true",
                   help="accepted for llama-quantize compatibility (quantized sources are always allowed)")
    p.add_argument("--requantize-all", action="store_true",
                   help="quantized sources: use llama-quantize's exact per-tensor types even where the "
                        "chosen type is not smaller than the source's (default: keep such tensors)")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-tensor lines")
    p.set_defaults(fn=cmd_quantize)

    p = sub.add_parser("convert", help="convert a Hugging Face checkpoint to GGUF (Llama, Mistral, Qwen2 / 3 / 3-MoE, "
                                       "GLM-4 MoE, Qwen3.5, Qwen3-Next)")
    p.add_argument("hf_dir", help="model directory: config.json, *.safetensors, tokenizer files")
    p.add_argument("output", help="destination GGUF file")
    p.add_argument("--outtype", type=str.lower, choices=["f32", "f16", "bf16"], default="f32",
                   help="type of the weight matrices (norms and small tensors stay F32)")
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the multi-token-prediction layers as nextn blocks (default: keep)")
    p.add_argument("--draft", action="store_true",
                   help="the checkpoint is a speculative drafter (DFlash / DSpark: z-lab, DeepSpec, speculators / "
                        "SpecForge); written as a drafter GGUF for --spec-type draft-dflash / draft-dspark")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-tensor lines")
    p.set_defaults(fn=cmd_convert)

    p = sub.add_parser("pull", help="download a model into the cache")
    p.add_argument("name", nargs="?", default="smollm2")
    p.set_defaults(fn=cmd_pull)
    return ap


MAX_CTX = 1 << 24  # tokens; far above any model's context, far below what overflows an allocation


def _check_args(a) -> None:
    """Misuse of the common flags, caught before any work: thread counts (clamped to the cores
    with a warning), context sizes, repetitions, and directories given where a file is wanted."""
    cores = os.cpu_count() or 1

    def threads(v: int, flag: str = "-t/--threads") -> int:
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
        if v > cores:
            print(f"warning: {flag} {v} is more than the {cores} CPU cores; using {cores}", file=sys.stderr)
            return cores
        return v

    t = getattr(a, "threads", None)
    if isinstance(t, int):
        a.threads = threads(t)
    elif isinstance(t, str):  # bench: a comma-separated list
        try:
            vals = [int(x) for x in t.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"-t/--threads must be comma-separated integers, got {t!r}") from None
        a.threads = ",".join(str(threads(v)) for v in vals) if vals else None
    for name, flag in (("ctx_size", "-c/--ctx-size"), ("ctx_size_spec", "-c/--ctx-size")):
        c = getattr(a, name, None)
        if c is not None and not 1 <= c <= MAX_CTX:
            raise ValueError(f"{flag} must be in [1, {MAX_CTX}], got {c}")
    r = getattr(a, "repetitions", None)
    if r is not None and r < 1:
        raise ValueError(f"-r/--repetitions must be >= 1, got {r}")
    for name, flag in (("file", "-f/--file"), ("api_key_file", "--api-key-file"), ("input", "input"),
                       ("output", "output"), ("model", "-m/--model"), ("model_path", "model"),
                       ("model_draft", "-md/--model-draft")):
        v = getattr(a, name, None)
        if isinstance(v, str) and v and os.path.isdir(v):
            raise ValueError(f"{flag} {v} is a directory; give a file")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_args(args)
        if getattr(args, "tp", 1) != 1:
            from pyfast.parallel.tp import follower_main

            if follower_main(args.tp):  # ranks 1.. of an mpirun world: mirror rank 0 until it stops
                return 0
        return args.fn(args) or 0
    except (ValueError, RuntimeError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    except OSError as e:  # missing files, directories given as files, permissions, disk full
        where = f": {e.filename}" if getattr(e, "filename", None) else ""
        print(f"error: {e.strerror or _one_line(e)}{where}", file=sys.stderr)
        return 1
    except MemoryError as e:
        print(f"error: out of memory ({_one_line(e) or 'allocation failed'}); try a smaller -c/--ctx-size "
              "or model", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug: still one line (PYFAST_DEBUG=1 shows the traceback)
        if os.environ.get("PYFAST_DEBUG"):
            raise
        print(f"error: internal error: {type(e).__name__}: {_one_line(e)} (PYFAST_DEBUG=1 for details)",
              file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


if __name__ == "__main__":
    sys.exit(main())
