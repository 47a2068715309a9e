"""``pyfast.convert`` / ``pyfast convert``: Hugging Face hybrid Gated-DeltaNet checkpoints
(Qwen3.5, Qwen3.5-MoE, Qwen3-Next) to GGUF, checked against the committed fixtures in
tests/fixtures/hybrid/ (built by scripts/make_hybrid_fixtures.py).

* converting each committed HF directory reproduces the committed GGUF exactly;
* every tensor transform is checked against an independent numpy formulation (norm +1, -exp,
  V-head tiling as an explicit index map, the Qwen3-Next qkvz split as explicit per-group rows);
* an independent float64 numpy forward pass over the GGUF (GDN recurrence, gated attention, MoE,
  MTP block) reproduces the transformers references in the .npz files, which pins down the
  layout conventions a graph builder relies on;
* --no-mtp, output types, BF16 / sharded / fused-expert / multimodal-named checkpoints, the
  tokenizer metadata, bad inputs and the CLI.

Needs neither torch nor transformers, except the ``torch``-marked regeneration test at the end.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from pyfast.convert import convert
from pyfast.gguf import GGUFReader

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "hybrid"
NAMES = ("qwen35", "qwen35moe", "qwen3next")
ARCH = {"qwen35": "qwen35", "qwen35moe": "qwen35moe", "qwen3next": "qwen3next"}


def hf(name: str) -> Path:
    return FIX / "hf" / name


# ---------------------------------------------------------------------------------------------
# independent safetensors read / write (not pyfast.convert.safetensors)
# ---------------------------------------------------------------------------------------------

_ST_NP = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8", "I32": "<i4"}


def st_read(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for k, v in header.items():
        b, e = v["data_offsets"]
        out[k] = np.frombuffer(raw[8 + n + b: 8 + n + e], dtype=_ST_NP[v["dtype"]]).reshape(v["shape"])
    return out


def hf_tensors(name: str) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) for k, v in st_read(hf(name) / "model.safetensors").items()}


def st_write(path: Path, tensors: dict[str, np.ndarray], dtypes: dict[str, str] | None = None) -> None:
    """Write a safetensors file; ``dtypes`` names BF16 tensors given as uint16 bits."""
    header, blobs, off = {}, [], 0
    for k in sorted(tensors):
        a = np.ascontiguousarray(tensors[k])
        dt = (dtypes or {}).get(k) or {np.dtype("float32"): "F32", np.dtype("float16"): "F16",
                                        np.dtype("float64"): "F64"}[a.dtype]
        blob = a.astype(_ST_NP[dt]).tobytes()
        header[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def copy_hf(name: str, dst: Path, with_weights: bool = True) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in hf(name).iterdir():
        if with_weights or not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    return dst


def gguf_arrays(path) -> tuple[GGUFReader, dict[str, np.ndarray]]:
    r = GGUFReader(str(path))
    return r, {n: np.array(r.tensor_array(n)) for n in r.tensors}


def convert_quiet(*a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert(*a, **kw)


# ---------------------------------------------------------------------------------------------
# reproduction of the committed files
# ---------------------------------------------------------------------------------------------

def assert_same_gguf(a, b, skip_meta=()):
    ra, rb = GGUFReader(str(a)), GGUFReader(str(b))
    ma = {k: v for k, v in ra.metadata.items() if k not in skip_meta}
    mb = {k: v for k, v in rb.metadata.items() if k not in skip_meta}
    assert list(ma) == list(mb)
    for k in ma:
        assert ma[k] == mb[k], k
        assert ra.metadata_types[k] == rb.metadata_types[k], k
    assert list(ra.tensors) == list(rb.tensors)
    for n, t in ra.tensors.items():
        u = rb.tensors[n]
        assert (t.type, tuple(t.shape)) == (u.type, tuple(u.shape)), n
        assert np.array_equal(ra.tensor_bytes(n), rb.tensor_bytes(n)), n


@pytest.mark.parametrize("name", NAMES)
def test_convert_reproduces_committed_gguf(name, tmp_path):
    out = tmp_path / f"{name}.gguf"
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # a tokenizer is present: no warning
        res = convert(hf(name), out)
    assert (res.arch, res.n_mtp, res.has_tokenizer) == (ARCH[name], 1, True)
    assert_same_gguf(out, FIX / f"{name}.gguf")


@pytest.mark.parametrize("name", NAMES)
def test_metadata(name):
    r = GGUFReader(str(FIX / f"{name}.gguf"))
    md, ty = r.metadata, r.metadata_types
    a = ARCH[name]
    cfg = json.loads((hf(name) / "config.json").read_text())
    assert md["general.architecture"] == a and md["general.file_type"] == 0
    want = {
        "block_count": 5, "embedding_length": 64, "context_length": 256, "attention.head_count": 2,
        "attention.head_count_kv": 1, "attention.key_length": 16, "attention.value_length": 16,
        "nextn_predict_layers": 1, "ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2,
        "ssm.time_step_rank": 4, "ssm.inner_size": 64, "full_attention_interval": 4,
        "rope.dimension_count": 8,
    }
    for k, v in want.items():
        assert md[f"{a}.{k}"] == v, k
        assert ty[f"{a}.{k}"] == "uint32", k
    assert md[f"{a}.rope.freq_base"] == 10000.0 and ty[f"{a}.rope.freq_base"] == "float32"
    assert md[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert md[f"{a}.attention.recurrent_layers"] == [True, True, True, False, False]
    if name == "qwen3next":
        assert f"{a}.rope.dimension_sections" not in md
    else:
        assert md[f"{a}.rope.dimension_sections"] == [2, 1, 1, 0]
        assert ty[f"{a}.rope.dimension_sections"] == "array[int32]"
    if name == "qwen35":
        assert md[f"{a}.feed_forward_length"] == 32 and f"{a}.expert_count" not in md
        assert "output.weight" not in r.tensors          # tied embeddings
    else:
        assert (md[f"{a}.expert_count"], md[f"{a}.expert_used_count"]) == (4, 2)
        assert md[f"{a}.expert_feed_forward_length"] == 8
        assert md[f"{a}.expert_shared_feed_forward_length"] == 16
        assert "output.weight" in r.tensors
    # tokenizer
    assert md["tokenizer.ggml.model"] == "gpt2"
    assert md["tokenizer.ggml.pre"] == ("qwen2" if name == "qwen3next" else "qwen35")
    toks, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert len(toks) == len(types) == cfg["vocab_size"] == 280
    assert toks[269:272] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and types[269:272] == [3, 3, 3]
    assert toks[272:] == [f"[PAD{i}]" for i in range(272, 280)] and set(types[272:]) == {5}
    assert set(types[:269]) == {1}
    assert md["tokenizer.ggml.merges"][:3] == ["Ġ t", "h e", "Ġt he"] and len(md["tokenizer.ggml.merges"]) == 13
    assert (md["tokenizer.ggml.eos_token_id"], md["tokenizer.ggml.padding_token_id"],
            md["tokenizer.ggml.bos_token_id"]) == (271, 269, 269)
    assert md["tokenizer.ggml.add_bos_token"] is False and md["tokenizer.ggml.add_eos_token"] is False
    assert md["tokenizer.chat_template"] == (hf(name) / "chat_template.jinja").read_text()


def test_tensor_names_are_llama_cpp_names():
    """Every tensor name is one of gguf-py's (llama.cpp's) names for its kind of tensor."""
    gguf = pytest.importorskip("gguf")
    templates = set(gguf.constants.TENSOR_NAMES.values())
    for name in NAMES:
        r = GGUFReader(str(FIX / f"{name}.gguf"))
        for n in r.tensors:
            base = n.rsplit(".", 1)[0] if n.endswith((".weight", ".bias")) else n
            if base.startswith("blk."):
                _, _bid, rest = base.split(".", 2)
                base = "blk.{bid}." + rest
            assert base in templates, n


def test_gguf_py_reads_the_file():
    gguf = pytest.importorskip("gguf")
    rd = gguf.GGUFReader(str(FIX / "qwen35moe.gguf"))
    names = {t.name: t for t in rd.tensors}
    t = names["blk.0.ffn_gate_exps.weight"]
    assert list(t.shape) == [64, 8, 4]                     # ggml ne order: {n_embd, n_ff_exp, n_expert}
    assert list(names["blk.0.ssm_conv1d.weight"].shape) == [4, 128]
    assert list(names["blk.4.nextn.eh_proj.weight"].shape) == [128, 64]


# ---------------------------------------------------------------------------------------------
# tensor transforms against independent numpy formulations
# ---------------------------------------------------------------------------------------------

def tiled_perm(Hk: int, Hv: int) -> np.ndarray:
    """perm[j] = the checkpoint (grouped) value head stored at tiled position j: position j uses
    key head j % Hk and is the (j // Hk)-th value head of that key head's group."""
    r = Hv // Hk
    return np.array([(j % Hk) * r + j // Hk for j in range(Hv)])


def head_rows(perm: np.ndarray, S: int) -> np.ndarray:
    return np.concatenate([np.arange(h * S, (h + 1) * S) for h in perm])


@pytest.mark.parametrize("name", NAMES)
def test_tensor_transforms(name):
    src = hf_tensors(name)
    _, g = gguf_arrays(FIX / f"{name}.gguf")
    Hk, Hv, S, E = 2, 4, 16, 4
    r = Hv // Hk
    kd = Hk * S
    perm = tiled_perm(Hk, Hv) if name != "qwen3next" else np.arange(Hv)
    if name != "qwen3next":
        assert list(perm) == [0, 2, 1, 3]
    vrows = head_rows(perm, S)
    checked = set()

    def eq(gname, want):
        assert g[gname].shape == want.shape, gname
        np.testing.assert_array_equal(g[gname], want.astype(np.float32), err_msg=gname)
        checked.add(gname)

    eq("token_embd.weight", src["model.embed_tokens.weight"])
    eq("output_norm.weight", src["model.norm.weight"] + 1)
    if "lm_head.weight" in src:
        eq("output.weight", src["lm_head.weight"])
    for i in range(5):
        b = f"blk.{i}"
        p = f"model.layers.{i}" if i < 4 else "mtp.layers.0"
        eq(f"{b}.attn_norm.weight", src[f"{p}.input_layernorm.weight"] + 1)
        eq(f"{b}.post_attention_norm.weight", src[f"{p}.post_attention_layernorm.weight"] + 1)
        if i >= 3:
            for w, hw in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
                eq(f"{b}.{w}.weight", src[f"{p}.self_attn.{hw}.weight"])
            eq(f"{b}.attn_q_norm.weight", src[f"{p}.self_attn.q_norm.weight"] + 1)
            eq(f"{b}.attn_k_norm.weight", src[f"{p}.self_attn.k_norm.weight"] + 1)
        else:
            a = f"{p}.linear_attn"
            if name == "qwen3next":
                w = src[f"{a}.in_proj_qkvz.weight"]
                per = 2 * S + 2 * r * S
                q = np.concatenate([w[gi * per: gi * per + S] for gi in range(Hk)])
                k = np.concatenate([w[gi * per + S: gi * per + 2 * S] for gi in range(Hk)])
                v = np.concatenate([w[gi * per + 2 * S: gi * per + 2 * S + r * S] for gi in range(Hk)])
                z = np.concatenate([w[gi * per + 2 * S + r * S: (gi + 1) * per] for gi in range(Hk)])
                eq(f"{b}.attn_qkv.weight", np.concatenate([q, k, v]))
                eq(f"{b}.attn_gate.weight", z)
                eq(f"{b}.ssm_ba.weight", src[f"{a}.in_proj_ba.weight"])
            else:
                w = src[f"{a}.in_proj_qkv.weight"]
                eq(f"{b}.attn_qkv.weight", np.concatenate([w[:2 * kd], w[2 * kd:][vrows]]))
                eq(f"{b}.attn_gate.weight", src[f"{a}.in_proj_z.weight"][vrows])
                eq(f"{b}.ssm_beta.weight", src[f"{a}.in_proj_b.weight"][perm])
                eq(f"{b}.ssm_alpha.weight", src[f"{a}.in_proj_a.weight"][perm])
            conv = src[f"{a}.conv1d.weight"][:, 0, :]
            eq(f"{b}.ssm_conv1d.weight", np.concatenate([conv[:2 * kd], conv[2 * kd:][vrows]]))
            eq(f"{b}.ssm_dt.bias", src[f"{a}.dt_bias"][perm])
            eq(f"{b}.ssm_a", -np.exp(src[f"{a}.A_log"].astype(np.float32))[perm])
            eq(f"{b}.ssm_norm.weight", src[f"{a}.norm.weight"])            # gated norm: no +1
            eq(f"{b}.ssm_out.weight", src[f"{a}.out_proj.weight"][:, vrows])
        m = f"{p}.mlp"
        if name == "qwen35":
            for w in ("gate", "up", "down"):
                eq(f"{b}.ffn_{w}.weight", src[f"{m}.{w}_proj.weight"])
        else:
            eq(f"{b}.ffn_gate_inp.weight", src[f"{m}.gate.weight"])
            for w in ("gate", "up", "down"):
                eq(f"{b}.ffn_{w}_exps.weight", np.stack([src[f"{m}.experts.{e}.{w}_proj.weight"] for e in range(E)]))
                eq(f"{b}.ffn_{w}_shexp.weight", src[f"{m}.shared_expert.{w}_proj.weight"])
            eq(f"{b}.ffn_gate_inp_shexp.weight", src[f"{m}.shared_expert_gate.weight"])
    eq("blk.4.nextn.eh_proj.weight", src["mtp.fc.weight"])
    eq("blk.4.nextn.enorm.weight", src["mtp.pre_fc_norm_embedding.weight"] + 1)
    eq("blk.4.nextn.hnorm.weight", src["mtp.pre_fc_norm_hidden.weight"] + 1)
    eq("blk.4.nextn.shared_head_norm.weight", src["mtp.norm.weight"] + 1)
    assert checked == set(g), sorted(set(g) - checked)


def test_grouped_to_tiled_matches_index_map():
    from pyfast.convert.qwen35 import grouped_to_tiled

    rng = np.random.default_rng(0)
    for Hk, r, D in ((2, 2, 3), (3, 4, 1), (1, 3, 2), (4, 1, 5)):
        perm = tiled_perm(Hk, Hk * r)
        x = rng.standard_normal((Hk * r * D, 7))
        np.testing.assert_array_equal(grouped_to_tiled(x, 0, Hk, r, D), x[head_rows(perm, D)])
        np.testing.assert_array_equal(grouped_to_tiled(x.T, 1, Hk, r, D), x.T[:, head_rows(perm, D)])
        # tiled position j holds a value head of key group j % Hk
        assert all(perm[j] // r == j % Hk for j in range(Hk * r))


def test_types_follow_outtype(tmp_path):
    _, ref = gguf_arrays(FIX / "qwen35moe.gguf")
    for ot, tname in (("f16", "F16"), ("bf16", "BF16")):
        out = tmp_path / f"{ot}.gguf"
        convert_quiet(hf("qwen35moe"), out, outtype=ot)
        r = GGUFReader(str(out))
        assert r.metadata["general.file_type"] == {"f16": 1, "bf16": 32}[ot]
        for n, t in r.tensors.items():
            small = (len(t.shape) == 1 or n.endswith("_norm.weight") or ".ffn_gate_inp" in n
                     or ".ssm_conv1d." in n or not n.endswith(".weight"))
            assert t.type_name == ("F32" if small else tname), n
            a = np.array(r.tensor_array(n))
            if t.type_name == "F32":
                np.testing.assert_array_equal(a, ref[n])
            elif t.type_name == "F16":
                np.testing.assert_array_equal(a, ref[n].astype(np.float16))
            else:
                got = (a.astype(np.uint32) << 16).view(np.float32)
                # round to nearest: within half a bf16 ulp (2^-8 relative) of the f32 value
                assert np.all(np.abs(got - ref[n]) <= np.abs(ref[n]) * 2.0 ** -8 + 1e-30), n
                # and the other neighbour is no closer
                bits = ref[n].view(np.uint32) >> 16
                lo = (bits << 16).view(np.float32)
                hi = ((bits + 1) << 16).view(np.float32)
                best = np.minimum(np.abs(lo - ref[n]), np.abs(hi - ref[n]))
                assert np.all(np.abs(got - ref[n]) <= best), n


def test_bf16_rounding_ties_and_nan():
    from pyfast.convert import to_bf16_bits

    x = np.array([1.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -2.5, np.inf, np.nan, 0.0], dtype=np.float32)
    b = to_bf16_bits(x)
    assert b[0] == 0x3F80 and b[1] == 0x3F80 and b[2] == 0x3F82      # ties to even
    assert b[3] == 0xC020 and b[4] == 0x7F80 and b[6] == 0
    assert (b[5] & 0x7F80) == 0x7F80 and (b[5] & 0x7F) != 0        # still a NaN


@pytest.mark.parametrize("name", NAMES)
def test_no_mtp_drops_nextn_blocks(name, tmp_path):
    out = tmp_path / "nomtp.gguf"
    res = convert_quiet(hf(name), out, mtp=False)
    assert res.n_mtp == 0
    r, g = gguf_arrays(out)
    a = ARCH[name]
    assert r.metadata[f"{a}.block_count"] == 4
    assert f"{a}.nextn_predict_layers" not in r.metadata
    assert r.metadata[f"{a}.attention.recurrent_layers"] == [True, True, True, False]
    assert not [n for n in g if n.startswith("blk.4.")]
    _, full = gguf_arrays(FIX / f"{name}.gguf")
    assert set(g) == {n for n in full if not n.startswith("blk.4.")}
    for n in g:
        np.testing.assert_array_equal(g[n], full[n])


def test_cli_no_mtp_flag(tmp_path, capsys):
    from pyfast.cli import main

    out = tmp_path / "x.gguf"
    assert main(["convert", str(hf("qwen3next")), str(out), "--no-mtp", "--outtype", "F16", "-q"]) == 0
    text = capsys.readouterr().out
    assert "qwen3next, 73 tensors (0 MTP layer(s))" in text
    r = GGUFReader(str(out))
    assert r.metadata["qwen3next.block_count"] == 4 and r.tensors["blk.0.attn_qkv.weight"].type_name == "F16"
    assert main(["convert", str(hf("qwen3next")), str(out), "--mtp"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("blk.4.nextn.eh_proj.weight") for line in lines)
    assert GGUFReader(str(out)).metadata["qwen3next.block_count"] == 5


def test_cli_errors_without_traceback(tmp_path, capsys):
    from pyfast.cli import main

    assert main(["convert", str(tmp_path), str(tmp_path / "o.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no config.json" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["convert", str(hf("qwen35")), str(tmp_path / "o.gguf"), "--outtype", "q4_0"])


def test_cli_subprocess(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    d = copy_hf("qwen35", tmp_path / "qwen35")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (d / f).unlink()
    r = subprocess.run([sys.executable, "-m", "pyfast", "convert", str(d), str(tmp_path / "o.gguf"), "-q"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "warning: " in r.stderr and "no tokenizer.json" in r.stderr
    assert "(no tokenizer)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "pyfast", "convert", str(tmp_path / "nope"), str(tmp_path / "o2.gguf")],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------------
# other checkpoint layouts give the same file
# ---------------------------------------------------------------------------------------------

def test_bf16_checkpoint(tmp_path):
    d = copy_hf("qwen35", tmp_path / "qwen35", with_weights=False)
    src = st_read(hf("qwen35") / "model.safetensors")
    bits = {k: (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16) for k, v in src.items()}
    st_write(d / "model.safetensors", bits, {k: "BF16" for k in bits})
    convert_quiet(d, tmp_path / "bf.gguf")
    _, g = gguf_arrays(tmp_path / "bf.gguf")
    truncated = {k: (b.astype(np.uint32) << 16).view(np.float32) for k, b in bits.items()}
    np.testing.assert_array_equal(g["token_embd.weight"], truncated["model.embed_tokens.weight"])
    np.testing.assert_array_equal(g["blk.0.attn_norm.weight"],
                                  truncated["model.layers.0.input_layernorm.weight"] + np.float32(1))
    np.testing.assert_array_equal(g["blk.4.nextn.eh_proj.weight"], truncated["mtp.fc.weight"])


def test_sharded_fused_experts_checkpoint(tmp_path):
    """Experts stored fused (transformers' in-memory layout: gate_up_proj [E, 2ff, d], down_proj
    [E, d, ff]) in two shards with an index: the same GGUF."""
    d = copy_hf("qwen35moe", tmp_path / "qwen35moe", with_weights=False)
    src = st_read(hf("qwen35moe") / "model.safetensors")
    fused = {}
    for k, v in src.items():
        if ".mlp.experts." not in k:
            fused[k] = v
    for p in [f"model.layers.{i}" for i in range(4)] + ["mtp.layers.0"]:
        e = f"{p}.mlp.experts"
        fused[f"{e}.gate_up_proj"] = np.stack([np.concatenate([src[f"{e}.{x}.gate_proj.weight"],
                                                               src[f"{e}.{x}.up_proj.weight"]]) for x in range(4)])
        fused[f"{e}.down_proj"] = np.stack([src[f"{e}.{x}.down_proj.weight"] for x in range(4)])
    names = sorted(fused)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fn, ks in shards.items():
        st_write(d / fn, {k: fused[k] for k in ks})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: fn for fn, ks in shards.items() for k in ks}}))
    convert_quiet(d, tmp_path / "out.gguf")
    assert_same_gguf(tmp_path / "out.gguf", FIX / "qwen35moe.gguf")


def test_multimodal_checkpoint_names(tmp_path):
    """Qwen3_5ForConditionalGeneration layout: text_config, model.language_model.* names, vision
    tensors (skipped), mtp.* at the top level."""
    d = copy_hf("qwen35", tmp_path / "qwen35", with_weights=False)
    text = json.loads((hf("qwen35") / "config.json").read_text())
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": True}
    (d / "config.json").write_text(json.dumps(cfg))
    src = st_read(hf("qwen35") / "model.safetensors")
    renamed = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in src.items()}
    renamed["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    st_write(d / "model.safetensors", renamed)
    convert_quiet(d, tmp_path / "out.gguf")
    assert_same_gguf(tmp_path / "out.gguf", FIX / "qwen35.gguf")


def test_config_without_mtp_count_infers_it(tmp_path):
    """Qwen3-Next configs do not name mtp_num_hidden_layers: the count comes from the tensors (the
    qwen3next fixture relies on it); a Qwen3.5 config naming layers the checkpoint lacks only
    warns, a count that disagrees with the tensors is an error."""
    assert "mtp_num_hidden_layers" not in json.loads((hf("qwen3next") / "config.json").read_text())
    d = copy_hf("qwen35", tmp_path / "qwen35", with_weights=False)
    src = st_read(hf("qwen35") / "model.safetensors")
    st_write(d / "model.safetensors", {k: v for k, v in src.items() if not k.startswith("mtp.")})
    with pytest.warns(UserWarning, match="no mtp.. tensors|no mtp"):
        res = convert(d, tmp_path / "a.gguf")
    assert res.n_mtp == 0
    st_write(d / "model.safetensors", src)
    cfg = json.loads((d / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 2
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="declares 2 MTP layer"):
        convert_quiet(d, tmp_path / "b.gguf")


def test_without_tokenizer_warns(tmp_path):
    d = copy_hf("qwen35moe", tmp_path / "qwen35moe")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (d / f).unlink()
    with pytest.warns(UserWarning, match="no tokenizer.json"):
        res = convert(d, tmp_path / "o.gguf")
    assert not res.has_tokenizer
    r = GGUFReader(str(tmp_path / "o.gguf"))
    assert not [k for k in r.metadata if k.startswith("tokenizer.")]
    assert_same_gguf(tmp_path / "o.gguf", FIX / "qwen35moe.gguf",
                     skip_meta=[k for k in GGUFReader(str(FIX / "qwen35moe.gguf")).metadata if k.startswith("tokenizer.")])


def test_tokenizer_metadata_variants(tmp_path):
    from pyfast.convert.hf_tokenizer import tokenizer_metadata

    d = copy_hf("qwen35", tmp_path / "t", with_weights=False)
    cfg = json.loads((d / "config.json").read_text())
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["model"]["merges"] = [m.split(" ") for m in ["Ġ t", "h e"]]   # the newer [left, right] form
    tj["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|im_start|>"}},
                                                                       {"Sequence": {"id": "A"}}]}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = [{"name": "default", "template": "D"}, {"name": "tool use", "template": "T"}]
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    md = {k: v for k, v, _ in tokenizer_metadata(str(d), cfg, 280, "qwen35")}
    assert md["tokenizer.ggml.merges"] == ["Ġ t", "h e"]
    assert md["tokenizer.ggml.add_bos_token"] is True and md["tokenizer.ggml.add_eos_token"] is False
    assert md["tokenizer.chat_template"] == "D" and md["tokenizer.chat_template.tool_use"] == "T"
    assert md["tokenizer.chat_templates"] == ["tool_use"]
    with pytest.raises(ValueError, match="does not fit the model's vocabulary"):
        tokenizer_metadata(str(d), cfg, 100, "qwen35")


@pytest.mark.parametrize("name", ["qwen35", "qwen3next"])
def test_pyfast_tokenizer_matches_hf_tokenizer(name):
    """The written vocabulary, merges and pre-tokenizer name give the same ids as the HF
    tokenizer.json (through ``tokenizers``) on text that exercises the merges and specials."""
    from tokenizers import Tokenizer as HFTokenizer

    from pyfast.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(GGUFReader(str(FIX / f"{name}.gguf")).metadata)
    ref = HFTokenizer.from_file(str(hf(name) / "tokenizer.json"))
    for text in ["the winter there, in the water;  at 12 we sat.\n\n<|im_start|>user\nhi<|im_end|>",
                 "Ünïcödé thé  enter\t\tre-entered 3.14 don't"]:
        assert tok.encode(text, special=True) == ref.encode(text).ids, text
    assert tok.eos_id == 271 and tok.n_vocab == 280


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        convert(tmp_path / "missing", tmp_path / "o.gguf")
    with pytest.raises(ValueError, match="no config.json"):
        convert(tmp_path, tmp_path / "o.gguf")
    d = copy_hf("qwen35", tmp_path / "m", with_weights=False)
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        convert_quiet(d, tmp_path / "o.gguf")
    src = st_read(hf("qwen35") / "model.safetensors")

    def variant(cfg_edit=None, tensors=None):
        cfg = json.loads((hf("qwen35") / "config.json").read_text())
        if cfg_edit:
            cfg_edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        st_write(d / "model.safetensors", src if tensors is None else tensors)
        return d

    with pytest.raises(ValueError, match="unsupported model_type 'gpt_neox'; supported model types: .*qwen3_moe"):
        convert_quiet(variant(lambda c: c.update(model_type="gpt_neox")), tmp_path / "o.gguf")
    with pytest.raises(ValueError, match="unsupported architectures"):
        convert_quiet(variant(lambda c: (c.pop("model_type"), c.update(architectures=["GPTNeoXForCausalLM"]))),
                      tmp_path / "o.gguf")
    miss = dict(src)
    del miss["model.layers.1.linear_attn.A_log"]
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.linear_attn.A_log'"):
        convert_quiet(variant(tensors=miss), tmp_path / "o.gguf")
    bad = dict(src)
    bad["model.layers.3.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    with pytest.raises(ValueError, match=r"'model.layers.3.self_attn.k_proj.weight' has shape \[8, 64\], "
                                         r"expected \[16, 64\]"):
        convert_quiet(variant(tensors=bad), tmp_path / "o.gguf")
    extra = dict(src)
    extra["model.layers.0.mystery.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match="unexpected tensor.*model.layers.0.mystery.weight"):
        convert_quiet(variant(tensors=extra), tmp_path / "o.gguf")
    with pytest.raises(ValueError, match="linear_key_head_dim 32 != linear_value_head_dim 16"):
        convert_quiet(variant(lambda c: c.update(linear_key_head_dim=32)), tmp_path / "o.gguf")
    with pytest.raises(ValueError, match="layer_types has 3 entries for 4 layers"):
        convert_quiet(variant(lambda c: c.update(layer_types=c["layer_types"][:3])), tmp_path / "o.gguf")
    with pytest.raises(ValueError, match="missing 'hidden_size'"):
        convert_quiet(variant(lambda c: c.pop("hidden_size")), tmp_path / "o.gguf")
    with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
        convert_quiet(variant(lambda c: c.update(tie_word_embeddings=False)), tmp_path / "o.gguf")
    variant()
    st_write(d / "model.safetensors", src, {"model.norm.weight": "I32"})
    with pytest.raises(ValueError, match="'model.norm.weight' has dtype I32"):
        convert_quiet(d, tmp_path / "o.gguf")
    with pytest.raises(ValueError, match="unknown output type 'q8_0'"):
        convert_quiet(variant(), tmp_path / "o.gguf", outtype="q8_0")
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ValueError, match="not a safetensors file"):
        convert_quiet(d, tmp_path / "o.gguf")
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"{xx}")
    with pytest.raises(ValueError, match="bad safetensors header"):
        convert_quiet(d, tmp_path / "o.gguf")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: unreadable"):
        convert_quiet(d, tmp_path / "o.gguf")
    assert not (tmp_path / "o.gguf").exists()


# ---------------------------------------------------------------------------------------------
# an independent float64 numpy forward over the GGUF reproduces the transformers references
# ---------------------------------------------------------------------------------------------

def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class HybridRef:
    """The GGUF's model in float64 numpy, written from the conventions in pyfast/convert/qwen35.py:
    stored norms already include the +1; ssm_a < 0; value head j uses key head j % Hk (qwen35*,
    tiled) or j // (Hv/Hk) (qwen3next, grouped); attn_q rows per head [q | gate]; NEOX rope on the
    first rope.dimension_count dims of each head."""

    def __init__(self, path):
        r = GGUFReader(str(path))
        self.md = r.metadata
        self.a = a = self.md["general.architecture"]
        self.W = {n: np.array(r.tensor_array(n), dtype=np.float64) for n in r.tensors}
        g = lambda k: self.md[f"{a}.{k}"]
        self.n_layer = g("block_count") - self.md.get(f"{a}.nextn_predict_layers", 0)
        self.H, self.Hkv, self.D = g("attention.head_count"), g("attention.head_count_kv"), g("attention.key_length")
        self.eps, self.n_rot, self.base = g("attention.layer_norm_rms_epsilon"), g("rope.dimension_count"), g("rope.freq_base")
        self.S, self.Hk, self.Hv = g("ssm.state_size"), g("ssm.group_count"), g("ssm.time_step_rank")
        self.recurrent = g("attention.recurrent_layers")
        self.k_used = self.md.get(f"{a}.expert_used_count", 0)
        self.out = self.W.get("output.weight", self.W["token_embd.weight"])

    def rope(self, x, pos):
        half = self.n_rot // 2
        ang = pos[:, None] * self.base ** (-np.arange(half) * 2.0 / self.n_rot)
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:self.n_rot]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., self.n_rot:]], axis=-1)

    def attention(self, b, x):
        W, H, Hkv, D, T = self.W, self.H, self.Hkv, self.D, x.shape[0]
        qg = (x @ W[f"{b}.attn_q.weight"].T).reshape(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
        k = (x @ W[f"{b}.attn_k.weight"].T).reshape(T, Hkv, D)
        v = (x @ W[f"{b}.attn_v.weight"].T).reshape(T, Hkv, D)
        pos = np.arange(T, dtype=np.float64)
        q = self.rope(_rms(q, W[f"{b}.attn_q_norm.weight"], self.eps), pos)
        k = self.rope(_rms(k, W[f"{b}.attn_k_norm.weight"], self.eps), pos)
        kv = np.arange(H) // (H // Hkv)
        sc = np.einsum("thd,shd->hts", q, k[:, kv]) / np.sqrt(D)
        sc = np.where(np.tril(np.ones((T, T), bool))[None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", p, v[:, kv]).reshape(T, H * D)
        return (o * _sigmoid(gate)) @ W[f"{b}.attn_output.weight"].T

    def gdn(self, b, x):
        W, S, Hk, Hv, T = self.W, self.S, self.Hk, self.Hv, x.shape[0]
        r = Hv // Hk
        qkv = x @ W[f"{b}.attn_qkv.weight"].T
        z = (x @ W[f"{b}.attn_gate.weight"].T).reshape(T, Hv, S)
        if self.a == "qwen3next":
            ba = (x @ W[f"{b}.ssm_ba.weight"].T).reshape(T, Hk, 2 * r)
            beta, alpha = ba[:, :, :r].reshape(T, Hv), ba[:, :, r:].reshape(T, Hv)
            kh = np.arange(Hv) // r
        else:
            beta, alpha = x @ W[f"{b}.ssm_beta.weight"].T, x @ W[f"{b}.ssm_alpha.weight"].T
            kh = np.arange(Hv) % Hk
        beta = _sigmoid(beta)
        g = W[f"{b}.ssm_a"] * np.logaddexp(0.0, alpha + W[f"{b}.ssm_dt.bias"])
        cw = W[f"{b}.ssm_conv1d.weight"]                         # [C, K]
        K = cw.shape[1]
        xp = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv])
        conv = _silu(sum(xp[j:j + T] * cw[:, j] for j in range(K)))
        q = conv[:, :Hk * S].reshape(T, Hk, S)
        k = conv[:, Hk * S:2 * Hk * S].reshape(T, Hk, S)
        v = conv[:, 2 * Hk * S:].reshape(T, Hv, S)
        l2 = lambda u: u / np.sqrt((u * u).sum(-1, keepdims=True) + 1e-6)
        q, k = l2(q)[:, kh], l2(k)[:, kh]
        M = np.zeros((Hv, S, S))
        o = np.zeros((T, Hv, S))
        for t in range(T):
            M *= np.exp(g[t])[:, None, None]
            u = np.einsum("hij,hi->hj", M, k[t])
            delta = beta[t][:, None] * (v[t] - u)
            M += k[t][:, :, None] * delta[:, None, :]
            o[t] = np.einsum("hij,hi->hj", M, q[t]) / np.sqrt(S)
        o = _rms(o, W[f"{b}.ssm_norm.weight"], self.eps) * _silu(z)
        return o.reshape(T, Hv * S) @ W[f"{b}.ssm_out.weight"].T

    def ffn(self, b, x):
        W = self.W
        if f"{b}.ffn_gate.weight" in W:
            return (_silu(x @ W[f"{b}.ffn_gate.weight"].T) * (x @ W[f"{b}.ffn_up.weight"].T)) @ W[f"{b}.ffn_down.weight"].T
        logits = x @ W[f"{b}.ffn_gate_inp.weight"].T
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            top = np.argsort(-p[t])[:self.k_used]
            wts = p[t, top] / p[t, top].sum()
            for e, w in zip(top, wts):
                h = _silu(W[f"{b}.ffn_gate_exps.weight"][e] @ x[t]) * (W[f"{b}.ffn_up_exps.weight"][e] @ x[t])
                out[t] += w * (W[f"{b}.ffn_down_exps.weight"][e] @ h)
        sh = (_silu(x @ W[f"{b}.ffn_gate_shexp.weight"].T) * (x @ W[f"{b}.ffn_up_shexp.weight"].T)) @ W[f"{b}.ffn_down_shexp.weight"].T
        return out + _sigmoid(x @ W[f"{b}.ffn_gate_inp_shexp.weight"].T) * sh

    def block(self, i, x, recurrent):
        b, W = f"blk.{i}", self.W
        h = _rms(x, W[f"{b}.attn_norm.weight"], self.eps)
        x = x + (self.gdn(b, h) if recurrent else self.attention(b, h))
        return x + self.ffn(b, _rms(x, W[f"{b}.post_attention_norm.weight"], self.eps))

    def forward(self, tokens):
        x = self.W["token_embd.weight"][tokens]
        for i in range(self.n_layer):
            x = self.block(i, x, self.recurrent[i])
        h = _rms(x, self.W["output_norm.weight"], self.eps)
        return h @ self.out.T, h, x

    def mtp(self, tokens, h_in):
        b, W = f"blk.{self.n_layer}", self.W
        e = W["token_embd.weight"][tokens]
        x = np.concatenate([_rms(e, W[f"{b}.nextn.enorm.weight"], self.eps),
                            _rms(h_in, W[f"{b}.nextn.hnorm.weight"], self.eps)], axis=-1) @ W[f"{b}.nextn.eh_proj.weight"].T
        y = _rms(self.block(self.n_layer, x, False), W[f"{b}.nextn.shared_head_norm.weight"], self.eps)
        return y @ self.out.T, y


def _rel(a, b):
    return float((np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)).max())


