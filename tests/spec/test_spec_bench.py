"""pyfast bench --spec end to end on SmolLM2 with a tiny budget: rows per configuration, greedy
outputs identical to plain decoding, per-prompt speedups, and the per-prompt table."""
from __future__ import annotations

import json

from pyfast.spec import SpecConfig
from pyfast.spec.bench import format_spec_results, run_spec_bench


def test_spec_bench_rows_and_per_prompt(smollm2_path, tmp_path):
    prompts = tmp_path / "p.json"
    passage = "one two three four five six seven eight nine ten eleven twelve"
    json.dump([f"Repeat exactly: {passage}", "Say hello."], prompts.open("w"))
    rows = run_spec_bench(str(smollm2_path), [("ngram-simple", SpecConfig(types=["ngram-simple"]))],
                          prompts=str(prompts), n_gen=24, threads=[2], reps=1)
    assert [r.config for r in rows] == ["none", "ngram-simple"]
    plain, spec = rows
    assert spec.identical is True  # greedy speculation is lossless
    assert spec.n_gen == plain.n_gen > 0
    assert len(spec.prompt_speedups) == 2 and all(x > 0 for x in spec.prompt_speedups)
    assert spec.prompt_tokens == plain.prompt_tokens and sum(spec.prompt_tokens) == spec.n_gen
    assert spec.drafted >= spec.accepted > 0  # the repeat prompt gets drafts accepted
    table = format_spec_results(rows, per_prompt=True)
    assert "| prompt | tokens | ngram-simple (t2) |" in table
    assert json.loads(format_spec_results(rows, "json"))[1]["prompt_speedups"] == spec.prompt_speedups
