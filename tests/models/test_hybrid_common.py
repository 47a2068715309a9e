"""Shared helpers of the tiny hybrid (Gated-DeltaNet) model tests (no tests here).

Fixtures: ``tests/fixtures/hybrid/<name>.gguf`` (tiny random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next
converted by ``pyfast.convert``) and ``<name>.npz`` (transformers references in float64, see
``scripts/make_hybrid_fixtures.py``). ``PYFAST_HYBRID_FIXTURES`` points elsewhere.

Error measure: ``rel_err(a, b) = max over rows of max|a - b| / max|b|`` (b the reference row).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from pyfast._loader import native

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(os.environ.get("PYFAST_HYBRID_FIXTURES", ROOT / "tests" / "fixtures" / "hybrid"))
NAMES = ("qwen35", "qwen35moe", "qwen3next", "qwen35kv2")  # qwen35kv2: 2 KV heads (the others have 1)
TOL = 1e-3          # vs the float64 transformers reference
TOL_SELF = 1e-5     # our own runs compared with each other (rollback / restore)


def fixture(name: str) -> tuple[Path, dict]:
    gguf, npz = FIXTURES / f"{name}.gguf", FIXTURES / f"{name}.npz"
    if not gguf.exists() or not npz.exists():
        pytest.skip(f"hybrid fixture {gguf} / {npz} not present")
    z = np.load(npz)
    return gguf, {k: z[k] for k in z.files}


def has_ops(*names: str) -> bool:
    g = native.Graph()
    return all(hasattr(g, n) for n in names)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Largest per-row relative error: max_rows(max|a - b| / max|b|)."""
    a = np.atleast_2d(np.asarray(a, dtype=np.float64))
    b = np.atleast_2d(np.asarray(b, dtype=np.float64))
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)).max())


DEVICE: list = [None]  # the device contexts are made on (on_device); None: the CPU


