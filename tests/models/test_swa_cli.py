"""``--swa-full`` / ``--no-swa-full`` (llama.cpp's flag name) on generate, chat, perplexity and
serve: the default keeps the full cache for Gemma's sliding-window layers; ``--no-swa-full`` gives
them the bounded cache (``LLM(swa_full=False)``), with the same output."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "decoder"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from pyfast.convert import convert

    path = tmp_path_factory.mktemp("swa_cli") / "gemma3.gguf"
    convert(FIX / "hf" / "gemma3", path, outtype="f32")
    return path


@pytest.mark.parametrize("cmd", ["generate", "chat", "perplexity", "serve"])
def test_flag_parses(cmd):
    from pyfast.cli import build_parser, swa_kwargs

    extra = ["-f", "x.txt"] if cmd == "perplexity" else []
    ap = build_parser()
    assert swa_kwargs(ap.parse_args([cmd, *extra])) == {"swa_full": True}
    assert swa_kwargs(ap.parse_args([cmd, *extra, "--no-swa-full"])) == {"swa_full": False}
    assert swa_kwargs(ap.parse_args([cmd, *extra, "--swa-full"])) == {"swa_full": True}


def _run_cli(monkeypatch, argv):
    """Run ``pyfast <argv>`` in-process; returns (stdout, the LLMs it built)."""
    import pyfast.llm
    from pyfast.cli import main

    built = []
    real = pyfast.llm.LLM

    class Recording(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.append(self)

    monkeypatch.setattr(pyfast.llm, "LLM", Recording)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(argv) == 0
    return out.getvalue(), built


def test_generate_bounded_cache_same_text(gemma3, monkeypatch):
    base = ["generate", "-m", str(gemma3), "--raw", "-p", "hello world, hello", "--temp", "0", "-n", "24",
            "-t", "2", "-c", "1024"]
    want, (full,) = _run_cli(monkeypatch, base)
    got, (bounded,) = _run_cli(monkeypatch, base + ["--no-swa-full"])
    assert full.ctx.kv_swa is None
    assert bounded.ctx.kv_swa is not None and bounded.ctx.kv_swa.n_ctx < bounded.ctx.kv.n_ctx
    assert got == want and len(want.strip()) > 0


def test_perplexity_bounded_cache_same_value(gemma3, monkeypatch, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 12)
    base = ["perplexity", "-m", str(gemma3), "-f", str(text), "-c", "64", "-t", "2"]
    want, (full,) = _run_cli(monkeypatch, base)
    got, (bounded,) = _run_cli(monkeypatch, base + ["--no-swa-full"])
    assert full.ctx.kv_swa is None and bounded.ctx.kv_swa is not None
    assert "PPL = " in want and got == want


def test_serve_passes_the_flag(gemma3, monkeypatch):
    """serve hands --no-swa-full to the engine, whose context then has the bounded cache."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import pyfast.server.engine as engine_mod
    from pyfast.cli import build_parser
    from pyfast.server.main import serve_from_args

    seen = []

    class Stop(Exception):
        pass

    class FakeEngine:
        def __init__(self, cfg, *a, **kw):
            seen.append(cfg)
            raise Stop

    monkeypatch.setattr(engine_mod, "Engine", FakeEngine)
    for flag, want in (([], True), (["--no-swa-full"], False)):
        with pytest.raises(Stop):
            serve_from_args(build_parser().parse_args(["serve", "-m", str(gemma3), *flag]))
        assert seen[-1].swa_full is want
    monkeypatch.undo()

    from pyfast.server.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model=str(gemma3), n_parallel=2, n_ctx=128, n_threads=1, swa_full=False))
    assert eng.ctx.kv_swa is not None
    eng = Engine(EngineConfig(model=str(gemma3), n_parallel=2, n_ctx=128, n_threads=1))
    assert eng.ctx.kv_swa is None
