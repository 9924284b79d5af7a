"""Transport benchmark: the same samples teacher -> student processes over several paths, in one run.

    .venv/bin/python benchmarks/transport.py [--repeats 3] [--total-mb 512] [--paths tcp,curve] [--students 2]

Paths (every student touches one byte per 4 KiB page of each sample, then acknowledges it):
  tcp     distill Publisher -> --students Subscriber processes, ZeroMQ over tcp loopback (shm off)
  tcpc    tcp with transport.chunk_bytes 1 MiB (tensors in 1 MiB frames, joined by the student)
  curve   the same with transport.curve (CURVE authentication + encryption, keys from distill-keygen;
          tensors in 1 MiB frames, the default with CURVE)
  curvew  curve with transport.chunk_bytes 0 (each tensor in one frame)
  curve2, tcp2  curve / tcp with transport.io_threads 2 (one teacher I/O thread per student)
  curve4  curve with transport.io_threads 4 (for --students 4 on a host with the cores)
  curvec2, curvec4  curve with 2 / 4 connections per student (transport.connections), the teacher
          with one I/O thread per connection (io_threads = students x connections)
  shm     the same with the same-host shared-memory ring (header over ZeroMQ, bytes in /dev/shm)
  file    vLLM's documented file handoff: the writer takes an exclusive flock on <file>.lock, writes
          safetensors to /dev/shm, releases; the reader takes a shared flock, loads, deletes
  socket  a bare TCP socket per student (length-prefixed, sendall / recv_into), one sender thread each
  memcpy  one in-process copy of the same bytes (the ceiling)
  cipher  libsodium's crypto_box_easy_afternm (XSalsa20-Poly1305, the cipher ZeroMQ's CURVE runs on
          every message) over the same bytes on one core, through the libsodium pyzmq ships: the
          ceiling of one CURVE connection, whose messages one I/O thread encrypts in turn

Samples: 8 MiB and 32 MiB bf16, --total-mb of each size per path and repeat. Prints GB/s per path
and size (median over repeats) and the ratios; for the ZeroMQ paths also the cores each side kept
busy while timed (CPU seconds of the teacher process, ZeroMQ I/O threads included, and of the
students together, over the wall time). The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import multiprocessing as mp
import os
import platform
import resource
import shutil
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distill.config import SpoolConfig, TransportConfig  # noqa: E402
from distill.protocol import Sample  # noqa: E402
from distill.spool import lock_path, remove_spool_file  # noqa: E402
from distill.transport import Publisher, Subscriber  # noqa: E402

MiB = 1 << 20
PAGE = 4096
# (path, path it is measured against) for each ratio reported, per size and overall (the least)
RATIOS = (
    ("shm", "file"),
    ("shm", "memcpy"),
    ("tcp", "socket"),
    ("curve", "tcp"),
    ("curvew", "tcp"),
    ("curve2", "tcp"),
    ("curve4", "tcp"),
    ("curvec2", "tcp"),
    ("curvec4", "tcp"),
    ("tcpc", "tcp"),
    ("curve", "cipher"),
    ("cipher", "tcp"),
)
CORES: list[tuple[float, float]] = []  # (teacher, students) cores busy of each ZeroMQ run, in order


def cpu_s() -> float:
    """CPU seconds of this process so far, all of its threads (ZeroMQ's I/O threads included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def touch(t: torch.Tensor) -> int:
    """Read one byte per page, so mapped memory is really brought in."""
    b = t.reshape(-1).view(torch.uint8)
    return int(b[::PAGE].sum()) if b.numel() else 0


# ---------------------------------------------------------------- student processes


def zmq_student(ep: str, shm: str, ready, done_q, curve: dict | None = None, conns: int = 1) -> None:
    cfg = TransportConfig(
        connect=[ep], shm=shm, credit_samples=8, credit_bytes=512 * MiB, curve=curve, connections=conns
    )
    with Subscriber(cfg, name=f"bench-{os.getpid()}") as sub:
        ready.set()
        n = 0
        cpu0 = None  # this process's CPU seconds (every thread) when the first timed sample came
        for s in sub:
            if cpu0 is None and not s.key.startswith("w"):
                cpu0 = cpu_s()
            touch(s.tensors["hidden_states"])
            sub.ack(s)
            n += 1
        done_q.put((n, cpu_s() - cpu0 if cpu0 is not None else 0.0))


def file_reader(q, done_q) -> None:
    from safetensors.torch import load_file

    n = 0
    while True:
        path = q.get()
        if path is None:
            break
        fd = os.open(lock_path(path), os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits for the writer
        t = load_file(path)["hidden_states"]
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        touch(t)
        remove_spool_file(path)  # and its .lock
        n += 1
        done_q.put(1)
    done_q.put(("end", n))


def socket_receiver(port: int, nbytes: int, ready, done_q) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(1)
    ready.set()
    conn, _ = srv.accept()
    buf = bytearray(nbytes)
    view = memoryview(buf)
    n = 0
    while True:
        hdr = conn.recv(8, socket.MSG_WAITALL)
        if len(hdr) < 8:
            break
        (size,) = struct.unpack("<Q", hdr)
        if size == 0:
            break
        got = 0
        while got < size:
            r = conn.recv_into(view[got:size], size - got)
            if r == 0:
                raise RuntimeError("sender closed early")
            got += r
        touch(torch.frombuffer(view[:size], dtype=torch.uint8))
        conn.sendall(b"a")  # per-sample ack, like the others
        n += 1
    done_q.put(n)
    conn.close()
    srv.close()


# ---------------------------------------------------------------- paths


def make_pool(size_mib: int, k: int = 4) -> list[torch.Tensor]:
    hidden = 4096
    layers = 4
    tokens = size_mib * MiB // (hidden * layers * 2)
    return [torch.randn(tokens, layers, hidden).bfloat16() for _ in range(k)]


def curve_keys(d: Path, n: int) -> tuple[dict, list[dict]]:
    """Teacher and `n` student CURVE configs with fresh keys under `d`."""
    from distill.keygen import make_keys

    if d.exists():
        shutil.rmtree(d)
    make_keys(d, "teacher")
    students = [make_keys(d / "students", f"s{i}")[1] for i in range(n)]
    teacher = {"secret_key": str(d / "teacher.key_secret"), "authorized_keys": str(d / "students")}
    return teacher, [{"secret_key": str(sec), "server_key": str(d / "teacher.key")} for sec in students]


def run_zmq(
    pool,
    count: int,
    shm: str,
    ctx,
    curve: bool = False,
    io_threads: int = 1,
    chunk: int | None = None,
    n: int = 2,
    conns: int = 1,
) -> float:
    port = _free_port()
    ep = f"tcp://127.0.0.1:{port}"
    nbytes = pool[0].numel() * 2
    t_curve, s_curve = curve_keys(Path(f"/tmp/bench-keys-{os.getpid()}"), n) if curve else (None, [None] * n)
    cfg = TransportConfig(
        chunk_bytes=chunk,
        bind=[ep],
        shm=shm,
        shm_bytes=max(256 * MiB, 20 * nbytes),
        max_buffer_bytes=64 * nbytes,
        curve=t_curve,
        io_threads=io_threads,
    )
    spool = f"/tmp/bench-spool-{os.getpid()}"
    with Publisher(cfg, SpoolConfig(dir=spool)) as pub:
        done_q = ctx.Queue()
        evs = [ctx.Event() for _ in range(n)]
        procs = [
            ctx.Process(target=zmq_student, args=(ep, shm, evs[i], done_q, s_curve[i], conns))
            for i in range(n)
        ]
        for p in procs:
            p.start()
        for e in evs:
            e.wait(60)
        while pub.stats()["sessions"] < n * conns:
            time.sleep(0.01)
        # Warm-up lap (untimed): a long-running teacher reuses warm ring pages and socket buffers.
        warm = min(count, 24)
        for i in range(warm):
            pub.submit(Sample(key=f"w{i}", tensors={"hidden_states": pool[i % len(pool)]}))
        while pub.stats()["acked"] < warm:
            time.sleep(0.005)
        t0, c0 = time.perf_counter(), cpu_s()
        for i in range(count):
            pub.submit(Sample(key=f"k{i}", tensors={"hidden_states": pool[i % len(pool)]}))
        pub.close_input()
        if not pub.wait_done(600):
            raise RuntimeError("zmq path did not finish")
        dt, teacher_cpu = time.perf_counter() - t0, cpu_s() - c0
        ends = [done_q.get(timeout=60) for _ in range(n)]
        got = sum(e[0] for e in ends) - warm
        for p in procs:
            p.join()
        st = pub.stats()
    shutil.rmtree(spool, ignore_errors=True)
    if got != count or st["spooled"]:
        raise RuntimeError(f"zmq path delivered {got}/{count}, spooled {st['spooled']}")
    if shm == "auto" and st.get("shm_samples", 0) != count + warm:
        raise RuntimeError(f"shm path used the ring for only {st.get('shm_samples', 0)}/{count} samples")
    # Cores busy while timed: the teacher process, and the students together.
    CORES.append((teacher_cpu / dt, sum(e[1] for e in ends) / dt))
    return dt


def run_file(pool, count: int, ctx) -> float:
    from safetensors.torch import save_file

    d = Path(f"/dev/shm/bench-files-{os.getpid()}")
    d.mkdir(parents=True, exist_ok=True)
    qs = [ctx.Queue() for _ in range(2)]
    done_q = ctx.Queue()
    procs = [ctx.Process(target=file_reader, args=(qs[i], done_q)) for i in range(2)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    for i in range(count):
        path = str(d / f"req-{i}.safetensors")
        fd = os.open(lock_path(path), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        qs[i % 2].put(path)  # the reader learns the path before the write is done, as in vLLM
        save_file({"hidden_states": pool[i % len(pool)]}, path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    for _ in range(count):
        done_q.get(timeout=600)
    dt = time.perf_counter() - t0
    for q in qs:
        q.put(None)
    got = 0
    for _ in range(2):
        got += done_q.get(timeout=60)[1]
    for p in procs:
        p.join()
    shutil.rmtree(d, ignore_errors=True)
    if got != count:
        raise RuntimeError(f"file path delivered {got}/{count}")
    return dt


def run_socket(pool, count: int, ctx) -> float:
    nbytes = pool[0].numel() * 2
    ports = [_free_port() for _ in range(2)]
    done_q = ctx.Queue()
    evs = [ctx.Event() for _ in range(2)]
    procs = [ctx.Process(target=socket_receiver, args=(ports[i], nbytes, evs[i], done_q)) for i in range(2)]
    for p in procs:
        p.start()
    for e in evs:
        e.wait(60)
    conns = []
    for port in ports:
        c = socket.create_connection(("127.0.0.1", port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns.append(c)
    bufs = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in pool]

    def sender(c, idx):
        for i in idx:
            b = bufs[i % len(bufs)]
            c.sendall(struct.pack("<Q", b.nbytes))
            c.sendall(b)
            c.recv(1)
        c.sendall(struct.pack("<Q", 0))

    t0 = time.perf_counter()
    ths = [threading.Thread(target=sender, args=(conns[r], range(r, count, 2))) for r in range(2)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    got = done_q.get(timeout=60) + done_q.get(timeout=60)
    dt = time.perf_counter() - t0
    for p in procs:
        p.join()
    for c in conns:
        c.close()
    if got != count:
        raise RuntimeError(f"socket path delivered {got}/{count}")
    return dt


def run_memcpy(pool, count: int) -> float:
    dst = torch.empty_like(pool[0])
    dst.copy_(pool[0])  # warm: fault the destination pages in
    t0 = time.perf_counter()
    for i in range(count):
        dst.copy_(pool[i % len(pool)])
    return time.perf_counter() - t0


@functools.cache
def _libsodium():
    import ctypes
    import ctypes.util

    import zmq

    libs = Path(zmq.__file__).resolve().parent.parent / "pyzmq.libs"
    found = sorted(libs.glob("libsodium*")) if libs.is_dir() else []
    name = str(found[0]) if found else ctypes.util.find_library("sodium")
    if not name:
        raise RuntimeError("no libsodium found (neither pyzmq's bundled copy nor a system one)")
    lib = ctypes.CDLL(name)
    if lib.sodium_init() < 0:
        raise RuntimeError(f"sodium_init failed in {name}")
    return lib


def run_cipher(pool, count: int) -> float:
    import ctypes

    lib = _libsodium()
    nbytes = pool[0].numel() * pool[0].element_size()
    out = ctypes.create_string_buffer(nbytes + 16)  # ciphertext + the 16-byte Poly1305 tag
    key, nonce = ctypes.create_string_buffer(32), ctypes.create_string_buffer(24)
    box = lib.crypto_box_easy_afternm
    box.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_void_p]
    box(out, pool[0].data_ptr(), nbytes, nonce, key)  # warm
    t0 = time.perf_counter()
    for i in range(count):
        if box(out, pool[i % len(pool)].data_ptr(), nbytes, nonce, key) != 0:
            raise RuntimeError("crypto_box_easy_afternm failed")
    return time.perf_counter() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--total-mb", type=int, default=512, help="MiB per path, size and repeat")
    ap.add_argument("--sizes", default="8,32", help="sample sizes in MiB")
    ap.add_argument("--paths", default="tcp,curve,shm,file,socket,memcpy", help="paths to measure")
    ap.add_argument("--students", type=int, default=2, help="student processes of the ZeroMQ paths")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results: dict = {
        "machine": f"{platform.node()} {os.cpu_count()} cores {platform.processor() or platform.machine()}",
        "command": "python " + " ".join(sys.argv),
    }
    paths = [p for p in args.paths.split(",") if p]
    ns = args.students
    results["students"] = ns
    run = {
        "tcp": lambda pool, count: run_zmq(pool, count, "off", ctx, n=ns),
        "tcpc": lambda pool, count: run_zmq(pool, count, "off", ctx, chunk=MiB, n=ns),
        "curve": lambda pool, count: run_zmq(pool, count, "off", ctx, curve=True, n=ns),
        "curvew": lambda pool, count: run_zmq(pool, count, "off", ctx, curve=True, chunk=0, n=ns),
        "curve2": lambda pool, count: run_zmq(pool, count, "off", ctx, curve=True, io_threads=2, n=ns),
        "curve4": lambda pool, count: run_zmq(pool, count, "off", ctx, curve=True, io_threads=4, n=ns),
        "tcp2": lambda pool, count: run_zmq(pool, count, "off", ctx, io_threads=2, n=ns),
        "curvec2": lambda pool, count: run_zmq(
            pool, count, "off", ctx, curve=True, io_threads=2 * ns, n=ns, conns=2
        ),
        "curvec4": lambda pool, count: run_zmq(
            pool, count, "off", ctx, curve=True, io_threads=4 * ns, n=ns, conns=4
        ),
        "shm": lambda pool, count: run_zmq(pool, count, "auto", ctx, n=ns),
        "file": lambda pool, count: run_file(pool, count, ctx),
        "socket": lambda pool, count: run_socket(pool, count, ctx),
        "memcpy": lambda pool, count: run_memcpy(pool, count),
        "cipher": lambda pool, count: run_cipher(pool, count),
    }
    for size in [int(x) for x in args.sizes.split(",")]:
        pool = make_pool(size)
        nbytes = pool[0].numel() * 2
        count = max(2, args.total_mb // size)
        times: dict[str, list[float]] = {p: [] for p in paths}
        cores: dict[str, list[tuple[float, float]]] = {p: [] for p in paths}
        for r in range(args.repeats):
            for p in paths:
                CORES.clear()
                times[p].append(run[p](pool, count))
                cores[p].extend(CORES)
            print(
                f"  {size} MiB repeat {r + 1}: "
                + ", ".join(f"{p} {count * nbytes / times[p][-1] / 1e9:.2f}" for p in paths),
                flush=True,
            )
        gbs = {p: count * nbytes / statistics.median(times[p]) / 1e9 for p in paths}
        for p in paths:
            results[f"gbs_{p}_{size}mib"] = round(gbs[p], 3)
            if cores[p]:  # median over repeats of the cores each side kept busy
                results[f"cores_{p}_{size}mib"] = {
                    "teacher": round(statistics.median(c[0] for c in cores[p]), 2),
                    "students": round(statistics.median(c[1] for c in cores[p]), 2),
                }
        ratios = {}
        for a, b in RATIOS:
            if a in gbs and b in gbs:
                ratios[f"{a}_over_{b}"] = results[f"ratio_{a}_over_{b}_{size}mib"] = round(gbs[a] / gbs[b], 3)
        results[f"samples_{size}mib"] = count
        print(f"{size} MiB samples x {count} ({count * nbytes / 1e6:.0f} MB), median of {args.repeats}:")
        for p in paths:
            busy = results.get(f"cores_{p}_{size}mib")
            cores_note = (
                f"   cores busy: teacher {busy['teacher']:.2f}, students {busy['students']:.2f}"
                if busy
                else ""
            )
            print(f"  {p:7s} {gbs[p]:7.2f} GB/s{cores_note}")
        print("  " + "   ".join(f"{k.replace('_over_', '/')} {v:.2f}" for k, v in ratios.items()))
    for key in (f"{a}_over_{b}" for a, b in RATIOS):
        vals = [v for k, v in results.items() if k.startswith(f"ratio_{key}_")]
        if vals:
            results[f"ratio_{key}"] = min(vals)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