class on_device:
    """Within the block, make_ctx builds contexts on `device` (a name or an opened Device)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        DEVICE.append(self.device)

    def __exit__(self, *exc):
        DEVICE.pop()


def make_ctx(model, **kw):
    from pyfast.context import Context

    kw.setdefault("device", DEVICE[-1])
    kw.setdefault("n_ctx", 128)
    kw.setdefault("n_threads", 2)
    kw.setdefault("kv_dtype", native.DType.F32)
    return Context(model, **kw)


ERRS: dict[tuple[str, str], float] = {}   # (model, mode) -> measured max relative error


def record(name: str, mode: str, err: float) -> float:
    ERRS[(name, mode)] = max(err, ERRS.get((name, mode), 0.0))
    return err


# --- checks shared by the hybrid architectures (parametrized in test_hybrid_tiny.py) ---
def load(name: str):
    from pyfast.models import Model

    path, ref = fixture(name)
    return Model(path), ref


def check_prefill(name: str, chunk_min: int | None = None, n_ubatch: int = 512) -> float:
    """Whole sequences in one batch (or split in micro-batches) vs the reference logits."""
    model, ref = load(name)
    if chunk_min is not None:
        model.args.chunk_min = chunk_min
    err = 0.0
    for s in (0, 1):
        got = make_ctx(model, n_ubatch=n_ubatch).decode(ref[f"tokens_{s}"], logits="all")
        err = max(err, rel_err(got, ref[f"logits_{s}"]))
    return err


def check_prefill_isas(name: str) -> float:
    """check_prefill and check_decode under every CPU ISA (scalar reference and the best one)."""
    best = native.cpu_best_isa()
    old = native.cpu_isa()
    err = 0.0
    try:
        for isa in dict.fromkeys(["scalar", best]):
            native.set_cpu_isa(isa)
            err = max(err, check_prefill(name), check_decode(name))
    finally:
        native.set_cpu_isa(old)
    return err


def check_decode(name: str) -> float:
    """Token by token from an empty context."""
    model, ref = load(name)
    toks = ref["tokens_0"]
    ctx = make_ctx(model)
    got = np.concatenate([ctx.decode([t], logits="last") for t in toks])
    return max(rel_err(got, ref["logits_0"]), rel_err(got, ref["decode_logits_0"]))


def check_prefill_then_decode(name: str) -> float:
    """Prefill n_prefill tokens, then one at a time; then again with uneven chunks."""
    model, ref = load(name)
    toks, n0 = ref["tokens_0"], int(ref["n_prefill"])
    ctx = make_ctx(model)
    got = [ctx.decode(toks[:n0], logits="all")] + [ctx.decode([t]) for t in toks[n0:]]
    err = rel_err(np.concatenate(got), ref["decode_logits_0"])
    ctx = make_ctx(model)
    got, i = [], 0
    for n in (4, 1, 3, 2, 3):
        got.append(ctx.decode(toks[i:i + n], logits="all"))
        i += n
    assert i == toks.size
    return max(err, rel_err(np.concatenate(got), ref["logits_0"]))


def check_two_sequences(name: str) -> float:
    """Both sequences in one batch with interleaved rows, then a step of one token each."""
    model, ref = load(name)
    a, b = ref["tokens_0"], ref["tokens_1"]
    na, nb = a.size - 2, b.size - 1
    toks, seqs, pos = [], [], []
    for i in range(max(na, nb)):
        for s, t, n in ((3, a, na), (8, b, nb)):
            if i < n:
                toks.append(int(t[i]))
                seqs.append(s)
                pos.append(i)
    ctx = make_ctx(model)
    got = ctx.decode(toks, positions=pos, seq_ids=seqs, logits="all")
    seqs = np.asarray(seqs)
    err = max(rel_err(got[seqs == 3], ref["logits_0"][:na]), rel_err(got[seqs == 8], ref["logits_1"][:nb]))
    got2 = ctx.decode([b[nb], a[na]], positions=[nb, na], seq_ids=[8, 3], logits="all")
    err = max(err, rel_err(got2[0:1], ref["logits_1"][nb:nb + 1]), rel_err(got2[1:2], ref["logits_0"][na:na + 1]))
    got3 = ctx.decode([a[na + 1]], seq_ids=3, logits="all")   # positions follow the sequence
    return max(err, rel_err(got3, ref["logits_0"][na + 1:na + 2]))


def check_hidden(name: str) -> float:
    """export_hidden: post-final-norm rows of every row, in the caller's row order."""
    model, ref = load(name)
    a, b = ref["tokens_0"][:6], ref["tokens_1"][:5]
    toks = np.concatenate([b[:2], a, b[2:]])
    seqs = [1, 1] + [0] * 6 + [1, 1, 1]
    pos = [0, 1] + list(range(6)) + [2, 3, 4]
    ctx = make_ctx(model, export_hidden=True)
    lg = ctx.decode(toks, positions=pos, seq_ids=seqs, logits=[7, 0])
    h = ctx.last_hidden
    assert h.shape == (11, model.args.n_embd) and h.dtype == np.float32
    err = max(rel_err(h[2:8], ref["hidden_0"][:6]), rel_err(h[[0, 1, 8, 9, 10]], ref["hidden_1"][:5]))
    err = max(err, rel_err(lg[0:1], ref["logits_0"][5:6]), rel_err(lg[1:2], ref["logits_1"][0:1]))
    ctx.decode([a[0]], seq_ids=5)
    assert ctx.last_hidden.shape == (1, model.args.n_embd)
    return err


def _fresh(model, prefix, batches, R, **kw):
    ctx = make_ctx(model, n_rollback=R, **kw)
    ctx.decode(prefix, logits="none")
    out = None
    for bt in batches:
        out = ctx.decode(bt, logits="all")
    return ctx, out