@pytest.mark.parametrize("name", NAMES)
def test_numpy_forward_reproduces_references(name):
    ref = np.load(FIX / f"{name}.npz")
    m = HybridRef(FIX / f"{name}.gguf")
    assert int(ref["n_prefill"]) == 5 and ref["tokens_0"].shape == (13,) and ref["tokens_1"].shape == (9,)
    if name != "qwen35":
        assert float(ref["router_margin"]) >= 1e-4
    np.testing.assert_allclose(ref["decode_logits_0"], ref["logits_0"], rtol=0, atol=1e-4)
    for s in (0, 1):
        toks = ref[f"tokens_{s}"]
        T = toks.size
        for k, shape in (("logits", (T, 280)), ("hidden", (T, 64)), ("hidden_prenorm", (T, 64)),
                         ("mtp_h_in", (T, 64)), ("mtp_logits", (T, 280)), ("mtp_hidden", (T, 64))):
            assert ref[f"{k}_{s}"].shape == shape and ref[f"{k}_{s}"].dtype == np.float32, k
        logits, h, pre = m.forward(toks)
        assert _rel(logits, ref[f"logits_{s}"]) < 1e-5
        assert _rel(h, ref[f"hidden_{s}"]) < 1e-5
        assert _rel(pre, ref[f"hidden_prenorm_{s}"]) < 1e-5
        # MTP pairing: row p gets (token_p, h_{p-1}); row 0 gets zeros
        h_in = ref[f"mtp_h_in_{s}"]
        assert not h_in[0].any()
        np.testing.assert_array_equal(h_in[1:], ref[f"hidden_{s}"][:-1])
        ml, y = m.mtp(toks, h_in.astype(np.float64))
        assert _rel(ml, ref[f"mtp_logits_{s}"]) < 1e-5
        assert _rel(y, ref[f"mtp_hidden_{s}"]) < 1e-5
        # the pairing matters: shifting the hidden rows by one changes the MTP logits
        wrong, _ = m.mtp(toks, ref[f"hidden_{s}"].astype(np.float64))
        assert _rel(wrong, ref[f"mtp_logits_{s}"]) > 1e-2


