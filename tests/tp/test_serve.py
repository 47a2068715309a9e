"""``mpirun -np 2 pyfast serve --tp 2``: rank 0 serves HTTP, rank 1 holds half of every layer; a
greedy completion over real HTTP equals LLM.generate in one process, and the server shuts down
cleanly (the follower returns when rank 0 exits)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

from tests.models.test_hybrid_common import FIXTURES
from tests.tp.common import MPIRUN, ROOT, mpi_env, needs_mpi

pytestmark = needs_mpi


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_tp2_completion_equals_one_process():
    pytest_importorskip = __import__("pytest").importorskip
    pytest_importorskip("uvicorn")
    from pyfast.llm import LLM

    model = FIXTURES / "qwen35kv2.gguf"
    port = _free_port()
    proc = subprocess.Popen([MPIRUN, "--oversubscribe", "-np", "2", sys.executable, "-m", "pyfast", "serve", "--tp", "2",
                             "-t", "1", "-m", str(model), "--port", str(port), "-np", "2", "-c", "512"],
                            cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    raise AssertionError(f"the server exited: {proc.stdout.read()[-3000:]}")
                time.sleep(0.25)
        body = json.dumps({"prompt": "hello world", "max_tokens": 12, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
        got = json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]["text"]
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    want = LLM(str(model), n_ctx=512, n_threads=1).generate("hello world", max_tokens=12, temperature=0)
    assert got == want.text, f"served {got!r}, one process {want.text!r}"
