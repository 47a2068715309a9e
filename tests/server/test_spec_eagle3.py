"""The server with ``--spec-type draft-eagle3`` (target feature capture through the engine's shared
decodes): on the tiny hybrid Qwen3.5 fixture with a random EAGLE-3 head, several sampling
requests at once give the same text and the same draft / accepted counts as ``LLM.generate``."""
from __future__ import annotations

import asyncio

import pytest

from tests.server.helpers import ThreadServer, server_threads
from tests.server.test_spec_round import PROMPTS, _compare, _post_all
from tests.spec.eagle3_helpers import convert, make_eagle3


@pytest.fixture(scope="module")
def head(hybrid_path, tmp_path_factory):
    from pyfast.models import Model

    m = Model(hybrid_path)
    td = tmp_path_factory.mktemp("e3srv")
    make_eagle3(td / "hf", n_vocab=m.n_vocab, target_n_embd=m.args.n_embd, layers=None, n_vocab_draft=120,
                seed=9, scale=3.0)
    return convert(td / "hf", td / "head.gguf")


def test_draft_eagle3_sampling_equals_llm(hybrid_path, head):
    from pyfast.llm import LLM
    from pyfast.server.app import create_app
    from pyfast.server.engine import Engine, EngineConfig
    from pyfast.server.spec import SpecConfig as ServerSpec
    from pyfast.spec import SpecConfig

    llm = LLM(hybrid_path, n_ctx=512, n_threads=1,
              speculative=SpecConfig(types="eagle3", draft_model=str(head), draft_max=3))
    reqs = [dict(prompt=p, max_tokens=32, temperature=1.5, top_k=30, top_p=1.0, min_p=0.0, seed=7 + i,
                 ignore_eos=True) for i, p in enumerate(PROMPTS + PROMPTS[:1])]
    want = [llm.generate(r["prompt"], max_tokens=r["max_tokens"], temperature=r["temperature"], top_k=r["top_k"],
                         top_p=r["top_p"], min_p=r["min_p"], seed=r["seed"], ignore_eos=True) for r in reqs]
    engine = Engine(EngineConfig(model=str(hybrid_path), n_parallel=3, n_ctx=3 * 512, n_threads=server_threads(),
                                 spec=ServerSpec(spec_type="eagle3", draft_model=str(head), n_max=3)))
    assert engine.ctx.capture_layers and not engine.ctx.export_hidden
    with ThreadServer(create_app(engine)) as srv:
        got = asyncio.run(_post_all(srv.url, reqs))
    _compare(got, want)
    for s in engine.slots:
        assert engine.ctx.seq_len(s.id) == len(s.tokens)
