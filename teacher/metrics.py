"""The teacher's Prometheus endpoint (`teacher.metrics_port`) and the Publisher counters of a run.

One endpoint for the whole `distill-teacher` run, served by the distill-teacher process itself:

- GENERATE: the Publisher lives in vLLM's worker; the connector writes its `Publisher.stats()` to
  `<journal>.publisher.json` every second and once more when it closes (teacher/connector/plugin.py,
  `ConnectorConfig.stats_path`); this process reads that file at scrape time.
- SERVE: this process's own Publisher; its `stats()` at scrape time.

Each phase's Publisher counts from zero, so `PublisherTotals` adds every finished phase's last
counters to the live phase's: the `_total` counters never go down during a run. The same totals
are the summary's `transport` (what a scrape at the end shows). Dataset figures (committed, in
spool) come from the journal (read incrementally) and the spool folder, as the summary's.
"""

from __future__ import annotations

import collections
import json
import threading
from pathlib import Path

from distill.errors import JournalError
from distill.journal import JournalTail
from distill.metrics import Metric, MetricsServer, serve
from distill.spool import list_spool, spool_name

# Publisher.stats() key -> (metric name, help): counters summed over the run's phases.
COUNTERS = {
    "submitted": ("distill_samples_submitted_total", "Samples handed to the Publisher (generated)"),
    "sent": ("distill_samples_sent_total", "Samples sent to students (shared memory or frames)"),
    "acked": ("distill_samples_acked_total", "Samples students acknowledged after their optimizer step"),
    "committed": ("distill_commits_total", "Keys students committed (a saved checkpoint covers them)"),
    "bytes_sent": ("distill_bytes_sent_total", "Bytes of samples sent to students"),
    "spooled": ("distill_samples_spooled_total", "Samples written to the spool folder"),
    "replayed": ("distill_samples_replayed_total", "Spool files read back and sent again"),
    "redelivered": ("distill_samples_redelivered_total", "Samples sent again after a student was gone"),
    "lost": ("distill_samples_lost_total", "Keys acked by a student session that ended uncommitted"),
    "shm_samples": ("distill_shm_samples_total", "Samples placed in the shared-memory ring"),
    "shm_full": ("distill_shm_full_total", "Same-host sends that found no room in the ring (frames)"),
    "chunked": ("distill_samples_chunked_total", "Samples sent with tensors in transport.chunk_bytes frames"),
    "spool_full_wait_s": ("distill_spool_full_wait_seconds_total", "Producer waiting on a full spool"),
    "student_idle_s": (
        "distill_student_wait_seconds_total",
        "Student-seconds with nothing in flight while the teacher had more to produce",
    ),
    "no_credit_s": (
        "distill_teacher_wait_seconds_total",
        "Seconds with samples ready to send and no student with credit",
    ),
    "flow_s": ("distill_flow_seconds_total", "Seconds a student was connected while samples were left"),
    "student_s": ("distill_student_connected_seconds_total", "Student-seconds connected during flow"),
}
# Publisher.stats() key -> (metric name, help): the live phase's values (0 between phases).
GAUGES = {
    "students": ("distill_students_connected", "Student ranks connected to the teacher"),
    "sessions": (
        "distill_student_sessions",
        "Student connections to the teacher (transport.connections per rank)",
    ),
    "inflight": ("distill_samples_in_flight", "Samples sent and not yet acked"),
    "pending": ("distill_samples_waiting", "Samples in memory waiting for a student's credit"),
    "uncommitted": ("distill_samples_uncommitted", "Samples acked by students, not yet committed"),
    "credit_free": (
        "distill_credit_window",
        "Samples the connected students' credit lets the teacher send now",
    ),
    "buffered_bytes": ("distill_buffered_bytes", "Bytes of samples held in memory"),
    "spool_bytes": ("distill_spool_bytes", "Bytes of the Publisher's spool files"),
    "read_ahead_ready": ("distill_read_ahead_samples", "Spool files read ahead, ready to send"),
}
PHASES = ("start", "generate", "serve", "done")


