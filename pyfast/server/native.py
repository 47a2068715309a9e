"""llama-server's native routes and embeddings, on the same engine as the OpenAI API.

* ``POST /completion``: llama-server's request (``prompt`` as text, token ids or a mix,
  ``n_predict``, ``stop``, ``n_probs``, ``cache_prompt``, ``stream``, ``seed``, the sampler
  fields, ``json_schema`` / ``grammar``) and response (``content``, ``tokens``, ``stop``,
  ``stop_type``, ``stopping_word``, ``tokens_predicted``, ``tokens_evaluated``, ``tokens_cached``,
  ``timings``, ``completion_probabilities``, ``generation_settings``). Streaming sends one
  ``data:`` object per piece of text and a last one with ``"stop": true``.
* ``GET /props``: the default generation settings, slot count, model, chat template and special
  tokens. ``GET /slots``: each slot's state.
* ``POST /v1/embeddings`` (and ``/embeddings``): OpenAI's embeddings. Each input is decoded by a
  context of its own (``export_hidden``: the final hidden state after the output norm, the rows
  the LM head reads) and pooled (``mean`` over all tokens, ``last`` token or ``cls`` = first
  token; ``--pooling`` or the request's ``pooling``), then L2-normalised.
"""
from __future__ import annotations

import asyncio
import base64
import threading
from typing import Any, AsyncIterator

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pyfast import __version__
from pyfast.server.schemas import EmbeddingRequest, NativeCompletionRequest


def add_routes(app: FastAPI, api) -> None:
    from pyfast.server import app as appmod

    nat = _Native(api, appmod)
    app.add_api_route("/completion", nat.completion, methods=["POST"])
    app.add_api_route("/props", nat.props, methods=["GET"])
    app.add_api_route("/slots", nat.slots, methods=["GET"])
    app.add_api_route("/v1/embeddings", nat.embeddings, methods=["POST"])
    app.add_api_route("/embeddings", nat.embeddings, methods=["POST"])
    app.state.native = nat


