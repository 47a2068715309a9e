"""The pyfast command line, run as a subprocess on the default model."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args, stdin: str | None = None, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "pyfast", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from pyfast.llm import LLM

    return LLM(smollm2_path, n_ctx=1024, n_threads=2)


def test_generate_applies_chat_template(smollm2_path, llm):
    r = run("generate", "-m", str(smollm2_path), "-p", "Write a haiku about the sea.", "--temp", "0",
            "-n", "48", "-t", "2")
    assert r.returncode == 0, r.stderr
    want = llm.chat([{"role": "user", "content": "Write a haiku about the sea."}], max_tokens=48, temperature=0)
    assert r.stdout.strip() == want.text.strip()
    assert len(want.text.split()) >= 8
    assert "generated:" in r.stderr


def test_generate_raw(smollm2_path, llm):
    r = run("generate", "-m", str(smollm2_path), "--raw", "-p", "def fibonacci(n):", "--temp", "0", "-n", "16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == llm.generate("def fibonacci(n):", max_tokens=16, temperature=0).text


def test_chat_multi_turn(smollm2_path, llm):
    turns = "My name is Alice and I like apples.\nWhat is my name?\n"
    r = run("chat", "-m", str(smollm2_path), "--temp", "0", "-n", "40", stdin=turns)
    assert r.returncode == 0, r.stderr
    msgs = [{"role": "user", "content": "My name is Alice and I like apples."}]
    first = llm.chat(msgs, max_tokens=40, temperature=0).text
    msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "What is my name?"}]
    second = llm.chat(msgs, max_tokens=40, temperature=0).text
    assert r.stdout == first + "\n" + second + "\n"


def test_info_lists_metadata_and_tensors(smollm2_path):
    r = run("info", str(smollm2_path))
    assert r.returncode == 0, r.stderr
    assert "llama" in r.stdout and "blk.0.attn_q.weight" in r.stdout and "Q4_1" in r.stdout


def test_errors_are_clean(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    r = run("generate", "-m", str(bad), "-p", "hi")
    assert r.returncode == 1
    assert "error:" in r.stderr and "magic" in r.stderr.lower()
    assert "Traceback" not in r.stderr
    r = run("generate", "-m", str(tmp_path / "missing.gguf"), "-p", "hi")
    assert r.returncode == 1 and "Traceback" not in r.stderr
