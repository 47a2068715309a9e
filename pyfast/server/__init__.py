"""``pyfast serve``: an OpenAI-compatible server with continuous batching.

* ``engine.py``  — slots, the bounded queue, the scheduler thread (one batched decode per step)
  and the prompt cache (with context checkpoints for hybrid / recurrent models);
* ``spec.py``    — the per-slot speculation hook (drafters, verification inside the batch);
* ``app.py``     — the FastAPI routes, SSE streaming, API keys and errors;
* ``schemas.py`` — the OpenAI request schemas; ``metrics.py`` — Prometheus metrics;
* ``main.py``    — the command-line flags and the uvicorn runner.

Needs the ``server`` extra (``pip install 'pyfast[server]'``).
"""
from __future__ import annotations

__all__ = ["Engine", "EngineConfig", "SpecConfig", "create_app", "register_drafter"]


def __getattr__(name: str):
    import importlib

    where = {"Engine": "engine", "EngineConfig": "engine", "SpecConfig": "spec", "register_drafter": "spec",
             "create_app": "app"}.get(name)
    if where is None:
        raise AttributeError(f"module 'pyfast.server' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pyfast.server.{where}"), name)
