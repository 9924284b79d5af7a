"""Spool replay benchmark: how fast a teacher's Publisher serves a spool folder to one student.

    .venv/bin/python benchmarks/spool_replay.py [--total-mb 1024] [--sample-mb 8] [--repeats 3]
        [--shm auto|off] [--dir /dev/shm/spool_replay_bench] [--consume]

This is the serve phase of `distill-teacher` (a teacher restarted after everything was spooled, or
students slower than the teacher): a Publisher started on a folder of spool files replays them; one
Subscriber process copies each sample's hidden states into a reused buffer (as the student's collate
does) and acknowledges every 16 samples (as a student does after its optimizer step). Timed from
the first sample the student receives to END (every file acknowledged, the last acks committed).
The files are kept (`spool.keep`), so every repeat replays the same folder; with --consume they are
removed on ack and acks are journalled, as distill-teacher serves (the folder is written again
before each repeat). Prints GB/s per repeat and the median; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distill.config import SpoolConfig, TransportConfig  # noqa: E402
from distill.protocol import Sample, sample_x3  # noqa: E402
from distill.spool import list_spool, write_sample  # noqa: E402
from distill.transport import Publisher, Subscriber  # noqa: E402

MiB = 1 << 20
HIDDEN, LAYERS = 2048, 4


def student(ep: str, shm: str, done_q) -> None:
    """Copy, ack every 16 samples (and when the teacher has nothing more to send), until END."""
    cfg = TransportConfig(connect=[ep], shm=shm, credit_samples=32, credit_bytes=2048 * MiB)
    buf = None
    n = 0
    held = []
    t_first = t_last = None
    with Subscriber(cfg, name=f"replay-bench-{os.getpid()}") as sub:
        while True:
            s = sub.get(timeout=0.05)
            if s is None:
                if sub.finished:
                    break
                if held:
                    sub.ack(held)
                    held = []
                continue
            t_last = time.time()
            if t_first is None:
                t_first = t_last
            hs = s.tensors["hidden_states"]
            if buf is None or buf.numel() < hs.numel():
                buf = torch.empty(hs.numel(), dtype=hs.dtype)
            buf[: hs.numel()].copy_(hs.reshape(-1))
            held.append(s)
            n += 1
            if len(held) >= 16:
                sub.ack(held)
                held = []
    done_q.put((n, t_first, t_last, time.time()))


def make_spool(d: Path, total_mb: int, sample_mb: int) -> int:
    if d.exists():
        shutil.rmtree(d)
    tokens = sample_mb * MiB // (HIDDEN * LAYERS * 2)
    n = max(1, total_mb // sample_mb)
    pool = [torch.randn(tokens, LAYERS, HIDDEN).bfloat16() for _ in range(4)]
    for i in range(n):
        s = Sample(
            key=f"replay-{i:06d}",
            tensors={"hidden_states": pool[i % 4], "token_ids": torch.arange(tokens)},
            layers=[4, 8, 12, 16],
        )
        s.x3 = sample_x3(s)
        write_sample(d, s)
    return n


def replay_once(d: Path, shm: str, journal: Path | None = None) -> dict:
    """One replay of folder `d`; with `journal`, as distill-teacher serves: acked files are removed
    and every ack is journalled."""
    cfg = TransportConfig(bind=["tcp://127.0.0.1:0"], shm=shm)
    spool = SpoolConfig(dir=str(d), keep=journal is None)
    ctx = mp.get_context("spawn")
    done_q = ctx.Queue()
    with Publisher(cfg, spool, journal=journal) as pub:
        ep = pub.endpoints[0]
        t0 = time.perf_counter()
        p = ctx.Process(target=student, args=(ep, shm, done_q))
        p.start()
        pub.close_input()  # END once every file is acked
        sizes = [f.stat().st_size for f in list_spool(d)]
        got, t_first, t_last, t_end = done_q.get(timeout=600)
        dt = time.perf_counter() - t0
        st = pub.stats()
        p.join(30)
    steady = t_end - t_first
    return {
        "samples": got,
        "acked": st.get("acked", 0),
        "shm_samples": st.get("shm_samples", 0),
        "s": round(dt, 3),
        "first_to_end_s": round(steady, 3),
        "last_to_end_s": round(t_end - t_last, 3),
        # from the first sample received to END: the student's start-up left out
        "GB_s": round(sum(sizes[1:]) / steady / 1e9, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=1024)
    ap.add_argument("--sample-mb", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shm", default="auto", choices=["auto", "off"])
    ap.add_argument("--dir", default="/dev/shm/spool_replay_bench")
    ap.add_argument("--label", default="")
    ap.add_argument(
        "--consume", action="store_true", help="as distill-teacher serves: remove acked files, journal acks"
    )
    a = ap.parse_args()
    d = Path(a.dir)
    n = make_spool(d, a.total_mb, a.sample_mb)
    runs = []
    for i in range(a.repeats):
        if a.consume and i:
            make_spool(d, a.total_mb, a.sample_mb)
        journal = d.with_name(d.name + f".journal{i}") if a.consume else None
        r = replay_once(d, a.shm, journal)
        if journal is not None:
            journal.unlink(missing_ok=True)
        runs.append(r)
        print(
            f"repeat {i + 1}: {r['samples']} samples, first to END {r['first_to_end_s']} s, {r['GB_s']} GB/s (shm {r['shm_samples']})"
        )
    shutil.rmtree(d, ignore_errors=True)
    med = statistics.median(r["GB_s"] for r in runs)
    print(f"median {med} GB/s over {a.repeats} repeats ({n} samples of {a.sample_mb} MiB, shm {a.shm})")
    out = {
        "bench": "spool_replay",
        "label": a.label,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "samples": n,
        "sample_mb": a.sample_mb,
        "shm": a.shm,
        "consume": a.consume,
        "GB_s_median": med,
        "runs": runs,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