def check_rollback(name: str, R: int = 3) -> float:
    """T2.3: decode R+1 tokens in one batch, roll back r (1..R), decode the same r tokens again:
    the logits equal a fresh run that never decoded them."""
    model, ref = load(name)
    toks = ref["tokens_0"]
    prefix, X = toks[:6], toks[6:6 + R + 1]
    err = 0.0
    for r in range(1, R + 1):
        ctx, _ = _fresh(model, prefix, [X], R)
        assert ctx.can_rollback(0) == R
        ctx.truncate(0, 6 + R + 1 - r)
        assert ctx.seq_len(0) == 6 + R + 1 - r
        again = ctx.decode(X[R + 1 - r:], logits="all")
        _, want = _fresh(model, prefix, [X[:R + 1 - r], X[R + 1 - r:]], R)
        err = max(err, rel_err(again, want))
        assert rel_err(again, ref["logits_0"][6 + R + 1 - r: 6 + R + 1]) < TOL
    # rolling back one token at a time adds up
    ctx, _ = _fresh(model, prefix, [X], R)
    for r in range(1, R + 1):
        ctx.truncate(0, 6 + R + 1 - r)
    again = ctx.decode(X[1:], logits="all")
    _, want = _fresh(model, prefix, [X[:1], X[1:]], R)
    return max(err, rel_err(again, want))


def check_save_restore(name: str, R: int = 3) -> float:
    """T2.3 after save -> restore, into a fresh context and into one whose other sequences hold
    rolled-back state; the other sequences are unaffected."""
    model, ref = load(name)
    toks, other = ref["tokens_0"], ref["tokens_1"]
    prefix, X = toks[:6], toks[6:6 + R + 1]
    r = 2
    ctx, _ = _fresh(model, prefix, [X], R)
    ctx.truncate(0, 6 + R + 1 - r)
    st = ctx.save_state(0)
    _, want = _fresh(model, prefix, [X[:R + 1 - r], X[R + 1 - r:]], R)
    fresh = make_ctx(model, n_rollback=R)
    fresh.restore_state(0, st)
    assert fresh.seq_len(0) == 6 + R + 1 - r
    err = rel_err(fresh.decode(X[R + 1 - r:], logits="all"), want)
    # a dirty context: two sequences rolled back, then the state restored under another id
    dirty = make_ctx(model, n_rollback=R)
    dirty.decode(np.concatenate([other[:4], other[:7]]), positions=list(range(4)) + list(range(7)),
                 seq_ids=[5] * 4 + [6] * 7, logits="none")
    dirty.truncate(5, 2)
    dirty.truncate(6, 4)
    dirty.restore_state(9, st)
    err = max(err, rel_err(dirty.decode(X[R + 1 - r:], seq_ids=9, logits="all"), want))
    got = dirty.decode(np.concatenate([other[2:5], other[4:6]]), positions=[2, 3, 4, 4, 5],
                       seq_ids=[5, 5, 5, 6, 6], logits="all")
    assert rel_err(got[:3], ref["logits_1"][2:5]) < TOL and rel_err(got[3:], ref["logits_1"][4:6]) < TOL
    # restoring over an existing sequence replaces it
    dirty.restore_state(5, st)
    err = max(err, rel_err(dirty.decode(X[R + 1 - r:], seq_ids=5, logits="all"), want))
    return err


