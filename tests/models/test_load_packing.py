"""The loader packs the usual matmul weights (x16) while it reads them (pyfast.models.base.Weights,
``_MATMUL_NAMES``), before any graph is built. For a tiny Q8_0 model of every architecture: every
tensor it packed is one the graphs read as a matmul weight (none is ever read row-major, which would
cost an unpacked copy), and the logits equal those of the mapped, row-major file bit for bit."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from pyfast._loader import native
from pyfast.context import Context
from pyfast.models import Model

FIX = Path(__file__).resolve().parents[1] / "fixtures"
CHECKPOINTS = {
    "llama3": FIX / "decoder" / "hf" / "llama3",
    "qwen3moe": FIX / "decoder" / "hf" / "qwen3moe",
    "glm4moe": FIX / "decoder" / "hf" / "glm4moe",
    "gemma4moe": FIX / "decoder" / "hf" / "gemma4moe",
    "deepseek_v3": FIX / "deepseek" / "hf" / "deepseek_v3",
}
GGUFS = {"qwen35": FIX / "hybrid" / "qwen35.gguf", "qwen35moe": FIX / "hybrid" / "qwen35moe.gguf",
         "qwen3next": FIX / "hybrid" / "qwen3next.gguf"}


@pytest.fixture(scope="module")
def q8_files(tmp_path_factory):
    from pyfast.convert import convert
    from pyfast.quantize import quantize

    d = tmp_path_factory.mktemp("loadpack")
    out = {}
    for name, src in {**CHECKPOINTS, **GGUFS}.items():
        f32 = d / f"{name}.f32.gguf"
        if src.suffix == ".gguf":
            shutil.copyfile(src, f32)
        else:
            convert(src, f32, outtype="f32")
        quantize(str(f32), str(d / f"{name}.q8.gguf"), "Q8_0")
        out[name] = d / f"{name}.q8.gguf"
    return out


@pytest.mark.parametrize("name", list(CHECKPOINTS) + list(GGUFS))
def test_loader_packs_only_matmul_weights(q8_files, name, monkeypatch):
    monkeypatch.setenv("PYFAST_PACK", "1")  # the packed layout on every ISA (others unpack per use)
    path = q8_files[name]
    mem, mapped = Model(path, mmap=False), Model(path, mmap=True)
    w = mem.weights
    w._wait_loaded()
    eager = set(w._eager_pack()[1])  # the names the loader packs as it reads
    assert eager and eager <= w._pack.packed, "the loader packed nothing"
    n_vocab = mem.n_vocab
    prompt = [(7 * i + 3) % n_vocab for i in range(6)]
    kw = dict(n_ctx=64, n_threads=2, kv_dtype=native.DType.F32)
    a = Context(mem, **kw).decode(prompt, seq_ids=0, logits="all")
    b = Context(mapped, **kw).decode(prompt, seq_ids=0, logits="all")
    np.testing.assert_array_equal(a, b)
    unpacked = sorted(k for k in w._derived if k.endswith("#row-major"))
    assert not unpacked, f"packed at load but read row-major: {unpacked}"
    assert not (eager & w._pack.row_major)
