"""Bad speculative settings fail with a clear error before anything is decoded; the CLI prints
the statistics and the bench compares against plain decoding in one run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyfast.context import Context
from pyfast.llm import LLM
from pyfast.spec import SpecConfig
from tests.spec.helpers import write_tiny_draft

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_decode(monkeypatch):
    """Fail the test if anything is decoded."""
    def decode(*a, **k):
        raise AssertionError("decoded before the settings were checked")

    monkeypatch.setattr(Context, "decode", decode)


@pytest.mark.parametrize("cfg, match", [
    (dict(types="ngram-simple,foo"), "unknown speculative type 'foo'"),
    (dict(types="ngram-simple,ngram-simple"), "listed twice"),
    (dict(types=[]), "needs at least one"),
    (dict(types="draft-model"), "needs a draft model"),
    (dict(draft_model="DRAFT", draft_max=0), "--draft-max must be >= 1.*draft-model"),
    (dict(types="ngram-simple", draft_max=-2), "--draft-max must be >= 1"),
    (dict(types="ngram-simple", draft_min=5, draft_max=4), "--draft-min"),
    (dict(types="ngram-simple", draft_p_min=1.5), "--draft-p-min"),
    (dict(types="ngram-simple", draft_max=600), "does not fit the context size 512"),
])
def test_bad_settings_fail_before_decoding(cfg, match, smollm2_path, tiny_draft, no_decode):
    cfg = {k: (tiny_draft if v == "DRAFT" else v) for k, v in cfg.items()}
    with pytest.raises(ValueError, match=match):
        LLM(smollm2_path, n_ctx=512, n_threads=2, speculative=SpecConfig(**cfg))


def test_incompatible_draft_models(smollm2_path, smollm2_model, tmp_path, no_decode):
    other = write_tiny_draft(tmp_path / "other.gguf", smollm2_model.metadata, vocab_from_target=False)
    with pytest.raises(ValueError, match="incompatible vocabulary: token 0"):
        LLM(smollm2_path, n_ctx=512, n_threads=2, speculative=SpecConfig(draft_model=other))
    small = write_tiny_draft(tmp_path / "small.gguf", smollm2_model.metadata, vocab_from_target=False,
                             n_vocab=1000)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens but the target .* has 49152"):
        LLM(smollm2_path, n_ctx=512, n_threads=2, speculative=SpecConfig(draft_model=small))
    short = write_tiny_draft(tmp_path / "short.gguf", smollm2_model.metadata, context_length=256)
    with pytest.raises(ValueError, match="trained for a context of 256 tokens, smaller than the context size 512"):
        LLM(smollm2_path, n_ctx=512, n_threads=2, speculative=SpecConfig(draft_model=short))
    with pytest.raises(FileNotFoundError):
        LLM(smollm2_path, n_ctx=512, n_threads=2, speculative=SpecConfig(draft_model=tmp_path / "none.gguf"))


def test_speculative_true_without_config(base_llm):
    with pytest.raises(ValueError, match="speculative=SpecConfig"):
        base_llm.generate("hi", max_tokens=2, speculative=True)


def run(*args, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "pyfast", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_cli_errors(smollm2_path, tmp_path, smollm2_model):
    r = run("generate", "-m", str(smollm2_path), "-p", "hi", "--spec-type", "ngram-simple,bogus")
    assert r.returncode == 1 and "unknown speculative type 'bogus'" in r.stderr
    r = run("generate", "-m", str(smollm2_path), "-p", "hi", "-md", str(smollm2_path), "--draft-max", "0")
    assert r.returncode == 1 and "--draft-max must be >= 1" in r.stderr
    r = run("generate", "-m", str(smollm2_path), "-p", "hi", "--draft-max", "4")
    assert r.returncode == 1 and "needs speculative decoding" in r.stderr
    bad = write_tiny_draft(tmp_path / "bad.gguf", smollm2_model.metadata, vocab_from_target=False, n_vocab=512)
    r = run("generate", "-m", str(smollm2_path), "-p", "hi", "-md", str(bad), "-n", "4")
    assert r.returncode == 1 and "vocabulary of 512 tokens" in r.stderr
    assert r.stdout == ""  # nothing was generated


def test_cli_generate_prints_stats_and_same_text(smollm2_path, base_llm):
    prompt = "Repeat exactly: alpha beta gamma delta, alpha beta gamma delta."
    args = ["generate", "-m", str(smollm2_path), "-p", prompt, "--temp", "0", "-n", "32", "-t", "2"]
    r = run(*args, "--spec-type", "ngram-simple,ngram-mod", "--draft-max", "8", "--spec-adaptive")
    assert r.returncode == 0, r.stderr
    want = base_llm.chat([{"role": "user", "content": prompt}], max_tokens=32, temperature=0)
    assert r.stdout.strip() == want.text.strip()
    assert "[speculative: drafted" in r.stderr and "accepted per position" in r.stderr


def test_cli_bench_spec_reports_against_plain(smollm2_path, tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["Repeat exactly: one two three four five six seven eight nine ten."]))
    r = run("bench", "-m", str(smollm2_path), "--spec", "ngram-simple", "--spec", "ngram-mod",
            "--spec-adaptive", "--prompts", str(prompts), "-n", "16", "-r", "1", "-t", "2", "-o", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [x["config"] for x in rows] == ["none", "ngram-simple adaptive", "ngram-mod adaptive"]
    assert rows[0]["speedup"] == pytest.approx(1.0)
    for x in rows[1:]:
        assert x["identical"] is True and x["tps"] > 0 and x["speedup"] > 0
        assert 0.0 <= x["acceptance"] <= 1.0 and x["n_gen"] == rows[0]["n_gen"]