def check_rollback_errors(name: str, R: int = 2) -> None:
    """T2.4: rolling back more than R, or the whole last batch, raises RollbackError and changes
    nothing; the context still decodes correctly afterwards."""
    from pyfast.context import RollbackError

    model, ref = load(name)
    toks = ref["tokens_0"]
    ctx = make_ctx(model, n_rollback=R)
    ctx.decode(toks[:5], logits="none")
    ctx.decode(toks[5:9], logits="none")                 # 4 tokens: R = 2 of them can go
    assert ctx.can_rollback(0) == 2
    with pytest.raises(RollbackError, match="sequence 0"):
        ctx.truncate(0, 6)                               # r = 3 > R
    assert ctx.seq_len(0) == 9 and ctx.kv.seq_len(0) == 9
    ctx.truncate(0, 8)
    with pytest.raises(RollbackError):
        ctx.truncate(0, 6)                               # 1 + 2 > R
    assert ctx.seq_len(0) == 8
    got = ctx.decode(toks[8:10], logits="all")
    assert rel_err(got, ref["logits_0"][8:10]) < TOL
    assert ctx.can_rollback(0) == 1                      # a 2-token batch: only 1 back
    with pytest.raises(RollbackError):
        ctx.truncate(0, 8)                               # the whole last batch
    ctx.decode(toks[10:11])
    assert ctx.can_rollback(0) == 0
    with pytest.raises(RollbackError):
        ctx.truncate(0, 10)
    ctx.truncate(0, 11)                                  # nothing to remove: fine
    got = ctx.decode(toks[11:13], logits="all")
    assert rel_err(got, ref["logits_0"][11:13]) < TOL
    with pytest.raises(ValueError, match="sequence 0: positions 20"):
        ctx.decode(toks[:1], positions=[20])
    ctx.truncate(0, 0)                                   # removing everything always works
    assert ctx.seq_len(0) == 0
    assert rel_err(ctx.decode(toks[:3], logits="all"), ref["logits_0"][:3]) < TOL


def check_splitter(name: str, R: int = 3, n_ubatch: int = 5) -> float:
    """Several sequences of uneven lengths through small micro-batches: every sequence's last
    R+1 tokens land in one micro-batch (so each can roll back R), and the logits match."""
    model, ref = load(name)
    toks = ref["tokens_0"]
    lens = {0: 13, 1: 2, 2: 7, 3: 4}
    rows_t, rows_s, rows_p = [], [], []
    for s, n in lens.items():
        rows_t += toks[:n].tolist()
        rows_s += [s] * n
        rows_p += list(range(n))
    rng = np.random.default_rng(0)
    order = rng.permutation(len(rows_t))                # any row order: the context groups them
    ctx = make_ctx(model, n_rollback=R, n_ubatch=n_ubatch)
    calls = []
    orig = ctx.rec.prepare
    ctx.rec.prepare = lambda segs: calls.append(list(segs)) or orig(segs)
    got = ctx.decode(np.asarray(rows_t)[order], positions=np.asarray(rows_p)[order],
                     seq_ids=np.asarray(rows_s)[order], logits="all")
    assert all(sum(n for _, _, n, _ in segs) <= n_ubatch for segs in calls)
    for s, n in lens.items():
        assert ctx.can_rollback(s) == min(R, n - 1)
        last = [seg for segs in calls for seg in segs if seg[0] == s][-1]
        assert last[2] >= min(n, R + 1)
    err = 0.0
    want = np.concatenate([ref["logits_0"][:n] for n in lens.values()])[order]
    err = rel_err(got, want)
    ctx.truncate(0, 13 - R)
    assert rel_err(ctx.decode(toks[13 - R:13], logits="all"), ref["logits_0"][13 - R:13]) < TOL
    return err


def rewrite_gguf(rd, out, drop=(), reshape=None, add=None):
    """Copy a GGUF (reader rd) to `out` without the tensors in `drop`, with the shapes in
    `reshape` (same bytes), plus `add`: name -> f32 array."""
    from pyfast.gguf.writer import GGUFWriter

    w = GGUFWriter(out)
    w.copy_metadata(rd)
    for n, info in rd.tensors.items():
        if n in drop:
            continue
        shape = tuple(reshape[n]) if reshape and n in reshape else tuple(info.shape)
        w.add_tensor(n, info.type, shape, rd.tensor_bytes(n))
    for n, arr in (add or {}).items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        w.add_tensor(n, 0, arr.shape, arr)
    w.write()
    return out


