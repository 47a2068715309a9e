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
