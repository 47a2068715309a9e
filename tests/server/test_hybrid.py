"""``pyfast serve`` on a hybrid model (the tiny Qwen3.5 fixture: Gated-DeltaNet layers with a
recurrent state next to an attention layer). Served greedy output must equal ``pyfast.LLM``'s for
the same prompt, alone or under concurrency; the prompt cache must work although recurrent state
cannot be truncated: a prompt that extends the slot's state continues it, one that diverges
earlier restores the newest context checkpoint before the divergence (and only the rest is
decoded), and speculative drafts roll back through snapshot planes or save / restore / replay.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server.helpers import ServerProcess, ThreadServer, metric, no_leaks, server_threads

openai = pytest.importorskip("openai")

MAX_TOKENS = 12
SYSTEM = "You are a terse assistant for the hybrid model tests."


@pytest.fixture(scope="module")
def oa(hybrid_server):
    return openai.OpenAI(base_url=hybrid_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _metrics(srv) -> str:
    return httpx.get(srv.url + "/metrics", timeout=30).text


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_models_reports_hybrid(hybrid_server):
    meta = httpx.get(hybrid_server.url + "/v1/models", timeout=30).json()["data"][0]["meta"]
    assert meta["recurrent"] is True and meta["ctx_checkpoints"] == 8 and meta["n_rollback"] == 0


def test_chat_and_completion_equal_llm(oa, hybrid_server, hybrid_llm):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three colors."}]
    want = hybrid_llm.chat(msgs, max_tokens=MAX_TOKENS, temperature=0)
    with no_leaks(hybrid_server.url):
        r = oa.chat.completions.create(model="qwen35", messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].message.content == want.text
        assert r.usage.prompt_tokens == len(want.prompt_tokens)
        assert r.usage.completion_tokens == len(want.tokens)
        chunks = oa.chat.completions.create(model="qwen35", messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text

        prompt = "The lighthouse keeper climbed the stairs and"
        want = hybrid_llm.generate(prompt, max_tokens=MAX_TOKENS, temperature=0)
        r = oa.completions.create(model="qwen35", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == want.text
        chunks = oa.completions.create(model="qwen35", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text


async def _post_all(url: str, path: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        rs = await asyncio.gather(*(c.post(path, json=b) for b in bodies))
    for r in rs:
        assert r.status_code == 200, r.text
    return [r.json() for r in rs]


def test_concurrent_requests_equal_solo(hybrid_server, hybrid_llm):
    prompts = [f"Request number {i}: write about {topic}" for i, topic in
               enumerate(["rivers", "stone walls", "maple trees", "candles", "tigers", "clouds"])]
    want = [hybrid_llm.generate(p, max_tokens=MAX_TOKENS + 4 * i, temperature=0).text for i, p in enumerate(prompts)]
    bodies = [{"prompt": p, "max_tokens": MAX_TOKENS + 4 * i, "temperature": 0} for i, p in enumerate(prompts)]
    with no_leaks(hybrid_server.url):
        got = asyncio.run(_post_all(hybrid_server.url, "/v1/completions", bodies))
    assert [g["choices"][0]["text"] for g in got] == want


def test_turns_continue_or_restore_a_checkpoint(hybrid_server, hybrid_llm):
    """Token-level turns: the reply's tokens go back verbatim, so the cache behaviour is exact."""
    tok = hybrid_llm.tokenize
    p1 = tok("<|im_start|>user\nA story about a lighthouse keeper, please: he climbs, he counts, he "
             "writes the weather in a book.<|im_end|>\n<|im_start|>assistant\n")
    x = tok("<|im_end|>\n<|im_start|>user\nWhat does he count every evening?<|im_end|>\n<|im_start|>assistant\n")
    y = tok("Continue the story with the storm that came in the night.")
    assert x[0] != y[0] and len(x) > 8

    def run(prompt):
        return httpx.post(hybrid_server.url + "/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()

    r1 = run(p1)
    g1 = hybrid_llm.generate(p1, max_tokens=8, temperature=0, ignore_eos=True).tokens
    assert r1["choices"][0]["text"] == hybrid_llm.detokenize(g1)
    held = len(p1) + len(g1) - 1  # the last sampled token is not decoded

    # turn 2 extends everything the slot holds: only the new tokens are decoded
    t2 = p1 + g1 + x
    m0 = _metrics(hybrid_server)
    r2 = run(t2)
    m1 = _metrics(hybrid_server)
    assert r2["choices"][0]["text"] == hybrid_llm.generate(t2, max_tokens=8, temperature=0, ignore_eos=True).text
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == held
    assert r2["timings"]["prompt_n"] == len(t2) - held
    assert metric(m1, "pyfast_prompt_tokens_processed_total") - metric(m0, "pyfast_prompt_tokens_processed_total") \
        == len(t2) - held
    assert metric(m1, "pyfast_prompt_tokens_reprocessed_total") == metric(m0, "pyfast_prompt_tokens_reprocessed_total")
    assert metric(m1, "pyfast_checkpoints_restored_total") == metric(m0, "pyfast_checkpoints_restored_total")

    # turn 2': branches right after the first reply, before the end of the slot's state: the
    # checkpoint taken at the end of that reply is restored and only the rest decoded
    t3 = p1 + g1 + y
    r3 = run(t3)
    m2 = _metrics(hybrid_server)
    assert r3["choices"][0]["text"] == hybrid_llm.generate(t3, max_tokens=8, temperature=0, ignore_eos=True).text
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == held
    assert r3["timings"]["prompt_n"] == len(t3) - held
    assert metric(m2, "pyfast_checkpoints_restored_total") - metric(m1, "pyfast_checkpoints_restored_total") == 1
    # the common prefix was held + 1 tokens (all of g1): one of them is decoded again
    assert metric(m2, "pyfast_prompt_tokens_reprocessed_total") - \
        metric(m1, "pyfast_prompt_tokens_reprocessed_total") == 1

    # the same prompt again: the whole prompt matches, the checkpoint 4 tokens before its end serves
    r4 = run(t3)
    assert r4["choices"][0]["text"] == r3["choices"][0]["text"]
    assert r4["usage"]["prompt_tokens_details"]["cached_tokens"] == len(t3) - 4
    assert r4["timings"]["prompt_n"] == 4


def test_chat_second_turn_branch_restores_checkpoint(oa, hybrid_server, hybrid_llm):
    """A conversation, then the same system and first user message with a different second turn:
    the common prefix is shorter than the slot's state, so the newest checkpoint before it (4
    tokens before the first turn's prompt end) is restored and the prompt decoded from there."""
    def render(msgs):
        return hybrid_llm.tokenize(hybrid_llm.apply_chat_template(msgs))

    def ask(msgs):
        return oa.chat.completions.create(model="qwen35", messages=msgs, max_tokens=8, temperature=0)

    base = [{"role": "system", "content": "You keep the lighthouse log. " * 3},
            {"role": "user", "content": "Describe the evening routine of the keeper in detail."}]
    r1 = ask(base)
    n1 = r1.usage.prompt_tokens
    g1 = hybrid_llm.chat(base, max_tokens=8, temperature=0)
    assert r1.choices[0].message.content == g1.text and n1 == len(g1.prompt_tokens)

    turn = base + [{"role": "assistant", "content": "He climbs the stairs and lights the lamp."}]
    m2 = turn + [{"role": "user", "content": "How many steps does the spiral staircase have?"}]
    m3 = turn + [{"role": "user", "content": "Which weather did he write in the book last night?"}]
    p1, p2, p3 = render(base), render(m2), render(m3)
    held1 = n1 + len(g1.tokens) - 1
    # the fixed assistant reply is not what the model said: the state cannot continue
    assert n1 - 4 <= common_prefix(p1 + g1.tokens, p2) < held1

    m0 = _metrics(hybrid_server)
    r2 = ask(m2)
    assert r2.choices[0].message.content == hybrid_llm.chat(m2, max_tokens=8, temperature=0).text
    assert r2.usage.prompt_tokens_details.cached_tokens == n1 - 4

    m1 = _metrics(hybrid_server)
    r3 = ask(m3)
    m_3 = _metrics(hybrid_server)
    assert r3.choices[0].message.content == hybrid_llm.chat(m3, max_tokens=8, temperature=0).text
    lcp = common_prefix(p2, p3)
    assert n1 <= lcp < len(p2) - 4  # diverges inside the second user message
    assert r3.usage.prompt_tokens_details.cached_tokens == n1 - 4
    raw = httpx.post(hybrid_server.url + "/v1/chat/completions", timeout=120,
                     json={"messages": m3, "max_tokens": 8, "temperature": 0}).json()  # same prompt again
    assert raw["timings"]["prompt_n"] == 4  # its own checkpoint 4 tokens before its end
    assert metric(m1, "pyfast_checkpoints_restored_total") - metric(m0, "pyfast_checkpoints_restored_total") == 1
    assert metric(m_3, "pyfast_checkpoints_restored_total") - metric(m1, "pyfast_checkpoints_restored_total") == 1
    assert metric(m_3, "pyfast_prompt_tokens_reprocessed_total") - \
        metric(m1, "pyfast_prompt_tokens_reprocessed_total") == lcp - (n1 - 4)
    assert metric(m_3, "pyfast_checkpoints_created_total") > 0
    assert metric(m_3, "pyfast_checkpoints") > 0 and metric(m_3, "pyfast_checkpoint_bytes") > 0


SPEC_PROMPTS = ["def fibonacci(n):", "Copy: apple, river, stone, apple, river, stone, apple, river,",
                "The capital of France is"]


def test_ngram_speculation_via_cli(hybrid_path, hybrid_llm):
    spec = pytest.importorskip("pyfast.spec")
    if "ngram-simple" not in getattr(spec, "SPEC_TYPES", ()):
        pytest.skip("pyfast.spec has no ngram-simple proposer")
    want = [hybrid_llm.generate(p, max_tokens=64, temperature=0).text for p in SPEC_PROMPTS]
    with ServerProcess("-m", str(hybrid_path), "--parallel", "3", "--ctx-size", str(3 * 512),
                       "--spec-type", "ngram-simple", "--draft-max", "4") as srv:
        meta = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["meta"]
        assert meta["speculative"] is True and meta["n_rollback"] == 4
        bodies = [{"prompt": p, "max_tokens": 64, "temperature": 0} for p in SPEC_PROMPTS]
        got = asyncio.run(_post_all(srv.url, "/v1/completions", bodies))
        assert [g["choices"][0]["text"] for g in got] == want
        drafted = sum(g["timings"]["draft_n"] for g in got)
        accepted = sum(g["timings"]["draft_n_accepted"] for g in got)
        assert drafted > 0 and 0 < accepted < drafted  # some rejected drafts rolled back
        m = _metrics(srv)
        assert metric(m, "pyfast_spec_draft_tokens_total") == drafted
        assert metric(m, "pyfast_spec_accepted_tokens_total") == accepted
        assert metric(m, "pyfast_spec_state_restores_total") == 0  # the planes reach every draft


class WrongAfterTwo:
    """Drafts the reference continuation with its third token replaced: two accepted, then a
    rejection that removes more tokens than one snapshot plane reaches."""

    name = "wrong-after-two"
    default_n_max = 4

    def __init__(self, refs: dict[tuple, list[int]], n_vocab: int):
        self.refs, self.n_vocab, self.seqs = refs, n_vocab, {}

    def begin(self, seq, prompt):
        self.seqs[seq] = (self.refs.get(tuple(int(t) for t in prompt), []), len(prompt))

    def draft(self, requests):
        out = []
        for r in requests:
            cont, n_prompt = self.seqs[r.seq]
            d = list(cont[len(r.tokens) - n_prompt: len(r.tokens) - n_prompt + r.n_max])
            if len(d) >= 3:
                d[2] = (d[2] + 1) % self.n_vocab
            out.append(d or None)
        return out

    def accept(self, seq, k, other=False):
        pass

    def process(self, batch):
        pass

    def end(self, seq):
        self.seqs.pop(seq, None)


def test_long_drafts_save_restore_and_replay(hybrid_path, hybrid_llm):
    """One snapshot plane (n_rollback=1) but drafts of 4: rejected drafts restore the state saved
    before the verify decode and replay the accepted tokens; output is unchanged."""
    from pyfast.server.app import create_app
    from pyfast.server.engine import Engine, EngineConfig
    from pyfast.server.spec import SpecConfig

    prompts = SPEC_PROMPTS[:2]
    refs = {tuple(r.prompt_tokens): list(r.tokens) + [0] * 8 for r in
            (hybrid_llm.generate(p, max_tokens=24, temperature=0, ignore_eos=True) for p in prompts)}
    want = [hybrid_llm.generate(p, max_tokens=24, temperature=0, ignore_eos=True).text for p in prompts]
    engine = Engine(EngineConfig(model=str(hybrid_path), n_parallel=2, n_ctx=2 * 256, n_threads=server_threads(),
                                 spec=SpecConfig(n_max=4), n_rollback=1),
                    proposers=[WrongAfterTwo(refs, hybrid_llm.n_vocab)])
    assert engine.ctx.n_rollback == 1
    with ThreadServer(create_app(engine)) as srv:
        bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True} for p in prompts]
        got = asyncio.run(_post_all(srv.url, "/v1/completions", bodies))
        assert [g["choices"][0]["text"] for g in got] == want
        for g in got:
            assert 0 < g["timings"]["draft_n_accepted"] < g["timings"]["draft_n"]
        m = _metrics(srv)
        restores = metric(m, "pyfast_spec_state_restores_total")
        assert restores > 0
        assert restores <= metric(m, "pyfast_spec_replayed_tokens_total") <= 3 * restores

        # the slot's cache stays consistent: a follow-up turn continues from it
        t2 = hybrid_llm.tokenize(prompts[0]) + list(refs[tuple(hybrid_llm.tokenize(prompts[0]))][:24]) + [65, 66, 67]
        r = httpx.post(srv.url + "/v1/completions", timeout=120,
                       json={"prompt": t2, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
        assert r["choices"][0]["text"] == hybrid_llm.generate(t2, max_tokens=8, temperature=0, ignore_eos=True).text
        assert r["timings"]["prompt_n"] == 4
    for s in engine.slots:
        assert engine.ctx.seq_len(s.id) == len(s.tokens)


def test_without_checkpoints_diverging_prompts_start_over(hybrid_path, hybrid_llm):
    """--ctx-checkpoints 0: a prompt that extends the state still continues it; one that diverges
    inside it is decoded from scratch (never an error)."""
    from pyfast.server.app import create_app
    from pyfast.server.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(hybrid_path), n_parallel=1, n_ctx=512, n_threads=server_threads(),
                                 n_checkpoints=0))
    p1 = hybrid_llm.tokenize("Once upon a time, in a small village by the sea, there lived")
    assert p1[-3] != 70
    g1 = hybrid_llm.generate(p1, max_tokens=6, temperature=0, ignore_eos=True).tokens
    with ThreadServer(create_app(engine)) as srv:
        def run(prompt):
            return httpx.post(srv.url + "/v1/completions", timeout=120,
                              json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}).json()

        assert run(p1)["choices"][0]["text"] == hybrid_llm.detokenize(g1)
        for prompt, cached in ((p1 + g1 + [65, 66], len(p1) + len(g1) - 1), (p1[:-3] + [70, 71], 0), (p1, 0)):
            r = run(prompt)
            assert r["choices"][0]["text"] == hybrid_llm.generate(prompt, max_tokens=6, temperature=0,
                                                                  ignore_eos=True).text
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        m = _metrics(srv)
    assert metric(m, "pyfast_checkpoints_created_total") == 0
    # each diverging request had len(p1) - 3 tokens in common with the slot's state
    assert metric(m, "pyfast_prompt_tokens_reprocessed_total") == 2 * (len(p1) - 3)