def check_merged_gate_up(name: str, tmp_path) -> float:
    """A GGUF with pre-merged ffn_gate_up_exps [E, 2F, d] gives the same logits as separate
    ffn_gate_exps / ffn_up_exps."""
    from pyfast.gguf import GGUFReader
    from pyfast.models import Model

    path, ref = fixture(name)
    rd = GGUFReader(str(path))
    model = Model(path)
    drop, add = set(), {}
    for i in range(model.args.n_layer):
        g, u = f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.ffn_up_exps.weight"
        add[f"blk.{i}.ffn_gate_up_exps.weight"] = np.concatenate([model.weights.f32(g), model.weights.f32(u)], axis=1)
        drop |= {g, u}
    merged = Model(rewrite_gguf(rd, tmp_path / "merged.gguf", drop=drop, add=add))
    assert merged.args.merged_gate_up
    toks = ref["tokens_0"]
    got = make_ctx(merged).decode(toks, logits="all")
    assert np.array_equal(got, make_ctx(model).decode(toks, logits="all"))
    return rel_err(got, ref["logits_0"])


def check_tensor_errors(name: str, tmp_path) -> None:
    """A GGUF whose recurrent tensors are missing or mis-shaped is refused naming the tensor."""
    from pyfast.gguf import GGUFReader
    from pyfast.models import Model

    path, _ = fixture(name)
    rd = GGUFReader(str(path))

    def rewrite(out, drop=(), reshape=None):
        return rewrite_gguf(rd, out, drop=drop, reshape=reshape)

    for t in ("blk.0.ssm_a", "blk.1.ssm_conv1d.weight", "blk.2.attn_qkv.weight", "blk.0.ssm_out.weight"):
        p = rewrite(tmp_path / "missing.gguf", drop={t})
        with pytest.raises(ValueError, match=f"missing tensor '{t}'"):
            Model(p)
    conv = rd.tensors["blk.1.ssm_conv1d.weight"].shape
    p = rewrite(tmp_path / "bad.gguf", reshape={"blk.1.ssm_conv1d.weight": (conv[1], conv[0])})
    with pytest.raises(ValueError, match="'blk.1.ssm_conv1d.weight' has shape"):
        Model(p)
    hv = rd.tensors["blk.0.ssm_a"].shape[0]
    ssm_norm = rd.tensors["blk.0.ssm_norm.weight"].shape[0]
    p = rewrite(tmp_path / "bad2.gguf", reshape={"blk.0.ssm_dt.bias": (1, hv)})
    with pytest.raises(ValueError, match="'blk.0.ssm_dt.bias' has shape"):
        Model(p)
    assert ssm_norm > 0


def greedy_plain(model, prompt, n, **kw):
    """Greedy tokens decoded one at a time (no speculation)."""
    ctx = make_ctx(model, **kw)
    lg = ctx.decode(prompt, logits="last")[0]
    out = []
    for _ in range(n):
        t = int(np.argmax(lg))
        out.append(t)
        lg = ctx.decode([t])[0]
    return out


class ScriptedProposer:
    """Drafts the next n tokens of a known greedy continuation with one wrong token at a position
    that cycles through the draft (so every rollback length occurs), or none with k = n."""

    def __new__(cls, *a, **kw):
        from pyfast.spec.base import Proposer

        class _P(Proposer):
            name = "scripted"
            default_n_max = 6

            def __init__(self, truth: dict[int, list[int]], n: int, n_vocab: int):
                self.truth, self.n, self.n_vocab, self.round = truth, n, n_vocab, 0

            def draft(self, requests):
                from pyfast.spec.base import Draft

                out = []
                for r in requests:
                    t = self.truth[r.seq]
                    L = r.tokens.size
                    cont = list(t[L: L + min(self.n, r.n_max)])
                    if not cont:
                        out.append(None)
                        continue
                    j = self.round % (self.n + 1)
                    if j < len(cont):
                        cont[j] = (cont[j] + 1) % self.n_vocab
                    out.append(Draft(np.asarray(cont, dtype=np.int32)))
                self.round += 1
                return out

        return _P(*a, **kw)


