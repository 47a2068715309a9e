"""``pyfast bench --spec``: speculative configurations against plain decoding, in one run.

For every repetition and prompt, plain decoding and each configuration generate in turn (the
order alternates between repetitions), so slow phases of a shared machine hit all of them alike.
Reported per configuration: tokens/s (generated tokens over generation time, prompt excluded),
the speedup over plain decoding measured in the same repetitions, acceptance, mean accepted
length, tokens per target decode, and (greedy) whether every output is token-identical to plain.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field

from pyfast.spec.config import SpecConfig
from pyfast.spec.prompts import load_prompts


@dataclass
class SpecBenchRow:
    config: str                 # "none" = plain decoding
    prompts: str
    threads: int
    n_prompts: int
    n_gen: int                  # generated tokens per repetition (all prompts)
    tps: float                  # median over repetitions of tokens / generation seconds
    speedup: float              # median over repetitions of tps / plain tps of that repetition
    acceptance: float = 0.0
    mean_accepted: float = 0.0
    tokens_per_step: float = 1.0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    identical: bool | None = None   # greedy only: same tokens as plain decoding on every prompt
    tps_samples: list[float] = field(default_factory=list)
    speedup_samples: list[float] = field(default_factory=list)
    # per prompt (in set order): median over repetitions of this config's tokens/s over plain's
    # on that prompt, and the prompt's generated tokens
    prompt_speedups: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)


def run_spec_bench(model_path: str, configs: list[tuple[str, SpecConfig]], prompts: str = "copy",
                   n_gen: int = 256, threads: list[int] | None = None, reps: int = 3,
                   temperature: float = 0.0, n_ctx: int = 2048, chat: bool = True,
                   log=None) -> list[SpecBenchRow]:
    """Benchmark ``configs`` (name, SpecConfig) against plain decoding on a prompt set."""
    from pyfast.context import default_threads
    from pyfast.llm import LLM

    set_name, texts = load_prompts(prompts)
    names: list[str] = []
    for name, _ in configs:  # labels key the results: make repeated ones unique
        label, i = name, 2
        while label in names or label == "none":
            label, i = f"{name} #{i}", i + 1
        names.append(label)
    configs = [(label, cfg) for label, (_, cfg) in zip(names, configs)]
    results: list[SpecBenchRow] = []
    for nt in threads or [default_threads()]:
        base = LLM(model_path, n_ctx=n_ctx, n_threads=nt)
        if chat and base.chat_template is not None:
            texts_in = [base.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        else:
            texts_in = list(texts)
        runners = [("none", base)] + [(name, LLM(model_path, n_ctx=n_ctx, n_threads=nt, speculative=cfg))
                                      for name, cfg in configs]
        kw = dict(temperature=temperature, seed=1234)
        for _, llm in runners:  # warm-up: page in weights, build plans, calibrate adaptive costs
            llm.generate(texts_in[0], max_tokens=16, **kw)
            if llm._spec is not None:
                llm._spec.calibrate()
        per = {name: dict(tok=[], sec=[], stats=[], outs=[], ptps=[[] for _ in texts_in], ptok=[0] * len(texts_in))
               for name, _ in runners}
        for r in range(reps):
            for _, llm in runners:  # cross-request memory (ngram-mod) must not remember earlier reps
                for p in (llm._spec.proposers if llm._spec is not None else ()):
                    if hasattr(p, "reset"):
                        p.reset()
            order = runners if r % 2 == 0 else runners[::-1]
            tot = {name: [0, 0.0] for name, _ in runners}
            for pi, text in enumerate(texts_in):
                for name, llm in order:
                    llm.ctx.clear()
                    llm._cached = []
                    res = llm.generate(text, max_tokens=n_gen, **kw)
                    tot[name][0] += res.timings.n_gen
                    tot[name][1] += res.timings.gen_s
                    if res.timings.gen_s > 0:
                        per[name]["ptps"][pi].append(res.timings.n_gen / res.timings.gen_s)
                    per[name]["ptok"][pi] = res.timings.n_gen
                    if res.spec is not None:
                        per[name]["stats"].append(res.spec)
                    if r == 0:
                        per[name]["outs"].append(res.tokens)
            for name, (tk, sec) in tot.items():
                per[name]["tok"].append(tk)
                per[name]["sec"].append(sec)
            if log is not None:
                log(f"[bench --spec] threads {nt}, repetition {r + 1}/{reps}: " + ", ".join(
                    f"{n} {tot[n][0] / tot[n][1]:.1f} t/s" for n, _ in runners if tot[n][1] > 0))
        plain = [tk / sec if sec > 0 else 0.0 for tk, sec in zip(per["none"]["tok"], per["none"]["sec"])]
        for name, _ in runners:
            p = per[name]
            tps = [tk / sec if sec > 0 else 0.0 for tk, sec in zip(p["tok"], p["sec"])]
            ratios = [a / b if b > 0 else 0.0 for a, b in zip(tps, plain)]
            row = SpecBenchRow(config=name, prompts=set_name, threads=nt, n_prompts=len(texts_in),
                               n_gen=int(statistics.median(p["tok"])), tps=statistics.median(tps),
                               speedup=statistics.median(ratios), tps_samples=tps, speedup_samples=ratios,
                               prompt_tokens=list(p["ptok"]))
            for pi in range(len(texts_in)):
                pr = [a / b for a, b in zip(p["ptps"][pi], per["none"]["ptps"][pi]) if b > 0]
                row.prompt_speedups.append(statistics.median(pr) if pr else 0.0)
            if p["stats"]:
                from pyfast.spec.stats import SpecStats

                st = SpecStats()
                for s in p["stats"]:
                    st.merge(s)
                row.acceptance, row.mean_accepted = st.acceptance, st.mean_accepted
                row.tokens_per_step, row.drafted, row.accepted = st.tokens_per_step, st.drafted, st.accepted
                row.draft_s, row.verify_s = st.t_draft, st.t_verify
            if temperature <= 0 and name != "none":
                row.identical = p["outs"] == per["none"]["outs"]
            results.append(row)
    return results


def format_spec_results(rows: list[SpecBenchRow], fmt: str = "md", per_prompt: bool = False) -> str:
    if fmt == "json":
        return json.dumps([asdict(r) for r in rows], indent=2)
    text = _format_spec_table(rows)
    spec_rows = [r for r in rows if r.config != "none"]
    if per_prompt and spec_rows:
        n = len(spec_rows[0].prompt_speedups)
        head = "| prompt | tokens | " + " | ".join(f"{r.config} (t{r.threads})" for r in spec_rows) + " |"
        lines = ["", head, "| ---: | ---: |" + " ---: |" * len(spec_rows)]
        for i in range(n):
            lines.append(f"| {i} | {spec_rows[0].prompt_tokens[i]} | "
                         + " | ".join(f"{r.prompt_speedups[i]:.2f}x" for r in spec_rows) + " |")
        text += "\n" + "\n".join(lines)
    return text


def _format_spec_table(rows: list[SpecBenchRow]) -> str:
    out = ["| config | prompts | threads | tokens | t/s | speedup | acceptance | mean acc. len | tok/step "
           "| draft / verify s | identical |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        same = "" if r.identical is None else ("yes" if r.identical else "NO")
        acc = f"{100 * r.acceptance:.1f}%" if r.config != "none" else ""
        mal = f"{r.mean_accepted:.2f}" if r.config != "none" else ""
        dv = f"{r.draft_s:.2f} / {r.verify_s:.2f}" if r.config != "none" else ""
        out.append(f"| {r.config} | {r.prompts} | {r.threads} | {r.n_gen} | {r.tps:.1f} | {r.speedup:.2f}x "
                   f"| {acc} | {mal} | {r.tokens_per_step:.2f} | {dv} | {same} |")
    return "\n".join(out)