def test_mtp_drafts_match_llm(hybrid_path):
    """draft-mtp in the server: the target exports hidden rows, each process() gets exactly its
    batch's rows, so the MTP drafts (random weights: rarely accepted) are the very drafts
    ``pyfast.LLM`` makes for the same prompts, and outputs equal plain decoding."""
    mtp = pytest.importorskip("pyfast.spec.mtp")
    from pyfast.llm import LLM
    from pyfast.models import Model
    from pyfast.server.app import create_app
    from pyfast.server.engine import Engine, EngineConfig
    from pyfast.server.spec import SpecConfig as ServerSpec
    from pyfast.spec import SpecConfig

    class Recording(mtp.MTPProposer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.log, self.prompts = {}, {}

        def begin(self, seq, prompt):
            super().begin(seq, prompt)
            self.prompts[seq] = tuple(int(t) for t in prompt)

        def draft(self, requests):
            out = super().draft(requests)
            for r, d in zip(requests, out):
                self.log[(self.prompts[r.seq], len(r.tokens))] = None if d is None else d.tokens.tolist()
            return out

    n_gen = 24
    ref_prop = Recording(Model(hybrid_path), n_ctx=512)
    llm = LLM(hybrid_path, n_ctx=512, n_threads=1, speculative=SpecConfig(types=[ref_prop], draft_max=3))
    want = [llm.generate(p, max_tokens=n_gen, temperature=0, ignore_eos=True) for p in SPEC_PROMPTS]
    plain = [llm.generate(p, max_tokens=n_gen, temperature=0, ignore_eos=True, speculative=False).text
             for p in SPEC_PROMPTS]
    assert [w.text for w in want] == plain

    srv_prop = Recording(Model(hybrid_path), n_ctx=3 * 256)
    engine = Engine(EngineConfig(model=str(hybrid_path), n_parallel=3, n_ctx=3 * 256, n_threads=server_threads(),
                                 spec=ServerSpec(n_max=3)), proposers=[srv_prop])
    assert engine.ctx.export_hidden and engine.ctx.n_rollback == 3
    with ThreadServer(create_app(engine)) as srv:
        bodies = [{"prompt": p, "max_tokens": n_gen, "temperature": 0, "ignore_eos": True} for p in SPEC_PROMPTS]
        got = asyncio.run(_post_all(srv.url, "/v1/completions", bodies))
    assert [g["choices"][0]["text"] for g in got] == plain
    assert sum(g["timings"]["draft_n"] for g in got) == sum(w.spec.drafted for w in want) > 0
    assert srv_prop.log == ref_prop.log
    assert srv_prop.n_lost == 0

    # --spec-type draft-mtp builds the same wiring
    engine = Engine(EngineConfig(model=str(hybrid_path), n_parallel=2, n_ctx=2 * 256, n_threads=server_threads(),
                                 spec=ServerSpec(spec_type="draft-mtp")))
    assert engine.ctx.export_hidden and engine.ctx.n_rollback == 3
    assert any(isinstance(p, mtp.MTPProposer) for p in engine.spec.proposers)
