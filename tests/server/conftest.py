"""Fixtures for the server tests: the shared ``pyfast serve`` on the default model and a reference
``pyfast.LLM``; the same pair on the tiny hybrid (Gated-DeltaNet) Qwen3.5 fixture. The whole
directory is skipped when the server extra is not installed."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_MISSING = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
if _MISSING:  # pip install ".[test]" (or ".[server]") to run these
    collect_ignore_glob = ["test_*.py"]
else:
    import httpx

    from tests.server.helpers import ServerProcess


@pytest.fixture(scope="session")
def main_server(smollm2_path):
    """The default model with 8 slots of 1024 tokens: shared by the API, error and load tests."""
    with ServerProcess("-m", str(smollm2_path), "--parallel", "8", "--ctx-size", str(8 * 1024)) as srv:
        yield srv


@pytest.fixture(scope="session")
def ref_llm(smollm2_path):
    from pyfast.llm import LLM

    return LLM(smollm2_path, n_ctx=1024)


@pytest.fixture
def client(main_server):
    with httpx.Client(base_url=main_server.url, timeout=120) as c:
        yield c


HYBRID_GGUF = Path(__file__).resolve().parents[1] / "fixtures" / "hybrid" / "qwen35.gguf"


@pytest.fixture(scope="session")
def hybrid_path():
    if not HYBRID_GGUF.is_file():
        pytest.skip(f"hybrid fixture {HYBRID_GGUF} not present")
    return HYBRID_GGUF


@pytest.fixture(scope="module")
def hybrid_server(hybrid_path):
    """The tiny Qwen3.5 (hybrid: recurrent + attention) fixture with 3 slots of 1024 tokens."""
    with ServerProcess("-m", str(hybrid_path), "--parallel", "3", "--ctx-size", str(3 * 1024)) as srv:
        yield srv


@pytest.fixture(scope="session")
def hybrid_llm(hybrid_path):
    from pyfast.llm import LLM

    return LLM(hybrid_path, n_ctx=1024, n_threads=1)
