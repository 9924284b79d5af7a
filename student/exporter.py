"""A student rank's Prometheus endpoint (`student.metrics_port`: rank r serves port + r).

Started before the process group (a port in use stops the rank with one line, exit 2); until the
trainer exists every value is 0. Values are read at scrape time from the trainer (samples and
tokens this rank trained, steps, loss) and its source (the Subscriber's counters, the seconds it
waited for the teacher). Every series carries the `rank` label. Names: distill/metrics.py.
"""

from __future__ import annotations

from distill.metrics import Metric, MetricsServer, serve

# Subscriber.stats() key -> (metric name, help)
SOURCE_COUNTERS = {
    "received": ("distill_samples_received_total", "Samples received from teachers"),
    "acked": ("distill_samples_acked_total", "Samples acknowledged after the optimizer step"),
    "committed": ("distill_commits_total", "Keys committed after a checkpoint covered them"),
    "bytes_received": ("distill_bytes_received_total", "Bytes of samples received"),
    "shm_samples": ("distill_shm_samples_total", "Samples received through the shared-memory ring"),
    "skipped_duplicates": ("distill_samples_skipped_duplicates_total", "Redelivered copies of acked keys"),
}


def _stats(source) -> dict:
    """The source's counters; copied while its I/O thread may add a key: tried again then."""
    for _ in range(3):
        try:
            return source.stats()
        except RuntimeError:  # dictionary changed size during iteration
            continue
    return {}


class StudentMetrics:
    """The endpoint of one rank; `trainer` is set once training starts (student/loop.py)."""

    def __init__(self, port: int, rank: int, credit: int | None):
        self.port, self.rank, self.credit = port + rank, rank, credit
        self.trainer = None
        self.server: MetricsServer | None = None

    def start(self) -> StudentMetrics:
        self.server = serve(self.port, self.read, f"student.metrics_port (+ rank {self.rank})")
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def read(self) -> list[Metric]:
        t, lab = self.trainer, (str(self.rank),)
        stats = _stats(t.source) if t is not None else {}
        hist = t.ledger.history if t is not None else []

        def one(kind: str, name: str, doc: str, value) -> Metric:
            return Metric(kind, name, doc, labels=("rank",), by={lab: float(value or 0)})

        out = [
            one("counter", "distill_samples_trained_total", "Samples this rank trained (optimizer steps done)", t and t.trained_here),
            one("counter", "distill_tokens_trained_total", "Tokens of the samples this rank trained", t and t.tokens_here),
            one("counter", "distill_student_wait_seconds_total", "Seconds this rank waited for the teacher", t and t.source.wait_s),
            one("counter", "distill_samples_dropped_stale_total", "Samples discarded: their shared-memory slot was reused", t and t.counts["stale"]),
            one("counter", "distill_samples_dropped_duplicate_total", "Samples dropped: another rank trains the key", t and t.counts["duplicates"]),
            one("gauge", "distill_optimizer_step", "The optimizer step the job is at", t and t.step),
            one("gauge", "distill_credit_window", "Unacked samples the teachers let this rank hold", self.credit),
            one("gauge", "distill_samples_uncommitted", "Samples acked here that no checkpoint covers yet", t and t.source.uncommitted),
            one("gauge", "distill_loss", "Loss of the last optimizer step read back", hist[-1]["loss"] if hist else 0),
        ]  # fmt: skip
        out += [one("counter", name, doc, stats.get(k, 0)) for k, (name, doc) in SOURCE_COUNTERS.items()]
        rejected = stats.get("rejected_by_reason") or {}
        out.append(
            Metric(
                "counter", "distill_rejected_frames_total", "Messages from teachers rejected, by reason",
                labels=("rank", "reason"), by={(lab[0], k): v for k, v in rejected.items()},
            )
        )  # fmt: skip
        return out