def run_decoder(ctx, proposers, prompts, n_gen):
    """Greedy decoding of several sequences with a SpecDecoder; returns generated tokens."""
    from pyfast.sampling import Sampler, SamplingParams
    from pyfast.spec.decoder import SpecDecoder

    dec = SpecDecoder(ctx, proposers)
    slots = [dec.add(i, p, Sampler(SamplingParams(temperature=0.0), ctx.model.n_vocab)) for i, p in enumerate(prompts)]
    first = dec.prefill(slots)
    out = [[dec.start(s, lg)] for s, lg in zip(slots, first)]
    while any(len(o) < n_gen for o in out):
        act = [i for i in range(len(slots)) if len(out[i]) < n_gen]
        for i in act:
            slots[i].n_remaining = n_gen - len(out[i])
        for i, new in zip(act, dec.step([slots[i] for i in act])):
            out[i] += new
    return [o[:n_gen] for o in out], dec


def _count_fallbacks(ctx) -> dict:
    """Wrap ctx.truncate / ctx.restore_state to count refused rollbacks and restores."""
    from pyfast.context import RollbackError

    stats = {"restore": 0, "fail": 0}
    orig_restore, orig_trunc = ctx.restore_state, ctx.truncate

    def restore(seq, st):
        stats["restore"] += 1
        return orig_restore(seq, st)

    def truncate(seq, p):
        try:
            return orig_trunc(seq, p)
        except RollbackError:
            stats["fail"] += 1
            raise

    ctx.restore_state, ctx.truncate = restore, truncate
    return stats


def check_spec_fallback(name: str, R: int = 2, n_draft: int = 5, n_gen: int = 14) -> None:
    """Drafts longer than R: the state is saved before verify, truncate raises RollbackError, the
    decoder restores and replays; greedy output equals plain decoding (1 and 3 sequences)."""
    model, ref = load(name)
    prompts = [ref["tokens_0"][:7].tolist(), ref["tokens_1"][:5].tolist(), ref["tokens_0"][3:6].tolist()]
    plain = [greedy_plain(model, p, n_gen) for p in prompts]
    for k in (1, 3):
        ctx = make_ctx(model, n_rollback=R, n_seq_max=3)
        stats = _count_fallbacks(ctx)
        truth = {i: prompts[i] + plain[i] for i in range(k)}
        got, dec = run_decoder(ctx, [ScriptedProposer(truth, n_draft, model.n_vocab)], prompts[:k], n_gen)
        assert got == plain[:k]
        assert stats["fail"] > 0 and stats["restore"] == stats["fail"]
        assert dec.stats.drafted > 0 and 0 < dec.stats.accepted < dec.stats.drafted


def check_ngram_llm(name: str, tmp_path=None) -> None:
    """pyfast.LLM with n-gram speculation on a recurrent model: n_rollback = draft_max, and greedy
    output equals plain decoding with 1 and 3 sequences."""
    from pyfast.llm import LLM
    from pyfast.spec import SpecConfig

    path, ref = fixture(name)
    # prompts holding much of the vocabulary: the last token has usually occurred before, so the
    # n-gram proposer (key = the last token) drafts often and is often wrong; 150 tokens also put
    # the prompt through the chunked GDN form
    rng = np.random.default_rng(7)
    V = int(ref["logits_0"].shape[1])
    prompts = [rng.permutation(V)[:150].tolist(), rng.permutation(V)[:90].tolist(), ref["tokens_0"][:6].tolist() * 3]
    plain = LLM(path, n_ctx=512, n_threads=2)
    refs = [plain.generate(p, max_tokens=16, temperature=0, ignore_eos=True).tokens for p in prompts]
    for dm in (4, 16):
        llm = LLM(path, n_ctx=512, n_threads=2, speculative=SpecConfig(types="ngram-simple", draft_max=dm, ngram_n=1))
        assert llm.ctx.n_rollback == dm
        for p, want in zip(prompts, refs):
            assert llm.generate(p, max_tokens=16, temperature=0, ignore_eos=True).tokens == want
        got = llm.generate_batch(prompts, max_tokens=16, temperature=0, ignore_eos=True)
        assert [r.tokens for r in got] == refs
        assert llm.spec_stats.drafted > 0
        # the prompt cache after speculation still matches a plain run
        assert llm.generate(prompts[0], max_tokens=16, temperature=0, ignore_eos=True,
                            speculative=False).tokens == refs[0]


