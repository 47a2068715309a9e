"""``pyfast serve``: command-line flags (llama-server's names) and the uvicorn runner.

Importing this module is cheap (no FastAPI / model loading) so the CLI can build its parser.
"""
from __future__ import annotations

import argparse
import logging
import sys


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from pyfast.cli import add_cache_type_arguments, add_control_vector_arguments, add_device_argument, add_tp_argument

    p.add_argument("-m", "--model", default=None,
                   help="GGUF path, registry name or hf://owner/repo/file.gguf (default: smollm2)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-np", "--parallel", type=int, default=4, help="slots decoded together (default 4)")
    p.add_argument("-c", "--ctx-size", type=int, default=8192,
                   help="KV cache size in tokens, shared by the slots (each gets ctx-size / parallel)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    add_cache_type_arguments(p)
    add_device_argument(p)
    add_tp_argument(p)
    add_control_vector_arguments(p)
    p.add_argument("-b", "--batch-size", type=int, default=512,
                   help="most prompt tokens decoded in one scheduler step (all slots together)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512,
                   help="micro-batch size of the decode (default 512; raised to --draft-max + 1 on hybrid models)")
    p.add_argument("--ctx-checkpoints", type=int, default=8,
                   help="hybrid (recurrent) models: context checkpoints kept per slot, so a request that "
                        "shares only part of a slot's cached conversation resumes from the newest one before "
                        "the divergence instead of from scratch (default 8, 0 = off)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait for a slot; more get 503 (default 256)")
    p.add_argument("--api-key", action="append", default=[],
                   help="require this key (Authorization: Bearer KEY); may be repeated")
    p.add_argument("--api-key-file", default=None, help="file with one API key per line")
    p.add_argument("-a", "--alias", default=None, help="model id reported by /v1/models")
    p.add_argument("--strict-model-name", action="store_true",
                   help="answer 404 to requests naming another model than this server's (default: any name is "
                        "served by the one model, as llama-server does)")
    p.add_argument("--cors-origins", default="localhost",
                   help="comma-separated origins whose browser pages may call the API: 'localhost' (default: "
                        "http(s)://localhost, 127.0.0.1 and [::1] on any port), exact origins "
                        "(https://app.example:8443), '*' for any origin, or 'none'")
    p.add_argument("-n", "--n-predict", type=int, default=None,
                   help="default most tokens per reply for requests that set none (-1 = until the context is full)")
    p.add_argument("--temp", type=float, default=None, help="default temperature for requests that set none")
    p.add_argument("-s", "--seed", type=int, default=None, help="default seed for requests that set none")
    p.add_argument("--pooling", default="mean", choices=["mean", "last", "cls"],
                   help="how /v1/embeddings pools the final hidden states (default mean)")
    p.add_argument("--spec-type", default="none",
                   help="speculative proposers, comma-separated in the order asked (e.g. ngram-simple); "
                        "default none")
    p.add_argument("-md", "--model-draft", default=None, help="draft model GGUF (adds the draft-model proposer)")
    p.add_argument("--draft-max", type=int, default=None, help="most draft tokens verified per step")
    p.add_argument("--draft-min", type=int, default=None, help="drop drafts shorter than this")
    p.add_argument("--draft-p-min", type=float, default=0.0,
                   help="model drafters stop when their top-1 probability is below this")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM, seconds running requests get to finish before they are ended with an "
                        "error (default 10)")
    p.add_argument("--timeout", dest="body_timeout", type=float, default=30.0,
                   help="seconds a client has to send a request body (default 30; 10 between chunks)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client has to send a request's headers (default 10)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def read_api_keys(keys: list[str], path: str | None) -> list[str]:
    out = [k.strip() for k in keys if k and k.strip()]
    if path:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    out.append(line)
        if not out:
            raise ValueError(f"--api-key-file {path!r} holds no key")
    return out


def serve_from_args(a: argparse.Namespace) -> int:
    from pyfast.cli import control_vector_kwargs, dsa_kwargs, swa_kwargs

    try:
        import uvicorn

        from pyfast.server.app import ServerOptions, create_app
        from pyfast.server.limits import Drain, GracefulServer, Limits, header_timeout_protocol
        from pyfast.server.engine import Engine, EngineConfig
        from pyfast.server.spec import SpecConfig
    except ImportError as e:
        print(f"error: the server needs its extra dependencies ({e.name} is missing): "
              "pip install 'pyfast[server]'", file=sys.stderr)
        return 1
    if not 0 < a.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {a.port}")
    keys = read_api_keys(a.api_key, a.api_key_file)
    options = ServerOptions(strict_model_name=a.strict_model_name, cors_origins=a.cors_origins.split(","),
                            n_predict=a.n_predict, temperature=a.temp, seed=a.seed, pooling=a.pooling).validate()
    limits = Limits(body_timeout=a.body_timeout, body_idle_timeout=min(10.0, a.body_timeout),
                    header_timeout=a.header_timeout, shutdown_timeout=a.shutdown_timeout).validate()
    logging.basicConfig(level=getattr(logging, a.log_level.upper()), format="%(levelname)s: %(message)s")
    cfg = EngineConfig(model=a.model, n_parallel=a.parallel, n_ctx=a.ctx_size, n_threads=a.threads,
                       n_batch=a.batch_size, n_ubatch=a.ubatch_size, n_checkpoints=a.ctx_checkpoints,
                       max_queue=a.max_queue, alias=a.alias, cache_type_k=a.cache_type_k,
                       cache_type_v=a.cache_type_v, device=a.device, **control_vector_kwargs(a), **dsa_kwargs(a),
                       **swa_kwargs(a), tp=a.tp,
                       spec=SpecConfig(spec_type=a.spec_type, n_max=a.draft_max, n_min=a.draft_min,
                                       p_min=a.draft_p_min, draft_model=a.model_draft))
    engine = Engine(cfg)
    if a.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        logging.warning("serving on %s without an API key: anyone who can reach it can use it", a.host)
    logging.info("model %s: %d slots x %d tokens, listening on http://%s:%d", engine.model_id,
                 cfg.n_parallel, engine.n_ctx_slot, a.host, a.port)
    drain = Drain(limits.shutdown_timeout)
    app = create_app(engine, api_keys=keys, limits=limits, drain=drain, options=options)
    # uvicorn's own grace period is a backstop: the app ends its requests at shutdown_timeout
    config = uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level, access_log=a.log_level == "debug",
                            http=header_timeout_protocol(limits.header_timeout),
                            timeout_graceful_shutdown=limits.shutdown_timeout + 5)
    GracefulServer(config, drain).run()
    return 0
