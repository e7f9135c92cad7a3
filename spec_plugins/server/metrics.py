"""Prometheus text exposition for /metrics, written by hand (no client library needed).

Request counters and latency histograms are recorded by the HTTP layer; decoding counters
(target forwards, drafted/accepted tokens, acceptance by position) are read at scrape time from
the batch's ``DecodeStats``; the load-aware policy's current batch size and draft length come
from the scheduler.
"""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, v: float) -> None:
        self.n += 1
        self.total += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1


def _labels(d: dict[str, Any]) -> str:
    if not d:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in d.items()) + "}"


def _value(v: Any) -> str:
    """A sample value, exactly: integers in full (a counter past 1e9 keeps every digit), floats as
    their shortest round-trip repr, and the exposition format's spellings of infinity and NaN."""
    if isinstance(v, numbers.Integral):
        return str(int(v))
    f = float(v)
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    return repr(f)


class Metrics:
    """Thread-safe request metrics; ``render`` adds the decoding and policy gauges."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.latency: dict[str, _Histogram] = {}
        self.ttft: dict[str, _Histogram] = {}
        self.generated_tokens = 0
        self.cancelled = 0
        self.labels: dict[str, str] = {}  # on every sample (a Ray replica's id)

    def request_done(self, route: str, status: int | str, seconds: float | None = None,
                     generated: int = 0, first_token: float | None = None) -> None:
        """Count one request, once, under its route and status; a 499 (its client left before the
        answer was complete) is also the one count of a cancelled request."""
        with self._lock:
            key = (route, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1
            if str(status) == "499":
                self.cancelled += 1
            if seconds is not None:
                self.latency.setdefault(route, _Histogram(LATENCY_BUCKETS)).observe(seconds)
            if first_token is not None:
                self.ttft.setdefault(route, _Histogram(LATENCY_BUCKETS)).observe(first_token)
            self.generated_tokens += generated

    def render(self, stats: Any = None, policy: dict[str, Any] | None = None,
               proposer: Iterable[tuple[str, str, str, float]] = ()) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: Iterable[tuple[dict[str, Any], float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, v in samples:
                out.append(f"{name}{_labels({**self.labels, **labels})} {_value(v)}")

        with self._lock:
            metric("spec_requests_total", "counter", "HTTP requests by route and status code.",
                   [({"route": r, "status": s}, n) for (r, s), n in sorted(self.requests.items())])
            metric("spec_requests_cancelled_total", "counter",
                   "Requests whose client left before the answer was complete (status 499).",
                   [({}, self.cancelled)])
            metric("spec_generated_tokens_total", "counter", "Tokens returned to clients.",
                   [({}, self.generated_tokens)])
            for name, hists, help_ in (("spec_request_duration_seconds", self.latency, "Request latency."),
                                       ("spec_time_to_first_token_seconds", self.ttft, "Time to the first token.")):
                out.append(f"# HELP {name} {help_}")
                out.append(f"# TYPE {name} histogram")
                for route, h in sorted(hists.items()):
                    for b, c in zip(h.buckets, h.counts):
                        out.append(f"{name}_bucket{_labels({**self.labels, 'route': route, 'le': b})} {c}")
                    out.append(f"{name}_bucket{_labels({**self.labels, 'route': route, 'le': '+Inf'})} {h.n}")
                    out.append(f"{name}_sum{_labels({**self.labels, 'route': route})} {_value(h.total)}")
                    out.append(f"{name}_count{_labels({**self.labels, 'route': route})} {h.n}")
        if stats is not None:
            metric("spec_target_forwards_total", "counter", "Target verify forwards (rounds), prefill excluded.",
                   [({}, stats.target_forwards)])
            metric("spec_prefill_forwards_total", "counter", "Target prefill forwards (rows joining).",
                   [({}, stats.prefill_forwards)])
            metric("spec_decoded_tokens_total", "counter", "Tokens decoded by the batch (cancelled rows included).",
                   [({}, stats.new_tokens)])
            metric("spec_draft_tokens_total", "counter", "Draft tokens proposed to the verifier.",
                   [({}, stats.draft_tokens)])
            metric("spec_accepted_tokens_total", "counter", "Draft tokens accepted.", [({}, stats.accepted_tokens)])
            metric("spec_drafted_by_position_total", "counter", "Draft tokens proposed at each depth.",
                   [({"position": d}, n) for d, n in enumerate(stats.drafted_by_position)])
            metric("spec_accepted_by_position_total", "counter", "Draft tokens accepted at each depth.",
                   [({"position": d}, n) for d, n in enumerate(stats.accepted_by_position)])
            metric("spec_rows_by_position_total", "counter",
                   "Sequence-rounds that drafted each depth (a tree's nodes at one depth count once).",
                   [({"position": d}, n) for d, n in enumerate(stats.rows_by_position)])
            metric("spec_acceptance_rate", "gauge",
                   "Per sequence: accepted / sequence-rounds that drafted each depth "
                   "(spec_accepted_by_position_total / spec_rows_by_position_total; for a tree draft "
                   "not accepted / drafted tokens).",
                   [({"position": d}, r) for d, r in enumerate(stats.acceptance_by_position)])
            metric("spec_row_rounds_total", "counter", "Sequences verified, summed over target forwards.",
                   [({}, stats.row_rounds)])
            metric("spec_mean_accepted_tokens", "gauge",
                   "Mean acceptance length: tokens emitted per sequence per round (bonus included; 1 = no gain).",
                   [({}, stats.mean_accepted_tokens)])
            metric("spec_tokens_per_forward", "gauge", "Tokens the whole batch emitted per target forward.",
                   [({}, stats.tokens_per_forward)])
            metric("spec_lossy", "gauge", "1 if the verifier changes the output distribution (e.g. typical).",
                   [({}, int(stats.lossy))])
        if policy is not None:
            metric("spec_batch_size", "gauge", "Requests in the running batch.", [({}, policy.get("batch", 0))])
            metric("spec_queue_size", "gauge", "Requests waiting for a slot.", [({}, policy.get("queue", 0))])
            metric("spec_max_batch_size", "gauge", "Slots in the running batch.", [({}, policy.get("max_batch", 0))])
            metric("spec_draft_length", "gauge", "Draft length chosen for the current batch size (0 = no drafting).",
                   [({}, policy.get("draft_length", 0))])
            metric("spec_draft_length_max", "gauge", "Upper bound of the draft length.",
                   [({}, policy.get("max_draft_length", 0))])
            if "expected_tokens" in policy:
                metric("spec_policy_expected_tokens", "gauge",
                       "Expected tokens per row per round at the chosen draft length.",
                       [({}, policy["expected_tokens"])])
            table = policy.get("draft_length_by_batch") or {}
            metric("spec_policy_draft_length", "gauge", "Draft length the policy picks per batch size, now.",
                   [({"batch": b}, k) for b, k in sorted(table.items())])
        for name, kind, help_, value in proposer:
            metric(name, kind, help_, [({}, value)])
        return "\n".join(out) + "\n"


def proposer_metrics(proposer: Any) -> list[tuple[str, str, str, float]]:
    """What a proposer reports of its own (``ReportsMetrics``: suffix decoding's global index,
    a hybrid's children's)."""
    from spec_plugins.proposers.base import ProposerTraits

    return proposer.metrics() if proposer is not None and ProposerTraits.of(proposer).reports else []
