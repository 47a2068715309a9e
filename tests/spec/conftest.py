"""Fixtures for the speculation tests on SmolLM2: a plain LLM, prompts, their greedy references
and a tiny random draft model with SmolLM2's vocabulary."""
from __future__ import annotations

import pytest

N_GEN = 40


@pytest.fixture(scope="session")
def base_llm(smollm2_path):
    from pyfast.llm import LLM

    return LLM(smollm2_path, n_ctx=1024, n_threads=2)


@pytest.fixture(scope="session")
def prompts(base_llm) -> list[str]:
    chat = base_llm.apply_chat_template([{"role": "user", "content": "Give me two tips for sleeping well."}])
    code = "def is_prime(n):\n    if n < 2:\n        return False\n"
    rep = "red green blue. red green blue. red green blue. red green"
    copy = base_llm.apply_chat_template([{"role": "user", "content":
                                          "Repeat exactly: The quick brown fox jumps over the lazy dog near "
                                          "the river bank, then runs home before the rain starts."}])
    return [chat, code, rep, copy]


@pytest.fixture(scope="session")
def references(base_llm, prompts) -> list[list[int]]:
    """Plain greedy tokens of every prompt."""
    return [base_llm.generate(p, max_tokens=N_GEN, temperature=0, speculative=False).tokens for p in prompts]


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory, smollm2_model):
    from tests.spec.helpers import write_tiny_draft

    return write_tiny_draft(tmp_path_factory.mktemp("draft") / "tiny-draft.gguf", smollm2_model.metadata)
