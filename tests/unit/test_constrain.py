"""The constraint stage (pyfast.constrain) in the Sampler, LLM.generate / chat and the CLI."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from pyfast.constrain import Constraint, ConstraintError, compile_constraint  # noqa: E402
from pyfast.sampling import Sampler, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from pyfast.llm import LLM

    return LLM(smollm2_path, n_ctx=1024, n_threads=1)


def test_sampler_masks_and_follows_grammar(llm):
    """Random logits: every token the sampler returns keeps the text inside the grammar, greedy
    and sampled, and the grammar ends the text with an end-of-generation token."""
    tok = llm.tokenizer
    g = compile_constraint(Constraint.regex("(cat|dog)s?!"), tok, llm.n_vocab)
    rng = np.random.default_rng(0)
    for temp in (0.0, 1.0):
        s = Sampler(SamplingParams(temperature=temp, top_k=0, top_p=1.0, min_p=0.0, seed=1, constraint=g),
                    llm.n_vocab)
        out = []
        for _ in range(20):
            t = s.sample(rng.standard_normal(llm.n_vocab).astype(np.float32))
            if tok.is_eog(t):
                break
            out.append(t)
        assert re.fullmatch(r"(cat|dog)s?!", tok.decode(out)), tok.decode(out)
        assert tok.is_eog(t)


def test_probs_are_masked(llm):
    g = compile_constraint(Constraint.gbnf('root ::= "yes" | "no"'), llm.tokenizer, llm.n_vocab)
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, constraint=g), llm.n_vocab)
    p = s.probs(np.zeros(llm.n_vocab, dtype=np.float32))
    kept = np.flatnonzero(p)
    assert 0 < kept.size < 50
    assert all(llm.tokenizer.decode([int(i)]) and ("yes".startswith(llm.tokenizer.decode([int(i)]))
                                                   or "no".startswith(llm.tokenizer.decode([int(i)])))
               for i in kept)


def test_generate_and_chat_with_schema(llm):
    r = llm.generate("A person as JSON: ", max_tokens=60, temperature=0, json_schema=PERSON)
    assert r.finish_reason == "stop"
    jsonschema.validate(json.loads(r.text), PERSON)
    r = llm.chat([{"role": "user", "content": "Who are you?"}], max_tokens=60, temperature=0, json_schema=PERSON)
    jsonschema.validate(json.loads(r.text), PERSON)
    r = llm.generate("Is water wet? Answer:", max_tokens=8, temperature=0.7, seed=3,
                     grammar='root ::= " " ("yes" | "no")')
    assert r.text in (" yes", " no")
    with pytest.raises(ConstraintError, match="invalid GBNF"):
        llm.generate("x", max_tokens=2, grammar="root ::= nothing")
    with pytest.raises(ConstraintError, match="at most one"):
        llm.generate("x", max_tokens=2, grammar='root ::= "a"', json_schema={})


def test_greedy_speculation_lossless_under_grammar(smollm2_path):
    """ngram speculation under a schema gives the same greedy tokens as plain decoding."""
    from pyfast.llm import LLM
    from pyfast.spec import SpecConfig

    sp = LLM(smollm2_path, n_ctx=1024, n_threads=1, speculative=SpecConfig(types=["ngram-simple"], draft_max=4))
    schema = {"type": "object", "properties": {"list": {"type": "array", "maxItems": 6, "items": {
        "type": "string", "maxLength": 8}}}, "required": ["list"], "additionalProperties": False}
    prompt = 'Repeat: {"list":["apple","apple","apple","apple"]} Again: '
    a = sp.generate(prompt, max_tokens=60, temperature=0, json_schema=schema, speculative=False)
    b = sp.generate(prompt, max_tokens=60, temperature=0, json_schema=schema)
    assert b.tokens == a.tokens
    jsonschema.validate(json.loads(b.text), schema)
    assert b.spec is not None and b.spec.drafted > 0


def test_cli_json_schema_and_grammar(smollm2_path, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "pyfast", "generate", "-m", str(smollm2_path), "-t", "1",
                               "--temp", "0", "-n", "60", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)

    f = tmp_path / "s.json"
    f.write_text(json.dumps(PERSON))
    r = run("-p", "A person as JSON:", "--json-schema-file", str(f))
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()
    assert any(_valid(line) for line in out), r.stdout
    r = run("-p", "Yes or no?", "--grammar", 'root ::= "yes" | "no"')
    assert r.returncode == 0 and ("yes" in r.stdout or "no" in r.stdout)
    r = run("-p", "x", "--grammar", "root ::= missing")
    assert r.returncode == 1 and "error:" in r.stderr and "missing" in r.stderr


def _valid(line: str) -> bool:
    i = line.find("{")
    if i < 0:
        return False
    try:
        jsonschema.validate(json.loads(line[i:]), PERSON)
        return True
    except Exception:
        return False


def test_draft_model_sampling_under_schema(smollm2_path):
    """A draft model's sampled drafts (rejection sampling without a grammar) are verified row by
    row through the grammar: the output is valid."""
    from pyfast.llm import LLM
    from pyfast.spec import SpecConfig

    sp = LLM(smollm2_path, n_ctx=1024, n_threads=1, speculative=SpecConfig(draft_model=str(smollm2_path), draft_max=3))
    for seed in range(3):
        r = sp.generate("A person as JSON: ", max_tokens=80, temperature=0.8, seed=seed, json_schema=PERSON)
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), PERSON)
        assert r.spec.drafted > 0
