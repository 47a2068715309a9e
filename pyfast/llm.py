"""The high-level Python API: ``LLM`` (generate, chat, logits, perplexity, tokenize)."""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from pyfast.context import Context, RollbackError, default_threads
from pyfast.models import Model
from pyfast.sampling import Sampler, SamplingParams
from pyfast.spec.config import SpecConfig
from pyfast.spec.stats import SpecStats


@dataclass
class Timings:
    n_prompt: int = 0           # prompt tokens actually processed (after prefix reuse)
    n_prompt_cached: int = 0    # prompt tokens reused from the previous call
    prompt_s: float = 0.0
    n_gen: int = 0
    gen_s: float = 0.0

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.n_gen / self.gen_s if self.gen_s > 0 else 0.0


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: list[int]
    finish_reason: str  # "stop" (end of generation token or stop string) or "length"
    timings: Timings = field(default_factory=Timings)
    spec: SpecStats | None = None  # speculative decoding statistics of this request (if used)


@dataclass
class StreamChunk:
    text: str                 # new text since the previous chunk (complete UTF-8 only)
    token: int | None         # the token that produced it (None for the final flush)
    finish_reason: str | None = None
    result: GenerationResult | None = None  # set on the last chunk


@dataclass
class PerplexityResult:
    ppl: float
    n_chunks: int
    n_scored: int
    nll: float  # mean negative log-likelihood per scored token


def _control_vector(items, layer_range):
    """LLM's control_vectors argument as one ControlVector (or None)."""
    from pyfast.control_vector import ControlVector

    if items is None or (not isinstance(items, ControlVector) and not items):
        if layer_range is not None:
            raise ValueError("control_vector_layer_range needs control_vectors")
        return None
    if layer_range is not None and (len(layer_range) != 2 or not all(isinstance(v, int) for v in layer_range)):
        raise ValueError(f"control_vector_layer_range must be two layer numbers (first, last), got {layer_range!r}")
    if isinstance(items, ControlVector):
        return items
    if isinstance(items, (str, os.PathLike)):
        items = [items]
    pairs = []
    for it in items:
        if isinstance(it, (str, os.PathLike)):
            pairs.append((it, 1.0))
        elif isinstance(it, (tuple, list)) and len(it) == 2 and isinstance(it[1], (int, float)):
            pairs.append((it[0], float(it[1])))
        else:
            raise ValueError(f"control_vectors: expected a path or a (path, strength) pair, got {it!r}")
    return ControlVector.combine(pairs)


