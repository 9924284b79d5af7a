"""Helpers for the multi-process tests (fault matrix, multi-node, student end to end): process trees,
freezing and killing with psutil, the students' records, the tiny student's run file
(`tiny_student`, `write_run_file`), and network namespaces for "two student hosts" rows.

Traps this module exists for:
- `accelerate launch` runs torch elastic in-process; its ranks run in sessions of their own, so
  killing the launcher's process group leaves the ranks alive. `Procs` records every descendant of
  everything it started (a background thread, every 0.2 s) and kills them all at the end, also the
  ones orphaned by a dead launcher.
- A rank's exit code is not the launcher's: torch elastic exits 1 for any failed rank and names each
  rank's exit code in its error report ("exitcode : 3"); `Proc.rank_exit_codes()` reads them.
- Every wait has a timeout and fails with the log tail of the process it waited for.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml

_HANDED_OUT: set[int] = set()


@functools.cache
def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A tcp port free on `host` now, taken from below the kernel's ephemeral range: a port that
    bind(0) hands out is closed again before the process under test binds it, and in between any
    outgoing connection (vLLM's and torch's own sockets) may take it as its source port. Ports below
    the range are never picked by the kernel. Never the same port twice in one test session."""
    low = _ephemeral_low()
    if low > 12000:
        for _ in range(200):
            port = random.randrange(low - 10000, low)
            if port in _HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:  # a lowered ephemeral range: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def host_pressure(endpoint: str = "") -> str:
    """One line on what a process starting now competes with, for a test whose engine did not
    start: memory available, /dev/shm free, other vLLM engines alive, and whether `endpoint`'s tcp
    port is taken."""
    vm = psutil.virtual_memory()
    parts = [f"memory available {vm.available >> 20} MiB of {vm.total >> 20}"]
    with contextlib.suppress(OSError):
        du = shutil.disk_usage("/dev/shm")
        parts.append(f"/dev/shm free {du.free >> 20} MiB of {du.total >> 20}")
    engines = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            text = " ".join([proc.info["name"] or "", *(proc.info["cmdline"] or [])])
            if "EngineCore" in text or "VLLM::" in text:
                engines.append(proc.info["pid"])
    parts.append(f"vLLM engine processes alive: {engines or 'none'}")
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        with socket.socket() as s:
            try:
                s.bind((host, int(port)))
                parts.append(f"port {port} free")
            except OSError as err:
                parts.append(f"port {port} taken ({err.strerror})")
    return "; ".join(parts)


def wait_until(cond, timeout: float, what: str, poll: float = 0.2, check=None):
    """Poll `cond()` until truthy (returns its value); AssertionError naming `what` after `timeout`.
    `check()` runs on every poll (e.g. to fail early when a process died)."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


def tree(pid: int) -> list[psutil.Process]:
    """The process `pid` and all its descendants (empty when it is gone)."""
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.send_signal(sig)


class Proc:
    """One started command (a Popen) and its log."""

    def __init__(self, name: str, popen: subprocess.Popen, log: Path, cmd: list[str]):
        self.name, self.popen, self.log, self.cmd = name, popen, log, cmd
        self.t0 = time.monotonic()
        self.ended_at: float | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        rc = self.popen.poll()
        if rc is not None and self.ended_at is None:
            self.ended_at = time.monotonic()
        return rc

    def alive(self) -> bool:
        return self.poll() is None

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def wait(self, timeout: float) -> int:
        """Exit code; fails (with the log tail) when it does not end by itself within `timeout`."""
        try:
            rc = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} did not end by itself within {timeout:.0f}s; log tail:\n{self.tail()}"
            ) from None
        self.poll()
        return rc

    def tree(self) -> list[psutil.Process]:
        return tree(self.pid)

    def ranks(self) -> dict[int, psutil.Process]:
        """Student rank processes under this launcher: {RANK: process} (their env names RANK)."""
        out = {}
        for p in self.tree()[1:]:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if "student.py" not in " ".join(p.cmdline()):
                    continue
                env = p.environ()
                if "RANK" in env:
                    out[int(env["RANK"])] = p
        return out

    def engine_core(self) -> psutil.Process | None:
        """vLLM's engine core process under a distill-teacher (it names itself VLLM::EngineCore)."""
        for p in self.tree()[1:]:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()):
                    return p
        return None

    def rank_exit_codes(self) -> list[int]:
        """Exit codes torch elastic reports for failed ranks ("exitcode : 3"), root cause first."""
        text = self.text()
        codes = [int(x) for x in re.findall(r"exitcode\s*:\s*(-?\d+)", text)]
        root = text.find("Root Cause")
        if root >= 0:
            m = re.search(r"exitcode\s*:\s*(-?\d+)", text[root:])
            if m:
                codes.insert(0, int(m.group(1)))
        return codes

    def student_exit(self) -> int | None:
        """The students' exit code: 0 when the launcher exits 0, else the root-cause rank's code
        (the launcher itself exits 1 for any failed rank); None while running."""
        rc = self.poll()
        if rc is None or rc == 0:
            return rc
        codes = self.rank_exit_codes()
        return codes[0] if codes else rc


