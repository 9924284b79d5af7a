"""What one `distill-teacher` invocation did and where its samples are: `Run` (its settings, the
phases' results and the totals derived from them, the state of the dataset from the journal and the
spool folder, the skipped-rows file) and its summary
JSON (`teacher.summary_path`, default `<journal>.summary.json`), plus the exit codes and the
signal handler."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distill.config import SpoolConfig, TransportConfig
from distill.errors import JournalError
from distill.journal import Journal
from distill.spool import list_spool, spool_bytes, spool_name
from teacher.config import TeacherConfig
from teacher.metrics import PublisherTotals
from teacher.run.results import GenerateResult, PhaseResult, ServeResult
from teacher.sizing import Flow, delta, shares, sizing

log = logging.getLogger("distill.teacher")

EXIT_OK, EXIT_MISSING, EXIT_CONFIG, EXIT_STUDENTS_GONE, EXIT_SIGNAL = 0, 1, 2, 3, 130
# Finished (every usable sample committed / generated), but dataset rows were skipped. Not 4: that
# is a student's "a peer rank is gone"; no exit code means one thing for one tool and another for
# the other (0 done, 1 failed, 2 config, 3 the other side gone, 4 a student's peer gone, 5 the live
# probe, 6 rows skipped, 130 signal).
EXIT_SKIPPED = 6
EXIT_VERIFY = 5  # the live probe found a mismatch with teacher.verify_fail=stop (no END sent)


class Stop:
    """SIGINT/SIGTERM: the first asks to stop (after the current window / at the next check), the
    second aborts."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("%s: stopping (again to abort)", signal.Signals(signum).name)


def say(line: str) -> None:
    """One line for the user on stderr (progress, outcome); scripts read the summary JSON."""
    print(f"distill-teacher: {line}", file=sys.stderr, flush=True)


def _generate_total(counter: str, doc: str = "") -> property:
    """A read-only `Run` total: one GenerateResult counter summed over the generate phases so far."""
    return property(lambda run: sum(getattr(g, counter) for g in run._generated()), doc=doc or None)


