"""``pyfast serve`` on the tiny DSA models (``tests/fixtures/deepseek``, converted here): with
``--spec-type draft-mtp`` and the prompt cache, greedy answers equal ``pyfast.LLM``'s plain
decoding, a prompt extending an earlier conversation reuses the slot's cached tokens (its MLA rows
and indexer keys), and ``--dsa off`` / ``--dsa-top-k`` reach the model."""
from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.server.helpers import ThreadServer, server_threads

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "deepseek"


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def dsa_path(request, tmp_path_factory):
    from pyfast._loader import native
    from pyfast.convert import convert

    if not hasattr(native.Graph(), "topk_mask"):
        pytest.skip("native lacks topk_mask")
    hf = FIXTURES / "hf" / request.param
    if not hf.is_dir():
        pytest.skip(f"fixture {hf} not present")
    out = tmp_path_factory.mktemp(request.param) / "model.gguf"
    convert(hf, out)
    return out


def test_draft_mtp_with_prompt_cache_equals_llm(dsa_path):
    from pyfast.llm import LLM
    from pyfast.server.app import create_app
    from pyfast.server.engine import Engine, EngineConfig
    from pyfast.server.spec import SpecConfig as ServerSpec

    z = np.load(FIXTURES / f"{dsa_path.parent.name[:-1]}.npz")  # tmp dirs are named <fixture>0
    p1 = z["tokens_0"].tolist()
    llm = LLM(dsa_path, n_ctx=512, n_threads=1)
    g1 = llm.generate(p1, max_tokens=8, temperature=0, ignore_eos=True).tokens
    engine = Engine(EngineConfig(model=str(dsa_path), n_parallel=2, n_ctx=2 * 256, n_threads=server_threads(),
                                 spec=ServerSpec(spec_type="draft-mtp", n_max=3)))
    assert engine.ctx.export_hidden

    def run(srv, prompt):
        r = httpx.post(srv.url + "/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
        return r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"], r["timings"]

    with ThreadServer(create_app(engine)) as srv:
        text, cached, t = run(srv, p1)
        assert text == llm.detokenize(g1) and cached == 0 and t["draft_n"] > 0
        longer = p1 + g1 + [65, 66]
        text, cached, _ = run(srv, longer)
        assert text == llm.generate(longer, max_tokens=8, temperature=0, ignore_eos=True).text
        assert cached >= len(p1)


def test_dsa_flags_reach_the_model(dsa_path):
    from pyfast.cli import dsa_kwargs
    from pyfast.llm import LLM
    import argparse

    from pyfast.server.main import add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    a = p.parse_args(["-m", str(dsa_path), "--dsa", "off", "--dsa-top-k", "7"])
    assert dsa_kwargs(a) == {"dsa": False, "dsa_top_k": 7}
    llm = LLM(dsa_path, n_ctx=256, n_threads=1, **dsa_kwargs(a))
    assert llm.model.args.extra["dsa_on"] is False and llm.model.args.extra["idx_top_k"] == 7
    with pytest.raises(ValueError, match="top-k"):
        LLM(dsa_path, n_ctx=256, n_threads=1, dsa_top_k=0)
