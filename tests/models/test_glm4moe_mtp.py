"""GLM-4 MoE's NextN (MTP) block: the block as its own graph against the fixture's reference
(built from transformers' modules by scripts/make_decoder_fixtures.py), and draft-mtp
speculation that reproduces plain greedy decoding exactly."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast._loader import native
from pyfast.models import Model
from tests.models.test_decoder_tiny import TOL, converted, rel_err  # noqa: F401  (fixture)


def test_nextn_block_matches_reference(converted):  # noqa: F811
    from pyfast.memory.kv_cache import KVCache
    from pyfast.models import BatchShape, glm4moe
    from pyfast.models.base import GraphBuilder

    path, ref = converted["glm4moe"]
    model = Model(path)
    a = model.args
    assert a.n_nextn == 1 and a.n_layer == 3 and a.n_dense_lead == 1
    model.weights.check(glm4moe.nextn_tensors(a), model.path)
    pool = native.ThreadPool(2)

    def run(kv, toks, pos, h):
        T = len(toks)
        slots = kv.prepare(np.zeros(T, dtype=np.int32), np.asarray(pos, dtype=np.int32))
        b = GraphBuilder(model.weights, BatchShape(T, slots.n_kv, T), kv)
        b.g.output(glm4moe.build_nextn(b, a), "logits")
        plan = native.Plan(b.g, pool)
        for k, v in (("tokens", np.asarray(toks, dtype=np.int32)), ("pos", np.asarray(pos, dtype=np.int32)),
                     ("out_ids", np.arange(T, dtype=np.int32)), ("kv_idx", slots.rows), ("mask", slots.mask),
                     ("kv_order", slots.order), ("h", np.asarray(h, dtype=np.float32))):
            plan.set_input(k, v)
        plan.run()
        return plan.output("logits"), plan.output("hidden")

    for s in (0, 1):
        toks, h = ref[f"tokens_{s}"], ref[f"mtp_h_in_{s}"]
        T = toks.size
        lg, hid = run(KVCache(1, 64, a.n_head_kv, a.head_dim, native.DType.F32), toks, range(T), h)
        assert rel_err(lg, ref[f"mtp_logits_{s}"]) < TOL and rel_err(hid, ref[f"mtp_hidden_{s}"]) < TOL
        kv = KVCache(1, 64, a.n_head_kv, a.head_dim, native.DType.F32)
        rows = [run(kv, toks[t:t + 1], [t], h[t:t + 1])[0] for t in range(T)]
        assert rel_err(np.concatenate(rows), ref[f"mtp_logits_{s}"]) < TOL


def test_trunk_hidden_matches_reference(converted):  # noqa: F811
    from pyfast.context import Context

    path, ref = converted["glm4moe"]
    ctx = Context(Model(path), n_ctx=64, n_threads=2, kv_dtype=native.DType.F32, export_hidden=True)
    ctx.decode(ref["tokens_0"], logits="all")
    assert rel_err(ctx.last_hidden, ref["hidden_0"]) < TOL


@pytest.mark.parametrize("types", ["draft-mtp", "ngram-simple,draft-mtp"])
def test_draft_mtp_greedy_is_lossless(converted, types):  # noqa: F811
    from pyfast.llm import LLM
    from pyfast.spec import SpecConfig

    path, ref = converted["glm4moe"]
    prompts = [ref["tokens_0"].tolist(), ref["tokens_1"].tolist(), ref["tokens_0"][:4].tolist() * 2]
    plain = LLM(path, n_ctx=256, n_threads=2)
    want = [plain.generate(p, max_tokens=24, temperature=0, ignore_eos=True).tokens for p in prompts]
    for dm in (2, 3):
        llm = LLM(path, n_ctx=256, n_threads=2, speculative=SpecConfig(types=types, draft_max=dm, ngram_n=1))
        assert llm.ctx.export_hidden
        for p, w in zip(prompts, want):
            res = llm.generate(p, max_tokens=24, temperature=0, ignore_eos=True)
            assert res.tokens == w
        got = llm.generate_batch(prompts, max_tokens=24, temperature=0, ignore_eos=True)
        assert [r.tokens for r in got] == want
        st = llm.spec_stats
        # random MTP weights rarely agree with the trunk: every rejected draft is rolled back
        assert st.by_proposer["draft-mtp"].drafted > 0 and st.accepted <= st.drafted