def dev_shm_of(procs: list[psutil.Process]) -> dict[int, str]:
    """{inode: name} of the Python multiprocessing files in /dev/shm (`psm_*` segments, `sem.*`
    semaphores) these processes map (a semaphore is mapped under a temporary name: inodes match)."""
    inodes = set()
    for p in procs:
        with contextlib.suppress(OSError, psutil.Error, ValueError):
            for line in Path(f"/proc/{p.pid}/maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                    inodes.add(int(parts[4]))
    with os.scandir("/dev/shm") as it:
        return {e.inode(): e.name for e in it if e.name.startswith(("psm_", "sem.")) and e.inode() in inodes}


def still_there(files: dict[int, str]) -> list[str]:
    """Those of `files` ({inode: name}, from dev_shm_of) still in /dev/shm."""
    with os.scandir("/dev/shm") as it:
        return sorted(e.name for e in it if files.get(e.inode()) == e.name)


def running(procs: list[psutil.Process]) -> list[str]:
    """'pid name' of those of `procs` still running (zombies count as ended)."""
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()}")
    return out


def alive_or_fail(*procs: Proc):
    """A `wait_until` check: fails with the log tail of the first of `procs` that has ended."""

    def check():
        for p in procs:
            if not p.alive():
                raise AssertionError(f"{p.name} ended early (exit {p.poll()}); log tail:\n{p.tail()}")

    return check


def freeze(procs: list[psutil.Process]) -> None:
    """SIGSTOP each process (children first is not needed: a stopped process stays stopped)."""
    signal_all(procs, signal.SIGSTOP)


def thaw(procs: list[psutil.Process]) -> None:
    signal_all(procs, signal.SIGCONT)


