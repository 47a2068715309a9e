"""The ``serve`` command line, and the scheduler's pure helpers."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast.cli import build_parser
from pyfast.server.engine import common_prefix, find_stop
from pyfast.server.main import read_api_keys
from pyfast.server.metrics import ServerMetrics
from pyfast.server.spec import SpecConfig, Speculator, build_proposers, register_drafter


def test_serve_flags():
    a = build_parser().parse_args(["serve", "-m", "x.gguf", "--port", "9000", "-np", "8", "-c", "8192",
                                   "--api-key", "k1", "--api-key", "k2", "--spec-type", "none",
                                   "--draft-max", "8", "--max-queue", "5"])
    assert a.cmd == "serve" and a.model == "x.gguf" and a.port == 9000 and a.parallel == 8
    assert a.ctx_size == 8192 and a.api_key == ["k1", "k2"] and a.draft_max == 8 and a.max_queue == 5
    d = build_parser().parse_args(["serve"])
    assert d.host == "127.0.0.1" and d.model is None and d.spec_type == "none"
    assert d.cache_type_k == "f16" and d.cache_type_v is None
    q = build_parser().parse_args(["serve", "-ctk", "q8_0", "-ctv", "f16"])
    assert q.cache_type_k == "q8_0" and q.cache_type_v == "f16"


def test_engine_config_rejects_unknown_cache_types():
    from pyfast.server.engine import EngineConfig

    with pytest.raises(ValueError, match="--cache-type-k"):
        EngineConfig(cache_type_k="q4_0").validate()
    with pytest.raises(ValueError, match="--cache-type-v"):
        EngineConfig(cache_type_v="int8").validate()
    EngineConfig(cache_type_k="Q8_0", cache_type_v="f32").validate()


def test_api_key_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\n a \n\nb\n")
    assert read_api_keys(["c", " "], str(f)) == ["c", "a", "b"]
    f.write_text("# nothing\n")
    with pytest.raises(ValueError):
        read_api_keys([], str(f))


def test_common_prefix():
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([1, 5, 3], [1, 2, 3]) == 1
    assert common_prefix([7], [1]) == 0


def test_find_stop():
    assert find_stop("hello world", ["wor"], 0) == 6
    assert find_stop("hello world", ["xyz", "lo"], 0) == 3
    assert find_stop("hello world", ["hello"], 11) is None  # already emitted text is not searched


def test_spec_registry_and_speculator():
    assert build_proposers(SpecConfig(spec_type="none"), None, 100) == []
    with pytest.raises(ValueError):
        build_proposers(SpecConfig(spec_type="no-such-method"), None, 100)

    class Fixed:
        default_n_max = 4

        def __init__(self, toks):
            self.toks, self.log = toks, []

        def begin(self, seq, prompt):
            self.log.append(("begin", seq))

        def draft(self, reqs):
            return [self.toks[: r.n_max] for r in reqs]

        def accept(self, seq, k, other=False):
            self.log.append(("accept", seq, k, other))

        def process(self, batch):
            pass

    register_drafter("test-fixed", lambda model, cfg: Fixed([1, 2, 3, 4, 5]))
    (p,) = build_proposers(SpecConfig(spec_type="test-fixed"), None, 100)
    empty, full = Fixed([]), p
    sp = Speculator([empty, full], n_vocab=10, n_min=2)
    sp.begin(0, [7, 8])
    got = sp.draft([(0, np.array([7, 8]), 3, None), (1, np.array([7]), 1, None)])
    assert got == {0: [1, 2, 3]}  # seq 1's cap (1) is below n_min: no draft
    sp.accept(0, 2)
    assert ("accept", 0, 2, False) in full.log and ("accept", 0, 2, True) in empty.log
    bad = Speculator([Fixed([1, 99])], n_vocab=10)
    with pytest.raises(ValueError, match="outside"):
        bad.draft([(0, np.array([1]), 4, None)])
    with pytest.raises(ValueError):
        SpecConfig(n_max=0).validate()


def test_metrics_render():
    m = ServerMetrics()
    m.ttft.observe(0.2)
    m.http_requests.inc(route="/health", status="200")
    m.add_spec(10, 4)
    text = m.render()
    assert 'pyfast_time_to_first_token_seconds_bucket{le="0.25"} 1' in text
    assert 'pyfast_time_to_first_token_seconds_bucket{le="+Inf"} 1' in text
    assert 'pyfast_http_requests_total{route="/health",status="200"} 1' in text
    assert "pyfast_spec_acceptance_rate 0.4" in text
    assert "# TYPE pyfast_time_to_first_token_seconds histogram" in text