@dataclass
class Run:
    """What one `distill-teacher` invocation is and did; written as the summary JSON. Its settings,
    the dataset's facts (keys, rows skipped before vLLM) and its services (verifier, metrics,
    Publisher totals) are set at the start; each phase returns its own result
    (teacher/run/results.py), kept in `results`, and every count here is derived from those."""

    cfg: TeacherConfig
    transport: TransportConfig
    spool: SpoolConfig
    keys: list[str]
    command: str
    t0: float = field(default_factory=time.monotonic)
    base_tid: str = ""
    committed_at_start: int = 0
    bad_rows: list = field(default_factory=list)  # BadRow skipped before vLLM (on_bad_row=skip)
    verifier: Any = None  # teacher.verify.Verifier when teacher.verify_every > 0
    results: list[PhaseResult] = field(default_factory=list)  # the phases so far, the running one last
    interrupted: bool = False
    reason: str = ""
    journal_error: str | None = None  # the journal could not be read when the summary was written
    pub: PublisherTotals = field(default_factory=PublisherTotals)  # every phase's Publisher counters
    metrics: Any = None  # teacher.metrics.TeacherMetrics when teacher.metrics_port is set

    def begin(self, result: PhaseResult) -> PhaseResult:
        """A phase starts: its result is counted (and shown by the metrics endpoint) as it grows."""
        self.results.append(result)
        return result

    def _generated(self) -> list[GenerateResult]:
        return [g for g in list(self.results) if isinstance(g, GenerateResult)]

    # Totals over the generate phases so far, each the sum of one GenerateResult counter.
    generated = _generate_total("samples", "Samples that went through vLLM (this invocation, all rounds).")
    tokens = _generate_total("tokens")
    nbytes = _generate_total("nbytes")
    generate_s = _generate_total("engine_s")
    truncated = _generate_total("truncated")
    regenerated = _generate_total("regenerated", "Samples generated more than once by this invocation.")

    @property
    def engine_students(self) -> list[str]:
        """The students the last engine's Publisher was serving when it closed (the serve phase's
        Publisher expects them: one whose link was down then still gets END)."""
        gens = self._generated()
        return gens[-1].students if gens else []

    def generated_keys(self) -> frozenset[str]:
        return frozenset().union(*(g.keys for g in self._generated()))

    @property
    def too_long(self) -> set[str]:
        return set().union(*(g.too_long for g in self._generated()))

    @property
    def lost(self) -> int:
        return sum(p.lost for p in list(self.results))

    @property
    def students_max(self) -> int:
        return max((p.students_max for p in list(self.results) if isinstance(p, ServeResult)), default=0)

    @property
    def flow(self) -> Flow:
        """The flow counters of every phase whose Publisher reported them."""
        f = Flow()
        for p in list(self.results):
            if p.flow_stats is not None:
                f.add(p.flow_stats)
        return f

    def phase_shares(self, stats: dict) -> dict:
        """A phase's flow shares (teacher/sizing.py), with the run's generated samples so far."""
        return shares(delta(stats, None), self.spool.readers, self.generated, self.generate_s)

    @property
    def spool_dir(self) -> Path:
        return Path(self.spool.dir)

    @property
    def required(self) -> set[str]:
        return set(self.keys) - self.too_long

    def spooled_names(self) -> set[str]:
        return {p.name for p in list_spool(self.spool_dir)}

    def committed(self) -> set[str]:
        return Journal.read(self.cfg.journal).committed

    def todo(self, committed: set[str]) -> list[str]:
        """Keys to generate: neither `committed` nor spooled nor skipped as too long."""
        names, too_long = self.spooled_names(), self.too_long
        return [
            k for k in self.keys if k not in committed and k not in too_long and spool_name(k) not in names
        ]

    def state(self) -> dict:
        """Counts for the summary; an unreadable journal counts nothing as committed (and is named
        in the summary's `journal_error`): the summary is written at every exit."""
        try:
            committed = self.committed() & self.required
        except JournalError as e:
            self.journal_error, committed = str(e), set()
        names = self.spooled_names()
        left = [k for k in self.required if k not in committed]
        in_spool = sum(1 for k in left if spool_name(k) in names)
        return {
            "total": len(self.required),
            "committed": len(committed),
            "not_committed": len(left),
            "spooled": in_spool,
            "missing": len(left) - in_spool,  # neither committed nor in the spool
        }

    @property
    def verify_dir(self) -> Path:
        return Path(f"{self.cfg.journal}.verify")

    def verify_stop(self) -> bool:
        return self.verifier is not None and self.verifier.failed.is_set()

    def skipped_path(self) -> Path:
        """Skipped rows of this invocation, one JSON object a line: key, where, reason."""
        return Path(f"{self.cfg.journal}.skipped.jsonl")

    def start_skipped_file(self) -> None:
        p = self.skipped_path()
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "w") as f:
            for b in self.bad_rows:
                f.write(json.dumps(b.record()) + "\n")

    def note_too_long(self, key: str, n: int) -> None:
        """A row too long for the model, skipped (the generate phase counts it in its result)."""
        limit = self.cfg.max_model_len - self.cfg.max_tokens
        reason = f"{n} prompt tokens > max_model_len - max_tokens = {limit}"
        say(f"skipped row {key!r}: {reason}")
        with open(self.skipped_path(), "a") as f:
            f.write(json.dumps({"key": key, "where": None, "reason": reason}) + "\n")

    @property
    def skipped(self) -> int:
        return len(self.bad_rows) + len(self.too_long)

    def stats_path(self) -> Path:
        """Where the generate phase's connector writes its Publisher's stats (teacher/metrics.py)."""
        return Path(f"{self.cfg.journal}.publisher.json")

    def replay_keys_path(self) -> Path:
        """The keys whose spool files the generate phase's connector replays (this run's)."""
        return Path(f"{self.cfg.journal}.replay-keys")

    def summary_path(self) -> Path:
        return Path(self.cfg.summary_path or f"{self.cfg.journal}.summary.json")

    def finish(self, rc: int, reason: str | None = None) -> int:
        """Write the summary JSON and the closing line; returns the exit code (4 instead of 0 when
        rows were skipped)."""
        if reason is not None:
            self.reason = reason
        if rc == EXIT_OK and self.skipped:
            rc = EXIT_SKIPPED
            self.reason += f"; {self.skipped} rows skipped (see {self.skipped_path()})"
        self.pub.phase = "done"
        st = self.state()
        summary = self.summary(rc, st)
        path = self.summary_path()
        write_json(path, summary)
        if summary["sizing"]["flow_s"] > 0:
            say(f"sizing: {summary['sizing']['recommendation']}")
        gen_s = max(self.generate_s, 1e-9)
        say(
            f"{self.generated} samples, {self.tokens} tokens, {self.nbytes / 1e9:.3f} GB "
            f"generated in {self.generate_s:.1f}s ({self.tokens / gen_s:.0f} tok/s); "
            f"committed {st['committed']}/{st['total']} after {summary['wall_s']:.1f}s, "
            f"spooled {st['spooled']} ({summary['spool_bytes'] / 1e6:.1f} MB in {self.spool_dir}), "
            f"already done {self.committed_at_start}, skipped {self.skipped} (bad {len(self.bad_rows)}, "
            f"too long {len(self.too_long)}), truncated {self.truncated}, "
            f"lost {self.lost}, regenerated {self.regenerated}; exit {rc}; summary {path}"
        )
        return rc

    def summary(self, rc: int, st: dict) -> dict:
        gen_s = max(self.generate_s, 1e-9)
        verify = (
            {"every": self.cfg.verify_every, **self.verifier.summary()} if self.verifier is not None else None
        )
        return {
            "exit_code": rc,
            "reason": self.reason,
            **st,
            "samples": self.generated,
            "tokens": self.tokens,
            "bytes": self.nbytes,
            "generate_s": round(self.generate_s, 3),
            "wall_s": round(time.monotonic() - self.t0, 3),
            "tokens_per_s": round(self.tokens / gen_s, 1) if self.generated else 0.0,
            "committed_at_start": self.committed_at_start,
            "lost": self.lost,
            "regenerated": self.regenerated,
            "too_long": len(self.too_long),
            "skipped": self.skipped,
            "skipped_bad_rows": len(self.bad_rows),
            "skipped_too_long": len(self.too_long),
            "truncated": self.truncated,
            "skipped_file": str(self.skipped_path()),
            "verify": verify,
            "students_max": self.students_max,
            "transport": self.pub.summary(),
            "sizing": sizing(self.flow, self.spool.readers, self.generated, self.generate_s),
            "interrupted": self.interrupted,
            "spool_dir": str(self.spool_dir),
            "spool_bytes": spool_bytes(self.spool_dir),
            "journal": self.cfg.journal,
            "journal_error": self.journal_error,
            "teacher_id": self.base_tid,
            "phases": [p.record() for p in self.results],
            "command": self.command,
        }


def write_json(path: Path, data: dict) -> None:
    """Atomically (temp + rename); a failure is logged, never raised (the run's outcome stands)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.error("cannot write %s: %s", path, e)
