"""The serving engine: one model, ``n_parallel`` slots, a bounded queue and the
continuous-batching scheduler.

* **One context, one sequence per slot.** The KV cache is unified: ``n_ctx`` cells shared by the
  slots, slot i being sequence id i, each limited to ``n_ctx // n_parallel`` positions.
* **Every step is one batched decode** over all active slots: one round per generating slot
  (its last token plus its speculative draft) and chunks of waiting prompts up to ``n_batch``
  tokens in all. The rounds are ``pyfast.spec.decoder.SpecDecoder``'s, the code ``LLM.generate``
  and ``generate_batch`` run (drafting, the verify batch, verification, rollback, recurrent save /
  restore / replay, statistics; ``spec.py``); the scheduler adds the prompt chunks to the round's
  decode and consumes the new tokens (stop strings, EOS, streaming, logprobs). The decode runs in
  the scheduler thread with the GIL released, so the asyncio event loop serving HTTP never waits
  on compute. Batch invariance makes each sequence's logits bit-identical to decoding it alone,
  so served output equals ``LLM.generate``'s (greedy, or sampled with the same seed and the
  same proposers).
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
  simply truncated to it) and the prompt is decoded from there; failing that, from scratch. A
  checkpoint also keeps the proposers' state at its position (``Proposer.save_state``: the
  feature or hidden row an EAGLE-3 head or the MTP block reads next), so drafting after a
  restore is that of a slot that never went further.
  Speculative drafts longer than the rollback limit save the state before the verify decode and
  restore it and replay the accepted tokens after (in the shared round).
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
from pyfast.server.spec import SpecConfig, as_proposer, build_proposers
from pyfast.spec.config import capture_layers, needs_hidden
from pyfast.spec.decoder import SpecDecoder

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
    device: str | None = None    # "cpu" (default) or a device such as "vulkan:0" (pyfast.devices())
    control_vectors: list | None = None  # [(GGUF path, strength)] (llama-server's --control-vector[-scaled])
    control_vector_layer_range: tuple[int, int] | None = None  # first and last layer, inclusive
    dsa: bool | None = None      # DeepSeek sparse attention on / off (None: the model's default, on)
    dsa_top_k: int = -1          # cells each query keeps under DSA (-1: the model's)
    swa_full: bool = True        # sliding-window layers (Gemma): False bounds their cache to the window
    tp: int = 1                  # tensor parallelism over this many mpirun ranks (this process is rank 0)
    _control: "ControlVector | None" = field(default=None, init=False, repr=False, compare=False)  # read by validate()
    _device: object = field(default=None, init=False, repr=False, compare=False)  # opened by validate()

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
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if self.tp > 1 and (self.device is not None or self.control_vectors):
            raise ValueError("--tp: tensor parallelism runs on the CPU without control vectors for now")
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
        self._device = None
        if self.device is not None:  # a missing device fails before the model loads
            from pyfast.device import open_device

            self._device = open_device(self.device)
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
        self.seq = None            # its pyfast.spec.decoder.Slot: tokens, sampler, speculation statistics
        self.out: list[int] = []
        self.n_fed = 0             # prompt tokens in the slot's cache
        self.ckpt_at: list[int] = []  # hybrid: prompt positions to checkpoint at (ascending, > n_fed)
        self.text = ""
        self.emitted = 0
        self.decoder = None
        self.hold = max((len(s) for s in params.stop), default=0)
        self.t_last_token = 0.0


@dataclass
class Checkpoint:
    """A slot's recurrent state after its first ``n_tokens`` tokens (no KV rows: restoring it
    truncates the slot's KV cache to ``n_tokens``, whose rows are still those tokens' rows), and
    what the speculative proposers need to draft on from there (``SpecDecoder.save_state``: e.g.
    an EAGLE-3 head's deferred feature row, the MTP block's carry)."""

    n_tokens: int
    state: object      # pyfast.memory.hybrid.SeqState saved with kv=False
    nbytes: int
    spec: tuple | None = None


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
        # on a device the weights are uploaded from the file mapping
        self.new_context = Context  # contexts of this engine's model (mirrored on the other ranks under TP)
        if cfg.tp > 1:  # rank 0 of an mpirun world: the other ranks hold the rest of the model
            from functools import partial

            from pyfast.parallel.tp import TPContext, leader, leader_group

            group = leader_group(cfg.tp)
            self.model = leader(self.model_path, group)
            self.new_context = partial(TPContext, group=group)
        else:
            self.model = Model(self.model_path, mmap=True) if cfg._device is not None else Model(self.model_path)
        if cfg._control is not None:  # validate() read the files
            self.model.set_control_vector(cfg._control, *(cfg.control_vector_layer_range or (None, None)))
        self.model.set_dsa(on=cfg.dsa, top_k=cfg.dsa_top_k)
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
        proposers = [as_proposer(p) for p in proposers]
        round_cfg = cfg.spec.decoder_config()
        max_draft = max((round_cfg.n_max_for(p) for p in proposers), default=0)
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
        export_hidden = needs_hidden(proposers)  # draft-mtp reads the target's hidden rows
        self.ctx = self.new_context(self.model, n_ctx=n_ctx, n_threads=cfg.n_threads, max_plans=64,
                           n_ubatch=max(cfg.n_ubatch, n_rollback + 1), n_seq_max=cfg.n_parallel,
                           n_rollback=n_rollback, export_hidden=export_hidden,
                           capture_layers=capture_layers(proposers),
                           kv_dtype=cfg.cache_type_k, kv_dtype_v=cfg.cache_type_v, device=cfg._device,
                           swa_full=cfg.swa_full)
        self.ctx.max_plans += 2 * max_draft  # verify batches come in more sizes
        # every round goes through the decoder (a plain multi-sequence decoder without proposers)
        self.decoder = SpecDecoder(self.ctx, proposers, round_cfg, safe_drafts=True)
        self.spec = self.decoder if proposers else None
        self.spec_enabled = self.spec is not None
        self.slots = [Slot(i) for i in range(cfg.n_parallel)]
        self._to_end: list = []  # (slot id, decoder slot) of ended requests: released after the step
        self._failed: list[Slot] = []  # slots whose sampling failed in this step: reset after it
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
        while not self._stopping:
            if not self.step():
                with self._cv:
                    if not self._stopping and not self._waiting:
                        self._cv.wait(0.5)

    def step(self) -> bool:
        """One scheduler iteration in the calling thread (the scheduler thread's loop; tests and
        benchmarks may drive an engine that was not started): drop cancelled jobs, admit waiting
        ones, run one batched step. Returns False when there was nothing to run."""
        active: list[Slot] = []
        try:
            with self._cv:
                if self._stopping:
                    return False
                self._drop_cancelled()
                self._admit()
                active = [s for s in self.slots if s.job is not None]
            if active:
                self._step(active)
        except Exception as e:  # never let one bad batch stop the server
            log.exception("scheduler step failed")
            for s in active or self.slots:
                if s.job is not None:
                    self._fail(s.job, f"internal error: {type(e).__name__}: {e}", 500)
                self._reset_slot(s)
        self._flush()
        return bool(active)

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
        for sid, seq in self._to_end:
            if seq is not None and self.decoder.slots.get(sid) is seq:
                self.decoder.release(seq)  # the proposers' end(); the cache keeps the tokens
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
                    self.decoder.restore_state(slot.id, n, cp.spec)
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
        spec = self.decoder.save_state(slot.id, n)
        rec = st.rec
        nbytes = 0 if rec is None else int(rec.conv.nbytes + rec.ssm.nbytes)
        nbytes += sum(int(getattr(x, "nbytes", 0)) for x in spec or ())
        slot.checkpoints.append(Checkpoint(n, st, nbytes, spec))
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
        job.decoder = StreamDecoder(self.tokenizer)
        self.metrics.prompt_tokens.inc(len(job.prompt))
        self.metrics.prompt_tokens_cached.inc(n_keep)
        old = self.decoder.slots.get(slot.id)
        if old is not None:  # the slot's previous job ended during this admission
            self.decoder.release(old)
        job.seq = self.decoder.add(slot.id, job.prompt, Sampler(job.params.sampling, self.n_vocab),
                                   self.n_ctx_slot)  # the proposers' begin()
        if job.params.max_tokens == 0:
            st.t_prompt_done = st.t_start
            job.text += job.decoder.flush()
            self._finish(job, "length")

    def _step(self, active: list[Slot]) -> None:
        """One batched decode: a round of the shared decoder for every generating slot (its rows
        first), then prompt chunks of the others up to ``n_batch`` tokens in all."""
        dec, m = self.decoder, self.metrics
        gen = [s for s in active if s.job.seq.started]
        rnd = None
        parts: list[tuple] = []  # (tokens, positions, seq ids) of the decode, round first
        if gen:
            for s in gen:
                s.job.seq.n_remaining = _remaining(s.job, self.n_ctx_slot)
            rnd = dec.begin_round([s.job.seq for s in gen])
            parts.append((rnd.toks, rnd.pos, rnd.seqs))
        n_gen = rnd.n_rows if rnd is not None else 0
        rows = list(range(n_gen))
        pre: list[tuple[Slot, int, bool, int]] = []  # slot, n tokens, last chunk, logits row
        budget = max(1, self.cfg.n_batch - n_gen)
        n_tok = n_gen
        for s in sorted((s for s in active if not s.job.seq.started), key=lambda s: s.job.stats.t_start):
            if budget <= 0:
                break
            job = s.job
            todo = len(job.prompt) - job.n_fed
            n = min(todo, budget)
            if job.ckpt_at:  # end the chunk where a checkpoint is due
                n = min(n, job.ckpt_at[0] - job.n_fed)
            budget -= n
            parts.append((job.prompt[job.n_fed:job.n_fed + n], np.arange(job.n_fed, job.n_fed + n), [s.id] * n))
            n_tok += n
            last = n == todo
            pre.append((s, n, last, len(rows)))
            if last:
                rows.append(n_tok - 1)
        toks, pos, seqs = (np.concatenate(x).astype(np.int32, copy=False) for x in zip(*parts))

        t0 = time.perf_counter()
        logits = self.ctx.decode(toks, pos, seqs, logits=np.asarray(rows, dtype=np.int64))
        hidden = self.ctx.last_hidden if self.ctx.export_hidden else None  # every row's, for process()
        feats = self.ctx.last_features if self.ctx.capture_layers else None  # captured layers (EAGLE-3, DFlash)
        m.decode_seconds.inc(time.perf_counter() - t0)
        m.decode_steps.inc()
        m.batch_tokens.observe(len(toks))

        if pre:
            dec.process_prompt(seqs[n_gen:], toks[n_gen:], pos[n_gen:], None if hidden is None else hidden[n_gen:],
                               None if feats is None else feats[n_gen:])
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
                try:
                    tok = dec.start(job.seq, logits[r])
                except Exception as e:  # e.g. non-finite logits: fail this request only
                    self._verify_failed(job.seq, e)
                    continue
                self._take(job.seq, [tok], logits[r:r + 1])

        if rnd is not None:
            dec.end_round(rnd, logits[:n_gen], None if hidden is None else hidden[:n_gen], self._take,
                          self._verify_failed, None if feats is None else feats[:n_gen])
            for s, seq in zip(gen, rnd.slots):  # the cache holds every token of the sequence but the last
                if s not in self._failed:
                    s.tokens.extend(seq._buf[len(s.tokens): seq.n - 1].tolist())
            if rnd.n_drafted:
                m.add_spec(rnd.n_drafted, rnd.n_accepted)
            if rnd.n_restored:
                m.spec_state_restores.inc(rnd.n_restored)
                m.spec_replayed_tokens.inc(rnd.n_replayed)
                m.decode_seconds.inc(rnd.t_replay)
        for s in self._failed:
            self._reset_slot(s)
        self._failed.clear()
        self._end_sequences()

    def _take(self, seq, tokens: list[int], rows: np.ndarray) -> int:
        """The shared round's consumer: push a slot's new tokens to its job until the job
        finishes; returns how many were used (the round drops the rest from the cache)."""
        job = self.slots[seq.seq].job
        for i, tok in enumerate(tokens):
            try:
                if self._push(job, tok, rows[i]):
                    return i + 1
            except Exception as e:  # fail this request only
                log.exception("sampling failed")
                self._fail(job, f"internal error: {e}", 500)
                return i + 1
        return len(tokens)

    def _verify_failed(self, seq, e: Exception) -> None:
        """A slot's sampling or verification raised: fail its request, forget its cache."""
        log.error("sampling failed: %s: %s", type(e).__name__, e)
        s = self.slots[seq.seq]
        if s.job is not None:
            self._fail(s.job, f"internal error: {e}", 500)
        self._failed.append(s)  # reset after the step

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
        if len(job.out) >= _max_tokens(job, self.n_ctx_slot) or len(job.prompt) + len(job.out) >= self.n_ctx_slot:
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
            self._to_end.append((s.id, job.seq))
        job.finished = True
        self.metrics.slots_busy.set(self.n_busy)

    def _finish(self, job: Job, reason: str, lp: TokenLogprob | None = None) -> None:
        st = job.stats
        st.t_end = time.perf_counter()
        if not st.t_prompt_done:
            st.t_prompt_done = st.t_end
        st.n_gen = len(job.out)
        if job.seq is not None:  # the shared round counts the drafts
            st.n_drafted, st.n_accepted = job.seq.stats.drafted, job.seq.stats.accepted
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
    return min(_max_tokens(job, n_ctx_slot) - len(job.out), n_ctx_slot - len(job.prompt) - len(job.out))


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
