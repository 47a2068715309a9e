"""The ``serve`` command line, and the scheduler's pure helpers."""
from __future__ import annotations

import pytest

from pyfast.cli import build_parser
from pyfast.sampling import Sampler, SamplingParams
from pyfast.server.engine import common_prefix, find_stop
from pyfast.server.main import read_api_keys
from pyfast.server.metrics import ServerMetrics
from pyfast.server.spec import SpecConfig, as_proposer, build_proposers, register_drafter


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


class _StubKV:
    def free_cells(self, need):
        return need

    def can_rollback(self):
        return float("inf")


class _StubCtx:
    """What SpecDecoder's drafting reads of a Context."""

    n_ctx, max_plans, rec, export_hidden = 100, 12, None, False
    kv = _StubKV()

    class model:
        n_vocab = 10


def test_spec_registry_and_duck_typed_proposers():
    from pyfast.spec.base import Draft
    from pyfast.spec.decoder import SpecDecoder

    assert build_proposers(SpecConfig(spec_type="none"), None, 100) == []
    with pytest.raises(ValueError):
        build_proposers(SpecConfig(spec_type="no-such-method"), None, 100)

    class Fixed:  # a registered drafter need not subclass pyfast.spec.Proposer
        default_n_max = 4

        def __init__(self, toks):
            self.toks, self.log = toks, []

        def begin(self, seq, prompt):
            self.log.append(("begin", seq))

        def draft(self, reqs):
            return [self.toks[: r.n_max] for r in reqs]

        def accept(self, seq, k, other=False):
            self.log.append(("accept", seq, k, other))

    register_drafter("test-fixed", lambda model, cfg: Fixed([1, 2, 3, 4, 5]))
    (p,) = build_proposers(SpecConfig(spec_type="test-fixed"), None, 100)
    empty, full = as_proposer(Fixed([])), as_proposer(p)
    assert full.name == "Fixed" and full.default_n_max == 4 and as_proposer(full) is full
    dec = SpecDecoder(_StubCtx(), [empty, full], SpecConfig(n_min=2).decoder_config())
    sampler = Sampler(SamplingParams(temperature=0), 10)
    a = dec.add(0, [7, 8], sampler)
    b = dec.add(1, [7], sampler)
    b.n_remaining = 2  # its cap (1) is below n_min: no draft
    drafts, winners, _ = dec._draft([a, b])
    assert isinstance(drafts[0], Draft) and drafts[0].tokens.tolist() == [1, 2, 3, 4]
    assert winners == [full, None] and drafts[1] is None
    dec._settle(a, full, "Fixed", 4, [1, 2, 9], 2)
    assert ("accept", 0, 2, False) in p.log and ("begin", 1) in p.log
    bad = SpecDecoder(_StubCtx(), [as_proposer(Fixed([1, 99]))])
    c = bad.add(0, [1], sampler)
    with pytest.raises(ValueError, match="outside"):
        bad._draft([c])
    safe = SpecDecoder(_StubCtx(), [as_proposer(Fixed([1, 99]))], safe_drafts=True)  # the server's
    assert safe._draft([safe.add(0, [1], sampler)])[0] == [None]
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