@pytest.mark.parametrize("name", ["qwen35", "qwen3next"])
def test_numpy_forward_is_sensitive_to_conventions(name, tmp_path):
    """Breaking one convention (V-head order, norm +1, ssm_a sign) moves the logits far beyond the
    tolerance, so the reference comparison above really checks them."""
    ref = np.load(FIX / f"{name}.npz")
    toks = ref["tokens_0"]
    m = HybridRef(FIX / f"{name}.gguf")
    base = m.W.copy()
    Hk, Hv, S = m.Hk, m.Hv, m.S
    swap = np.concatenate([np.arange(2 * Hk * S), 2 * Hk * S + head_rows(tiled_perm(Hk, Hv), S)])
    edits = {
        "v order": lambda W: W.update({"blk.0.attn_qkv.weight": W["blk.0.attn_qkv.weight"][swap]}),
        "norm +1": lambda W: W.update({"blk.1.attn_norm.weight": W["blk.1.attn_norm.weight"] - 1}),
        "ssm_a sign": lambda W: W.update({"blk.2.ssm_a": -W["blk.2.ssm_a"] * 0.01}),
        "gated norm +1": lambda W: W.update({"blk.0.ssm_norm.weight": W["blk.0.ssm_norm.weight"] + 1}),
    }
    for what, edit in edits.items():
        m.W = dict(base)
        edit(m.W)
        assert _rel(m.forward(toks)[0], ref["logits_0"]) > 1e-3, what
    m.W = base


