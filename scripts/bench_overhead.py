"""Per-token overhead of generation: wall time per generated token minus the time spent inside
the native plans (Context.t_compute), for greedy and for the default sampled chain.

    python scripts/bench_overhead.py [-m MODEL] [-t THREADS] [-n TOKENS] [-r REPS]

Prints, per sampling mode, the median over repetitions of wall/token, plan/token and the share
of the step spent outside the plan (Python, inputs, sampling, detokenizing). Issue 3 asks for
under 5% with SmolLM2 and 2 threads.
"""
from __future__ import annotations

import argparse
import statistics
import time

from pyfast.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=5)
    a = ap.parse_args()
    llm = LLM(a.model, n_ctx=1024, n_threads=a.threads)
    prompt = "Write a long story about a lighthouse keeper and his cat."
    modes = {"greedy": dict(temperature=0.0),
             "sampled (T 0.8, top-k 40, top-p 0.95, min-p 0.05)": dict(temperature=0.8, seed=1)}
    llm.generate(prompt, max_tokens=16)  # warm up
    print(f"{'sampling':52s} {'wall/tok':>10s} {'plan/tok':>10s} {'outside':>9s}")
    for name, kw in modes.items():
        rows = []
        for _ in range(a.reps):
            it = llm.generate(prompt, max_tokens=a.tokens, ignore_eos=True, stream=True, **kw)
            next(it)  # first token: prompt processing is not part of the step
            t0 = time.perf_counter()
            c0 = llm.ctx.t_compute
            n = 0
            for chunk in it:
                n += chunk.token is not None
            wall = (time.perf_counter() - t0) / n
            plan = (llm.ctx.t_compute - c0) / n
            rows.append((wall, plan, (wall - plan) / wall))
        wall, plan, share = (statistics.median(r[i] for r in rows) for i in range(3))
        print(f"{name:52s} {wall * 1e3:8.3f}ms {plan * 1e3:8.3f}ms {100 * share:8.1f}%")


if __name__ == "__main__":
    main()