def rank_tree(p: psutil.Process) -> list[psutil.Process]:
    try:
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class Procs:
    """Starts commands in sessions of their own and guarantees none survives `kill_all`."""

    def __init__(self, tmp: Path):
        self.tmp = Path(tmp)
        self.procs: list[Proc] = []
        self._seen: dict[int, float] = {}  # pid -> create_time of every descendant ever seen
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            self.record()

    def record(self) -> None:
        with self._lock:
            procs = list(self.procs)
        for pr in procs:
            for p in tree(pr.pid):
                with contextlib.suppress(psutil.NoSuchProcess):
                    self._seen.setdefault(p.pid, p.create_time())

    def start(self, name: str, cmd: list[str], env: dict | None = None, prefix: list[str] = ()) -> Proc:
        log = self.tmp / f"{name}.log"
        n = 1
        while log.exists():
            n += 1
            log = self.tmp / f"{name}.{n}.log"
        full = [*prefix, *cmd]
        popen = subprocess.Popen(
            full,
            cwd=Path(__file__).resolve().parents[1],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        pr = Proc(name, popen, log, full)
        with self._lock:
            self.procs.append(pr)
        self.record()
        return pr

    def kill(self, pr: Proc) -> None:
        """SIGKILL `pr` and its whole tree now (collected before the kill), and reap it."""
        self.record()
        procs = pr.tree()
        thaw(procs)  # a stopped process dies on SIGKILL too, but be sure nothing stays stopped
        signal_all(procs, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            pr.popen.wait(timeout=20)
        psutil.wait_procs(procs, timeout=10)
        pr.poll()

    def leftovers(self) -> list[psutil.Process]:
        """Processes this object started (or their descendants) that still run."""
        self.record()
        out = []
        for pid, ct in list(self._seen.items()):
            with contextlib.suppress(psutil.NoSuchProcess):
                p = psutil.Process(pid)
                if p.create_time() == ct and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def kill_all(self) -> list[str]:
        """Kill everything still alive; returns descriptions of what had to be killed."""
        self.record()
        killed = []
        for pr in self.procs:
            if pr.alive():
                killed.append(f"{pr.name} (pid {pr.pid})")
            self.kill(pr)
        rest = self.leftovers()
        for p in rest:
            with contextlib.suppress(psutil.NoSuchProcess):
                killed.append(f"orphan {p.pid} {' '.join(p.cmdline())[:80]}")
        thaw(rest)
        signal_all(rest, signal.SIGKILL)
        psutil.wait_procs(rest, timeout=10)
        self._stop.set()
        return killed


# ---------------------------------------------------------------------------------------------
# The students' records
# ---------------------------------------------------------------------------------------------


def tally(metrics_json: Path, expected: set[str]) -> dict:
    """trained / lost / twice from a student run's final metrics.json (`trained`: [key, rank, step])."""
    m = json.loads(Path(metrics_json).read_text())
    counts = collections.Counter(e[0] for e in m["trained"])
    trained = set(counts)
    by_rank = collections.Counter(e[1] for e in m["trained"])
    return {
        "trained": len(trained & expected),
        "lost": len(expected - trained),
        "twice": sum(1 for c in counts.values() if c > 1),
        "unexpected": sorted(trained - expected)[:5],
        "per_rank": dict(sorted(by_rank.items())),
        "steps": m["summary"]["steps"],
    }


def journal_state(path: Path) -> tuple[set[str], set[str]]:
    """(committed, lost) keys of a journal file (distill.journal reads it; absent: both empty)."""
    from distill.journal import Journal

    st = Journal.read(path)
    return st.committed, st.lost


def spool_keys(d: Path) -> set[str]:
    from distill.spool import list_spool, read_spool_file

    out = set()
    for p in list_spool(d):
        with contextlib.suppress(Exception):
            out.add(read_spool_file(p).key)
    return out


# ---------------------------------------------------------------------------------------------
# Run files
# ---------------------------------------------------------------------------------------------

TINY_LAYERS = [2, 4]  # teacher layer ids the tiny students learn: a middle one and the last (pre-norm)


def tiny_student(teacher_model: str | Path, output_dir: str | Path, **overrides) -> dict:
    """The `student` section of the multi-process tests: a 2-layer Qwen3 (hidden 64, vocab 1024)
    learns the tiny teacher's (conftest `tiny_teacher`: hidden 128, 4 layers, vocab 1024) layers 2
    and 4 (nmse) and its next-token distribution (kl), in micro-batches of at most 2 samples.
    `overrides` replace or add keys of the section."""
    return {
        "from_config": {
            "model_type": "qwen3",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": 1024,
            "tie_word_embeddings": False,
        },
        "teacher_model": str(teacher_model),
        "layer_map": [
            {"student_layer": 1, "teacher_layer": 2, "weight": 1.0},
            {"student_layer": 2, "teacher_layer": 4, "weight": 1.0},
        ],
        "losses": {"nmse": 1.0, "kl": 1.0},
        "max_tokens_per_batch": 512,
        "max_samples_per_batch": 2,
        "idle_flush_s": 0.5,
        "lr": 1.0e-2,
        "output_dir": str(output_dir),
        "log_every": 8,
        **overrides,
    }


def write_run_file(path: Path, **sections) -> Path:
    """A run file (YAML) with the given sections (transport=..., spool=..., student=..., teacher=...)."""
    path.write_text(yaml.safe_dump(sections))
    return path


def checkpoint_step(ckpt_dir: Path) -> int:
    """The optimizer step of the checkpoint `latest` names in `ckpt_dir`; 0 when there is none."""
    from distill.checkpoint_layout import latest, step_of

    folder = latest(ckpt_dir)
    return step_of(folder) if folder is not None else 0


# ---------------------------------------------------------------------------------------------
# Network namespaces: a teacher host and student hosts on one bridge
# ---------------------------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


class Hosts:
    """Hosts as network namespaces on one bridge (in the root namespace).

        hosts = Hosts(["t", "s0", "s1"])      # 10.<net>.0.1, .2, .3 on each host's eth0
        hosts.prefix("s0", private_shm=True)  # command prefix: run inside s0 (own /dev/shm)
        hosts.link("s1", up=False)            # unplug s1's cable (both ends lose carrier)
        hosts.close()                         # delete everything

    Raises RuntimeError from the constructor when namespaces cannot be made (not root, no ip).
    """

    def __init__(self, names: list[str]):
        self.tag = f"f{os.getpid() % 10000}{int(time.time() * 1000) % 1000:03d}"[:8]
        self.names = list(names)
        self.net = 100 + os.getpid() % 100
        self.ns = {n: f"{self.tag}{n}" for n in names}
        self.port = {n: f"p{n}"[:15] for n in names}  # switch-side veth of each host
        self.addr = {n: f"10.{self.net}.0.{i + 1}" for i, n in enumerate(names)}
        self.switch = f"{self.tag}sw"  # the bridge lives in a namespace of its own: the root
        # namespace may pass bridged frames through iptables (bridge-nf-call-iptables) and drop them
        self._made_ns: list[str] = []
        try:
            _ip("netns", "add", self.switch)
            self._made_ns.append(self.switch)
            sw = ["-n", self.switch]
            _ip(*sw, "link", "add", "br0", "type", "bridge")
            _ip(*sw, "link", "set", "br0", "up")
            for n in names:
                ns = self.ns[n]
                _ip("netns", "add", ns)
                self._made_ns.append(ns)
                _ip(*sw, "link", "add", self.port[n], "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip(*sw, "link", "set", self.port[n], "master", "br0")
                _ip(*sw, "link", "set", self.port[n], "up")
                _ip("-n", ns, "addr", "add", f"{self.addr[n]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            # every host reaches every other one
            for a in names:
                for b in names:
                    if a != b:
                        self.ping(a, b)
        except BaseException:
            self.close()
            raise

    def ping(self, src: str, dst: str, timeout: float = 10) -> None:
        """Fail unless `src` reaches `dst`: a tcp connect to a closed port answered by a refusal
        (no ping binary needed)."""
        probe = (
            "import socket,sys\ns=socket.socket();s.settimeout(1)\n"
            "try:\n s.connect((sys.argv[1],9))\nexcept ConnectionRefusedError:\n sys.exit(0)\n"
            "except OSError:\n sys.exit(1)\n"
        )
        deadline = time.monotonic() + timeout
        while True:
            r = subprocess.run(
                ["ip", "netns", "exec", self.ns[src], sys.executable, "-c", probe, self.addr[dst]],
                capture_output=True,
                timeout=15,
            )
            if r.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{src} cannot reach {dst} ({self.addr[dst]}) over the bridge")
            time.sleep(0.2)

    def prefix(self, host: str, private_shm: bool = False) -> list[str]:
        """Command prefix that runs a command on `host`; private_shm: with a /dev/shm of its own
        (a fresh tmpfs in a mount namespace of its own), so no shared memory crosses hosts."""
        pre = ["ip", "netns", "exec", self.ns[host]]
        if private_shm:
            pre += [
                "unshare",
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                'mount -t tmpfs -o size=1g tmpfs /dev/shm && exec "$@"',
                "sh",
            ]
        return pre

    def link(self, host: str, up: bool) -> None:
        _ip("-n", self.switch, "link", "set", self.port[host], "up" if up else "down")

    def cut(self, host: str, peer: str, cut: bool = True) -> None:
        """Cut (or mend) only the path from `host` to `peer`: a blackhole route on `host`, its other
        paths stay up (both directions stop: `host` drops what it would answer)."""
        _ip("-n", self.ns[host], "route", "add" if cut else "del", "blackhole", f"{self.addr[peer]}/32")

    def close(self) -> None:
        for ns in reversed(self._made_ns):
            # processes still inside would keep the namespace's devices: callers kill them first
            _ip("netns", "del", ns, check=False)
        self._made_ns = []


def netns_available() -> str | None:
    """None when network namespaces, veth pairs and bridges can be made here; else why not."""
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_NET_ADMIN"
    try:
        h = Hosts(["a", "b"])
        h.close()
    except (RuntimeError, FileNotFoundError, subprocess.SubprocessError) as e:
        return f"cannot create network namespaces/veth/bridge: {e}"
    return None


def ended_by_itself(procs: Procs, timeout: float = 30) -> bool:
    """Every process `procs` started, and every descendant it ever had, has ended (none needs the
    teardown's kill): True, or AssertionError naming what still runs after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = procs.leftovers()
        if not left:
            return True
        if time.monotonic() > deadline:
            names = []
            for p in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    names.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
            raise AssertionError(f"processes still running {timeout:.0f}s after the run ended: {names}")
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# Packet capture on a host's interface (AF_PACKET; no tcpdump needed)
# ---------------------------------------------------------------------------------------------

# Runs inside the host's namespace (`ip netns exec`): every frame seen on the interface, in and
# out, appended to OUT as <u32 length><u8 packet type><frame>, until the file STOP exists; then the
# socket is drained and OUT.ready is replaced by OUT (complete).
_CAPTURE = r"""
import os, socket, struct, sys
out, stop, ifname = sys.argv[1], sys.argv[2], sys.argv[3]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
try:
    s.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE (root)
except OSError:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
s.bind((ifname, 0))
n = nbytes = 0
with open(out + ".part", "wb") as f:
    open(out + ".ready", "w").close()
    stopping = False
    while True:
        s.settimeout(0.0 if stopping else 0.2)
        try:
            data, addr = s.recvfrom(1 << 20)
        except (socket.timeout, BlockingIOError):
            if stopping:
                break
            stopping = os.path.exists(stop)
            continue
        if addr[0] != ifname:
            continue
        f.write(struct.pack("<IB", len(data), addr[2]) + data)
        n += 1
        nbytes += len(data)
os.replace(out + ".part", out)
print(f"capture on {ifname}: {n} frames, {nbytes} bytes", flush=True)
"""


class Capture:
    """A raw capture of every frame on `host`'s eth0, run inside its namespace:

    cap = Capture(procs, hosts, "s", tmp / "s.cap")   # returns once the socket is bound
    ...                                               # traffic
    cap.stop()                                        # the capture process ends by itself
    cap.frames, cap.bytes, cap.streams                # what crossed the link
    cap.contains(b"marker")                           # in a frame, or in a reassembled tcp stream
    """

    def __init__(self, procs: Procs, hosts: Hosts, host: str, out: Path, ifname: str = "eth0"):
        self.out = Path(out)
        self.stop_file = self.out.with_name(self.out.name + ".stop")
        self.proc = procs.start(
            f"capture-{host}",
            [sys.executable, "-c", _CAPTURE, str(self.out), str(self.stop_file), ifname],
            prefix=["ip", "netns", "exec", hosts.ns[host]],
        )

        def died():
            if not self.proc.alive():
                raise AssertionError(
                    f"the capture ended early (exit {self.proc.poll()}):\n{self.proc.tail()}"
                )

        wait_until(lambda: Path(str(self.out) + ".ready").exists(), 60, "the capture socket", check=died)
        self.raw: list[tuple[int, bytes]] = []
        self.streams: dict[tuple, bytes] = {}

    def stop(self, settle_s: float = 0.5, timeout: float = 30) -> None:
        time.sleep(settle_s)  # the last frames (acks, FIN) reach the socket
        self.stop_file.touch()
        rc = self.proc.wait(timeout)
        assert rc == 0, f"capture exit {rc}:\n{self.proc.tail()}"
        self._parse(self.out.read_bytes())

    @property
    def frames(self) -> int:
        return len(self.raw)

    @property
    def bytes(self) -> int:
        return sum(len(f) for _, f in self.raw)

    def tcp_payload_bytes(self, port: int) -> int:
        """Bytes of tcp payload to or from `port` (both directions)."""
        return sum(len(b) for (_, sp, _, dp), b in self.streams.items() if port in (sp, dp))

    def contains(self, needle: bytes) -> bool:
        return any(needle in f for _, f in self.raw) or any(needle in b for b in self.streams.values())

    def _parse(self, data: bytes) -> None:
        import struct

        i = 0
        while i + 5 <= len(data):
            n, ptype = struct.unpack_from("<IB", data, i)
            self.raw.append((ptype, data[i + 5 : i + 5 + n]))
            i += 5 + n
        # tcp payloads per direction, ordered by sequence number (relative to the first seen, so a
        # wrap of the 32-bit counter orders right); a retransmitted segment counts once
        segs: dict[tuple, dict[int, bytes]] = collections.defaultdict(dict)
        first: dict[tuple, int] = {}
        for _, fr in self.raw:
            if len(fr) < 34 or struct.unpack_from("!H", fr, 12)[0] != 0x0800:
                continue  # not IPv4 over Ethernet
            ip = 14
            ihl = (fr[ip] & 0x0F) * 4
            total = struct.unpack_from("!H", fr, ip + 2)[0]
            if fr[ip + 9] != 6 or len(fr) < ip + ihl + 20:
                continue  # not tcp
            t = ip + ihl
            sport, dport, seq = struct.unpack_from("!HHI", fr, t)
            doff = (fr[t + 12] >> 4) * 4
            end = ip + total if total else len(fr)  # total 0: a GSO frame over 64 KiB
            payload = fr[t + doff : end]
            if not payload:
                continue
            flow = (
                socket.inet_ntoa(fr[ip + 12 : ip + 16]),
                sport,
                socket.inet_ntoa(fr[ip + 16 : ip + 20]),
                dport,
            )
            base = first.setdefault(flow, seq)
            segs[flow].setdefault((seq - base) % (1 << 32), payload)
        self.streams = {f: b"".join(s[k] for k in sorted(s)) for f, s in segs.items()}
