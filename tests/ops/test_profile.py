"""PYFAST_PROFILE=1: the per-op kernel-time table printed at exit counts every share of every
kernel exactly once (nth shares per node per run) and names the ops that ran."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import numpy as np
    from pyfast._loader import native as N
    F32 = N.DType.F32
    g = N.Graph()
    x = g.input("x", F32, [7, 64])
    w = g.input("w", F32, [33, 64])
    y = g.add(g.matmul(x, w), g.scale(g.matmul(x, w), 0.5))
    g.output(g.silu(y), "y")
    p = N.Plan(g, N.ThreadPool({nth}))
    p.set_input("x", np.ones((7, 64), np.float32))
    p.set_input("w", np.ones((33, 64), np.float32))
    for _ in range({runs}):
        p.run()
    print("ok", float(p.output("y")[0, 0]))
""")


def _profile(nth: int, runs: int, env_value: str = "1") -> tuple[str, str]:
    env = dict(os.environ, PYFAST_PROFILE=env_value)
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(nth=nth, runs=runs)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout, r.stderr


def _table(stderr: str) -> dict[str, int]:
    rows = {}
    for line in stderr.splitlines():
        m = re.match(r"^(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%$", line)
        if m:
            rows[m.group(1)] = int(m.group(2))
    return rows


def test_profile_counts_every_share_once():
    for nth in (1, 3):
        out, err = _profile(nth, runs=5)
        assert out.startswith("ok")
        rows = _table(err)
        # two matmuls, one scale, one add, one silu per run; nth shares each
        assert rows.get("matmul") == 2 * 5 * nth, err
        assert rows.get("add") == 5 * nth and rows.get("scale") == 5 * nth and rows.get("silu") == 5 * nth, err
        assert ("(wait)" in rows) == (nth > 1), err


def test_profile_off_prints_nothing():
    out, err = _profile(2, runs=3, env_value="0")
    assert out.startswith("ok")
    assert "pyfast profile" not in err


MOE_SCRIPT = textwrap.dedent("""
    import numpy as np
    from pyfast._loader import native as N
    F32, I32 = N.DType.F32, N.DType.I32
    E, n, K = 8, 256, 1024
    g = N.Graph()
    x = g.input("x", F32, [3, K])
    w = g.input("w", F32, [E, n, K])
    ids = g.input("ids", I32, [3, 2])
    g.output(g.matmul_id(x, w, ids), "y")
    p = N.Plan(g, N.ThreadPool(2))
    p.set_input("x", np.ones((3, K), np.float32))
    p.set_input("w", np.ones((E, n, K), np.float32))
    p.set_input("ids", np.array([[5, 2], [2, 5], [5, 5]], np.int32))  # two distinct experts
    for _ in range(40):
        p.run()
    print("ok", float(p.output("y")[0, 0, 0]))
""")


def test_profile_detail_counts_selected_experts():
    # PYFAST_PROFILE=2 lists matmul_id by the bytes of the experts its ids select (2 of the 8
    # here), so GB/s x ms gives 40 runs x 2 experts x 256 x 1024 x 4 bytes, not 8 experts' worth.
    env = dict(os.environ, PYFAST_PROFILE="2")
    r = subprocess.run([sys.executable, "-c", MOE_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok 1024.0"), r.stdout
    row = [ln for ln in r.stderr.splitlines() if "(selected experts)" in ln]
    assert len(row) == 1, r.stderr
    m = re.match(r"^F32 256 x 1024 \(selected experts\), 3\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", row[0])
    assert m, row[0]
    runs, ms, gbs = int(m.group(1)), float(m.group(2)), float(m.group(4))
    assert runs == 40
    per_run = gbs * ms * 1e6 / runs
    assert abs(per_run / (2 * 256 * 1024 * 4) - 1) < 0.1, (per_run, r.stderr)


def test_profile_detail_names_the_groups_waited_for():
    # PYFAST_PROFILE=2 with 3 threads: every wait is counted against the group of nodes it waited
    # for, named by its ops; the per-group waits add up to the (wait) row's count.
    out, err = _profile(3, runs=5, env_value="2")
    assert out.startswith("ok")
    lines = err.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("pyfast wait profile"))
    groups = {}
    for ln in lines[at + 2:]:
        m = re.match(r"^(.+?)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", ln)
        if not m:
            break
        groups[m.group(1)] = int(m.group(2))
    # the two matmuls of x share a group (no dependency between them), then scale, add, silu
    assert set(groups) == {"matmul matmul", "scale", "add", "silu"}, err
    assert all(n == 5 * 3 for n in groups.values()), groups
    assert sum(groups.values()) == _table(err)["(wait)"], err
    # one thread: nothing to wait for, no table
    _, err1 = _profile(1, runs=2, env_value="2")
    assert "pyfast wait profile" not in err1
