"""matmul_id on small batches (decode and verify batches: at most 64 (token, slot) pairs and 32768
activation elements), where every thread builds its own routing tables and activation rows and
the op waits for no other thread (its shares may then run on any thread): bit-identical to the
per-expert dense matmul and to the same op on one thread, x 2-D and 3-D, experts repeated within
a token and across tokens."""
from __future__ import annotations

import numpy as np
import pytest

from .harness import ISAS, WEIGHT_TYPES, dname, encode, run_matmul
from .test_moe import _same, run_matmul_id


@pytest.mark.parametrize("dt", WEIGHT_TYPES, ids=dname)
def test_small_matmul_id_equals_dense_on_any_thread_count(dt):
    isa = ISAS[-1]
    rng = np.random.default_rng(11 + int(dt.value))
    E, Nw, K, k = 5, 48, 256, 4
    w = encode(rng.standard_normal((E, Nw, K)) * 0.2, dt)
    for T in (1, 2, 5, 16):  # 16 x 4 = 64 pairs: the largest small batch
        x = rng.standard_normal((T, K)).astype(np.float32)
        ids = rng.integers(0, E, (T, k)).astype(np.int32)
        ids[:, 1] = ids[:, 0]                       # an expert twice in one token
        x3 = rng.standard_normal((T, k, K)).astype(np.float32)
        ref = run_matmul_id(x, w, ids, dt, isa, 1)
        ref3 = run_matmul_id(x3, w, ids, dt, isa, 1)
        for nt in (2, 3, 4):
            _same(run_matmul_id(x, w, ids, dt, isa, nt), ref, f"{dname(dt)} T={T}: {nt} threads vs 1")
            _same(run_matmul_id(x3, w, ids, dt, isa, nt), ref3, f"{dname(dt)} T={T} 3-D: {nt} threads vs 1")
        for e in np.unique(ids):
            dense = run_matmul(x, w[e], dt, isa, 1)
            dense3 = run_matmul(x3.reshape(T * k, K), w[e], dt, isa, 1)
            for t, j in zip(*np.nonzero(ids == e)):
                _same(ref[t, j], dense[t], f"{dname(dt)} T={T}: row ({t}, {j})")
                _same(ref3[t, j], dense3[t * k + j], f"{dname(dt)} T={T} 3-D: row ({t}, {j})")
