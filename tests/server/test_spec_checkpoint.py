"""Context checkpoints keep the proposers' state (``Proposer.save_state``): on the tiny hybrid
Qwen3.5 fixture, a request that restores a checkpoint (its prompt branches off a long earlier
reply) drafts exactly as a fresh server slot fed the same prompt: the same draft tokens, draft
logits within 1e-4, no pair or carry written without its target row (``n_lost``). The EAGLE-3
head needs the deferred feature row and the MTP block its carry (both long gone from their
windows after a 72-token reply); a DSpark drafter's own cache holds everything it needs."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast.sampling import SamplingParams
from tests.server.helpers import server_threads

KINDS = ["draft-eagle3", "draft-mtp", "draft-dspark"]


@pytest.fixture(scope="module")
def drafters(hybrid_path, tmp_path_factory):
    from pyfast.convert.dflash import convert_draft
    from pyfast.models import Model
    from tests.spec.dflash_helpers import make_hf_drafter
    from tests.spec.eagle3_helpers import convert, make_eagle3

    m = Model(hybrid_path)
    a = m.args
    td = tmp_path_factory.mktemp("ckpt_spec")
    make_eagle3(td / "e3", n_vocab=m.n_vocab, target_n_embd=a.n_embd, layers=None, n_vocab_draft=120, seed=9,
                scale=3.0)
    hf = make_hf_drafter(td / "ds", "deepspec", n_vocab=m.n_vocab, target_n_embd=a.n_embd,
                         target_layers=[0, a.n_layer - 1], n_target_layers=a.n_layer, markov_rank=8, block=6, seed=5)
    convert_draft(hf, td / "ds.gguf")
    return {"draft-eagle3": str(convert(td / "e3", td / "e3.gguf")), "draft-mtp": None,
            "draft-dspark": str(td / "ds.gguf")}


def _engine(path, kind, gguf):
    from pyfast.server.engine import Engine, EngineConfig
    from pyfast.server.spec import SpecConfig as ServerSpec

    engine = Engine(EngineConfig(model=str(path), n_parallel=1, n_ctx=512, n_threads=server_threads(),
                                 spec=ServerSpec(spec_type=kind, draft_model=gguf, n_max=3)))
    prop = next(p for p in engine.decoder.proposers if p.name == kind)
    return engine, prop


def _run(engine, prompt, n):
    from pyfast.server.engine import GenParams, Job

    job = Job(prompt, GenParams(max_tokens=n, sampling=SamplingParams(temperature=0), ignore_eos=True))
    engine.submit([job])
    while engine.step():
        pass
    assert job.finished
    return job


@pytest.mark.parametrize("kind", KINDS)
def test_drafts_after_a_checkpoint_restore_equal_a_fresh_slot(hybrid_path, drafters, kind):
    engine, prop = _engine(hybrid_path, kind, drafters[kind])
    rng = np.random.default_rng(4)
    p1 = rng.integers(3, engine.n_vocab, 24).tolist()
    _run(engine, p1, 72)  # the reply outruns the 64-row feature window of the EAGLE-3 head
    lost = prop.n_lost
    p2 = p1[:22] + [(p1[22] + 1) % engine.n_vocab] + rng.integers(3, engine.n_vocab, 5).tolist()
    prop.trace = []
    job = _run(engine, p2, 16)
    # the slot held 95 tokens; p2 branches at 22: the checkpoint 4 tokens before p1's end serves
    assert engine.metrics.checkpoints_restored.value() == 1
    assert job.stats.n_cached == len(p1) - 4

    fresh, fprop = _engine(hybrid_path, kind, drafters[kind])
    fprop.trace = []
    want = _run(fresh, p2, 16)
    assert job.out == want.out
    assert (job.stats.n_drafted, job.stats.n_accepted) == (want.stats.n_drafted, want.stats.n_accepted)
    assert len(prop.trace) == len(fprop.trace) > 0
    for a, b in zip(prop.trace, fprop.trace):
        x, y = np.asarray(a["logits"], np.float64), np.asarray(b["logits"], np.float64)
        assert x.shape == y.shape
        assert np.abs(x - y).max() <= 1e-4 * max(1.0, np.abs(y).max()), "draft logits after the restore differ"
    assert fprop.n_lost == 0 and prop.n_lost == lost, "a row written without its target features"
