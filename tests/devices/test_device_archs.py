"""The standard-decoder, GLM-4 MoE and Gemma architectures on every non-CPU device (ops a device
lacks, such as rope with frequency factors or YaRN, gelu and tanh, run on the CPU): logits of the
tiny converted checkpoints against transformers' float64 reference, prompt and token by token, and
Gemma's bounded sliding-window cache living on the device."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast._loader import native
from tests.devices.test_device_models import dev_param
from tests.models.test_decoder_tiny import NAMES, converted, rel_err  # noqa: F401  (fixture)

TOL = 1e-3


@dev_param
@pytest.mark.parametrize("name", NAMES)
def test_arch_logits_on_device(converted, dev, name):  # noqa: F811
    from pyfast.context import Context
    from pyfast.models import Model

    path, ref = converted[name]
    model = Model(path)
    for swa_full in ((True, False) if name.startswith("gemma") else (True,)):
        ctx = Context(model, n_ctx=64, n_threads=2, kv_dtype=native.DType.F32, device=dev, n_ubatch=8,
                      swa_full=swa_full)
        toks, n0 = ref["tokens_0"], int(ref["n_prefill"])
        rows = [ctx.decode(toks[:n0], logits="all")] + [ctx.decode([t]) for t in toks[n0:]]
        assert rel_err(np.concatenate(rows), ref["decode_logits_0"]) < TOL, (name, swa_full)
