"""DFlash / DSpark drafters on every non-CPU device (the drafter's cache and plans live on the
target context's device; ops the device lacks run on the CPU): slot logits, Markov-biased logits
and confidences against the float64 numpy reference, and greedy speculation equal to plain
decoding with the drafter's cache length equal to the target's after every round."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast.spec import SpecConfig
from pyfast.spec.base import DraftRequest
from pyfast.spec.dflash import BlockDrafter, BlockDrafterModel
from tests.devices.test_device_models import dev_param
from tests.spec.test_dflash import (D_T, N_GEN, PROMPTS, TOL, V, _cache_check, _feed, _ref, _rel,  # noqa: F401
                                    _run, drafters, plain, target)


@dev_param
@pytest.mark.parametrize("name", ["dflash", "dspark", "dspark-reduced"])
def test_drafter_on_device(target, drafters, plain, dev, name):  # noqa: F811
    from pyfast.context import Context

    hf, gguf = drafters[name]
    ref = _ref(target, hf)
    prop = BlockDrafter(BlockDrafterModel(gguf), target, n_ctx=512)
    prop.bind_target(Context(target, n_ctx=64, n_threads=2, capture_layers=prop.capture_layers, device=dev))
    F = np.random.default_rng(5).standard_normal((9, len(prop.args.target_layers) * D_T)).astype(np.float32)
    toks = np.random.default_rng(6).integers(0, V, 10).astype(np.int32)
    _feed(prop, 0, F, toks)
    prop.trace = []
    d = prop.draft([DraftRequest(0, toks, 99, 1, 0.0, None)])[0]
    t, r = prop.trace[0], ref.forward(F, int(toks[-1]), 9)
    assert _rel(t.get("base", t["logits"])[:, 0], r["logits"]) < TOL
    assert _rel(t["logits"][:, 0], r["biased"]) < TOL
    if r["conf"] is not None:
        assert np.abs(1 / (1 + np.exp(-t["conf"][:, 0].astype(np.float64))) - r["conf"]).max() < TOL
    assert d.tokens.tolist() == r["tokens"].tolist()

    prop = BlockDrafter(BlockDrafterModel(gguf), target, n_ctx=512)
    got, dec = _run(target, PROMPTS, N_GEN, [prop], SpecConfig(draft_max=prop.args.n_read), prop.capture_layers,
                    check=_cache_check(prop), device=dev)
    assert got == plain and dec.stats.drafted > 0
    assert prop.kv.device is not None