# ---------------------------------------------------------------------------------------------
# regeneration (torch + transformers)
# ---------------------------------------------------------------------------------------------

@pytest.mark.torch
def test_regenerated_fixtures_match_committed(tmp_path, request):
    """Rebuilds all three fixtures (about a minute on 2 cores): runs with ``-m torch`` or
    ``PYFAST_TORCH_TESTS=1``, and needs torch, transformers and safetensors."""
    if "torch" not in (request.config.getoption("markexpr") or "") and not os.environ.get("PYFAST_TORCH_TESTS"):
        pytest.skip("slow fixture regeneration: run with -m torch or PYFAST_TORCH_TESTS=1")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_hybrid_fixtures as mk
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert mk.main(["--out", str(tmp_path)]) == 0
    for name in NAMES:
        for f in sorted(p.name for p in hf(name).iterdir()):
            new, old = tmp_path / "hf" / name / f, hf(name) / f
            if f.endswith(".safetensors"):
                a, b = st_read(new), st_read(old)
                assert sorted(a) == sorted(b)
                for k in a:
                    np.testing.assert_array_equal(a[k], b[k], err_msg=f"{name}: {k}")
            else:
                assert json.loads(new.read_text()) == json.loads(old.read_text()) if f.endswith(".json") \
                    else new.read_text() == old.read_text(), f
        assert_same_gguf(tmp_path / f"{name}.gguf", FIX / f"{name}.gguf")
        a, b = np.load(tmp_path / f"{name}.npz"), np.load(FIX / f"{name}.npz")
        assert sorted(a.files) == sorted(b.files)
        for k in a.files:
            if k.startswith("tokens") or k == "n_prefill":
                np.testing.assert_array_equal(a[k], b[k])
            else:
                np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5, err_msg=f"{name}: {k}")


