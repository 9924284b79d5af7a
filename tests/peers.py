"""Teacher and student peer processes for the transport tests (run as scripts, real sockets).

    python tests/peers.py teacher --bind EP --n N --out FILE [--spool DIR] [--connect-timeout S] [--end-on PATH]
                                  [--hand-over [--no-expect]]
    python tests/peers.py student --connect EP --out FILE [--shm auto|off] [--ack-delay S] [--no-ack-after K]

The teacher writes one JSON line per submitted sample (key, crc32, nbytes, where) and a final line
with its stats. A student writes one JSON line per received sample (key, crc32, dtype, shape) as it
receives it (flushed), then a final stats line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

import torch

from distill.config import SpoolConfig, TransportConfig
from distill.protocol import Sample
from distill.transport import Publisher, Subscriber

MiB = 1 << 20


def sample_sizes(n: int) -> list[int]:
    """Mixed sizes in bytes: mostly small, a few large (up to 64 MiB)."""
    big = [64 * MiB, 32 * MiB, 8 * MiB, 8 * MiB, 1 * MiB]
    return [
        big[i // 100] if i % 100 == 50 and i // 100 < len(big) else 4096 * (1 + (i * 7919) % 64)
        for i in range(n)
    ]


def make_sample(i: int, nbytes: int) -> Sample:
    dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
    hidden = 256
    layers = 2
    per_token = hidden * layers * (2 if dtype == torch.bfloat16 else 4)
    tokens = max(1, nbytes // per_token)
    g = torch.Generator().manual_seed(i)
    hs = torch.randn(tokens, layers, hidden, generator=g).to(dtype)
    ids = torch.randint(0, 50000, (tokens,), generator=g)
    return Sample(
        key=f"s{i:05d}", tensors={"hidden_states": hs, "token_ids": ids}, layers=[1, 3], meta={"i": i}
    )


def crc(sample: Sample) -> int:
    c = 0
    for t in sample.tensors.values():
        c = zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy(), c)
    return c


def teacher(args) -> None:
    cfg = TransportConfig(
        bind=[args.bind],
        connect_timeout_s=args.connect_timeout,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=args.hb_timeout,
        max_buffer_bytes=args.max_buffer,
        shm_bytes=256 * MiB,
        checksum="crc32",
    )
    out = open(args.out, "w", buffering=1)
    with Publisher(cfg, SpoolConfig(dir=args.spool), auto_end=not args.end_on) as pub:
        for i, nb in enumerate(sample_sizes(args.n)):
            s = make_sample(i, nb)
            c = crc(s)
            where = pub.submit(s)
            out.write(json.dumps({"key": s.key, "crc": c, "nbytes": s.nbytes, "where": where}) + "\n")
        pub.close_input()
        if args.hand_over:
            pub = _hand_over_on_signal(pub, cfg, args)
        elif args.end_on:
            _end_on_signal(pub, Path(args.end_on), args.timeout)
        try:
            _finish(pub, args, out)
        finally:
            pub.close()


def _finish(pub: Publisher, args, out) -> None:
    """END (once it is due), then serve until it reached the students; the final stats line."""
    done = pub.wait_done(timeout=args.timeout)
    if args.end_on:
        Path(args.end_on + ".ended").touch()
    t_end = time.monotonic()
    missing = pub.wait_end_delivered(0.5, args.end_grace) if done else None
    rec = {"stats": pub.stats(), "done": done, "end_missing": missing, "end_wait_s": time.monotonic() - t_end}
    out.write(json.dumps(rec) + "\n")
    sys.exit(0 if done else 3)


def _hand_over_on_signal(pub: Publisher, cfg: TransportConfig, args) -> Publisher:
    """(--hand-over, with --end-on PATH) Once every sample is acked, say so (PATH.idle) and wait
    for PATH; then close this Publisher at once, as distill-teacher's engine phase does, and start
    the next one on the same endpoint (another teacher id, as the serve phase's), which expects the
    first one's students (not with --no-expect) and sends END."""
    path = Path(args.end_on)
    deadline = time.monotonic() + args.timeout
    if not pub.wait_idle(timeout=args.timeout):
        sys.exit(3)
    Path(str(path) + ".idle").touch()
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)
    names = pub.student_names()
    pub.close()
    nxt = Publisher(
        cfg.model_copy(update={"teacher_id": "peer-next"}), SpoolConfig(dir=args.spool), auto_end=False
    )
    if not args.no_expect:
        nxt.expect_students(names)
    nxt.start()
    nxt.close_input()
    nxt.end()
    return nxt


def _end_on_signal(pub: Publisher, path: Path, timeout: float) -> None:
    """(--end-on PATH) Once every sample is acked, say so (PATH.idle), wait for PATH to exist, then
    for every session to have ended (its students silent past the heartbeat timeout); END after."""
    deadline = time.monotonic() + timeout
    if not pub.wait_idle(timeout=timeout):
        sys.exit(3)
    Path(str(path) + ".idle").touch()
    while not path.exists() or pub.stats()["students"]:
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)
    pub.end()


def student(args) -> None:
    cfg = TransportConfig(
        connect=[args.connect],
        shm=args.shm,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=args.student_hb_timeout,
        teacher_wait_s=args.teacher_wait,
        credit_samples=args.credit,
        credit_bytes=512 * MiB,
    )
    out = open(args.out, "w", buffering=1)
    with Subscriber(cfg) as sub:
        n = 0
        for s in sub:
            n += 1
            hs = s.tensors["hidden_states"]
            rec = {"key": s.key, "crc": crc(s), "dtype": str(hs.dtype), "shape": list(hs.shape), "seq": s.seq}
            out.write(json.dumps(rec) + "\n")
            if args.no_ack_after and n > args.no_ack_after:
                continue  # hold it unacked (the test kills us)
            if args.ack_delay:
                time.sleep(args.ack_delay)
            sub.ack(s)
        out.write(json.dumps({"stats": sub.stats()}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["teacher", "student"])
    ap.add_argument("--bind")
    ap.add_argument("--connect")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--out", required=True)
    ap.add_argument("--spool", default="/tmp/distill-test-spool")
    ap.add_argument("--connect-timeout", type=float, default=30.0)
    ap.add_argument("--hb-timeout", type=float, default=2.0)
    ap.add_argument("--max-buffer", type=int, default=512 * MiB)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--shm", default="auto")
    ap.add_argument("--credit", type=int, default=16)
    ap.add_argument("--ack-delay", type=float, default=0.0)
    ap.add_argument("--no-ack-after", type=int, default=0)
    ap.add_argument(
        "--end-on", default="", help="teacher: END only once this file exists (see _end_on_signal)"
    )
    ap.add_argument("--end-grace", type=float, default=30.0)
    ap.add_argument("--hand-over", action="store_true", help="teacher: see _hand_over_on_signal")
    ap.add_argument("--no-expect", action="store_true", help="teacher: the next Publisher expects nobody")
    ap.add_argument("--student-hb-timeout", type=float, default=10.0)
    ap.add_argument("--teacher-wait", type=float, default=600.0)
    args = ap.parse_args()
    teacher(args) if args.role == "teacher" else student(args)


if __name__ == "__main__":
    main()
