"""What one phase of `distill-teacher` did: `GenerateResult` and `ServeResult`. A phase creates its
result, counts into it alone and returns it; the run (teacher/run/state.py) keeps the results and
derives its totals from them (the summary JSON, the closing line, the metrics endpoint, which sees
the running phase's result as it grows)."""

from __future__ import annotations

from dataclasses import dataclass, field

from teacher.sizing import FLOW_KEYS

# Keys of a phase's flow shares in its summary record (teacher/sizing.py).
SHARE_KEYS = ("flow_s", "teacher_busy", "student_wait", "teacher_waited")


@dataclass
class PhaseResult:
    """The part every phase has: its round, what students lost meanwhile, its Publisher's flow
    counters (none when no Publisher ran) and their shares, its wall time."""

    round: int
    lost: int = 0  # lost records seen (keys whose student session ended uncommitted)
    flow_stats: dict | None = None  # the phase's Publisher flow counters (FLOW_KEYS)
    shares: dict = field(default_factory=dict)  # SHARE_KEYS of teacher.sizing.shares
    seconds: float | None = None

    def note_flow(self, stats: dict, shares: dict) -> None:
        self.flow_stats = {k: float(stats.get(k, 0) or 0) for k in FLOW_KEYS}
        self.shares = {k: shares[k] for k in SHARE_KEYS}


@dataclass
class GenerateResult(PhaseResult):
    """One GENERATE phase: the samples that came out of vLLM, and keys to generate again."""

    todo: int = 0
    samples: int = 0
    tokens: int = 0
    nbytes: int = 0
    engine_s: float = 0.0  # seconds vLLM generated (from the engine's start to its shutdown)
    truncated: int = 0  # rows cut to max_model_len - max_tokens (on_too_long=truncate)
    too_long: set[str] = field(default_factory=set)  # rows skipped as too long (on_too_long=skip)
    keys: set[str] = field(default_factory=set)  # keys generated
    regenerated: int = 0  # samples whose key this run had generated before (this phase or earlier)
    seen: frozenset[str] = frozenset()  # keys earlier phases generated (given at the start)
    again: bool = False  # keys lost after the last window: the caller generates them again
    sender_error: str | None = None  # the connector's sender could not place samples (the first error)
    unplaced: int = 0  # samples its sender could not place (neither streamed nor spooled)
    students: list[str] = field(default_factory=list)  # the engine's Publisher was serving at its close

    def count_output(self, key: str, tokens: int, bytes_per_token: int) -> None:
        """One sample out of vLLM."""
        self.tokens += tokens
        self.nbytes += tokens * bytes_per_token
        self.samples += 1
        if key in self.keys or key in self.seen:
            self.regenerated += 1
        self.keys.add(key)

    def record(self) -> dict:
        """This phase in the summary's `phases`."""
        rec = {
            "phase": "generate",
            "round": self.round,
            "todo": self.todo,
            "samples": self.samples,
            "lost": self.lost,
        }
        rec.update(self.shares)
        if self.seconds is not None:
            rec["seconds"] = self.seconds
        return rec


@dataclass
class ServeResult(PhaseResult):
    """One SERVE phase: keys committed while it served, and how it ended."""

    served: int = 0
    students_max: int = 0
    outcome: str | None = None  # done | lost | gone | signal | failed (None while it serves)
    lost_keys: set[str] = field(default_factory=set)  # to generate again (outcome lost)

    def record(self) -> dict:
        rec = {"phase": "serve", "round": self.round, "served": self.served, "lost": self.lost}
        rec.update(self.shares)
        if self.seconds is not None:
            rec["seconds"] = self.seconds
        if self.outcome is not None:
            rec["outcome"] = self.outcome
        return rec
