"""The serving engine: one model, ``n_parallel`` slots, a bounded queue and the
continuous-batching scheduler.

* **One context, one sequence per slot.** The KV cache is unified: ``n_ctx`` cells shared by the
  slots, slot i being sequence id i, each limited to ``n_ctx // n_parallel`` positions.
* **Every step is one batched decode** over all active slots: one token per generating slot
  (plus its speculative draft, see ``spec.py``) and chunks of waiting prompts up to ``n_batch``
  tokens in all. The decode runs in the scheduler thread with the GIL released, so the asyncio
  event loop serving HTTP never waits on compute. Batch invariance makes each sequence's logits
  bit-identical to decoding it alone, so served greedy output equals ``LLM.generate``.
* **Prompt cache.** A slot keeps the tokens its sequence holds in the KV cache after a request.
  A new request goes to the free slot that can reuse the longest prefix of its prompt (least
  recently used among ties); the slot's sequence is truncated to that prefix and only the rest is
  decoded.
* **Hybrid (recurrent) models** (Qwen3.5, Qwen3-Next: Gated-DeltaNet layers next to attention)
  keep a recurrent state that cannot be truncated like a KV cache: it rolls back at most
  ``n_rollback`` (= the speculative draft limit) trailing tokens of its last batch. Each slot
  therefore keeps up to ``--ctx-checkpoints`` **context checkpoints** (algorithms.md §2.7): copies
  of its recurrent state taken shortly before each prompt's end (``len - 4`` and
  ``len - 4 - n_ubatch``; the prompt's decode is split there) and at the end of each reply. A new
  request whose common prefix with the slot's tokens covers the whole state continues from it;
  otherwise the newest checkpoint at or before the common prefix is restored (the KV cache is
  simply truncated to it) and the prompt is decoded from there; failing that, from scratch.
  Speculative drafts longer than the rollback limit save the state before the verify decode and
  restore it and replay the accepted tokens after (as ``pyfast.spec.decoder`` does).
* **Output** goes back to the event loop in one ``call_soon_threadsafe`` per step, as
  :class:`Event` objects on each request's ``asyncio.Queue``.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pyfast.memory.recurrent import RollbackError
from pyfast.sampling import Sampler, SamplingParams
from pyfast.server.metrics import ServerMetrics
from pyfast.server.spec import SpecConfig, Speculator, build_proposers

log = logging.getLogger("pyfast.server")


class QueueFull(RuntimeError):
    """The waiting queue is at --max-queue."""


class EngineStopped(RuntimeError):
    """The engine is shutting down."""


@dataclass
class EngineConfig:
    model: str | None = None     # path / registry name; None = the default model
    n_parallel: int = 4          # slots
    n_ctx: int = 8192            # KV cells in all; each slot gets n_ctx // n_parallel positions
    n_threads: int | None = None
    n_batch: int = 512           # most prompt tokens decoded in one step, all slots together
    max_queue: int = 256         # requests waiting for a slot before new ones get 503
    alias: str | None = None     # model id served by /v1/models (default: the file's stem)
    spec: SpecConfig = field(default_factory=SpecConfig)
    n_ubatch: int = 512          # micro-batch size of the context (raised to n_rollback + 1)
    n_checkpoints: int = 8       # hybrid models: context checkpoints kept per slot (0 = none)
    n_rollback: int | None = None  # hybrid models: snapshot planes (None = the draft limit; fewer
                                   # save memory, longer drafts then save/restore/replay instead)
    cache_type_k: str = "f16"    # KV cache row types (f16, f32, q8_0); V as K unless given
    cache_type_v: str | None = None
    control_vectors: list | None = None  # [(GGUF path, strength)] (llama-server's --control-vector[-scaled])
    control_vector_layer_range: tuple[int, int] | None = None  # first and last layer, inclusive
    _control: "ControlVector | None" = field(default=None, init=False, repr=False, compare=False)  # read by validate()

    def validate(self) -> "EngineConfig":
        if self.n_parallel < 1:
            raise ValueError(f"--parallel must be >= 1, got {self.n_parallel}")
        if self.n_ctx < 2 * self.n_parallel:
            raise ValueError(f"--ctx-size {self.n_ctx} is too small for {self.n_parallel} slots")
        if self.n_batch < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.n_batch}")
        if self.n_ubatch < 1:
            raise ValueError(f"--ubatch-size must be >= 1, got {self.n_ubatch}")
        if self.n_checkpoints < 0:
            raise ValueError(f"--ctx-checkpoints must be >= 0, got {self.n_checkpoints}")
        if self.n_rollback is not None and self.n_rollback < 0:
            raise ValueError(f"n_rollback must be >= 0, got {self.n_rollback}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.n_threads is not None and self.n_threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.n_threads}")
        from pyfast.memory.kv_cache import cache_dtype

        cache_dtype(self.cache_type_k, "--cache-type-k")  # an unknown name fails before the model loads
        if self.cache_type_v is not None:
            cache_dtype(self.cache_type_v, "--cache-type-v")
        self._control = None
        if self.control_vectors:  # a bad file fails before the model loads
            from pyfast.control_vector import ControlVector

            self._control = ControlVector.combine(list(self.control_vectors))
        elif self.control_vector_layer_range is not None:
            raise ValueError("--control-vector-layer-range needs --control-vector or --control-vector-scaled")
        self.spec.validate()
        return self


@dataclass
class GenParams:
    """What one sequence generates."""

    max_tokens: int | None               # None = until the slot's context is full
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None          # None = off; k >= 0: the token's logprob and the top k


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class JobStats:
    n_prompt: int = 0
    n_cached: int = 0          # prompt tokens reused from the slot's cache
    n_gen: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    t_arrival: float = 0.0
    t_start: float = 0.0       # got a slot
    t_prompt_done: float = 0.0  # first token sampled
    t_end: float = 0.0

    @property
    def n_processed(self) -> int:
        return self.n_prompt - self.n_cached


@dataclass
class Event:
    """Output of one job: kind "delta" (text and/or logprobs), "done" or "error"."""

    job: "Job"
    kind: str
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stats: JobStats | None = None
    message: str = ""
    status: int = 500


class Job:
    """One generated sequence (a request with n > 1 or several prompts has several)."""

    def __init__(self, prompt: Sequence[int], params: GenParams, queue: asyncio.Queue | None = None,
                 index: int = 0):
        self.prompt = [int(t) for t in prompt]
        self.params = params
        self.queue = queue
        self.index = index
        self.cancelled = False
        self.finished = False
        self.stats = JobStats(n_prompt=len(self.prompt))
        # scheduler state
        self.slot: "Slot | None" = None
        self.sampler: Sampler | None = None
        self.history: list[int] = []
        self.out: list[int] = []
        self.n_fed = 0             # prompt tokens in the slot's cache
        self.ckpt_at: list[int] = []  # hybrid: prompt positions to checkpoint at (ascending, > n_fed)
        self.last: int | None = None  # last sampled token (not yet decoded)
        self.text = ""
        self.emitted = 0
        self.decoder = None
        self.hold = max((len(s) for s in params.stop), default=0)
        self.t_last_token = 0.0


@dataclass
class Checkpoint:
    """A slot's recurrent state after its first ``n_tokens`` tokens (no KV rows: restoring it
    truncates the slot's KV cache to ``n_tokens``, whose rows are still those tokens' rows)."""

    n_tokens: int
    state: object      # pyfast.memory.hybrid.SeqState saved with kv=False
    nbytes: int


class Slot:
    def __init__(self, sid: int):
        self.id = sid
        self.tokens: list[int] = []   # the tokens sequence `id` holds in the KV cache
        self.job: Job | None = None
        self.last_used = 0.0
        self.checkpoints: list[Checkpoint] = []  # hybrid models: ascending n_tokens, all <= len(tokens)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
    i = int(np.argmax(x))
    return n if not x[i] else i


def find_stop(text: str, stops: list[str], emitted: int) -> int | None:
    """Where the earliest stop string starts, looking only where it can overlap new text."""
    best = None
    for s in stops:
        i = text.find(s, max(0, emitted - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


class Engine:
    """Loads a model and serves generation jobs from a scheduler thread."""

    def __init__(self, cfg: EngineConfig, proposers: Sequence | None = None):
        """proposers: speculative proposers to use instead of those ``cfg.spec`` names."""
        from pyfast.chat import ChatTemplate
        from pyfast.context import Context
        from pyfast.hub import resolve_model
        from pyfast.models import Model
        from pyfast.tokenizer import Tokenizer

        self.cfg = cfg.validate()
        self.model_path = str(resolve_model(cfg.model, quiet=True))
        self.model = Model(self.model_path)
        if cfg._control is not None:  # validate() read the files
            self.model.set_control_vector(cfg._control, *(cfg.control_vector_layer_range or (None, None)))
        self.tokenizer = Tokenizer.from_gguf_metadata(self.model.metadata)
        self.chat_template = None
        self.template_error = ""
        try:
            self.chat_template = ChatTemplate.from_metadata(self.model.metadata, self.tokenizer)
        except ValueError as e:  # a broken template must not stop completions from working
            self.template_error = str(e)
            log.warning("chat template unusable: %s", e)
        self.n_vocab = self.model.n_vocab
        self.n_ctx_slot = cfg.n_ctx // cfg.n_parallel
        n_ctx = self.n_ctx_slot * cfg.n_parallel
        if proposers is None:
            proposers = build_proposers(cfg.spec, self.model, n_ctx, cfg.n_threads)
        self.spec: Speculator | None = None
        if proposers:
            self.spec = Speculator(proposers, self.n_vocab, cfg.spec.n_max, cfg.spec.n_min, cfg.spec.p_min)
        self.spec_enabled = self.spec is not None
        max_draft = self.spec.max_draft if self.spec is not None else 0
        # Hybrid models: one recurrent state slot per server slot (sequence ids are the slot
        # indices, nothing else), and one snapshot plane per draft token so that a rejected draft
        # rolls back without a copy (fewer planes with cfg.n_rollback: longer drafts then save,
        # restore and replay). Each plane costs a full recurrent state per slot.
        self.is_recurrent = bool(self.model.is_recurrent)
        n_rollback = 0
        if self.is_recurrent and max_draft:
            n_rollback = max_draft if cfg.n_rollback is None else min(cfg.n_rollback, max_draft)
        self.n_checkpoints = cfg.n_checkpoints if self.is_recurrent else 0
        # Continuous batching meets many batch shapes; keep more plans than single-sequence
        # decoding needs, but bounded (a prompt-sized plan holds tens of MB of activations).
        export_hidden = self.spec is not None and self.spec.needs_hidden  # draft-mtp reads hidden rows
        self.ctx = Context(self.model, n_ctx=n_ctx, n_threads=cfg.n_threads, max_plans=64,
                           n_ubatch=max(cfg.n_ubatch, n_rollback + 1), n_seq_max=cfg.n_parallel,
                           n_rollback=n_rollback, export_hidden=export_hidden,
                           kv_dtype=cfg.cache_type_k, kv_dtype_v=cfg.cache_type_v)
        self.ctx.max_plans += 2 * max_draft  # verify batches come in more sizes
        if self.spec is not None:
            self.spec.bind_target(self.ctx)
        self.slots = [Slot(i) for i in range(cfg.n_parallel)]
        self._to_end: list[int] = []  # slots whose request ended: proposers get end() after the step
        self.metrics = ServerMetrics()
        self.metrics.slots_total.set(cfg.n_parallel)
        self._ckpt_bytes = 0
        self.model_id = cfg.alias or _model_stem(self.model_path)
        self.created = int(time.time())
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._outbox: list[Event] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # --- lifecycle -------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pyfast-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._cv:
            jobs = list(self._waiting) + [s.job for s in self.slots if s.job is not None]
            self._waiting.clear()
        for j in jobs:
            self._fail(j, "the server is shutting down", 503)
        self._flush()

    # --- called from the event loop ---------------------------------------------------------
    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs (all or none). Raises QueueFull past --max-queue."""
        now = time.perf_counter()
        with self._cv:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            if len(self._waiting) + len(jobs) > self.cfg.max_queue + self._free_slots():
                self.metrics.requests_rejected.inc(reason="queue_full")
                raise QueueFull(f"the server is busy: {len(self._waiting)} requests are waiting "
                                f"(--max-queue {self.cfg.max_queue})")
            for j in jobs:
                j.stats.t_arrival = now
                self._waiting.append(j)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cv.notify_all()

    def cancel(self, job: Job) -> None:
        """Stop a job (its client went away); its slot is freed before the next step."""
        if job.finished or job.cancelled:
            return
        with self._cv:
            job.cancelled = True
            self._cv.notify_all()

    def _free_slots(self) -> int:
        return sum(1 for s in self.slots if s.job is None)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def n_busy(self) -> int:
        return sum(1 for s in self.slots if s.job is not None)

    # --- the scheduler thread ---------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """The scheduler thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while True:
            active: list[Slot] = []
            try:
                with self._cv:
                    if self._stopping:
                        return
                    self._drop_cancelled()
                    self._admit()
                    active = [s for s in self.slots if s.job is not None]
                    if not active:
                        self._flush()
                        self._cv.wait(0.5)
                        continue
                self._step(active)
            except Exception as e:  # never let one bad batch stop the server
                log.exception("scheduler step failed")
                for s in active or self.slots:
                    if s.job is not None:
                        self._fail(s.job, f"internal error: {type(e).__name__}: {e}", 500)
                    self._reset_slot(s)
            self._flush()

    def _drop_cancelled(self) -> None:
        if any(j.cancelled for j in self._waiting):
            keep = [j for j in self._waiting if not j.cancelled]
            for j in self._waiting:
                if j.cancelled:
                    self._close(j, "cancelled")
            self._waiting = deque(keep)
        for s in self.slots:
            if s.job is not None and s.job.cancelled:
                self._close(s.job, "cancelled")
        self.metrics.queue_depth.set(len(self._waiting))

    def _end_sequences(self) -> None:
        for sid in self._to_end:
            if self.spec is not None:
                self.spec.end(sid)
            s = self.slots[sid]
            if s.job is None:  # the reply's end: where the next turn of a conversation branches
                self._checkpoint(s)
        self._to_end.clear()

    def _admit(self) -> None:
        self._end_sequences()
        while self._waiting:
            free = [s for s in self.slots if s.job is None]
            if not free:
                break
            job = self._waiting.popleft()
            best, best_key = None, None
            for s in free:
                key = (self._usable_prefix(s, job.prompt, common_prefix(s.tokens, job.prompt)), -s.last_used)
                if best_key is None or key > best_key:
                    best, best_key = s, key
            self._start(best, job, common_prefix(best.tokens, job.prompt))
        self.metrics.queue_depth.set(len(self._waiting))
        self.metrics.slots_busy.set(self.n_busy)

    # --- the prompt cache ------------------------------------------------------------------
    def _usable_prefix(self, slot: Slot, prompt: list[int], lcp: int) -> int:
        """How many of the slot's cached tokens a prompt sharing ``lcp`` of them can keep."""
        want = min(lcp, len(prompt) - 1)  # decode at least one token for its logits
        held = len(slot.tokens)
        if not self.is_recurrent or want >= held or held - want <= self.ctx.can_rollback(slot.id):
            return want
        cp = self._checkpoint_before(slot, want)
        return cp.n_tokens if cp is not None else 0

    def _checkpoint_before(self, slot: Slot, n: int) -> Checkpoint | None:
        """The newest checkpoint of the slot holding at most ``n`` tokens."""
        best = None
        for cp in slot.checkpoints:
            if cp.n_tokens <= n:
                best = cp
        return best

    def _reuse_prefix(self, slot: Slot, prompt: list[int], lcp: int) -> int:
        """Keep the first ``n_keep`` cached tokens of the slot for this prompt; returns n_keep.

        A KV cache truncates to any length. Recurrent state (hybrid models) continues when the
        common prefix covers all of it, rolls back through its snapshot planes when they reach,
        and otherwise restores the newest checkpoint at or before the common prefix (the prompt
        is then decoded from there), or starts over (algorithms.md §2.7)."""
        want = min(lcp, len(prompt) - 1)  # decode at least one token for its logits
        n_keep = self._rewind(slot, want)
        if want > n_keep:
            self.metrics.prompt_tokens_reprocessed.inc(want - n_keep)
        return n_keep

    def _rewind(self, slot: Slot, n: int) -> int:
        """Make the slot's sequence hold (a prefix of) its first ``n`` tokens; returns how many
        it holds: ``n`` unless recurrent state had to go back to a checkpoint or to nothing."""
        if len(slot.tokens) <= n:
            return len(slot.tokens)
        try:
            self.ctx.truncate(slot.id, n)
        except RollbackError:
            cp = self._checkpoint_before(slot, n)
            n = 0
            if cp is not None:
                try:
                    self.ctx.restore_state(slot.id, cp.state)
                    n = cp.n_tokens
                    self.metrics.checkpoints_restored.inc()
                except Exception:  # a checkpoint that does not fit any more: start over
                    log.exception("restoring a context checkpoint failed")
                    n = 0
            if n == 0:
                self.ctx.remove_seq(slot.id)
        del slot.tokens[n:]
        self._drop_checkpoints(slot, n)
        return n

    # --- context checkpoints (hybrid models) -------------------------------------------------
    def _checkpoint(self, slot: Slot) -> None:
        """Save the slot's recurrent state as a checkpoint at its current length (no-op for
        KV-only models, when checkpoints are off or one is already there)."""
        n = len(slot.tokens)
        if not self.n_checkpoints or n == 0 or (slot.checkpoints and slot.checkpoints[-1].n_tokens >= n):
            return
        if self.ctx.seq_len(slot.id) != n:  # never expected: do not save a state we cannot trust
            log.warning("slot %d holds %d tokens but its sequence %d; no checkpoint", slot.id, n,
                        self.ctx.seq_len(slot.id))
            return
        st = self.ctx.save_state(slot.id, kv=False)
        rec = st.rec
        nbytes = 0 if rec is None else int(rec.conv.nbytes + rec.ssm.nbytes)
        slot.checkpoints.append(Checkpoint(n, st, nbytes))
        self._ckpt_bytes += nbytes
        self.metrics.checkpoints_created.inc()
        while len(slot.checkpoints) > self.n_checkpoints:  # oldest first
            self._ckpt_bytes -= slot.checkpoints.pop(0).nbytes
        self._ckpt_gauges()

    def _drop_checkpoints(self, slot: Slot, n: int) -> None:
        """Invalidate the slot's checkpoints past its new end ``n``."""
        keep = [cp for cp in slot.checkpoints if cp.n_tokens <= n]
        if len(keep) != len(slot.checkpoints):
            self._ckpt_bytes -= sum(cp.nbytes for cp in slot.checkpoints if cp.n_tokens > n)
            slot.checkpoints = keep
            self._ckpt_gauges()

    def _ckpt_gauges(self) -> None:
        self.metrics.checkpoints.set(sum(len(s.checkpoints) for s in self.slots))
        self.metrics.checkpoint_bytes.set(self._ckpt_bytes)

    def _reset_slot(self, slot: Slot) -> None:
        """Forget everything the slot's sequence holds."""
        self.ctx.remove_seq(slot.id)
        slot.tokens = []
        self._drop_checkpoints(slot, 0)

    def _plan_checkpoints(self, job: Job, n_keep: int) -> list[int]:
        """Prompt positions at which to checkpoint the state: shortly before the prompt's end,
        where a later request (the same prompt again, the next turn branching) will likely
        diverge (algorithms.md §2.7)."""
        if not self.n_checkpoints:
            return []
        n = len(job.prompt)
        at = {n - 4, n - 4 - self.ctx.n_ubatch}
        return sorted(p for p in at if p > n_keep)

    def _start(self, slot: Slot, job: Job, lcp: int) -> None:
        from pyfast.tokenizer import StreamDecoder

        n_keep = self._reuse_prefix(slot, job.prompt, lcp)
        job.slot = slot
        slot.job = job
        st = job.stats
        st.t_start = time.perf_counter()
        st.n_cached = n_keep
        job.n_fed = n_keep
        job.ckpt_at = self._plan_checkpoints(job, n_keep)
        job.history = list(job.prompt)
        job.sampler = Sampler(job.params.sampling, self.n_vocab)
        job.decoder = StreamDecoder(self.tokenizer)
        self.metrics.prompt_tokens.inc(len(job.prompt))
        self.metrics.prompt_tokens_cached.inc(n_keep)
        if self.spec is not None:
            self.spec.begin(slot.id, job.prompt)
        if job.params.max_tokens == 0:
            st.t_prompt_done = st.t_start
            job.text += job.decoder.flush()
            self._finish(job, "length")

    def _step(self, active: list[Slot]) -> None:
        toks: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        rows: list[int] = []
        gen: list[tuple[Slot, list[int], int, list[int]]] = []   # slot, fed, first out row, draft
        pre: list[tuple[Slot, int, bool, int]] = []              # slot, n tokens, last chunk, out row
        gen_slots = [s for s in active if s.job.last is not None]
        drafts = self._drafts(gen_slots) if self.spec is not None and gen_slots else {}
        saved: dict[int, object] = {}  # slot -> state before a draft longer than the rollback limit
        limit = self.ctx.rollback_limit
        for s in gen_slots:
            job = s.job
            draft = drafts.get(s.id, [])
            fed = [job.last] + draft
            n0 = len(s.tokens)
            if len(draft) > limit:  # recurrent state: the planes cannot remove that many tokens
                saved[s.id] = self.ctx.save_state(s.id, kv=False)
            gen.append((s, fed, len(rows), draft))
            rows.extend(range(len(toks), len(toks) + len(fed)))
            toks.extend(fed)
            pos.extend(range(n0, n0 + len(fed)))
            seqs.extend([s.id] * len(fed))
        n_gen = len(toks)
        budget = max(1, self.cfg.n_batch - n_gen)
        for s in sorted((s for s in active if s.job.last is None), key=lambda s: s.job.stats.t_start):
            if budget <= 0:
                break
            job = s.job
            todo = len(job.prompt) - job.n_fed
            n = min(todo, budget)
            if job.ckpt_at:  # end the chunk where a checkpoint is due
                n = min(n, job.ckpt_at[0] - job.n_fed)
            budget -= n
            toks.extend(job.prompt[job.n_fed:job.n_fed + n])
            pos.extend(range(job.n_fed, job.n_fed + n))
            seqs.extend([s.id] * n)
            last = n == todo
            pre.append((s, n, last, len(rows)))
            if last:
                rows.append(len(toks) - 1)

        t0 = time.perf_counter()
        logits = self.ctx.decode(toks, pos, seqs, logits=np.asarray(rows, dtype=np.int64))
        hidden = self.ctx.last_hidden if self.ctx.export_hidden else None  # every row's, for process()
        m = self.metrics
        m.decode_seconds.inc(time.perf_counter() - t0)
        m.decode_steps.inc()
        m.batch_tokens.observe(len(toks))

        if self.spec is not None and pre:
            self.spec.process("prompt", seqs[n_gen:], toks[n_gen:], pos[n_gen:],
                              hidden=None if hidden is None else hidden[n_gen:])
        for s, n, last, r in pre:
            job = s.job
            s.tokens.extend(job.prompt[job.n_fed:job.n_fed + n])
            job.n_fed += n
            m.prompt_tokens_processed.inc(n)
            if job.ckpt_at and job.n_fed >= job.ckpt_at[0]:
                job.ckpt_at.pop(0)
                self._checkpoint(s)
            if last:
                job.stats.t_prompt_done = time.perf_counter()
                self._sample(s, job, logits[r:r + 1], [])

        accepted: dict[int, int] = {}
        replay: list[tuple[Slot, int, list[int]]] = []
        for s, fed, r0, draft in gen:
            job = s.job
            s.tokens.extend(fed)
            accepted[s.id] = self._sample(s, job, logits[r0:r0 + len(fed)], draft, saved, replay)
        if replay:
            self._replay(replay)
        if self.spec is not None and gen:
            for sid, k in accepted.items():
                self.spec.accept(sid, k)
            self.spec.process("verify", seqs[:n_gen], toks[:n_gen], pos[:n_gen], accepted,
                              hidden=None if hidden is None else hidden[:n_gen])
        self._end_sequences()

    def _drafts(self, gen_slots: list[Slot]) -> dict[int, list[int]]:
        """Ask the proposers for drafts for every generating slot (one batched call)."""
        wants = []
        for s in gen_slots:
            job = s.job
            cap = min(self.n_ctx_slot - len(s.tokens) - 1, _remaining(job, self.n_ctx_slot) - 1)
            if cap >= 1:
                wants.append((s.id, np.asarray(job.history, dtype=np.int32), cap, job.sampler))
        if not wants:
            return {}
        try:
            return self.spec.draft(wants)
        except Exception:  # a failing proposer costs speed, never output
            log.exception("drafting failed; this step runs without drafts")
            return {}

    def _sample(self, s: Slot, job: Job, rows: np.ndarray, draft: list[int], saved: dict | None = None,
                replay: list | None = None) -> int:
        """Sample from each row in turn (verifying the draft), push the tokens, roll back the
        cache to the last row whose input was confirmed. Returns the accepted draft length.

        Recurrent state that cannot roll back that far is restored from ``saved`` (taken before
        the decode) or a checkpoint, and the tokens to decode again go to ``replay``."""
        n_rows = 0
        accepted = 0
        tok = None
        done = False
        try:
            for i in range(rows.shape[0]):
                n_rows += 1
                tok = job.sampler.sample(rows[i], job.history)
                done = self._push(job, tok, rows[i])
                if done or i >= len(draft) or tok != draft[i]:
                    break
                accepted += 1
        except Exception as e:  # e.g. non-finite logits: fail this request only
            log.exception("sampling failed")
            self._fail(job, f"internal error: {e}", 500)
            done = True
        if draft:
            job.stats.n_drafted += len(draft)
            job.stats.n_accepted += accepted
            self.metrics.add_spec(len(draft), accepted)
        # rows 0..n_rows-1 read confirmed inputs; drop the rest of the draft from the cache
        keep = len(s.tokens) - rows.shape[0] + n_rows
        if keep < len(s.tokens):
            try:
                self.ctx.truncate(s.id, keep)
                del s.tokens[keep:]
            except RollbackError:
                self._restore_for_replay(s, keep, (saved or {}).get(s.id), replay)
        if not done:
            job.last = tok
        return accepted

    def _restore_for_replay(self, s: Slot, keep: int, saved, replay: list | None) -> None:
        """After a verify decode, make the slot hold its first ``keep`` tokens when its recurrent
        state cannot roll back there: restore the state saved before the decode (else the newest
        checkpoint, else nothing) and queue the missing tokens for one replay decode."""
        tokens = s.tokens[:keep]
        if saved is not None and saved.n_tokens <= keep:
            self.ctx.restore_state(s.id, saved)
            start = saved.n_tokens
            self.metrics.spec_state_restores.inc()
        else:  # never expected (drafts beyond the limit are saved first): a checkpoint or nothing
            log.warning("slot %d: no saved state to roll back a draft; replaying from a checkpoint", s.id)
            start = self._rewind(s, keep)
        s.tokens = tokens[:start]
        self._drop_checkpoints(s, start)
        if keep > start:
            if replay is None:
                self._replay([(s, start, tokens[start:keep])])
            else:
                replay.append((s, start, tokens[start:keep]))

    def _replay(self, items: list[tuple[Slot, int, list[int]]]) -> None:
        """Decode tokens again that a restored state lacks (one batch, no logits)."""
        toks: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        for s, start, t in items:
            toks.extend(t)
            pos.extend(range(start, start + len(t)))
            seqs.extend([s.id] * len(t))
        t0 = time.perf_counter()
        self.ctx.decode(toks, pos, seqs, logits="none")
        self.metrics.decode_seconds.inc(time.perf_counter() - t0)
        self.metrics.spec_replayed_tokens.inc(len(toks))
        for s, start, t in items:
            s.tokens.extend(t)

    def _push(self, job: Job, tok: int, row: np.ndarray) -> bool:
        """Add one sampled token to a job's output; True when the job is finished."""
        now = time.perf_counter()
        if not job.params.ignore_eos and self.tokenizer.is_eog(tok):
            self._finish(job, "stop")
            return True
        m = self.metrics
        if not job.out:
            m.ttft.observe(now - job.stats.t_arrival)
        else:
            m.tpot.observe(now - job.t_last_token)
        job.t_last_token = now
        m.generation_tokens.inc()
        lp = _logprob(row, tok, job.params.logprobs) if job.params.logprobs is not None else None
        job.out.append(tok)
        job.history.append(tok)
        job.text += job.decoder.feed(tok)
        hit = find_stop(job.text, job.params.stop, job.emitted)
        if hit is not None:
            job.text = job.text[:hit]
            self._finish(job, "stop", lp)
            return True
        safe = max(job.emitted, len(job.text) - job.hold) if job.hold else len(job.text)
        if safe > job.emitted or lp is not None:
            self._post(Event(job, "delta", text=job.text[job.emitted:safe],
                             logprobs=[lp] if lp is not None else None))
            job.emitted = safe
        if len(job.out) >= _max_tokens(job, self.n_ctx_slot) or len(job.history) >= self.n_ctx_slot:
            job.text += job.decoder.flush()
            self._finish(job, "length")
            return True
        return False

    # --- finishing ---------------------------------------------------------------------------
    def _release(self, job: Job) -> None:
        s = job.slot
        if s is not None and s.job is job:
            s.job = None
            s.last_used = time.perf_counter()
            self._to_end.append(s.id)
        job.finished = True
        self.metrics.slots_busy.set(self.n_busy)

    def _finish(self, job: Job, reason: str, lp: TokenLogprob | None = None) -> None:
        st = job.stats
        st.t_end = time.perf_counter()
        if not st.t_prompt_done:
            st.t_prompt_done = st.t_end
        st.n_gen = len(job.out)
        self._release(job)
        self.metrics.requests_finished.inc(reason=reason)
        self.metrics.request_latency.observe(st.t_end - st.t_arrival)
        self._post(Event(job, "done", text=job.text[job.emitted:], finish_reason=reason, stats=st,
                         logprobs=[lp] if lp is not None else None))
        job.emitted = len(job.text)

    def _close(self, job: Job, reason: str) -> None:
        """End a job whose client is gone: no event."""
        job.stats.t_end = time.perf_counter()
        self._release(job)
        self.metrics.requests_finished.inc(reason=reason)

    def _fail(self, job: Job, message: str, status: int) -> None:
        if job.finished:
            return
        self._release(job)
        self.metrics.requests_finished.inc(reason="error")
        self._post(Event(job, "error", message=message, status=status))

    def _post(self, ev: Event) -> None:
        self._outbox.append(ev)

    def _flush(self) -> None:
        if not self._outbox or self._loop is None:
            self._outbox.clear()
            return
        batch, self._outbox = self._outbox, []
        try:
            self._loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the loop is closed: nobody is listening
            pass


def _deliver(events: list[Event]) -> None:
    for ev in events:
        if ev.job.queue is not None:
            ev.job.queue.put_nowait(ev)


def _max_tokens(job: Job, n_ctx_slot: int) -> int:
    mt = job.params.max_tokens
    return n_ctx_slot if mt is None else mt


def _remaining(job: Job, n_ctx_slot: int) -> int:
    return min(_max_tokens(job, n_ctx_slot) - len(job.out), n_ctx_slot - len(job.history))


def _logprob(row: np.ndarray, tok: int, k: int) -> TokenLogprob:
    x = row.astype(np.float64)
    mx = x.max()
    lse = mx + np.log(np.exp(x - mx).sum())
    top: list[tuple[int, float]] = []
    if k > 0:
        k = min(k, x.size)
        idx = np.argpartition(-x, k - 1)[:k]
        idx = idx[np.lexsort((idx, -x[idx]))]
        top = [(int(i), float(x[i] - lse)) for i in idx]
    return TokenLogprob(token=int(tok), logprob=float(x[tok] - lse), top=top)


def _model_stem(path: str) -> str:
    import os

    name = os.path.basename(path)
    return name[:-5] if name.lower().endswith(".gguf") else name
