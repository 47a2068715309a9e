"""llama-bench style throughput measurements: prompt processing (ppN) and generation (tgN); and
speculative decoding against plain decoding (``run_spec_bench``, ``pyfast bench --spec``)."""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from pyfast.context import Context
from pyfast.models import Model


@dataclass
class BenchResult:
    model: str
    size_mib: float
    n_params: int
    backend: str
    threads: int
    test: str
    n_tokens: int
    tps_median: float
    tps_stdev: float
    samples: list[float]
    # Generation rows: the machine's measured read bandwidth with this many threads (median of
    # the probes taken right before each repetition) and the median over repetitions of the
    # fraction of the bandwidth bound (decode_read_bytes per token at that probe's rate) reached.
    read_gbs: float | None = None
    bw_fraction: float | None = None


def _random_tokens(n: int, n_vocab: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, n_vocab, size=n).tolist()


def bench_pp(ctx: Context, n: int, seed: int = 0) -> float:
    """Tokens/s for one prompt of n tokens from an empty cache (logits of the last row only)."""
    toks = _random_tokens(n, ctx.model.n_vocab, seed)
    ctx.clear()
    t0 = time.perf_counter()
    ctx.decode(toks, seq_ids=0, logits="last")
    dt = time.perf_counter() - t0
    ctx.clear()
    return n / dt


def bench_tg(ctx: Context, n: int, seed: int = 0) -> float:
    """Tokens/s for n single-token decodes starting from an empty cache."""
    toks = _random_tokens(n, ctx.model.n_vocab, seed)
    ctx.clear()
    ctx.decode(toks[:1], positions=[0], seq_ids=0)  # warm the plan for this cache size
    ctx.clear()
    t0 = time.perf_counter()
    for i, t in enumerate(toks):
        ctx.decode([t], positions=[i], seq_ids=0)
    dt = time.perf_counter() - t0
    ctx.clear()
    return n / dt


def read_bandwidth_gbs(n_threads: int, nbytes: int = 256 << 20) -> float:
    """Measured memory read bandwidth (GB/s) with n_threads threads."""
    from pyfast._loader import native

    return native.read_bandwidth(nbytes, n_threads, 3) / 1e9


def decode_read_bytes(model: Model, ctx: Context | None = None) -> int:
    """Bytes one generated token reads from memory at the least: every weight once, except the
    token-embedding table when the model has a separate output matrix (decode gathers one row of
    it), and routed experts at expert_used_count / expert_count of their size (the share a token
    picks per layer); plus, for recurrent models, the state of one sequence read and written
    (conv and SSM planes of every recurrent layer, f32)."""
    info = model.weights.info
    md = model.metadata
    arch = md.get("general.architecture", "")
    n_exp = md.get(f"{arch}.expert_count")
    n_used = md.get(f"{arch}.expert_used_count")
    total = 0
    for name, i in info.items():
        if name == "token_embd.weight" and "output.weight" in info:
            continue
        if "_exps." in name and n_exp and n_used:
            total += i.nbytes * int(n_used) // int(n_exp)
        else:
            total += i.nbytes
    rec = getattr(ctx, "rec", None) if ctx is not None else None
    if rec is not None:
        total += 2 * rec.n_layer * (rec.geom.conv_elems + rec.geom.ssm_elems) * 4
    return total


def run_bench(model_path: str, pp: list[int], tg: list[int], threads: list[int], reps: int = 3,
              n_ctx: int = 2048, bandwidth: bool = True, device: str | None = None) -> list[BenchResult]:
    """device: run there ("vulkan:0"); the bandwidth bound is then the host's and is not printed."""
    from pyfast._loader import native
    from pyfast.device import open_device

    dev = open_device(device)
    model = Model(model_path, mmap=True) if dev is not None else Model(model_path)
    if dev is None:
        model.weights.settle()  # decode is measured on the huge pages the weights keep
    size = sum(i.nbytes for i in model.weights.info.values())
    n_params = sum(int(np.prod(i.shape)) for i in model.weights.info.values())
    results = []
    for nt in threads:
        ctx = Context(model, n_ctx=max(n_ctx, max(pp + tg, default=0) + 1), n_threads=nt, device=dev)
        probe = bandwidth and dev is None
        per_token = decode_read_bytes(model, ctx)
        for kind, sizes, fn in (("pp", pp, bench_pp), ("tg", tg, bench_tg)):
            for n in sizes:
                if n <= 0:
                    continue
                # warm-up (page in weights, build the plans): a whole prompt of the measured size,
                # as llama-bench warms up, since a prompt's first run builds its plan and faults in
                # its scratch; generation needs a few tokens
                fn(ctx, n if kind == "pp" else min(n, 16), seed=123)
                samples, probes = [], []
                for r in range(reps):
                    # The host's bandwidth can move by tens of percent within minutes: each
                    # generation repetition is set against a probe taken right before it.
                    if kind == "tg" and probe:
                        probes.append(read_bandwidth_gbs(nt))
                    samples.append(fn(ctx, n, seed=r))
                med = statistics.median(samples)
                bw = statistics.median(probes) if probes else None
                frac = (statistics.median(per_token * t / (b * 1e9) for t, b in zip(samples, probes))
                        if probes else None)
                results.append(BenchResult(
                    model=model.name, size_mib=size / 2**20, n_params=n_params,
                    backend=f"CPU ({native.cpu_isa()})" if dev is None else dev.name, threads=nt, test=f"{kind}{n}", n_tokens=n,
                    tps_median=med,
                    tps_stdev=statistics.stdev(samples) if len(samples) > 1 else 0.0, samples=samples,
                    read_gbs=bw if kind == "tg" else None, bw_fraction=frac))
    return results


def format_results(results: list[BenchResult], fmt: str = "md") -> str:
    if fmt == "json":
        return json.dumps([asdict(r) for r in results], indent=2)
    head = "| model | size | params | backend | threads | test | t/s | of bandwidth bound |"
    rows = [head, "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in results:
        bw = f"{100 * r.bw_fraction:.0f}% of {r.read_gbs:.1f} GB/s" if r.bw_fraction is not None else ""
        rows.append(f"| {r.model} | {r.size_mib:.2f} MiB | {r.n_params / 1e6:.2f} M | {r.backend} | {r.threads} "
                    f"| {r.test} | {r.tps_median:.2f} ± {r.tps_stdev:.2f} | {bw} |")
    return "\n".join(rows)


# Speculative decoding benchmarks (`pyfast bench --spec`) live with the proposers.
from pyfast.spec.bench import SpecBenchRow, format_spec_results, run_spec_bench  # noqa: F401
