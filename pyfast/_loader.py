"""Locate the native extension.

Normally ``pyfast._native`` is the extension installed next to this file. Developers who build
with plain CMake can point ``PYFAST_NATIVE`` at the built ``_native*.so`` instead.
"""
from __future__ import annotations

import glob
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
    try:
        return importlib.import_module("pyfast._native")
    except ImportError as err:
        # Running from a source checkout whose pyfast/ has no built extension, while the package
        # is installed (pip install .): use the installed extension.
        here = os.path.dirname(os.path.abspath(__file__))
        for entry in sys.path:
            for cand in sorted(glob.glob(os.path.join(entry or ".", "pyfast", "_native*.*"))):
                if os.path.dirname(os.path.abspath(cand)) != here and cand.endswith((".so", ".pyd")):
                    os.environ["PYFAST_NATIVE"] = cand
                    try:
                        return load_native()
                    finally:
                        del os.environ["PYFAST_NATIVE"]
        raise ImportError("pyfast's native extension is not built: run `pip install .` "
                          "(or point PYFAST_NATIVE at a built _native*.so)") from err


native = load_native()
