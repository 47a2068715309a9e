"""The read-bandwidth probe that `pyfast bench` prints next to each generation figure."""
import math

import pytest

from pyfast._loader import native as N


def test_probe_reports_a_plausible_rate():
    # 8 MiB read 2 times by 1 and 2 threads: a finite rate between 100 MB/s and 10 TB/s
    for nt in (1, 2):
        gbs = N.read_bandwidth(8 << 20, nt, 2) / 1e9
        assert math.isfinite(gbs) and 0.1 < gbs < 10_000, (nt, gbs)


@pytest.mark.parametrize("nbytes,reps,match", [(1 << 19, 1, "at least 1 MiB"), (1 << 20, 0, "reps")])
def test_probe_rejects_bad_arguments(nbytes, reps, match):
    with pytest.raises(ValueError, match=match):
        N.read_bandwidth(nbytes, 1, reps)


# The bytes a generated token must read, which the bound is computed from.
FIX = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures" / "hybrid"


def test_decode_read_bytes_counts_used_experts_and_recurrent_state():
    from pyfast.bench import decode_read_bytes
    from pyfast.context import Context
    from pyfast.models import Model

    m = Model(str(FIX / "qwen35moe.gguf"))
    info, md = m.weights.info, m.metadata
    n_exp, n_used = md["qwen35moe.expert_count"], md["qwen35moe.expert_used_count"]
    assert n_used < n_exp
    exps = sum(i.nbytes for k, i in info.items() if "_exps." in k)
    assert exps > 0
    rest = sum(i.nbytes for k, i in info.items() if "_exps." not in k)
    if "output.weight" in info:
        rest -= info["token_embd.weight"].nbytes
    want = rest + sum(i.nbytes * n_used // n_exp for k, i in info.items() if "_exps." in k)
    assert decode_read_bytes(m) == want
    # with a context: one sequence's recurrent state, read and written, every recurrent layer
    ctx = Context(m, n_ctx=64)
    spec = m.memory_spec()
    g = spec.recurrent
    state = 2 * 4 * len(spec.recurrent_layers) * ((g.conv_kernel - 1) * g.conv_channels + g.n_v_heads * g.state_size ** 2)
    assert decode_read_bytes(m, ctx) == want + state
