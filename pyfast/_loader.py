"""Locate the native extension.

Normally ``pyfast._native`` is the extension installed next to this file. Developers who build
with plain CMake can point ``PYFAST_NATIVE`` at the built ``_native*.so`` instead.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def load_native():
    path = os.environ.get("PYFAST_NATIVE")
    if path:
        spec = importlib.util.spec_from_file_location("pyfast._native", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"PYFAST_NATIVE={path!r} is not a loadable extension")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["pyfast._native"] = mod
        spec.loader.exec_module(mod)
        return mod
    return importlib.import_module("pyfast._native")


native = load_native()