class PublisherTotals:
    """The Publisher counters of one `distill-teacher` run: finished phases plus the live one."""

    def __init__(self):
        self._lock = threading.Lock()
        self._closed: collections.Counter = collections.Counter()
        self._rejected: collections.Counter = collections.Counter()
        self._live = None  # callable -> Publisher.stats()-like dict, or None between phases
        self.phase = "start"

    def live(self, phase: str, read) -> None:
        """A phase's Publisher is running: `read()` gives its current stats (a dict, or None)."""
        with self._lock:
            self.phase, self._live = phase, read

    def closed(self, final: dict | None) -> None:
        """The live phase ended; `final` is its Publisher's last stats (None: nothing ran)."""
        with self._lock:
            self._live = None
            if final:
                self._closed.update(_numbers(final))
                self._rejected.update(final.get("rejected_by_reason") or {})

    def snapshot(self) -> tuple[dict, dict, dict]:
        """(counter totals, rejected by reason, the live phase's stats or {})."""
        with self._lock:
            read, totals, rejected = (
                self._live,
                collections.Counter(self._closed),
                collections.Counter(self._rejected),
            )
        now = (read() if read is not None else None) or {}
        totals.update(_numbers(now))
        rejected.update(now.get("rejected_by_reason") or {})
        return dict(totals), dict(rejected), now

    def summary(self) -> dict:
        """The summary's `transport`: every counter of COUNTERS, and rejected frames by reason."""
        totals, rejected, _ = self.snapshot()
        out = {k: _round(totals.get(k, 0)) for k in COUNTERS}
        out["rejected"] = sum(rejected.values())
        out["rejected_by_reason"] = rejected
        return out


def _numbers(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k in COUNTERS and isinstance(v, (int, float))}


def _round(v):
    return round(v, 3) if isinstance(v, float) else v


def read_stats_file(path: Path) -> dict | None:
    """The generate phase's Publisher stats as its connector last wrote them (None: not yet)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class TeacherMetrics:
    """What `teacher.metrics_port` serves: the run's Publisher totals, the phase, and the dataset's
    state from the journal and the spool folder."""

    def __init__(self, r):
        self.r = r  # teacher.run.state.Run
        self._tail = JournalTail(r.cfg.journal)
        self._lock = threading.Lock()
        self.server: MetricsServer | None = None

    def start(self, port: int) -> TeacherMetrics:
        self.server = serve(port, self.read, "teacher.metrics_port")
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def _dataset(self) -> tuple[int, int]:
        """(committed keys of the dataset, not committed whose file is in the spool)."""
        required = self.r.required
        with self._lock:
            try:
                self._tail.poll()
            except JournalError:
                pass  # the run says so; the scrape shows the last good figures
            committed = self._tail.committed & required
        names = {p.name for p in list_spool(self.r.spool_dir)}
        spooled = sum(1 for k in required - committed if spool_name(k) in names)
        return len(committed), spooled

    def read(self) -> list[Metric]:
        r = self.r
        totals, rejected, now = r.pub.snapshot()
        committed, spooled = self._dataset()
        out = [
            Metric("counter", "distill_samples_committed_total", "Dataset keys committed in the journal", committed),
            Metric("gauge", "distill_samples_in_spool", "Dataset keys not committed whose file is in the spool", spooled),
            Metric("gauge", "distill_dataset_samples", "Dataset keys of this run (skipped rows excluded)", len(r.required)),
            Metric("counter", "distill_samples_generated_total", "Samples that came out of vLLM", r.generated),
            Metric("counter", "distill_tokens_generated_total", "Tokens of the samples that came out of vLLM", r.tokens),
            Metric("counter", "distill_samples_regenerated_total", "Samples generated more than once", r.regenerated),
            Metric("gauge", "distill_samples_skipped", "Dataset rows skipped (bad or too long)", r.skipped),
        ]  # fmt: skip
        out += [Metric("counter", name, doc, totals.get(k, 0)) for k, (name, doc) in COUNTERS.items()]
        out += [Metric("gauge", name, doc, now.get(k, 0)) for k, (name, doc) in GAUGES.items()]
        out.append(
            Metric(
                "counter", "distill_rejected_frames_total", "Messages from students rejected, by reason",
                labels=("reason",), by={(k,): v for k, v in rejected.items()},
            )
        )  # fmt: skip
        out.append(
            Metric(
                "gauge", "distill_teacher_phase", "1 for the phase distill-teacher is in",
                labels=("phase",), by={(p,): float(p == r.pub.phase) for p in PHASES},
            )
        )  # fmt: skip
        return out
