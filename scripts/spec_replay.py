"""Replay speculative decoding against recorded greedy outputs, without the model.

Greedy output is the same with and without speculation, so a prompt set's greedy continuations,
generated once, decide whether every possible draft is accepted. This script replays the n-gram
proposers and the adaptive controller round by round against them and prices each round with a
cost model of verify decodes. Comparing draft policies then takes seconds instead of a bench run,
and an oracle that drafts exactly the tokens that will be accepted bounds what any length choice
could gain.

    python scripts/spec_replay.py record [--prompts copy] [-o copy.json]   # needs the model
    python scripts/spec_replay.py replay copy.json [--spec ngram-simple] [--oracle] [--sizes]

Cost model, in plain decoding steps: a decode of T rows costs 1.03 for T = 1 and
1.21 + 0.214 (T - 2) for T >= 2, plus 0.016 per row of the decode before it (the weights it let
the shared L3 forget). A plain step takes 2.57 ms + 1.62 µs per context token. Python adds
0.19 ms to a round with a draft, 0.08 ms to one without, and 0.055 ms to a plain step. These
are session 8's fit over every timed decode of a copy-set run (2-core VM, SmolLM2 Q4_1,
2 threads); refit them for another machine. The controller sees the same curve (in a real run
it sees the calibrated one). Session 8's first version of this replay, with the calibrated
curve, predicted 1.58x where `pyfast bench --spec` measured 1.53-1.56x.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

STEP_MS, STEP_PER_TOKEN_MS = 2.57, 1.62e-3
PY_DRAFT_MS, PY_NODRAFT_MS, PY_PLAIN_MS = 0.19, 0.08, 0.055


def rows_cost(T: int, prev_T: int) -> float:
    """A decode of T rows after one of prev_T rows, in plain steps."""
    c = 1.03 if T == 1 else 1.21 + 0.214 * (T - 2)
    return c + 0.016 * (prev_T - 1)


def step_ms(pos: int) -> float:
    return STEP_MS + STEP_PER_TOKEN_MS * pos


class ModelCost:
    """The controller's view of verify costs (the one CostModel method the controller reads)."""

    @staticmethod
    def costs(t0: int, n: int) -> list[float]:
        return [rows_cost(T, 1) for T in range(t0, t0 + n)]


def record(prompts: str, out: str, model: str | None, n_gen: int) -> None:
    from pyfast.llm import LLM
    from pyfast.spec.prompts import load_prompts

    set_name, texts = load_prompts(prompts)
    llm = LLM(model, n_ctx=2048, n_threads=2)
    seqs = []
    for t in texts:
        text = llm.apply_chat_template([{"role": "user", "content": t}]) if llm.chat_template else t
        r = llm.generate(text, max_tokens=n_gen, temperature=0)
        seqs.append({"prompt": list(map(int, r.prompt_tokens)), "generated": list(map(int, r.tokens))})
    with open(out, "w") as f:
        json.dump({"prompts": set_name, "sequences": seqs}, f)
    print(f"{len(seqs)} greedy outputs ({sum(len(s['generated']) for s in seqs)} tokens) -> {out}")


