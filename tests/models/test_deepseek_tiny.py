"""Tiny random DeepSeek-family models against the float64 transformers references in
tests/fixtures/deepseek/ (``scripts/make_deepseek_fixtures.py``): the checkpoint is converted with
``pyfast convert`` here, then prefill (scalar and best ISA), token-by-token decode, prefill then
decode, two sequences in one batch, hidden export, batch invariance (bit for bit), truncate and
save / restore, and the MTP block graph are checked. ``deepseek_v3`` -> ``deepseek2`` (MLA with
absorbed projections over the compressed cache, sigmoid grouped routing with a bias, shared expert);
``deepseek_v32`` -> ``deepseek32`` and ``glm_moe_dsa`` -> ``glm-dsa`` add the DSA lightning indexer
with top-k 4 below the sequence lengths: their logits are compared with transformers' full
(non-cached) path, their per-layer selections with its index sets, and with the top-k at or above
the visible cells they equal dense attention (transformers' and their own with DSA off, bit for bit).

Errors are max over rows of max|a - b| / max|b| (< 1e-3 against the reference)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from pyfast._loader import native

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(os.environ.get("PYFAST_DEEPSEEK_FIXTURES", ROOT / "tests" / "fixtures" / "deepseek"))
NAMES = ["deepseek_v3", "deepseek_v32", "glm_moe_dsa"]
DSA = {"deepseek_v32", "glm_moe_dsa"}
TOL = 1e-3

pytestmark = pytest.mark.skipif(not hasattr(native.Graph(), "topk_mask"), reason="native lacks topk_mask")


def rel_err(a, b) -> float:
    a = np.atleast_2d(np.asarray(a, dtype=np.float64))
    b = np.atleast_2d(np.asarray(b, dtype=np.float64))
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)).max())


@pytest.fixture(scope="module", params=NAMES)
def fx(request, tmp_path_factory):
    """(name, GGUF path converted from the fixture checkpoint, reference dict)."""
    from pyfast.convert import convert

    name = request.param
    hf, npz = FIXTURES / "hf" / name, FIXTURES / f"{name}.npz"
    if not hf.is_dir() or not npz.exists():
        pytest.skip(f"fixture {hf} / {npz} not present")
    out = tmp_path_factory.mktemp(name) / f"{name}.gguf"
    convert(hf, out, mtp=True, outtype="f32")
    z = np.load(npz)
    return name, out, {k: z[k] for k in z.files}


def model_of(fx):
    from pyfast.models import Model

    return Model(fx[1])


def make_ctx(model, **kw):
    from pyfast.context import Context

    kw.setdefault("n_ctx", 128)
    kw.setdefault("n_threads", 2)
    kw.setdefault("kv_dtype", native.DType.F32)
    return Context(model, **kw)


def decode_ref(fx):
    """What incremental decode must reproduce: transformers' cached decode for dense models; for the
    DSA ones its full path (each row selects among the cells up to it, as pyfast's decode does)."""
    return fx[2]["logits_0"] if fx[0] in DSA else fx[2]["decode_logits_0"]


def test_prefill_and_decode_match_reference_on_every_isa(fx):
    _, _, ref = fx
    model = model_of(fx)
    old = native.cpu_isa()
    try:
        for isa in dict.fromkeys(["scalar", native.cpu_best_isa()]):
            native.set_cpu_isa(isa)
            for s in (0, 1):
                got = make_ctx(model).decode(ref[f"tokens_{s}"], logits="all")
                assert rel_err(got, ref[f"logits_{s}"]) < TOL, (isa, s)
            ctx = make_ctx(model)
            steps = np.concatenate([ctx.decode([t]) for t in ref["tokens_0"]])
            assert rel_err(steps, decode_ref(fx)) < TOL, isa
    finally:
        native.set_cpu_isa(old)


def test_prefill_then_decode_and_uneven_chunks(fx):
    _, _, ref = fx
    model = model_of(fx)
    toks, n0 = ref["tokens_0"], int(ref["n_prefill"])
    ctx = make_ctx(model)
    got = [ctx.decode(toks[:n0], logits="all")] + [ctx.decode([t]) for t in toks[n0:]]
    assert rel_err(np.concatenate(got), decode_ref(fx)) < TOL
    ctx, got, i = make_ctx(model, kv_dtype=native.DType.F16), [], 0
    for n in (4, 1, 3, 2, 3):
        got.append(ctx.decode(toks[i:i + n], logits="all"))
        i += n
    assert rel_err(np.concatenate(got), ref["logits_0"]) < TOL  # an F16 cache stays within 1e-3 here


def test_two_sequences_in_one_batch_and_batch_invariance(fx):
    _, _, ref = fx
    model = model_of(fx)
    a, b = ref["tokens_0"], ref["tokens_1"]
    one = make_ctx(model).decode(a, logits="all")
    assert rel_err(one, ref["logits_0"]) < TOL
    ctx = make_ctx(model)
    steps = np.concatenate([ctx.decode([t]) for t in a])
    split = make_ctx(model, n_ubatch=3).decode(a, logits="all")
    both = make_ctx(model).decode(np.concatenate([b, a]), positions=list(range(b.size)) + list(range(a.size)),
                                  seq_ids=[1] * b.size + [0] * a.size, logits="all")
    assert np.array_equal(one, steps) and np.array_equal(one, split) and np.array_equal(one, both[b.size:])
    assert rel_err(both[:b.size], ref["logits_1"]) < TOL


def test_hidden_export(fx):
    _, _, ref = fx
    model = model_of(fx)
    ctx = make_ctx(model, export_hidden=True)
    lg = ctx.decode(ref["tokens_0"], logits="all")
    assert rel_err(ctx.last_hidden, ref["hidden_0"]) < TOL and rel_err(lg, ref["logits_0"]) < TOL


def test_truncate_and_save_restore(fx):
    _, _, ref = fx
    model = model_of(fx)
    a, b = ref["tokens_0"], ref["tokens_1"]
    ctx = make_ctx(model)
    ctx.decode(a, logits="none")
    ctx.truncate(0, 7)
    got = ctx.decode(a[7:], logits="all")
    assert rel_err(got, ref["logits_0"][7:]) < TOL
    st = ctx.save_state(0)
    other = make_ctx(model)
    other.decode(b[:5], seq_ids=2, logits="none")
    other.restore_state(4, st)
    other.truncate(4, 10)
    got = other.decode(a[10:], seq_ids=4, logits="all")
    assert rel_err(got, ref["logits_0"][10:]) < TOL
    assert rel_err(other.decode(b[5:], seq_ids=2, logits="all"), ref["logits_1"][5:]) < TOL


def test_cache_is_compressed(fx):
    """One cache row per token and layer of kv_lora + rope values (+ the indexer key), not per head;
    the values are its first kv_lora columns. A V type other than K's keeps V rows of its own."""
    _, _, ref = fx
    model = model_of(fx)
    a = model.args
    ctx = make_ctx(model)
    assert (ctx.kv.n_head_kv, ctx.kv.head_dim, ctx.kv.head_dim_v) == (1, a.head_dim, a.kv_lora)
    assert a.head_dim == a.kv_lora + a.qk_rope + a.cache_extra
    assert ctx.kv.v is None and ctx.kv.v_row_bytes == 0
    sep = make_ctx(model, kv_dtype_v=native.DType.F16)
    assert sep.kv.v is not None and sep.kv.v_row_bytes == 2 * a.kv_lora
    assert rel_err(sep.decode(ref["tokens_0"], logits="all"), ref["logits_0"]) < TOL


def test_mtp_block_matches_reference(fx):
    """The MTP (nextn) block as its own graph with its own one-layer cache, fed the reference's
    (token_p, h_{p-1}) rows: all rows at once, then one row at a time."""
    from pyfast.memory.kv_cache import KVCache
    from pyfast.models import BatchShape
    from pyfast.models.base import GraphBuilder

    _, _, ref = fx
    model = model_of(fx)
    a, impl = model.args, model.arch
    assert a.n_nextn == 1
    model.weights.check(impl.nextn_tensors(a), model.path)
    pool = native.ThreadPool(2)

    def new_kv():
        return KVCache(1, 64, a.n_head_kv, a.head_dim, native.DType.F32, a.head_dim_v)

    def run(kv, toks, pos, h):
        T = len(toks)
        slots = kv.prepare(np.zeros(T, dtype=np.int32), np.asarray(pos, dtype=np.int32))
        b = GraphBuilder(model.weights, BatchShape(T, slots.n_kv, T), kv)
        b.g.output(impl.build_nextn(b, a), "logits")
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
        lg, hid = run(new_kv(), toks, range(T), h)
        assert rel_err(lg, ref[f"mtp_logits_{s}"]) < TOL and rel_err(hid, ref[f"mtp_hidden_{s}"]) < TOL
        kv = new_kv()
        rows = [run(kv, toks[t:t + 1], [t], h[t:t + 1])[0] for t in range(T)]
        assert rel_err(np.concatenate(rows), ref[f"mtp_logits_{s}"]) < TOL


def test_convert_without_mtp_and_metadata(fx, tmp_path):
    from pyfast.convert import convert
    from pyfast.gguf import GGUFReader

    name, path, _ = fx
    md = GGUFReader(str(path)).metadata
    arch = md["general.architecture"]
    assert md[f"{arch}.nextn_predict_layers"] == 1 and md[f"{arch}.attention.head_count_kv"] == 1
    assert md[f"{arch}.expert_gating_func"] == 2
    n_trunk = md[f"{arch}.block_count"] - 1
    res = convert(FIXTURES / "hf" / name, tmp_path / "nomtp.gguf", mtp=False)
    assert res.n_mtp == 0
    md = GGUFReader(str(tmp_path / "nomtp.gguf")).metadata
    assert f"{arch}.nextn_predict_layers" not in md and md[f"{arch}.block_count"] == n_trunk
    assert not any(".nextn." in t for t in GGUFReader(str(tmp_path / "nomtp.gguf")).tensors)


def test_yarn_rope_matches_reference(fx, tmp_path):
    """DeepSeek-V3's YaRN (factor 4 over an original context of 8, mscale = mscale_all_dim = 1):
    the converter writes llama.cpp's yarn keys, the model matches transformers' full forward."""
    import json
    import shutil

    from pyfast.convert import convert
    from pyfast.gguf import GGUFReader
    from pyfast.models import Model

    name, _, ref = fx
    if "yarn_logits_0" not in ref:
        pytest.skip("no YaRN reference for this fixture")
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "hf" / name, hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 1.0,
                              "beta_fast": 32.0, "beta_slow": 1.0}
    (hf / "config.json").write_text(json.dumps(cfg))
    convert(hf, tmp_path / "yarn.gguf")
    md = GGUFReader(str(tmp_path / "yarn.gguf")).metadata
    assert md["deepseek2.rope.scaling.type"] == "yarn" and md["deepseek2.rope.scaling.original_context_length"] == 8
    assert md["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1)
    m = Model(tmp_path / "yarn.gguf")
    for s in (0, 1):
        got = make_ctx(m).decode(ref[f"tokens_{s}"], logits="all")
        assert rel_err(got, ref[f"yarn_logits_{s}"]) < TOL
    assert rel_err(got, ref["logits_1"]) > 1e-2  # YaRN changes the result here


def test_attn_kv_b_files_are_split_at_load(fx, tmp_path):
    """A file with attn_kv_b (older llama.cpp conversions) instead of attn_k_b / attn_v_b gives the
    same logits."""
    from pyfast.gguf import GGUFReader
    from pyfast.gguf.writer import GGUFWriter
    from pyfast.models import Model

    _, path, ref = fx
    r = GGUFReader(str(path))
    a = Model(path).args
    H, n, v, L = a.n_head, a.qk_nope, a.v_head_dim, a.kv_lora
    w = GGUFWriter(str(tmp_path / "kvb.gguf"))
    for k, val in r.metadata.items():
        typ = r.metadata_types[k]
        w.add(k, val, typ)
    for name, info in r.tensors.items():
        data = np.asarray(r.tensor_bytes(name)).view(np.float32).reshape(tuple(info.shape))
        if name.endswith("attn_v_b.weight"):
            continue
        if name.endswith("attn_k_b.weight"):
            vb = np.asarray(r.tensor_bytes(name.replace("k_b", "v_b"))).view(np.float32).reshape(H, v, L)
            kvb = np.concatenate([data.transpose(0, 2, 1), vb], axis=1).reshape(H * (n + v), L)
            name, data = name.replace("attn_k_b", "attn_kv_b"), np.ascontiguousarray(kvb)
        w.add_tensor(name, 0, data.shape, lambda d=data: d)
    w.write()
    m = Model(tmp_path / "kvb.gguf")
    assert m.args.kv_b
    got = make_ctx(m).decode(ref["tokens_0"], logits="all")
    assert rel_err(got, ref["logits_0"]) < TOL


# --- DSA (deepseek32, glm-dsa) --------------------------------------------------------------------
def dsa_fx(fx):
    if fx[0] not in DSA:
        pytest.skip("no sparse attention")
    return fx


def test_dsa_selection_matches_transformers_index_sets(fx):
    """Each indexer layer keeps, per row, the cells of the positions transformers' full path picks
    (its rows t < k-1 also name masked future positions: those are left out)."""
    name, _, ref = dsa_fx(fx)
    model = model_of(fx)
    model.args.extra["debug_outputs"] = True
    full = [il for il, f in enumerate(model.args.extra["idx_full"]) if f]
    for s in (0, 1):
        toks = ref[f"tokens_{s}"]
        ctx = make_ctx(model)
        ctx.decode(toks, logits="all")
        plan = ctx._last_plan
        cell_pos = ctx.kv.cell_pos
        sel = ref[f"sel_{s}"]
        assert sel.shape[0] == len(full)
        for j, il in enumerate(full):
            keep = plan.output(f"dsa_keep.{il}")                       # [T, n_kv] 0 / -inf
            for t in range(toks.size):
                got = {int(cell_pos[c]) for c in np.flatnonzero(keep[t] == 0.0) if 0 <= cell_pos[c] <= t}
                want = {int(i) for i in sel[j, t] if i <= t}
                assert got == want, (name, s, il, t, got, want)


def test_dsa_top_k_at_n_kv_is_dense_bit_for_bit(fx):
    _, path, ref = dsa_fx(fx)
    from pyfast.models import Model

    dense = {}
    for mode in ("topk", "off"):
        m = Model(path)
        m.set_dsa(on=mode == "topk", top_k=100000 if mode == "topk" else None)
        dense[mode] = [make_ctx(m).decode(ref[f"tokens_{s}"], logits="all") for s in (0, 1)]
    for s in (0, 1):
        assert np.array_equal(dense["topk"][s], dense["off"][s])
        assert rel_err(dense["off"][s], ref[f"dense_logits_{s}"]) < TOL
    ctx = make_ctx(m)
    steps = np.concatenate([ctx.decode([t]) for t in ref["tokens_0"]])
    assert rel_err(steps, ref["decode_logits_0"]) < TOL     # transformers' dense cached decode
    sparse = make_ctx(Model(path)).decode(ref["tokens_0"], logits="all")
    assert rel_err(sparse, dense["off"][0]) > 1e-3             # the selection matters here


def test_dsa_sink_is_per_sequence_and_batch_invariant(fx):
    """With the sink on (n_kv > top_k), two sequences in one batch equal each alone, and the
    first position of each sequence is always kept."""
    _, path, ref = dsa_fx(fx)
    from pyfast.models import Model

    m = Model(path)
    m.set_dsa(sink=True)
    m.args.extra["debug_outputs"] = True
    a, b = ref["tokens_0"], ref["tokens_1"]
    alone = make_ctx(m).decode(a, logits="all")
    ctx = make_ctx(m)
    ctx.decode(b[:3], seq_ids=1, logits="none")           # b's first cells come first in the cache
    both = ctx.decode(np.concatenate([b[3:], a]), positions=list(range(3, b.size)) + list(range(a.size)),
                      seq_ids=[1] * (b.size - 3) + [0] * a.size, logits="all")
    assert np.array_equal(alone, both[b.size - 3:])
    keep = ctx._last_plan.output("dsa_keep.0")
    cell_pos, cell_seq = ctx.kv.cell_pos, ctx.kv.cell_seq
    first_a = int(np.flatnonzero((cell_seq == 0) & (cell_pos == 0))[0])
    first_b = int(np.flatnonzero((cell_seq == 1) & (cell_pos == 0))[0])
    assert (keep[b.size - 3:, first_a] == 0).all() and (keep[:b.size - 3, first_b] == 0).all()


def test_dsa_hadamard_rotation_changes_only_rounding(fx):
    _, path, ref = dsa_fx(fx)
    from pyfast.models import Model

    m = Model(path)
    m.set_dsa(hadamard=True)
    got = make_ctx(m).decode(ref["tokens_0"], logits="all")
    assert rel_err(got, ref["logits_0"]) < TOL


def test_dsa_options_are_checked(fx):
    name, path, _ = fx
    from pyfast.models import Model

    m = Model(path)
    if name not in DSA:
        with pytest.raises(ValueError, match="no sparse attention"):
            m.set_dsa(on=True)
        return
    with pytest.raises(ValueError, match="top-k"):
        m.set_dsa(top_k=0)
    make_ctx(m).decode([1, 2])
    with pytest.raises(ValueError, match="already built"):
        m.set_dsa(on=False)


def test_index_share_pattern():
    from pyfast.models.dsa import index_share_default

    full = index_share_default(78)
    assert sum(full) == 21 and full[:7] == (True, True, True, False, False, False, True)


# --- draft-mtp (the NextN block as drafter; dense attention inside it) -------------------------------
def test_draft_mtp_is_lossless(fx):
    """Greedy draft-mtp output equals plain decoding, one sequence and three at once (sparse
    attention stays on in the trunk of the DSA models)."""
    from pyfast.llm import LLM
    from pyfast.spec import SpecConfig

    _, path, ref = fx
    llm = LLM(path, n_ctx=512, n_threads=2, speculative=SpecConfig(types=["draft-mtp"], draft_max=3))
    prompts = [ref["tokens_0"].tolist(), ref["tokens_1"].tolist(), ref["tokens_0"][:5].tolist()]
    for p in prompts[:2]:
        res = llm.generate(p, max_tokens=20, temperature=0, ignore_eos=True)
        plain = llm.generate(p, max_tokens=20, temperature=0, ignore_eos=True, speculative=False)
        assert res.tokens == plain.tokens and res.spec.drafted > 0
    outs = llm.generate_batch(prompts, max_tokens=12, temperature=0, ignore_eos=True)
    for p, o in zip(prompts, outs):
        assert o.tokens == llm.generate(p, max_tokens=12, temperature=0, ignore_eos=True, speculative=False).tokens


def test_dsa_layer0_index_scores_match_numpy(fx):
    """T6.1: layer 0's index scores against a numpy float64 evaluation of algorithms.md §6.1-6.2 from
    the file's weights (embedding -> attn_norm -> q latent; indexer q / k, LayerNorm with bias, RoPE
    on the first rope dims with the model's pairing, ReLU, per-head weights); with the Hadamard
    rotation on they differ only by rounding (T6.6)."""
    from pyfast.models import Model

    _, path, ref = dsa_fx(fx)
    toks = ref["tokens_0"]
    T = toks.size
    got = {}
    for had in (False, True):
        m = Model(path)
        m.set_dsa(hadamard=had)
        m.args.extra["debug_outputs"] = True
        ctx = make_ctx(m)
        ctx.decode(toks, logits="none")
        cells = np.argsort(ctx.kv.cell_pos[:T])  # cell of each position (a fresh cache: 0..T-1)
        got[had] = ctx._last_plan.output("dsa_score.0")[:, cells]
    a, w = m.args, m.weights
    x = a.extra
    f = {n: w.f32(n).astype(np.float64) for n in w.info if n.startswith(("blk.0.", "token_embd"))}

    def rms(v, g, eps):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    def rope(v, mode):  # v [T, H, D]: rotate the first rope dims at positions 0..T-1
        r = a.qk_rope
        inv = a.rope.base ** (-np.arange(0, r, 2) / r)
        ang = np.arange(T)[:, None, None] * inv[None, None, :]
        c, s = np.cos(ang), np.sin(ang)
        v = v.copy()
        if mode == 0:
            e, o = v[..., 0:r:2].copy(), v[..., 1:r:2].copy()
            v[..., 0:r:2], v[..., 1:r:2] = e * c - o * s, o * c + e * s
        else:
            lo, hi = v[..., :r // 2].copy(), v[..., r // 2:r].copy()
            v[..., :r // 2], v[..., r // 2:r] = lo * c - hi * s, hi * c + lo * s
        return v

    h = rms(f["token_embd.weight"][toks], f["blk.0.attn_norm.weight"], a.eps)
    qr = rms(h @ f["blk.0.attn_q_a.weight"].T, f["blk.0.attn_q_a_norm.weight"], a.eps)
    Hi, D = x["idx_heads"], x["idx_dim"]
    q = rope((qr @ f["blk.0.indexer.attn_q_b.weight"].T).reshape(T, Hi, D), x["idx_rope_mode"])
    k = h @ f["blk.0.indexer.attn_k.weight"].T
    k = k - k.mean(-1, keepdims=True)
    k = k / np.sqrt((k * k).mean(-1, keepdims=True) + 1e-6) * f["blk.0.indexer.k_norm.weight"] \
        + f["blk.0.indexer.k_norm.bias"]
    k = rope(k.reshape(T, 1, D), x["idx_rope_mode"])[:, 0]
    wt = (h @ f["blk.0.indexer.proj.weight"].T) / np.sqrt(D * Hi)
    want = np.einsum("th,ths->ts", wt, np.maximum(np.einsum("thd,sd->ths", q, k), 0.0))
    causal = np.tril(np.ones((T, T), dtype=bool))
    scale = np.abs(want[causal]).max()
    for had in (False, True):
        assert np.isneginf(got[had][~causal]).all()
        assert np.abs(got[had][causal] - want[causal]).max() < 1e-5 * scale, had
