#!/usr/bin/env python3
"""Train a small EAGLE-3 head for SmolLM2-135M-Instruct on this machine (CPU torch, one thread).

Three stages, each cached in ``--work`` so a rerun resumes:

1. **Data** (pyfast): chat prompts built from templates (topics x task kinds, plus "repeat /
   rewrite this passage" tasks over the model's own earlier answers; none of them is a prompt of
   ``pyfast bench --spec``) are answered greedily by the target (``LLM.generate_batch``). Each
   prompt + answer is decoded once more by a ``Context(capture_layers=(2, 15, 27))``: pyfast's own
   feature capture gives the input rows of those layers for every position, and the logits give the
   target's greedy next token at every position (the labels).
2. **Train** (torch, float32, ``torch.set_num_threads(1)``): the head of ``pyfast/spec/eagle3.py``
   (fc over the three features, one decoder layer over [RMS(emb(x)); RMS(g)], SwiGLU, final norm,
   a reduced head over the ``--vocab`` most frequent label tokens, mapped by d2t) with EAGLE-3's
   training-time test: step 0 reads the target's features, step k reads step k-1's output; step k at
   anchor P attends to the step-0 rows at positions <= P and to its own chain rows at P (what the
   drafting chain sees). Loss: cross-entropy against the target's greedy token, weight 0.8^k.
   The reduced head starts from the target's (tied) embedding rows of the draft vocabulary, the
   final norm from the target's.
3. **Export**: a Hugging Face directory (EAGLE-3 ``midlayer.`` names, d2t as offsets, t2d) and its
   GGUF through ``pyfast.convert.eagle3`` (F16).

Usage::

    nice -n 10 python scripts/train_eagle3.py --work eagle3-smollm2 --minutes 30
    pyfast bench --spec eagle3 -md eagle3-smollm2/eagle3.gguf --prompts chat -t 2
    python scripts/train_eagle3.py --work eagle3-smollm2 --eval      # acceptance per draft position

Defaults: 480 prompts, answers of up to 160 tokens, 4096-token draft vocabulary, 3 test-time steps.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOPICS = [
    "volcanoes", "honeybees", "the printing press", "black holes", "photosynthesis", "the Roman empire",
    "electric cars", "coral reefs", "the stock market", "vaccines", "the moon landing", "glaciers",
    "jazz music", "the human heart", "recycling", "earthquakes", "chess", "the internet", "bread baking",
    "solar panels", "the Great Wall of China", "dinosaurs", "rain forests", "the French revolution",
    "microscopes", "tea", "bicycles", "penguins", "the water cycle", "democracy", "tornadoes", "coffee",
    "the periodic table", "octopuses", "the Olympic games", "windmills", "mountains", "the immune system",
    "origami", "submarines", "lighthouses", "bridges", "elephants", "the Silk Road", "clouds", "magnets",
    "public libraries", "sleep", "deserts", "airplanes", "gardening", "the ocean tides", "pyramids",
    "robots", "trees", "hurricanes", "the violin", "money", "cheese", "satellites", "butterflies",
    "friendship", "time zones", "fossils", "vitamins", "trains", "the alphabet", "rivers", "snow",
    "batteries", "owls", "maps", "soap", "the compass", "wolves", "spiders", "the brain", "salt",
    "calendars", "rockets", "kites", "whales", "cities", "farming", "paper", "glass", "football",
]
TASKS = [
    "Explain {t} to a ten-year-old.", "Write three interesting facts about {t}.",
    "Describe {t} in one paragraph.", "What are the pros and cons of {t}?",
    "Write a short poem about {t}.", "Give me a brief history of {t}.",
    "Why is {t} important?", "Write a short story that involves {t}.",
    "List five questions a student might ask about {t}, with short answers.",
    "Summarize what scientists know about {t}.", "How would you teach a friend about {t}?",
    "Write a Python function related to {t} and explain it.",
]
COPY_TASKS = [
    "Repeat the following text exactly:\n\n{p}", "Copy this paragraph word for word:\n\n{p}",
    "Rewrite the following text, keeping every sentence the same:\n\n{p}",
    "Here is a passage:\n\n{p}\n\nWrite it out again without changes.",
]
LAYERS = (2, 15, 27)   # inputs of layers {2, n/2, n-3} for n = 30


# --- stage 1: data --------------------------------------------------------------------------------
def make_data(work: Path, n_prompts: int, max_tokens: int, threads: int, log) -> None:
    from pyfast.context import Context
    from pyfast.hub import resolve_model
    from pyfast.llm import LLM

    path = str(resolve_model(None, quiet=True))
    llm = LLM(path, n_ctx=2048, n_threads=threads)
    rng = np.random.default_rng(1)
    prompts = []
    for i in range(n_prompts * 3 // 4):
        prompts.append(TASKS[i % len(TASKS)].format(t=TOPICS[int(rng.integers(len(TOPICS)))]))
    t0 = time.time()
    answers: list[tuple[list[int], list[int]]] = []

    def run(batch):
        ids = [llm.tokenize(llm.apply_chat_template([{"role": "user", "content": p}])) for p in batch]
        outs = llm.generate_batch(ids, max_tokens=max_tokens, temperature=0)
        for i, o in zip(ids, outs):
            answers.append((list(i), list(o.tokens)))

    for b in range(0, len(prompts), 8):
        run(prompts[b:b + 8])
        log(f"[data] {len(answers)}/{n_prompts} answers, {time.time() - t0:.0f} s")
    texts = [llm.detokenize(a, skip_special=True) for _, a in answers if len(a) >= min(40, max_tokens)]
    copies = [COPY_TASKS[i % len(COPY_TASKS)].format(p=texts[int(rng.integers(len(texts)))].strip())
              for i in range(n_prompts - len(prompts))]
    for b in range(0, len(copies), 8):
        run(copies[b:b + 8])
        log(f"[data] {len(answers)}/{n_prompts} answers, {time.time() - t0:.0f} s")
    ctx = Context(llm.model, n_ctx=2048, n_threads=threads, capture_layers=LAYERS)
    toks, feats, labels, starts = [], [], [], []
    n = 0
    for p, a in answers:
        seq = np.asarray(p + a, dtype=np.int32)
        ctx.clear()
        logits = ctx.decode(seq, positions=np.arange(seq.size), seq_ids=0, logits="all")
        toks.append(seq)
        feats.append(ctx.last_features.astype(np.float16))
        labels.append(logits.argmax(1).astype(np.int32))
        starts.append(n)
        n += seq.size
    np.savez(work / "data.npz", tokens=np.concatenate(toks), features=np.concatenate(feats),
             labels=np.concatenate(labels), starts=np.asarray(starts + [n], dtype=np.int64),
             n_prompt=np.asarray([len(p) for p, _ in answers], dtype=np.int64))
    log(f"[data] {len(answers)} sequences, {n} tokens with features, {time.time() - t0:.0f} s")


# --- stage 2: the head in torch ----------------------------------------------------------------------
def build_head(torch, d, n_head, n_head_kv, ff, Vd, dt, eps, theta):
    nn = torch.nn
    hd = d // n_head

    class RMS(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))

        def forward(self, x):
            return self.weight * x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3 * dt, d, bias=False)
            self.input_layernorm, self.hidden_norm, self.post_attention_layernorm = RMS(d), RMS(d), RMS(d)
            self.q_proj = nn.Linear(2 * d, n_head * hd, bias=False)
            self.k_proj = nn.Linear(2 * d, n_head_kv * hd, bias=False)
            self.v_proj = nn.Linear(2 * d, n_head_kv * hd, bias=False)
            self.o_proj = nn.Linear(n_head * hd, d, bias=False)
            self.gate_proj = nn.Linear(d, ff, bias=False)
            self.up_proj = nn.Linear(d, ff, bias=False)
            self.down_proj = nn.Linear(ff, d, bias=False)
            self.norm = RMS(d)
            self.lm_head = nn.Linear(d, Vd, bias=False)
            inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
            self.register_buffer("inv", inv, persistent=False)

        def rope(self, x, pos):                     # x [B, n, h, hd], pos [n]
            ang = pos[:, None].float() * self.inv[None, :]
            cos = torch.cat([ang.cos()] * 2, -1)[None, :, None, :]
            sin = torch.cat([ang.sin()] * 2, -1)[None, :, None, :]
            x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
            return x * cos + torch.cat([-x2, x1], -1) * sin

        def qkv(self, emb, g, pos):
            B, n, _ = g.shape
            hn = self.hidden_norm(g)
            a = torch.cat([self.input_layernorm(emb), hn], -1)
            q = self.rope(self.q_proj(a).view(B, n, n_head, hd), pos)
            k = self.rope(self.k_proj(a).view(B, n, n_head_kv, hd), pos)
            v = self.v_proj(a).view(B, n, n_head_kv, hd)
            return q, k, v

        def rest(self, g, o):
            x = g + self.o_proj(o)
            y = self.post_attention_layernorm(x)
            z = x + self.down_proj(torch.nn.functional.silu(self.gate_proj(y)) * self.up_proj(y))
            return z, self.lm_head(self.norm(z))

    return Head()


def ttt_forward(torch, head, E, tokens, feats, K, n_head, n_head_kv):
    """Training-time test over a batch [B, T]: returns the logits of steps 0..K-1, step k's row P
    predicting the label at position P + 1 + k (rows P < T - 1 - k)."""
    B, T = tokens.shape
    rep = n_head // n_head_kv
    n0 = T - 1
    pos0 = torch.arange(n0)
    g = head.fc(feats[:, :n0])
    q, k0, v0 = head.qkv(E[tokens[:, 1:]], g, pos0)
    k0r, v0r = k0.repeat_interleave(rep, 2), v0.repeat_interleave(rep, 2)  # [B, n0, H, hd]
    hd = q.shape[-1]
    causal = torch.ones(n0, n0, dtype=torch.bool).tril()
    diag_k, diag_v, outs = [], [], []
    for step in range(K):
        n = n0 - step
        if step > 0:   # step k: (token P + 1 + k, step k-1's output at anchor P) at position P + k
            g = g[:, :n]
            q, kk, vv = head.qkv(E[tokens[:, 1 + step:]], g, pos0[:n] + step)
            diag_k = [x[:, :n] for x in diag_k] + [kk.repeat_interleave(rep, 2)]
            diag_v = [x[:, :n] for x in diag_v] + [vv.repeat_interleave(rep, 2)]
        s0 = torch.einsum("bqhd,bkhd->bhqk", q, k0r) / math.sqrt(hd)            # [B, H, n, n0]
        s0 = s0.masked_fill(~causal[:n], float("-inf"))
        sd = [torch.einsum("bqhd,bqhd->bhq", q, dk)[..., None] / math.sqrt(hd) for dk in diag_k]
        p = torch.softmax(torch.cat([s0] + sd, -1), -1)
        o = torch.einsum("bhqk,bkhd->bqhd", p[..., :n0], v0r)
        for j, dv in enumerate(diag_v):
            o = o + p[..., n0 + j].permute(0, 2, 1)[..., None] * dv
        z, logits = head.rest(g, o.reshape(B, n, -1))
        outs.append(logits)
        g = z
    return outs


def train(work: Path, minutes: float, vocab: int, K: int, seq_len: int, batch: int, lr: float, log) -> None:
    import torch

    from pyfast.hub import resolve_model
    from pyfast.models import Model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    z = np.load(work / "data.npz")
    tokens, feats, labels, starts = z["tokens"], z["features"], z["labels"], z["starts"]
    model = Model(str(resolve_model(None, quiet=True)))
    a = model.args
    V, d = model.n_vocab, a.n_embd
    n_seq = starts.size - 1
    n_prompt = z["n_prompt"]
    answer = np.zeros(labels.size, dtype=bool)  # labels of answer tokens (the shared system prompt would dominate)
    for i in range(n_seq):
        answer[int(starts[i]) + max(int(n_prompt[i]) - 1, 0): int(starts[i + 1]) - 1] = True
    counts = np.bincount(labels[answer], minlength=V)
    d2t = np.sort(np.argsort(-counts, kind="stable")[:vocab])
    t2d = np.full(V, -1, dtype=np.int64)
    t2d[d2t] = np.arange(vocab)
    cover = counts[d2t].sum() / counts.sum()
    log(f"[train] {tokens.size} tokens, draft vocabulary {vocab} covers {cover:.1%} of the labels")
    E = torch.tensor(model.weights.f32("token_embd.weight"))                 # [V, d] (tied head)
    head = build_head(torch, d, a.n_head, a.n_head_kv, a.n_ff, vocab, d, a.eps, a.rope.base)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
        head.lm_head.weight.copy_(E[torch.tensor(d2t)])
        head.norm.weight.copy_(torch.tensor(model.weights.f32("output_norm.weight")))
    # train / held-out split by sequence
    rng = np.random.default_rng(0)
    order = rng.permutation(n_seq)
    held = set(order[: max(4, n_seq // 20)].tolist())
    chunks = []                                   # (start, length) windows of whole sequences
    for i in range(n_seq):
        s, e = int(starts[i]), int(starts[i + 1])
        # windows from the sequence start: the prompt is context (as in drafting), not a target
        for c in range(s, e - 8, seq_len):
            chunks.append((i in held, c, min(seq_len, e - c)))
    tr = [c for c in chunks if not c[0]]
    ev = [c for c in chunks if c[0]]
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    lab = np.where(answer, t2d[labels], -1)                                  # -1: not trained on
    lab_d = torch.tensor(lab)
    T_all = torch.tensor(tokens.astype(np.int64))
    F_all = torch.tensor(feats.astype(np.float32))
    f_scale = float(np.sqrt((feats[:20000].astype(np.float32) ** 2).mean()))

    def batch_of(cs):
        L = min(c[2] for c in cs)
        idx = torch.stack([torch.arange(c[1], c[1] + L) for c in cs])
        return T_all[idx], F_all[idx] / f_scale, lab_d[idx]

    def loss_of(cs, grad=True):
        tok, f, y = batch_of(cs)
        outs = ttt_forward(torch, head, E, tok, f, K, a.n_head, a.n_head_kv)
        total, accs = 0.0, []
        for k, lg in enumerate(outs):
            yk = y[:, 1 + k: 1 + k + lg.shape[1]]
            m = yk >= 0
            if not bool(m.any()):
                accs.append(0.0)
                continue
            ce = torch.nn.functional.cross_entropy(lg[m], yk[m])
            total = total + (0.8 ** k) * ce
            accs.append(((lg.argmax(-1) == yk) & m).sum().item() / max(1, int(m.sum())))
        return total, accs

    t0, step, deadline = time.time(), 0, time.time() + 60 * minutes
    n_steps_est = None
    tr.sort(key=lambda c: c[2])  # batches of similar lengths (a batch is cut to its shortest window)
    batches = [tr[i:i + batch] for i in range(0, len(tr) - batch + 1, batch)]
    ev.sort(key=lambda c: c[2])
    while time.time() < deadline:
        for bi in rng.permutation(len(batches)):
            if time.time() >= deadline:
                break
            frac = (time.time() - t0) / (60 * minutes)
            for gr in opt.param_groups:  # warm-up then cosine decay over the time budget
                gr["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
            loss, accs = loss_of(batches[bi])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 25 == 0:
                log(f"[train] step {step}, {time.time() - t0:.0f} s, loss {loss.item():.3f}, "
                    f"top-1 by step {' '.join(f'{x:.2f}' for x in accs)}")
    with torch.no_grad():
        res = [loss_of(ev[i:i + batch], grad=False)[1] for i in range(0, len(ev) - batch + 1, batch)]
    acc = np.mean(np.asarray(res), 0) if res else []
    log(f"[train] done: {step} steps in {time.time() - t0:.0f} s; held-out top-1 by step "
        f"{' '.join(f'{x:.3f}' for x in acc)}")
    export(work, head, d2t, V, model, f_scale, a)
    (work / "train_log.json").write_text(json.dumps(dict(steps=step, seconds=time.time() - t0, vocab=vocab,
                                                         coverage=float(cover), heldout_top1=[float(x) for x in acc],
                                                         tokens=int(tokens.size), K=K)))


def export(work: Path, head, d2t, V, model, f_scale, a) -> None:
    """The EAGLE-3 checkpoint layout (midlayer., d2t offsets, t2d), then its GGUF."""
    from pyfast.convert.eagle3 import convert_eagle3
    from tests.spec.eagle3_helpers import write_safetensors

    sd = {k: v.detach().float().numpy() for k, v in head.state_dict().items()}
    p = "midlayer"
    w = {"fc.weight": sd["fc.weight"] / f_scale,     # the features were scaled by 1 / f_scale in training
         f"{p}.input_layernorm.weight": sd["input_layernorm.weight"],
         f"{p}.hidden_norm.weight": sd["hidden_norm.weight"],
         f"{p}.post_attention_layernorm.weight": sd["post_attention_layernorm.weight"],
         "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w[f"{p}.self_attn.{n}.weight"] = sd[f"{n}.weight"]
    for n in ("gate_proj", "up_proj", "down_proj"):
        w[f"{p}.mlp.{n}.weight"] = sd[f"{n}.weight"]
    w["d2t"] = (d2t - np.arange(d2t.size)).astype(np.int64)
    t2d = np.zeros(V, dtype=bool)
    t2d[d2t] = True
    w["t2d"] = t2d
    hf = work / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": a.n_embd,
           "intermediate_size": a.n_ff, "num_attention_heads": a.n_head, "num_key_value_heads": a.n_head_kv,
           "head_dim": a.head_dim, "num_hidden_layers": 1, "rms_norm_eps": a.eps, "rope_theta": a.rope.base,
           "max_position_embeddings": 8192, "vocab_size": V, "draft_vocab_size": int(d2t.size),
           "hidden_act": "silu", "target_hidden_size": a.n_embd,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(LAYERS), "use_aux_hidden_state": True}}
    (hf / "config.json").write_text(json.dumps(cfg, indent=1))
    write_safetensors(hf / "model.safetensors", {k: np.ascontiguousarray(v) for k, v in w.items()})
    convert_eagle3(hf, work / "eagle3.gguf", outtype="f16")


# --- evaluation: acceptance per draft position ---------------------------------------------------------
def evaluate(work: Path, threads: int, draft_max: int, n_gen: int, log) -> None:
    from pyfast.hub import resolve_model
    from pyfast.llm import LLM
    from pyfast.spec import SpecConfig
    from pyfast.spec.prompts import load_prompts

    path = str(resolve_model(None, quiet=True))
    out = {}
    for set_name in ("chat", "copy"):
        _, texts = load_prompts(set_name)
        llm = LLM(path, n_ctx=2048, n_threads=threads,
                  speculative=SpecConfig(types="eagle3", draft_model=str(work / "eagle3.gguf"), draft_max=draft_max))
        for t in texts:
            llm.generate(llm.apply_chat_template([{"role": "user", "content": t}]), max_tokens=n_gen, temperature=0)
        st = llm.spec_stats
        pos = [st.pos_accepted[i] / max(1, st.pos_drafted[i]) for i in range(min(draft_max, len(st.pos_drafted)))]
        out[set_name] = dict(drafted=st.drafted, accepted=st.accepted, acceptance=st.acceptance,
                             per_position=pos, tokens_per_step=st.tokens_per_step)
        log(f"[eval] {set_name}: acceptance {st.acceptance:.3f}, per position "
            f"{' '.join(f'{x:.3f}' for x in pos)}, tokens per target decode {st.tokens_per_step:.2f}")
    (work / "eval.json").write_text(json.dumps(out, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="eagle3-smollm2", help="directory for data, checkpoint and GGUF")
    ap.add_argument("--prompts", type=int, default=480)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=1, help="pyfast threads for the data stage")
    ap.add_argument("--minutes", type=float, default=30.0, help="training time budget")
    ap.add_argument("--vocab", type=int, default=4096, help="draft vocabulary size")
    ap.add_argument("--ttt", type=int, default=3, help="training-time-test steps")
    ap.add_argument("--seq-len", type=int, default=320)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval", action="store_true", help="only measure acceptance per draft position")
    ap.add_argument("--draft-max", type=int, default=4)
    a = ap.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)

    def log(s):
        print(s, flush=True)

    if a.eval:
        evaluate(work, max(a.threads, 1), a.draft_max, 256, log)
        return 0
    if not (work / "data.npz").exists():
        make_data(work, a.prompts, a.max_tokens, a.threads, log)
    train(work, a.minutes, a.vocab, a.ttt, a.seq_len, a.batch, a.lr, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
