"""CLI misuse (issue 21, item 5): one line on stderr, a non-zero exit, never a traceback; thread
counts above the cores are clamped with a warning."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from pyfast import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("gguf")
    from tests.reference.tiny_gguf import write_tiny_llama

    p = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    write_tiny_llama(p, n_vocab=64, n_embd=32, n_layer=2, n_head=4, n_head_kv=2, n_ff=32)
    return str(p)


def run(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    err = capsys.readouterr().err
    return rc, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["generate", "-f", "{dir}", "-n", "1"], "-f/--file {dir} is a directory"),
    (["perplexity", "-m", "{model}", "-f", "{dir}"], "-f/--file {dir} is a directory"),
    (["generate", "-m", "{dir}", "-p", "hi"], "is a directory"),
    (["info", "{dir}"], "is a directory"),
    (["quantize", "{model}", "{dir}", "F16"], "output {dir} is a directory"),
    (["quantize", "{dir}", "{dir}/x.gguf", "F16"], "input {dir} is a directory"),
    (["serve", "-m", "{model}", "--api-key-file", "{dir}"], "--api-key-file {dir} is a directory"),
    (["generate", "-m", "{model}", "-c", "1000000000", "-p", "hi"], "-c/--ctx-size must be in [1, 16777216], got 1000000000"),
    (["generate", "-m", "{model}", "-c", "0", "-p", "hi"], "-c/--ctx-size must be in [1,"),
    (["generate", "-m", "{model}", "-t", "-3", "-p", "hi"], "-t/--threads must be >= 1, got -3"),
    (["serve", "-m", "{model}", "-t", "0"], "-t/--threads must be >= 1, got 0"),
    (["bench", "-m", "{model}", "-r", "0", "-p", "8", "-n", "2"], "-r/--repetitions must be >= 1, got 0"),
    (["bench", "-m", "{model}", "-t", "1,x", "-p", "8"], "-t/--threads must be comma-separated integers"),
    (["generate", "-m", "{missing}", "-p", "hi"], "not found"),
    (["perplexity", "-m", "{model}", "-f", "{missing}"], "No such file or directory: {missing}"),
    (["generate", "-m", "{corrupt}", "-p", "hi"], "{corrupt}"),
])
def test_misuse_is_one_line(capsys, tmp_path, tiny, argv, expected):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(open(tiny, "rb").read()[:3000])
    subs = {"dir": str(tmp_path), "model": tiny, "missing": str(tmp_path / "nope.gguf"), "corrupt": str(corrupt)}
    argv = [a.format(**subs) for a in argv]
    rc, err = run(capsys, *argv)
    assert rc == 1
    assert expected.format(**subs) in one_error_line(err)


def test_allocation_failure_is_one_line(capsys, smollm2_path):
    # within the -c bound, but a KV cache of ~230 GB: the allocation fails, cleanly
    rc, err = run(capsys, "generate", "-m", str(smollm2_path), "-c", "10000000", "-p", "hi", "-n", "1")
    assert rc == 1 and "out of memory" in one_error_line(err)


def test_threads_are_clamped_to_the_cores(capsys, tiny):
    cores = os.cpu_count() or 1
    rc, err = run(capsys, "generate", "-m", tiny, "-t", "1000", "--raw", "-p", "ab", "-n", "2", "--temp", "0",
                  "-c", "32")
    assert rc == 0, err
    assert f"warning: -t/--threads 1000 is more than the {cores} CPU cores; using {cores}" in err
    a = argparse.Namespace(threads="1,1000", repetitions=1)
    cli._check_args(a)
    assert a.threads == f"1,{cores}"


def test_the_process_prints_no_traceback(tmp_path):
    """The whole process, not just main(): argparse errors and ours end with one message."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    for argv in (["generate", "-f", str(tmp_path)], ["bench", "-r", "0"], ["generate", "-t", "abc"]):
        p = subprocess.run([sys.executable, "-m", "pyfast", *argv], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=120)
        assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.strip().splitlines()[-1].startswith(("error: ", "pyfast ")), p.stderr