class LLM:
    """A GGUF model ready to generate.

    >>> llm = LLM()                       # the default model (SmolLM2-135M-Instruct Q4_1)
    >>> llm.generate("The capital of France is", max_tokens=8, temperature=0).text

    speculative: a ``SpecConfig`` turns on speculative decoding for every generate call (pass
    ``speculative=False`` to a call to decode plainly). Its settings and draft model are checked
    here, before any decoding.
    n_seq_max: models with recurrent layers (Qwen3.5, Qwen3-Next): how many sequences may hold
    recurrent state at once (generate_batch prompts, plus one for adaptive speculation's cost
    calibration). With speculation their memory keeps draft_max snapshot planes for rollback.
    cache_type_k, cache_type_v: how the KV cache stores K and V rows: "f16" (default), "f32" or
    "q8_0" (V as K unless given; llama.cpp's --cache-type-k / -v). Q8_0 halves the cache's memory
    and the bytes attention reads per token, at a small cost in precision.
    control_vectors: control-vector GGUFs added to the residual stream (llama.cpp's
    --control-vector): paths (strength 1) or (path, strength) pairs, summed; or a
    ``pyfast.control_vector.ControlVector``. control_vector_layer_range: (first, last) layer whose
    output gets its direction, inclusive (default 1 .. n_layer).
    dsa, dsa_top_k: DeepSeek Sparse Attention of deepseek32 / glm-dsa models (llama.cpp's --dsa,
    --dsa-top-k): on (None: the default) or off, and the cells each query keeps (-1: the model's
    ``attention.indexer.top_k``). dsa=True on a model without sparse attention is a ValueError.
    swa_full: models with sliding-window layers (Gemma 3 / 4): False gives those layers a KV cache
    bounded to the window (n_seq_max * (W - 1) + n_ubatch cells) instead of n_ctx; a reused prompt
    prefix that reaches back past the window is then decoded afresh.
    device: where the model runs: "cpu" (default) or a device from ``pyfast.devices()`` such as
    "vulkan:0". The weights are uploaded to it once and the KV cache and recurrent state live in
    its memory; ops it has no kernel for run on the CPU. A device that does not exist is a
    ValueError naming it.
    tp: tensor parallelism over this many processes started by ``mpirun -np tp`` (docs/
    tensor-parallel.md): this process must be rank 0 (the others run ``pyfast.parallel.follow``);
    the model's weights, KV cache and recurrent state are split by head over the ranks.
    """

    def __init__(self, model: str | os.PathLike | None = None, n_ctx: int = 4096,
                 n_threads: int | None = None, n_ubatch: int = 512, verbose: bool = False,
                 speculative: SpecConfig | None = None, n_seq_max: int = 4, cache_type_k: str = "f16",
                 cache_type_v: str | None = None, control_vectors=None,
                 control_vector_layer_range: tuple[int, int] | None = None, device: str | None = None,
                 dsa: bool | None = None, dsa_top_k: int = -1, swa_full: bool = True, tp: int = 1):
        from pyfast.chat import ChatTemplate
        from pyfast.device import open_device
        from pyfast.hub import resolve_model
        from pyfast.tokenizer import Tokenizer

        cvec = _control_vector(control_vectors, control_vector_layer_range)  # bad files fail before loading
        dev = open_device(device)  # a missing device fails before the model loads
        path = resolve_model(None if model is None else str(model), quiet=not verbose)
        self.model_path = str(path)
        # on a device the weights are uploaded from the file mapping (no host copy is kept)
        self._tp_group = None
        if tp is not None and tp > 1:
            from pyfast.parallel.tp import leader_group, leader

            if dev is not None or cvec is not None:
                raise ValueError("tp: tensor parallelism runs on the CPU without control vectors for now")
            self._tp_group = leader_group(tp)
            self.model = leader(path, self._tp_group)
        elif tp is not None and tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        else:
            self.model = Model(path, mmap=True) if dev is not None else Model(path)
        if cvec is not None:
            self.model.set_control_vector(cvec, *(control_vector_layer_range or (None, None)))
        self.model.set_dsa(on=dsa, top_k=dsa_top_k)
        self.tokenizer = Tokenizer.from_gguf_metadata(self.model.metadata)
        self.chat_template = ChatTemplate.from_metadata(self.model.metadata, self.tokenizer)
        props = None
        if speculative is not None:
            from pyfast.spec.config import make_proposers

            if not isinstance(speculative, SpecConfig):
                raise ValueError(f"speculative must be a SpecConfig, got {type(speculative).__name__}")
            props = make_proposers(speculative, self.model, n_ctx=n_ctx, n_threads=n_threads or default_threads())
        # recurrent memory rolls a rejected draft back through snapshot planes, one per draft token
        n_rollback = max((speculative.n_max_for(p) for p in props), default=0) \
            if props and self.model.is_recurrent else 0
        # draft-mtp reads the target's hidden rows: export them only when a proposer needs them
        from pyfast.spec.config import capture_layers, needs_hidden

        ctx_cls = Context
        if self._tp_group is not None:
            from functools import partial

            from pyfast.parallel.tp import TPContext

            ctx_cls = partial(TPContext, group=self._tp_group)
        self.ctx = ctx_cls(self.model, n_ctx=n_ctx, n_threads=n_threads, n_ubatch=max(n_ubatch, n_rollback + 1),
                           n_seq_max=n_seq_max, n_rollback=n_rollback, export_hidden=needs_hidden(props),
                           capture_layers=capture_layers(props),
                           kv_dtype=cache_type_k, kv_dtype_v=cache_type_v, device=dev, swa_full=swa_full)
        self._cached: list[int] = []  # tokens of sequence 0 currently in the cache
        self.speculative = speculative
        self._spec = None        # SpecDecoder with the configured proposers
        self._multi = None       # SpecDecoder without proposers (plain generate_batch)
        if props is not None:
            from pyfast.spec.decoder import SpecDecoder

            self._spec = SpecDecoder(self.ctx, props, speculative)

    # --- basics ----------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.ctx.n_ctx

    @property
    def n_vocab(self) -> int:
        return self.model.n_vocab

    @property
    def spec_stats(self) -> SpecStats | None:
        """Cumulative speculative decoding statistics over every request (None when off)."""
        return self._spec.stats if self._spec is not None else None

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Text to token ids (special tokens such as <|im_start|> are parsed by default)."""
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: Sequence[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(tokens), skip_special=skip_special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    # --- logits ----------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits of every position, float32 [n_tokens, n_vocab], for a fresh sequence."""
        ids = list(token_ids)
        if not ids:
            raise ValueError("logits: empty token list")
        self._check_fits(len(ids))
        self.ctx.remove_seq(0)
        self._cached = []
        out = self.ctx.decode(ids, seq_ids=0, logits="all")
        self.ctx.remove_seq(0)
        return out

    # --- generation ------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, *,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, repeat_penalty: float | None = None,
                 frequency_penalty: float | None = None, presence_penalty: float | None = None,
                 seed: int | None = None, stop: str | Sequence[str] | None = None,
                 logit_bias: dict[int, float] | None = None,
                 params: SamplingParams | None = None, add_bos: bool | None = None, special: bool = True,
                 ignore_eos: bool = False, stream: bool = False, speculative: bool | None = None,
                 json_schema: dict | str | bool | None = None, grammar: str | None = None, regex: str | None = None):
        """Complete a raw prompt (text or token ids).

        json_schema / grammar (GBNF) / regex: constrain the output (at most one;
        ``pyfast.constrain``); an invalid one raises ``ConstraintError`` (a ValueError).

        Returns a GenerationResult, or with stream=True an iterator of StreamChunk whose last
        chunk carries the full result. temperature <= 0 means greedy decoding.
        speculative: None = as configured on the LLM, False = decode without speculation.
        With speculation, greedy output is token-identical to plain decoding and sampled output
        has the same distribution (not the same tokens for a given seed).
        """
        sp = _sampling_params(params, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, seed=seed, logit_bias=logit_bias)
        if json_schema is not None or grammar is not None or regex is not None:
            sp = self._constrained(sp, json_schema, grammar, regex)
        if isinstance(prompt, str):
            ptoks = self.tokenize(prompt, add_bos=add_bos, special=special)
        else:
            ptoks = [int(t) for t in prompt]
        if not ptoks:
            raise ValueError("generate: the prompt is empty")
        if max_tokens is None or max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
        it = self._generate(ptoks, max_tokens, sp, stops, ignore_eos, self._use_spec(speculative), stream=stream)
        if stream:
            return it
        last = None
        for chunk in it:
            last = chunk
        return last.result

    def _constrained(self, sp: SamplingParams, json_schema, grammar, regex) -> SamplingParams:
        import dataclasses

        from pyfast.constrain import Constraint, ConstraintError, compile_constraint

        given = [c for c in (None if json_schema is None else Constraint.json_schema(json_schema),
                             None if grammar is None else Constraint.gbnf(grammar),
                             None if regex is None else Constraint.regex(regex)) if c is not None]
        if len(given) > 1:
            raise ConstraintError("give at most one of json_schema, grammar and regex", given[1].param)
        return dataclasses.replace(sp, constraint=compile_constraint(given[0], self.tokenizer, self.n_vocab))

    def chat(self, messages: list[dict], max_tokens: int = 256, **kwargs):
        """Generate the assistant's reply to a conversation using the model's chat template."""
        text = self.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(text, max_tokens=max_tokens, **kwargs)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_tokens: int = 128, *,
                       temperature: float | None = None, top_k: int | None = None,
                       top_p: float | None = None, min_p: float | None = None,
                       repeat_penalty: float | None = None, frequency_penalty: float | None = None,
                       presence_penalty: float | None = None, seed: int | None = None,
                       stop: str | Sequence[str] | None = None, params: SamplingParams | None = None,
                       add_bos: bool | None = None, special: bool = True, ignore_eos: bool = False,
                       speculative: bool | None = None) -> list[GenerationResult]:
        """Complete several prompts at once: every step decodes all unfinished sequences (and,
        with speculation, all their verify batches) in ONE target decode.

        The sequences share the context's cells (their prompts together must fit in n_ctx). Each
        gets its own sampler, seeded ``seed + i`` when a seed is given. Greedy outputs equal
        ``generate`` on each prompt alone. Clears the prompt cache of ``generate``.
        """
        from pyfast.memory.kv_cache import KVCacheFull
        from pyfast.spec.decoder import SpecDecoder
        from pyfast.tokenizer import StreamDecoder

        sp = _sampling_params(params, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, seed=seed)
        if max_tokens is None or max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        ptoks_all = [self.tokenize(p, add_bos=add_bos, special=special) if isinstance(p, str)
                     else [int(t) for t in p] for p in prompts]
        if not ptoks_all:
            return []
        for i, pt in enumerate(ptoks_all):
            if not pt:
                raise ValueError(f"generate_batch: prompt {i} is empty")
            self._check_fits(len(pt))
        total = sum(len(pt) for pt in ptoks_all)
        if total + len(ptoks_all) > self.n_ctx:
            raise ValueError(f"generate_batch: the prompts hold {total} tokens together, which with one "
                             f"generated token each do not fit in the context ({self.n_ctx}); raise n_ctx")
        stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
        dec = self._use_spec(speculative)
        if self.ctx.is_recurrent:  # adaptive speculation calibrates on one more (scratch) sequence
            need = len(ptoks_all) + (1 if dec is not None and dec.adaptive is not None else 0)
            if need > self.ctx.n_seq_max:
                raise ValueError(f"generate_batch: {len(ptoks_all)} prompts need {need} sequence slots but this "
                                 f"recurrent model's context has {self.ctx.n_seq_max}; raise LLM(n_seq_max=...)")
        if dec is None:
            if self._multi is None:
                self._multi = SpecDecoder(self.ctx)
            dec = self._multi
        for old in list(dec.slots.values()):
            dec.release(old)
        self.ctx.clear()
        self._cached = []

        n = len(ptoks_all)
        slots = []
        for i, pt in enumerate(ptoks_all):
            spi = sp if sp.seed is None else dataclasses.replace(sp, seed=sp.seed + i)
            slots.append(dec.add(i, pt, Sampler(spi, self.n_vocab)))
        t0 = time.perf_counter()
        first = dec.prefill(slots)
        prompt_s = time.perf_counter() - t0
        outs: list[list[int]] = [[] for _ in range(n)]
        texts = [""] * n
        decs = [StreamDecoder(self.tokenizer) for _ in range(n)]
        finish: list[str | None] = [None] * n
        pending = [[dec.start(s, lg)] if max_tokens > 0 else [] for s, lg in zip(slots, first)]
        t1 = time.perf_counter()
        active = list(range(n))
        try:
            while active:
                for i in active:
                    for tok in pending[i]:
                        if not ignore_eos and self.tokenizer.is_eog(tok):
                            finish[i] = "stop"
                            break
                        outs[i].append(tok)
                        before = len(texts[i])
                        texts[i] += decs[i].feed(tok)
                        hit = _find_stop(texts[i], stops, before)
                        if hit is not None:
                            texts[i] = texts[i][:hit]
                            finish[i] = "stop"
                            break
                        if len(outs[i]) >= max_tokens or len(ptoks_all[i]) + len(outs[i]) >= self.n_ctx:
                            finish[i] = "length"
                            break
                    if max_tokens <= 0:
                        finish[i] = "length"
                for i in active:
                    if finish[i] is not None:  # free its cells for the others now
                        dec.release(slots[i], n_keep=0)
                active = [i for i in active if finish[i] is None]
                if not active:
                    break
                for i in active:
                    slots[i].n_remaining = max_tokens - len(outs[i])
                new = dec.step([slots[i] for i in active])
                for i, toks in zip(active, new):
                    pending[i] = toks
        except KVCacheFull:
            for i in active:
                finish[i] = "length"
        gen_s = time.perf_counter() - t1
        results = []
        for i, s in enumerate(slots):
            if finish[i] == "length":
                texts[i] += decs[i].flush()
            if s.seq in dec.slots:
                dec.release(s, n_keep=0)
            t = Timings(n_prompt=len(ptoks_all[i]), prompt_s=prompt_s, n_gen=len(outs[i]), gen_s=gen_s)
            results.append(GenerationResult(text=texts[i], tokens=outs[i], prompt_tokens=ptoks_all[i],
                                            finish_reason=finish[i] or "length", timings=t,
                                            spec=s.stats if dec is self._spec else None))
        return results

    def _check_fits(self, n: int) -> None:
        if n > self.n_ctx:
            raise ValueError(f"{n} tokens do not fit in the context ({self.n_ctx}); raise n_ctx")

    def _prefill(self, ptoks: list[int], timings: Timings) -> np.ndarray:
        """Decode the prompt, reusing the longest common prefix with the cached sequence."""
        n_keep = 0
        for a, b in zip(self._cached, ptoks):
            if a != b:
                break
            n_keep += 1
        n_keep = min(n_keep, len(ptoks) - 1)  # always decode at least one token for logits
        try:
            self.ctx.truncate(0, n_keep)
        except RollbackError:  # recurrent state cannot go back there: decode the prompt afresh
            self.ctx.remove_seq(0)
            n_keep = 0
        self._cached = ptoks[:n_keep]
        t0 = time.perf_counter()
        logits = self.ctx.decode(ptoks[n_keep:], positions=range(n_keep, len(ptoks)), seq_ids=0)[-1]
        timings.prompt_s = time.perf_counter() - t0
        timings.n_prompt = len(ptoks) - n_keep
        timings.n_prompt_cached = n_keep
        self._cached = list(ptoks)
        return logits

    def _use_spec(self, speculative: bool | None):
        if speculative is None or speculative is True:
            if speculative and self._spec is None:
                raise ValueError("speculative=True needs an LLM created with speculative=SpecConfig(...)")
            return self._spec
        return None

    def _plain_tokens(self, logits: np.ndarray, sampler: Sampler, history: list[int]) -> Iterator[int]:
        """Plain decoding: sample, hand the token out (the consumer appends it to history), decode it."""
        ctx, am = self.ctx, None
        greedy = sampler.params.greedy
        while True:
            tok = sampler.sample(logits, history, am)
            yield tok
            self._cached.append(tok)
            logits = ctx.decode_step(tok, len(history) - 1, 0)
            if greedy:
                am = ctx.last_argmax()[0]  # the plan's (the greedy fast path reads it)

    def _generate(self, ptoks: list[int], max_tokens: int, sp: SamplingParams, stops: list[str],
                  ignore_eos: bool, spec=None, stream: bool = True) -> Iterator[StreamChunk]:
        """Generate after ``ptoks``; yields text chunks as they become final, the last one with
        the result. stream=False without stop strings yields only the last chunk and decodes the
        text once at the end (the same text: one UTF-8 decoder over the same bytes)."""
        from pyfast.tokenizer import StreamDecoder

        self._check_fits(len(ptoks))
        timings = Timings()
        logits = self._prefill(ptoks, timings)
        sampler = Sampler(sp, self.n_vocab)
        history = list(ptoks)
        out: list[int] = []
        slot = None
        if max_tokens <= 0:
            source: Iterator[int] = iter(())
        elif spec is None:
            source = self._plain_tokens(logits, sampler, history)
        else:
            if 0 in spec.slots:  # left over from an abandoned stream
                spec.release(spec.slots[0])
            slot = spec.add(0, ptoks, sampler)
            spec.notify_prompt(slot, timings.n_prompt_cached)
            source = spec.tokens(slot, logits, remaining=lambda: max_tokens - len(out))
        dec = StreamDecoder(self.tokenizer)
        text = ""        # all text generated so far
        emitted = 0      # chars of `text` already streamed
        hold = max((len(s) for s in stops), default=0)
        finish = "length"
        t0 = time.perf_counter()
        if not stream and not stops:  # only the result is wanted: no text until the end
            is_eog, n_ctx = self.tokenizer.is_eog, self.n_ctx
            for tok in source:
                if not ignore_eos and is_eog(tok):
                    finish = "stop"
                    break
                out.append(tok)
                history.append(tok)  # (the plain generator reads it: penalties, the next position)
                if len(out) >= max_tokens or len(history) >= n_ctx:
                    break
            text = dec.feed(out)
            source = iter(())  # consumed: the streaming loop below has nothing left to do
        for tok in source:
            if not ignore_eos and self.tokenizer.is_eog(tok):
                finish = "stop"
                break
            out.append(tok)
            history.append(tok)
            text += dec.feed(tok)
            hit = _find_stop(text, stops, emitted)
            if hit is not None:
                text = text[:hit]
                finish = "stop"
                break
            # Hold back a tail that might still become a stop string.
            safe = max(emitted, len(text) - hold) if hold else len(text)
            if safe > emitted:
                yield StreamChunk(text=text[emitted:safe], token=tok)
                emitted = safe
            if len(out) >= max_tokens or len(history) >= self.n_ctx:
                break
        if finish == "length":
            text += dec.flush()
        timings.gen_s = time.perf_counter() - t0
        timings.n_gen = len(out)
        if slot is not None:
            # A round may have accepted tokens past the stop: keep the cache to what was emitted.
            keep = min(self.ctx.seq_len(0), len(history))
            spec.release(slot, n_keep=keep)
            self._cached = history[: min(keep, self.ctx.seq_len(0))]
        else:
            # The last sampled token is not in the cache; keep _cached in sync with the KV cache.
            self._cached = self._cached[: self.ctx.seq_len(0)]
        result = GenerationResult(text=text, tokens=out, prompt_tokens=list(ptoks), finish_reason=finish,
                                  timings=timings, spec=slot.stats if slot is not None else None)
        yield StreamChunk(text=text[emitted:], token=None, finish_reason=finish, result=result)

    # --- evaluation ------------------------------------------------------------------------
    def perplexity(self, text: str, n_ctx: int = 512) -> PerplexityResult:
        """Perplexity as llama-perplexity computes it: the text is cut into chunks of n_ctx
        tokens, each evaluated from scratch, and the second half of each chunk is scored."""
        if n_ctx < 8:
            raise ValueError("perplexity: n_ctx must be >= 8")
        self._check_fits(n_ctx)
        toks = self.tokenize(text, special=False)
        n_chunks = len(toks) // n_ctx
        if n_chunks == 0:
            raise ValueError(f"perplexity: need at least {n_ctx} tokens, the text has {len(toks)}")
        add_bos = bool(self.model.metadata.get("tokenizer.ggml.add_bos_token", False))
        first = n_ctx // 2
        nll_sum, count = 0.0, 0
        self._cached = []
        for c in range(n_chunks):
            chunk = toks[c * n_ctx:(c + 1) * n_ctx]
            if add_bos:
                chunk[0] = self.tokenizer.bos_id
            self.ctx.remove_seq(0)
            lg = self.ctx.decode(chunk, positions=range(n_ctx), seq_ids=0,
                                 logits=np.arange(first, n_ctx - 1)).astype(np.float64)
            target = np.asarray(chunk[first + 1:n_ctx])
            mx = lg.max(axis=1, keepdims=True)
            lse = np.log(np.exp(lg - mx).sum(axis=1)) + mx[:, 0]
            nll_sum += float((lse - lg[np.arange(lg.shape[0]), target]).sum())
            count += lg.shape[0]
        self.ctx.remove_seq(0)
        nll = nll_sum / count
        return PerplexityResult(ppl=math.exp(nll), n_chunks=n_chunks, n_scored=count, nll=nll)


def _find_stop(text: str, stops: list[str], emitted: int) -> int | None:
    """Index where the earliest stop string starts in the not-yet-emitted region, if any."""
    best = None
    for s in stops:
        i = text.find(s, max(0, emitted - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _sampling_params(params: SamplingParams | None, **overrides) -> SamplingParams:
    import dataclasses

    sp = params or SamplingParams()
    changes = {k: v for k, v in overrides.items() if v is not None}
    if changes:
        sp = dataclasses.replace(sp, **changes)
    sp.validate()
    return sp


def load(model: str | os.PathLike | None = None, **kwargs) -> LLM:
    """Shorthand for LLM(model, **kwargs)."""
    return LLM(model, **kwargs)