@pytest.mark.parametrize("change", ["metaspace", "byte_fallback", "unigram"])
def test_sentencepiece_style_tokenizer_is_not_byte_level(change, tmp_path):
    """A BPE over SentencePiece pieces (Metaspace / byte fallback, as Gemma's) is written as a
    SentencePiece vocabulary, never as byte-level BPE (tests/unit/test_tokenizer_spm.py checks the
    ids); the byte-level original stays gpt2; a Unigram tokenizer.json is refused by name."""
    from pyfast.convert.hf_tokenizer import tokenizer_metadata

    src = FIX / "hf" / "qwen35"
    cfg = json.loads((src / "config.json").read_text())
    n_vocab = int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])
    shutil.copytree(src, tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors"))
    md = {k: v for k, v, _ in tokenizer_metadata(str(tmp_path / "m"), cfg, n_vocab, "qwen35")}
    assert md["tokenizer.ggml.model"] == "gpt2"
    tj = json.loads((src / "tokenizer.json").read_text())
    if change == "metaspace":
        tj["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"}
        tj["decoder"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"}
    elif change == "byte_fallback":
        tj["pre_tokenizer"] = None
        tj["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]}
        tj["model"]["byte_fallback"] = True
    else:
        tj["model"] = {"type": "Unigram", "vocab": [["a", -1.0]], "unk_id": 0}
    (tmp_path / "m" / "tokenizer.json").write_text(json.dumps(tj))
    if change == "unigram":
        with pytest.raises(ValueError, match="only BPE tokenizers"):
            tokenizer_metadata(str(tmp_path / "m"), cfg, n_vocab, "qwen35")
        return
    md = {k: v for k, v, _ in tokenizer_metadata(str(tmp_path / "m"), cfg, n_vocab, "qwen35")}
    assert md["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.scores" in md
    assert md["tokenizer.ggml.add_space_prefix"] is (change == "metaspace")