class _Native:
    def __init__(self, api, appmod):
        self.api = api
        self.m = appmod
        self._embed_ctx = None
        self._embed_lock = threading.Lock()

    @property
    def engine(self):
        return self.api.engine

    # --- /props, /slots ----------------------------------------------------------------------
    def _settings(self) -> dict:
        o = self.api.options
        from pyfast.sampling import SamplingParams

        d = SamplingParams()
        return {"n_ctx": self.engine.n_ctx_slot, "model": self.engine.model_id,
                "params": {"n_predict": -1 if o.n_predict is None else o.n_predict,
                           "temperature": d.temperature if o.temperature is None else o.temperature,
                           "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
                           "repeat_penalty": d.repeat_penalty, "repeat_last_n": d.repeat_last_n,
                           "seed": -1 if o.seed is None else o.seed}}

    async def props(self) -> Response:
        e = self.engine
        tok = e.tokenizer
        ct = e.chat_template
        return JSONResponse({
            "default_generation_settings": self._settings(),
            "total_slots": e.cfg.n_parallel,
            "model_alias": e.model_id,
            "model_path": e.model_path,
            "chat_template": ct.source if ct is not None else None,
            "bos_token": ct.bos_token if ct is not None else "",
            "eos_token": ct.eos_token if ct is not None else "",
            "add_bos_token": bool(tok.add_bos),
            "n_vocab": e.n_vocab,
            "modalities": {"vision": False, "audio": False},
            "build_info": f"pyfast {__version__}",
        })

    async def slots(self) -> Response:
        e = self.engine
        out = []
        for s in list(e.slots):
            job = s.job
            out.append({"id": s.id, "n_ctx": e.n_ctx_slot, "is_processing": job is not None,
                        "n_cached": len(s.tokens), "speculative": e.spec_enabled,
                        "n_prompt": len(job.prompt) if job is not None else 0,
                        "n_decoded": len(job.out) if job is not None else 0})
        return JSONResponse(out)

    # --- /completion -------------------------------------------------------------------------
    async def completion(self, request: Request) -> Response:
        m, api, e = self.m, self.api, self.engine
        req: NativeCompletionRequest = await m._parse(request, NativeCompletionRequest, api.limits)
        api._check_model(req.model)
        if req.n != 1:
            raise m.APIError(400, "n: /completion makes one completion per prompt (use /v1/completions for n > 1)",
                             param="n")
        p = req.prompt
        texts = [p] if isinstance(p, str) else [x for x in p if isinstance(x, str)]
        for t in texts:
            api._check_bytes(len(t.encode("utf-8", "surrogatepass")), "prompt")

        def tokenize(_stop) -> list[int]:
            if isinstance(p, str):
                return e.tokenizer.encode(p)
            ids: list[int] = []
            for k, x in enumerate(p):  # llama-server: strings tokenized in place, BOS (when due) first only
                ids += e.tokenizer.encode(x, add_bos=None if k == 0 else False) if isinstance(x, str) else [x]
            return ids

        try:
            prompt = await api._prepare(request, tokenize)
        except (ValueError, TypeError) as err:
            raise m.APIError(400, f"prompt: {err}", param="prompt") from None
        api._check_ids(prompt, "prompt")
        grammar = await api._grammar_of(request, req, chat=False)
        max_tokens = api._default_max_tokens(req, None) if req.max_tokens is None else req.max_tokens
        # logprobs carry each token's id: the stream and `tokens` need them
        jobs, queue = api._submit(req, [prompt], max_tokens, req.n_probs, chat=False, grammar=grammar, n=1)
        job = jobs[0]
        stops = [req.stop] if isinstance(req.stop, str) else [s for s in (req.stop or []) if s]
        if req.stream:
            return StreamingResponse(self._stream(req, job, queue, stops), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.ensure_future(m._wait_disconnect(request))
        events = m._Events(queue, api.drain)
        texts_out: list[str] = []
        lps: list = []
        try:
            while True:
                ev = await events.next(watcher)
                if ev is watcher:
                    return Response(status_code=499)
                if ev is None:
                    raise m.APIError(503, m._SHUTDOWN_MSG, "server_error", code="shutting_down")
                if ev.kind == "error":
                    raise m.APIError(ev.status, ev.message, "server_error")
                texts_out.append(ev.text)
                if ev.logprobs:
                    lps.extend(ev.logprobs)
                if ev.kind == "done":
                    break
        finally:
            watcher.cancel()
            events.close()
            e.cancel(job)
        text = "".join(texts_out)
        body = {"index": 0, "content": text, "tokens": [lp.token for lp in lps] if req.return_tokens else [],
                "id_slot": job.slot.id if job.slot is not None else -1}
        body.update(self._final(req, job, ev, stops, text))
        if req.n_probs > 0:
            body["completion_probabilities"] = [self._prob(lp) for lp in lps]
        return JSONResponse(body)

    def _final(self, req, job, ev, stops: list[str], text: str) -> dict:
        e = self.engine
        stop_type, word = "limit", ""
        if ev.finish_reason == "stop":
            full = e.tokenizer.decode(job.out)
            hits = [(full.find(s), s) for s in stops if s and full.find(s) >= 0]
            if hits:
                stop_type, word = "word", min(hits)[1]
            else:
                stop_type = "eos"
        st = ev.stats
        t = self.m._Formatter.timings([st]) if st is not None else {}
        timings = {"cache_n": t.get("prompt_cached", 0), "prompt_n": t.get("prompt_n", 0),
                   "prompt_ms": t.get("prompt_ms", 0.0),
                   "prompt_per_token_ms": t["prompt_ms"] / t["prompt_n"] if t.get("prompt_n") else 0.0,
                   "prompt_per_second": t.get("prompt_per_second", 0.0),
                   "predicted_n": t.get("predicted_n", 0), "predicted_ms": t.get("predicted_ms", 0.0),
                   "predicted_per_token_ms": t["predicted_ms"] / t["predicted_n"] if t.get("predicted_n") else 0.0,
                   "predicted_per_second": t.get("predicted_per_second", 0.0),
                   "draft_n": t.get("draft_n", 0), "draft_n_accepted": t.get("draft_n_accepted", 0)}
        settings = self._settings()
        sp = job.params.sampling
        settings["params"].update(n_predict=-1 if job.params.max_tokens is None else job.params.max_tokens,
                                  temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
                                  repeat_penalty=sp.repeat_penalty, repeat_last_n=sp.repeat_last_n,
                                  seed=-1 if sp.seed is None else sp.seed, stop=stops, n_probs=req.n_probs,
                                  cache_prompt=req.cache_prompt)
        n_prompt = len(job.prompt)
        return {"model": e.model_id, "stop": True, "stop_type": stop_type, "stopping_word": word,
                "tokens_predicted": len(job.out), "tokens_evaluated": n_prompt,
                "tokens_cached": n_prompt + len(job.out), "truncated": False,
                "has_new_line": "\n" in text, "generation_settings": settings,
                "prompt": e.tokenizer.decode(job.prompt), "timings": timings}

    def _prob(self, lp) -> dict:
        tok = self.engine.tokenizer

        def one(t: int, v: float) -> dict:
            b = tok.token_piece(t)
            return {"id": int(t), "token": b.decode("utf-8", errors="replace"), "logprob": v, "bytes": list(b)}

        d = one(lp.token, lp.logprob)
        d["top_logprobs"] = [one(t, v) for t, v in lp.top]
        return d

    async def _stream(self, req, job, queue, stops) -> AsyncIterator[bytes]:
        m, e = self.m, self.engine
        events = m._Events(queue, self.api.drain)
        text = []
        try:
            while True:
                ev = await events.next()
                if ev is None:
                    yield m._sse_line(m.APIError(503, m._SHUTDOWN_MSG, "server_error", code="shutting_down").body())
                    return
                if ev.kind == "error":
                    yield m._sse_line(m.APIError(ev.status, ev.message, "server_error").body())
                    return
                lps = ev.logprobs or []
                text.append(ev.text)
                if ev.text or lps:
                    chunk = {"index": 0, "content": ev.text, "tokens": [lp.token for lp in lps] if req.return_tokens
                             else [], "stop": False, "id_slot": job.slot.id if job.slot is not None else -1}
                    if req.n_probs > 0:
                        chunk["completion_probabilities"] = [self._prob(lp) for lp in lps]
                    yield m._sse_line(chunk)
                if ev.kind == "done":
                    last = {"index": 0, "content": "", "tokens": [], "id_slot": job.slot.id if job.slot else -1}
                    last.update(self._final(req, job, ev, stops, "".join(text)))
                    yield m._sse_line(last)
                    return
        finally:
            events.close()
            e.cancel(job)

    # --- embeddings --------------------------------------------------------------------------
    def _context(self):
        if self._embed_ctx is None:
            from pyfast.context import Context

            e = self.engine
            make = getattr(e, "new_context", Context)  # under TP: a context the other ranks mirror
            self._embed_ctx = make(e.model, n_ctx=e.n_ctx_slot, n_threads=e.cfg.n_threads, n_seq_max=1,
                                      export_hidden=True, max_plans=8, device=e.cfg._device)
        return self._embed_ctx

    def embed(self, ids: list[int], pooling: str, normalize: bool = True) -> np.ndarray:
        """The pooled final hidden state of one token sequence (float32 [n_embd])."""
        with self._embed_lock:
            ctx = self._context()
            ctx.clear()
            ctx.decode(np.asarray(ids, dtype=np.int32), positions=np.arange(len(ids), dtype=np.int32), seq_ids=0,
                       logits="none")
            h = np.asarray(ctx.last_hidden[: len(ids)], dtype=np.float32)
            ctx.clear()
        v = pool(h, pooling)
        if normalize:
            n = float(np.linalg.norm(v))
            if n > 0:
                v = v / n
        return v.astype(np.float32)

    async def embeddings(self, request: Request) -> Response:
        m, api, e = self.m, self.api, self.engine
        req: EmbeddingRequest = await m._parse(request, EmbeddingRequest, api.limits)
        api._check_model(req.model)
        if req.dimensions is not None:
            raise m.APIError(400, "dimensions: not supported (the embedding has the model's width, "
                                  f"{e.model.args.n_embd})", param="dimensions")
        if not getattr(e.model, "supports_hidden", False):
            raise m.APIError(400, f"embeddings: architecture {e.model.arch.ARCH!r} does not export hidden states",
                             param="model")
        pooling = req.pooling or api.options.pooling
        x = req.input
        if isinstance(x, str):
            items: list = [x]
        elif all(isinstance(v, int) for v in x):
            items = [list(x)]
        else:
            items = list(x)
        for k, it in enumerate(items):
            if isinstance(it, str):
                api._check_bytes(len(it.encode("utf-8", "surrogatepass")), "input")

        def run(should_stop) -> tuple[list[np.ndarray], int]:
            out, n_tok = [], 0
            for k, it in enumerate(items):
                if should_stop():
                    raise m.APIError(499, "the client went away")
                ids = e.tokenizer.encode(it) if isinstance(it, str) else it
                if not ids:
                    raise m.APIError(400, f"input[{k}]: empty", param="input")
                if len(ids) > e.n_ctx_slot:
                    raise m.APIError(400, f"input[{k}]: {len(ids)} tokens; at most {e.n_ctx_slot} per input",
                                     param="input", code="context_length_exceeded")
                api._check_ids(ids, "input")
                out.append(self.embed(ids, pooling, req.normalize))
                n_tok += len(ids)
            return out, n_tok

        vecs, n_tok = await api._prepare(request, run)
        data = []
        for k, v in enumerate(vecs):
            emb: Any = base64.b64encode(v.astype("<f4").tobytes()).decode() if req.encoding_format == "base64" \
                else v.tolist()
            data.append({"object": "embedding", "index": k, "embedding": emb})
        return JSONResponse({"object": "list", "data": data, "model": e.model_id,
                             "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok}})


def pool(h: np.ndarray, pooling: str) -> np.ndarray:
    """Pool hidden rows [n_tokens, n_embd] into one vector: mean, last or cls (the first)."""
    if pooling == "mean":
        return h.astype(np.float64).mean(axis=0).astype(np.float32)
    if pooling == "last":
        return h[-1]
    if pooling == "cls":
        return h[0]
    raise ValueError(f"pooling must be mean, last or cls, got {pooling!r}")
