"""Prometheus metrics in the text exposition format (version 0.0.4), without a client library.

Counters, gauges and histograms are updated from the scheduler thread and the event loop, so
every update takes the registry's lock; rendering takes it once and formats a consistent view.
"""
from __future__ import annotations

import math
import threading
from typing import Iterable

# Latency buckets (seconds): time to first token spans queueing, so it reaches further.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0,
                7.5, 10.0, 20.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def _fmt(v: float) -> str:
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return str(int(v))
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Metric:
    kind = ""

    def __init__(self, registry: "Registry", name: str, help_: str, labels: Iterable[str] = ()):
        self.registry = registry
        self.name = name
        self.help = help_
        self.label_names = tuple(labels)
        registry._metrics.append(self)

    def _key(self, labels: dict[str, str] | None) -> tuple[str, ...]:
        labels = labels or {}
        return tuple(str(labels.get(n, "")) for n in self.label_names)

    def lines(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._values: dict[tuple[str, ...], float] = {} if self.label_names else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self.registry.lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self.registry.lock:
            return self._values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{_labels(self.label_names, k)} {_fmt(v)}" for k, v in sorted(self._values.items())]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self.registry.lock:
            self._values[key] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, registry, name, help_, buckets: Iterable[float]):
        super().__init__(registry, name, help_)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._count = 0

    def observe(self, v: float) -> None:
        i = 0
        while i < len(self.buckets) and v > self.buckets[i]:
            i += 1
        with self.registry.lock:
            self._counts[i] += 1
            self._sum += v
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def lines(self) -> list[str]:
        out, cum = [], 0
        for b, c in zip(self.buckets + (math.inf,), self._counts):
            cum += c
            out.append(f'{self.name}_bucket{{le="{_fmt(b)}"}} {cum}')
        out.append(f"{self.name}_sum {_fmt(self._sum)}")
        out.append(f"{self.name}_count {self._count}")
        return out


class Registry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._metrics: list[_Metric] = []

    def render(self) -> str:
        out = []
        with self.lock:
            for m in self._metrics:
                out.append(f"# HELP {m.name} {m.help}")
                out.append(f"# TYPE {m.name} {m.kind}")
                out.extend(m.lines())
        return "\n".join(out) + "\n"


class ServerMetrics:
    """Every metric the server exports."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        p = "pyfast_"
        self.http_requests = Counter(r, p + "http_requests_total", "HTTP requests by route and status code",
                                     ("route", "status"))
        self.requests_finished = Counter(r, p + "requests_finished_total",
                                         "generation requests finished, by finish reason", ("reason",))
        self.requests_rejected = Counter(r, p + "requests_rejected_total",
                                         "generation requests refused before queueing", ("reason",))
        self.prompt_tokens = Counter(r, p + "prompt_tokens_total", "prompt tokens of admitted requests")
        self.prompt_tokens_cached = Counter(r, p + "prompt_tokens_cached_total",
                                            "prompt tokens reused from a slot's cache (not recomputed)")
        self.prompt_tokens_processed = Counter(r, p + "prompt_tokens_processed_total",
                                               "prompt tokens decoded (computed)")
        self.prompt_tokens_reprocessed = Counter(
            r, p + "prompt_tokens_reprocessed_total",
            "prompt tokens that matched a slot's cache but were decoded again (hybrid models: recurrent "
            "state restored from a context checkpoint before them, or reset)")
        self.checkpoints_created = Counter(r, p + "checkpoints_created_total",
                                           "context checkpoints saved (hybrid models' recurrent state)")
        self.checkpoints_restored = Counter(r, p + "checkpoints_restored_total",
                                            "context checkpoints restored for a new request's prompt")
        self.checkpoints = Gauge(r, p + "checkpoints", "context checkpoints held, all slots together")
        self.checkpoint_bytes = Gauge(r, p + "checkpoint_bytes", "host memory held by context checkpoints")
        self.generation_tokens = Counter(r, p + "generation_tokens_total", "generated (completion) tokens")
        self.decode_steps = Counter(r, p + "decode_steps_total", "batched decode steps run by the scheduler")
        self.decode_seconds = Counter(r, p + "decode_seconds_total", "wall time spent inside batched decodes")
        self.spec_drafted = Counter(r, p + "spec_draft_tokens_total", "speculative draft tokens verified")
        self.spec_accepted = Counter(r, p + "spec_accepted_tokens_total", "speculative draft tokens accepted")
        self.spec_state_restores = Counter(
            r, p + "spec_state_restores_total",
            "verify decodes rolled back by restoring the saved recurrent state (draft longer than the "
            "snapshot planes reach)")
        self.spec_replayed_tokens = Counter(r, p + "spec_replayed_tokens_total",
                                            "accepted tokens decoded again after such a restore")
        self.spec_acceptance = Gauge(r, p + "spec_acceptance_rate", "accepted / drafted draft tokens since start")
        self.queue_depth = Gauge(r, p + "queue_depth", "requests waiting for a slot")
        self.slots_busy = Gauge(r, p + "slots_busy", "slots running a request")
        self.slots_total = Gauge(r, p + "slots_total", "slots (--parallel)")
        self.ttft = Histogram(r, p + "time_to_first_token_seconds",
                              "time from arrival to the first generated token", TTFT_BUCKETS)
        self.tpot = Histogram(r, p + "time_per_output_token_seconds",
                              "time between consecutive generated tokens of a request", TPOT_BUCKETS)
        self.request_latency = Histogram(r, p + "request_duration_seconds",
                                         "time from arrival to the last token", REQUEST_BUCKETS)
        self.batch_tokens = Histogram(r, p + "decode_batch_tokens", "tokens per batched decode step",
                                      BATCH_BUCKETS)

    def add_spec(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.spec_drafted.inc(drafted)
        self.spec_accepted.inc(accepted)
        d = self.spec_drafted.value()
        self.spec_acceptance.set(self.spec_accepted.value() / d if d else 0.0)

    def render(self) -> str:
        return self.registry.render()