def replay_one(prompt, generated, proposers, controller, n_max: int, oracle: bool, sizes: dict | None = None):
    """Simulated (speculative ms, plain ms, drafted, accepted) for one sequence; ``sizes`` (if
    given) collects [rounds, ms] per verify batch size."""
    from pyfast.spec.base import DraftRequest

    full = np.asarray(list(prompt) + list(generated), dtype=np.int32)
    end, n = len(full), len(prompt) + 1  # the first generated token comes from the prompt's logits
    for p in proposers:
        p.begin(0, full[:len(prompt)])
    est: dict = {}
    spec_ms, prev_T, drafted, accepted = 0.0, 1, 0, 0
    while n < end:
        toks, cap = full[:n], min(n_max, end - n - 1)  # a round yields at most its draft + 1 tokens
        draft, winner, key, k = None, None, None, 0
        for p in proposers if cap > 0 else ():
            d = p.draft([DraftRequest(0, toks, cap, 1)])[0]
            if d is None or len(d) == 0:
                continue
            kind_key = p.name + (":" + d.kind if d.kind else "")
            cont = d.tokens[:cap]
            truth = full[n:n + len(cont)]
            k_full = int(np.argmin(np.append(cont == truth, False)))  # agreeing prefix length
            m = k_full if oracle else (controller.choose(est, kind_key, len(cont), 1) if controller else len(cont))
            if m <= 0:
                continue
            draft, winner, key, k = cont[:m], p, kind_key, min(k_full, m)
            break
        N = 0 if draft is None else len(draft)
        round_ms = rows_cost(N + 1, prev_T) * step_ms(n) + (PY_DRAFT_MS if N else PY_NODRAFT_MS)
        spec_ms += round_ms
        if sizes is not None:
            acc = sizes.setdefault(N + 1, [0, 0.0])
            acc[0], acc[1] = acc[0] + 1, acc[1] + round_ms
        prev_T = N + 1
        for p in proposers:
            p.accept(0, k, other=p is not winner)
        if winner is not None and controller is not None:
            controller.update(est, key, N, k)
        drafted, accepted = drafted + N, accepted + k
        n += k + 1
    plain_ms = sum(step_ms(len(prompt) + i) + PY_PLAIN_MS for i in range(len(generated) - 1))
    return spec_ms, plain_ms, drafted, accepted


def replay(path: str, types: list[str], n_max: int, adaptive: bool, oracle: bool, show_sizes: bool = False) -> None:
    from pyfast.spec.adaptive import AdaptiveController
    from pyfast.spec.config import SpecConfig, make_proposers

    with open(path) as f:
        data = json.load(f)
    cfg = SpecConfig(types=types, adaptive=adaptive)
    proposers = make_proposers(cfg, None, n_ctx=4096)
    controller = None
    if adaptive:
        priors = {p.name + (":" + k if k else ""): v for p in proposers for k, v in getattr(p, "kind_priors", {}).items()}
        controller = AdaptiveController(ModelCost(), n_max, priors=priors)
    tot_s = tot_p = 0.0
    tot_d = tot_a = 0
    per = []
    sizes: dict = {}
    for s in data["sequences"]:
        sm, pm, d, a = replay_one(s["prompt"], s["generated"], proposers, controller, n_max, oracle, sizes)
        tot_s, tot_p, tot_d, tot_a = tot_s + sm, tot_p + pm, tot_d + d, tot_a + a
        per.append(pm / sm)
    label = ",".join(types) + (" oracle lengths" if oracle else " adaptive" if adaptive else "")
    print(f"{data['prompts']}: {label}: simulated speedup {tot_p / tot_s:.3f}x, acceptance "
          f"{tot_a / max(tot_d, 1):.1%} ({tot_a} of {tot_d} drafted)")
    print("  per prompt: " + " ".join(f"{x:.2f}" for x in per))
    if show_sizes:  # where the time goes: rounds and share of the simulated time by batch rows
        print("  rows: rounds (time share) " + ", ".join(
            f"{T}: {n} ({ms / tot_s:.1%})" for T, (n, ms) in sorted(sizes.items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record the greedy outputs of a prompt set (runs the model)")
    r.add_argument("--prompts", default="copy")
    r.add_argument("-m", "--model", default=None)
    r.add_argument("-n", "--n-gen", type=int, default=256)
    r.add_argument("-o", "--out", default=None)
    p = sub.add_parser("replay", help="simulate speculative decoding against recorded outputs")
    p.add_argument("path")
    p.add_argument("--spec", default="ngram-simple", help="comma-separated n-gram proposers")
    p.add_argument("--draft-max", type=int, default=16)
    p.add_argument("--no-adaptive", action="store_true", help="draft at full length")
    p.add_argument("--oracle", action="store_true", help="draft exactly the tokens that will be accepted")
    p.add_argument("--sizes", action="store_true", help="also print rounds and time share per verify batch size")
    a = ap.parse_args()
    if a.cmd == "record":
        record(a.prompts, a.out or f"{a.prompts}.json", a.model, a.n_gen)
    else:
        replay(a.path, a.spec.split(","), a.draft_max, not a.no_adaptive, a.oracle, a.sizes)


if __name__ == "__main__":
    main()
