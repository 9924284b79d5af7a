"""A synthetic teacher for student tests and smoke runs: real hidden states without vLLM.

Runs a transformers model's forward pass over a JSONL text dataset and sends, per row, the layers
named by their teacher layer ids (same convention as vLLM extraction, teacher/reference.py), in
vLLM's sample layout (`hidden_states` [T, n, H], `token_ids` [T]). Either publishes through
distill.transport.Publisher (the run file's transport section) or writes a spool folder.

    python -m testkit.synthetic_teacher --model runs/tiny-teacher --data runs/tiny.jsonl \\
        --layers 2,4 --config configs/student_tiny.yaml            # stream to students
    python -m testkit.synthetic_teacher ... --spool runs/spool              # offline: write a spool folder

Like `distill-teacher`, it writes a summary JSON (`--summary`, default `<journal>.summary.json`
when a journal is given): exit code, samples submitted and resubmitted, seconds, the Publisher's
stats. Scripts and tests read that file, not the log lines. Exit 0 when every row is committed
(or written to the spool), 1 on `--timeout`, 2 on a usage or config error (one line).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from distill.protocol import Sample


class SyntheticTeacher:
    """A transformers model (fp32, CPU) and a JSONL data set: computes the Sample of any row id."""

    def __init__(self, model_dir: str, data: str, layers: list[int], limit: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from teacher.reference import ReferenceStates

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.ref = ReferenceStates(model)
        bad = [i for i in layers if not 0 <= i <= self.ref.num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} outside 0..{self.ref.num_layers}")
        self.layers = list(layers)
        rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
        self.rows = {r["id"]: r["text"] for r in rows[:limit]}  # in data set order

    def sample(self, key: str) -> Sample:
        ids = self.tok(self.rows[key], return_tensors="pt")["input_ids"]
        stacked = self.ref.states(ids, self.layers).contiguous()  # [T, n, H]
        return Sample(
            key=key,
            tensors={"hidden_states": stacked, "token_ids": ids[0].to(torch.int64).contiguous()},
            layers=list(self.layers),
            meta={"num_tokens": int(ids.shape[1])},
        )


def teacher_samples(
    model_dir: str, data: str, layers: list[int], limit: int | None = None, skip: set[str] = frozenset()
) -> Iterator[Sample]:
    """Yield one Sample per dataset row (but rows whose id is in `skip`), in data set order."""
    t = SyntheticTeacher(model_dir, data, layers, limit)
    for key in t.rows:
        if key not in skip:
            yield t.sample(key)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m testkit.synthetic_teacher", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", required=True, help="teacher checkpoint folder")
    ap.add_argument("--data", required=True, help="JSONL rows with 'id' and 'text'")
    ap.add_argument("--layers", required=True, help="teacher layer ids to send, e.g. 2,4")
    ap.add_argument("--limit", type=int, default=None, help="send only the first N rows")
    ap.add_argument("--config", help="run file whose transport/spool sections the Publisher uses")
    ap.add_argument("--set", action="append", default=[], help="override, e.g. transport.bind=[...]")
    ap.add_argument("--spool", help="write a spool folder instead of publishing")
    ap.add_argument("--rate", type=float, default=0.0, help="samples per second (0 = as fast as possible)")
    ap.add_argument(
        "--timeout", type=float, default=600.0, help="give up when not every row is committed by then"
    )
    ap.add_argument(
        "--journal",
        help="journal of committed keys (distill.journal): appended to; its committed keys are not sent again",
    )
    ap.add_argument(
        "--summary", help="summary JSON to write (default: <journal>.summary.json with --journal)"
    )
    args = ap.parse_args(argv)
    if not args.spool and not args.config:
        ap.error("--config (a run file with a transport section) or --spool is required")
    return args


def write_spool(args, layers: list[int], summary: dict) -> int:
    from distill.spool import write_sample

    for s in teacher_samples(args.model, args.data, layers, args.limit):
        s.teacher = "synthetic"
        write_sample(args.spool, s)
        summary["samples"] += 1
    print(f"synthetic teacher: wrote {summary['samples']} samples to {args.spool}", flush=True)
    summary.update(spool_dir=args.spool, reason="done")
    return 0


def publish(args, layers: list[int], summary: dict) -> int:
    """Submit every row not committed yet, then resubmit lost keys until every row is committed
    (END sent) or `--timeout`."""
    from distill.config import load_run_file, parse_override
    from distill.journal import Journal
    from distill.transport import Publisher

    run = load_run_file(args.config, dict(parse_override(o) for o in args.set))
    done = Journal.read(args.journal).committed if args.journal else set()
    teacher = SyntheticTeacher(args.model, args.data, layers, args.limit)
    pub = Publisher(run.transport, run.spool, journal=args.journal)
    pub.start()
    summary["teacher_id"] = pub.tid
    print(
        f"synthetic teacher: publishing on {run.transport.bind}; {len(done)} keys committed in the journal",
        flush=True,
    )
    deadline = time.monotonic() + args.timeout
    try:
        for key in teacher.rows:
            if key not in done:
                pub.submit(teacher.sample(key))
                summary["samples"] += 1
                if args.rate > 0:
                    time.sleep(1.0 / args.rate)
        summary["generate_s"] = round(time.monotonic() - summary.pop("_t0"), 3)
        pub.close_input()
        ok = _resubmit_lost_until_done(pub, teacher, deadline, summary)
    finally:
        summary["stats"] = pub.stats()
        pub.close()
    summary["reason"] = "done" if ok else f"not every row committed within --timeout {args.timeout:.0f}s"
    print(
        f"synthetic teacher: submitted {summary['samples']}, resubmitted {summary['resubmitted']}, done={ok}",
        flush=True,
    )
    return 0 if ok else 1


def _resubmit_lost_until_done(pub, teacher: SyntheticTeacher, deadline: float, summary: dict) -> bool:
    """Keys a student session acknowledged but never committed (it died before a checkpoint covered
    them) come back from take_lost(): compute and send them again. True once END is sent."""
    while time.monotonic() < deadline:
        lost = pub.take_lost()
        for key in lost:
            pub.submit(teacher.sample(key))
        if lost:
            summary["resubmitted"] += len(lost)
            print(f"synthetic teacher: {len(lost)} keys lost by a student session; sent again", flush=True)
        if pub.wait_done(timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
            return True
    return False


def summary_path(args) -> Path | None:
    if args.summary:
        return Path(args.summary)
    return Path(f"{args.journal}.summary.json") if args.journal else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        layers = [int(x) for x in args.layers.split(",")]
    except ValueError:
        print(
            f"synthetic teacher: error: --layers {args.layers!r}: comma-separated integers", file=sys.stderr
        )
        return 2
    t0 = time.monotonic()
    summary = {
        "teacher": "synthetic",
        "exit_code": None,
        "reason": "",
        "samples": 0,
        "resubmitted": 0,
        "journal": args.journal,
        "command": shlex.join(
            ["python", "-m", "testkit.synthetic_teacher", *(argv if argv is not None else sys.argv[1:])]
        ),
        "_t0": t0,
    }
    from distill.errors import ConfigError
    from distill.transport import TransportError

    try:
        rc = write_spool(args, layers, summary) if args.spool else publish(args, layers, summary)
    except (ConfigError, TransportError, ValueError) as e:  # the user's to fix: one line
        print(f"synthetic teacher: error: {e}", file=sys.stderr, flush=True)
        rc, summary["reason"] = 2, str(e)
    summary.pop("_t0", None)
    summary.update(exit_code=rc, wall_s=round(time.monotonic() - t0, 3))
    path = summary_path(args)
    if path is not None:
        from teacher.run.state import write_json

        write_json(path, summary)
    return rc


if __name__ == "__main__":
    sys.exit(main())
