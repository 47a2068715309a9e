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
    # Generation rows: the machine's measured read bandwidth with this many threads and the
    # fraction of the bandwidth bound (every weight byte read once per token) reached.
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


def run_bench(model_path: str, pp: list[int], tg: list[int], threads: list[int], reps: int = 3,
              n_ctx: int = 2048, bandwidth: bool = True, device: str | None = None) -> list[BenchResult]:
    """device: run there ("vulkan:0"); the bandwidth bound is then the host's and is not printed."""
    from pyfast._loader import native
    from pyfast.device import open_device

    dev = open_device(device)
    model = Model(model_path, mmap=True) if dev is not None else Model(model_path)
    size = sum(i.nbytes for i in model.weights.info.values())
    n_params = sum(int(np.prod(i.shape)) for i in model.weights.info.values())
    results = []
    for nt in threads:
        ctx = Context(model, n_ctx=max(n_ctx, max(pp + tg, default=0) + 1), n_threads=nt, device=dev)
        bw = read_bandwidth_gbs(nt) if bandwidth and dev is None and any(n > 0 for n in tg) else None
        for kind, sizes, fn in (("pp", pp, bench_pp), ("tg", tg, bench_tg)):
            for n in sizes:
                if n <= 0:
                    continue
                fn(ctx, min(n, 16), seed=123)  # warm-up (page in weights, build plans)
                samples = [fn(ctx, n, seed=r) for r in range(reps)]
                med = statistics.median(samples)
                frac = size * med / (bw * 1e9) if (kind == "tg" and bw) else None
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
