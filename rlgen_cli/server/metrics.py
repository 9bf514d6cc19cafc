"""A minimal Prometheus registry (counters, gauges, histograms) rendered in the text exposition format.

The reward server needs a handful of series and no extra dependency, so this implements just the
text format 0.0.4: ``# HELP``/``# TYPE`` lines, labelled samples, and cumulative histogram buckets with
``_sum`` and ``_count``. Metrics are updated from the event loop only (single thread), so no locking.
"""

from __future__ import annotations

import math
from collections import defaultdict

__all__ = ["Counter", "Gauge", "Histogram", "MetricsRegistry", "ServerMetrics"]

Labels = tuple[tuple[str, str], ...]

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _labels(**labels: str) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt_labels(labels: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _fmt_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    """A monotonically increasing value per label set."""

    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self.values: dict[Labels, float] = defaultdict(float)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` to the series selected by ``labels``."""
        self.values[_labels(**labels)] += amount

    def get(self, **labels: str) -> float:
        """Return the current value of one series (0 if never touched)."""
        return self.values.get(_labels(**labels), 0.0)

    def render(self) -> list[str]:
        """Return the exposition lines of every series."""
        return [f"{self.name}{_fmt_labels(k)} {_fmt_value(v)}" for k, v in sorted(self.values.items())]


class Gauge(Counter):
    """A value that can go up and down."""

    kind = "gauge"

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        """Subtract ``amount`` from the series selected by ``labels``."""
        self.values[_labels(**labels)] -= amount


class Histogram:
    """Cumulative-bucket histogram per label set, with ``_sum`` and ``_count``."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, tuple(sorted(buckets))
        self.counts: dict[Labels, list[int]] = {}
        self.sums: dict[Labels, float] = defaultdict(float)

    def observe(self, value: float, **labels: str) -> None:
        """Record one observation in the series selected by ``labels``."""
        key = _labels(**labels)
        counts = self.counts.setdefault(key, [0] * (len(self.buckets) + 1))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                counts[i] += 1
        counts[-1] += 1  # +Inf
        self.sums[key] += value

    def count(self, **labels: str) -> int:
        """Number of observations in one series."""
        return self.counts.get(_labels(**labels), [0])[-1]

    def count_above(self, threshold: float, **labels: str) -> int:
        """Number of observations strictly above ``threshold`` (a bucket bound) in one series."""
        counts = self.counts.get(_labels(**labels))
        if counts is None:
            return 0
        below = counts[self.buckets.index(threshold)] if threshold in self.buckets else 0
        return counts[-1] - below

    def render(self) -> list[str]:
        """Return the bucket, sum and count lines of every series."""
        lines = []
        for key, counts in sorted(self.counts.items()):
            bounds = [*map(_fmt_value, self.buckets), "+Inf"]
            lines += [
                f"{self.name}_bucket{_fmt_labels(key, (('le', b),))} {c}" for b, c in zip(bounds, counts)
            ]
            lines.append(f"{self.name}_sum{_fmt_labels(key)} {_fmt_value(self.sums[key])}")
            lines.append(f"{self.name}_count{_fmt_labels(key)} {counts[-1]}")
        return lines


class MetricsRegistry:
    """Holds metrics and renders them all."""

    def __init__(self) -> None:
        self.metrics: list[Counter | Histogram] = []

    def add(self, metric: Counter | Histogram) -> Counter | Histogram:
        """Register ``metric`` and return it."""
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        """The full exposition text (``text/plain; version=0.0.4``)."""
        lines: list[str] = []
        for metric in self.metrics:
            lines += [f"# HELP {metric.name} {metric.help}", f"# TYPE {metric.name} {metric.kind}"]
            lines += metric.render()
        return "\n".join(lines) + "\n"


class ServerMetrics:
    """The reward server's series.

    Attributes:
        requests: ``rlgen_requests_total{route,status}``.
        latency: ``rlgen_request_seconds{route}`` histogram.
        errors: ``rlgen_errors_total{kind}`` (auth, validation, too_large, not_found, scoring, http,
            disconnect — a client gone before its body arrived —, timeout — a body slower than
            ``body_timeout_s`` —, busy — a 503 from admission —, internal).
        batch_size: ``rlgen_batch_size{reward}``: images per call of ``Reward.score``.
        batch_requests: ``rlgen_batch_requests{reward}``: requests merged into one micro-batch.
        score_seconds: ``rlgen_score_seconds{reward}``: time inside ``Reward.score``.
        images: ``rlgen_images_total{reward}``: images scored.
        nan_scores: ``rlgen_nan_scores_total{reward}``: non-finite scores sent as ``null``.
        in_flight: ``rlgen_in_flight_requests``: score requests being handled.
    """

    def __init__(self) -> None:
        self.registry = MetricsRegistry()
        add = self.registry.add
        self.requests = add(Counter("rlgen_requests_total", "HTTP requests by route and status."))
        self.latency = add(Histogram("rlgen_request_seconds", "Request latency.", LATENCY_BUCKETS))
        self.errors = add(Counter("rlgen_errors_total", "Failed requests by kind."))
        self.batch_size = add(Histogram("rlgen_batch_size", "Images per Reward.score call.", BATCH_BUCKETS))
        self.batch_requests = add(
            Histogram("rlgen_batch_requests", "Requests merged per micro-batch.", BATCH_BUCKETS)
        )
        self.score_seconds = add(Histogram("rlgen_score_seconds", "Time in Reward.score.", LATENCY_BUCKETS))
        self.images = add(Counter("rlgen_images_total", "Images scored."))
        self.nan_scores = add(Counter("rlgen_nan_scores_total", "Non-finite scores, sent as null."))
        self.in_flight = add(Gauge("rlgen_in_flight_requests", "Score requests being handled."))

    def render(self) -> str:
        """Render every series."""
        return self.registry.render()