def check_nextn(name: str) -> float:
    """The MTP block as its own graph (qwen35.build_nextn) with its own one-layer KV cache, fed
    the reference's (token_p, h_{p-1}) rows: all rows at once, then one row at a time."""
    from pyfast.memory.kv_cache import KVCache
    from pyfast.models import BatchShape, qwen35
    from pyfast.models.base import GraphBuilder

    model, ref = load(name)
    a = model.args
    model.weights.check(qwen35.nextn_tensors(a), model.path)
    pool = native.ThreadPool(2)

    def run(kv, toks, pos, h):
        T = len(toks)
        slots = kv.prepare(np.zeros(T, dtype=np.int32), np.asarray(pos, dtype=np.int32))
        b = GraphBuilder(model.weights, BatchShape(T, slots.n_kv, T), kv)
        b.g.output(qwen35.build_nextn(b, a), "logits")
        plan = native.Plan(b.g, pool)
        for k, v in (("tokens", np.asarray(toks, dtype=np.int32)), ("pos", np.asarray(pos, dtype=np.int32)),
                     ("out_ids", np.arange(T, dtype=np.int32)), ("kv_idx", slots.idx), ("mask", slots.mask),
                     ("kv_order", slots.order), ("h", np.asarray(h, dtype=np.float32))):
            plan.set_input(k, v)
        plan.run()
        return plan.output("logits"), plan.output("hidden")

    err = 0.0
    for s in (0, 1):
        toks, h = ref[f"tokens_{s}"], ref[f"mtp_h_in_{s}"]
        T = toks.size
        lg, hid = run(KVCache(1, 64, a.n_head_kv, a.head_dim, native.DType.F32), toks, range(T), h)
        err = max(err, rel_err(lg, ref[f"mtp_logits_{s}"]), rel_err(hid, ref[f"mtp_hidden_{s}"]))
        kv = KVCache(1, 64, a.n_head_kv, a.head_dim, native.DType.F32)
        rows = [run(kv, toks[t:t + 1], [t], h[t:t + 1])[0] for t in range(T)]
        err = max(err, rel_err(np.concatenate(rows), ref[f"mtp_logits_{s}"]))
    return err


def check_batch_invariance(name: str) -> None:
    """With the token-serial GDN (chunk_min = 0, the default) a sequence's logits are bit-identical
    whether it is decoded in one batch, token by token, split into micro-batches or next to
    another sequence."""
    model, ref = load(name)
    assert model.args.chunk_min == 0
    a, b = ref["tokens_0"], ref["tokens_1"]
    one = make_ctx(model).decode(a, logits="all")
    ctx = make_ctx(model)
    steps = np.concatenate([ctx.decode([t]) for t in a])
    split = make_ctx(model, n_ubatch=3).decode(a, logits="all")
    both = make_ctx(model).decode(np.concatenate([b, a]), positions=list(range(b.size)) + list(range(a.size)),
                                  seq_ids=[1] * b.size + [0] * a.size, logits="all")[b.size:]
    assert np.array_equal(one, steps) and np.array_equal(one, split) and np.array_equal(one, both)
