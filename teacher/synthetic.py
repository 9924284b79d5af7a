"""A synthetic teacher for student tests and smoke runs: real hidden states without vLLM.

Runs a transformers model's forward pass over a JSONL text dataset and sends, per row, the layers
named by their teacher layer ids (same convention as vLLM extraction: id L is the last decoder
layer's output before the final norm), in vLLM's sample layout (`hidden_states` [T, n, H],
`token_ids` [T]). Either publishes through distill.transport.Publisher (the run file's transport
section) or writes a spool folder.

    python -m student.synthetic_teacher --model runs/tiny-teacher --data runs/tiny.jsonl \\
        --layers 2,4 --config configs/student_tiny.yaml            # stream to students
    python -m student.synthetic_teacher ... --spool runs/spool      # offline: write a spool folder
"""

from __future__ import annotations

import argparse
import json
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

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.num_layers = self.model.config.num_hidden_layers
        bad = [i for i in layers if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} outside 0..{self.num_layers}")
        self.layers = list(layers)
        self._prenorm = {}
        self.model.model.norm.register_forward_pre_hook(lambda m, a: self._prenorm.__setitem__("h", a[0]))
        rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
        self.rows = {r["id"]: r["text"] for r in rows[:limit]}  # in data set order

    def sample(self, key: str) -> Sample:
        ids = self.tok(self.rows[key], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = self.model(input_ids=ids, output_hidden_states=True)
        hs = list(out.hidden_states)
        hs[self.num_layers] = self._prenorm["h"]  # id L = before the final norm
        stacked = torch.stack([hs[i][0] for i in self.layers], dim=1).contiguous()  # [T, n, H]
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    args = ap.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]

    if args.spool:
        from distill.spool import write_sample

        n = 0
        for s in teacher_samples(args.model, args.data, layers, args.limit):
            s.teacher = "synthetic"
            write_sample(args.spool, s)
            n += 1
        print(f"synthetic teacher: wrote {n} samples to {args.spool}", flush=True)
        return

    from distill.config import load_run_file, parse_override
    from distill.journal import Journal
    from distill.transport import Publisher

    run = load_run_file(args.config, dict(parse_override(o) for o in args.set))
    done = Journal.read(args.journal).committed if args.journal else set()
    teacher = SyntheticTeacher(args.model, args.data, layers, args.limit)
    pub = Publisher(run.transport, run.spool, journal=args.journal)
    pub.start()
    print(
        f"synthetic teacher: publishing on {run.transport.bind}; {len(done)} keys committed in the journal",
        flush=True,
    )
    deadline = time.monotonic() + args.timeout
    n = resubmitted = 0
    for key in teacher.rows:
        if key in done:
            continue
        pub.submit(teacher.sample(key))
        n += 1
        if args.rate > 0:
            time.sleep(1.0 / args.rate)
    pub.close_input()
    # Run until every row is committed. Keys a student session acknowledged but never committed
    # (it died before a checkpoint covered them) come back from take_lost(): compute and send again.
    ok = False
    while time.monotonic() < deadline:
        lost = pub.take_lost()
        for key in lost:
            pub.submit(teacher.sample(key))
        if lost:
            resubmitted += len(lost)
            print(f"synthetic teacher: {len(lost)} keys lost by a student session; sent again", flush=True)
        if pub.wait_done(timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
            ok = True
            break
    stats = pub.stats()
    pub.close()
    print(
        f"synthetic teacher: submitted {n}, resubmitted {resubmitted}, done={ok}, stats={json.dumps(stats)}",
        flush=True,
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
