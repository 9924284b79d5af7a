"""Multi-node helpers: the gloo interface and lost peer ranks (checkpoints on per-node storage:
student/checkpoint.py).

- `pick_gloo_ifname()`: before the process group starts, when GLOO_SOCKET_IFNAME is unset and
  MASTER_ADDR is not a loopback address, the interface that holds the local address of the route to
  MASTER_ADDR (a UDP connect picks the source address; no packet is sent). Without it gloo binds to
  the address the hostname resolves to, often 127.0.0.1.
- `is_peer_failure(exc)`: a collective that failed because a peer rank is gone (connection closed or
  reset, or nothing within student.collective_timeout_s).
- `PeerTable`: who is where (rank -> host, address), gathered once at start, so the one line a
  surviving rank prints names the lost host.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess


def _route_source(addr: str) -> str | None:
    try:
        infos = socket.getaddrinfo(addr, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sa in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sa)  # UDP: picks the route and its source address, sends nothing
                return s.getsockname()[0]
            except OSError:
                continue
    return None


def _ifname_of(ip: str) -> str | None:
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address.split("%")[0] == ip for a in addrs):
                return name
    except Exception:
        pass
    try:  # no psutil: ask iproute2
        out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[3].split("/")[0] == ip:
                return parts[1]
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def pick_gloo_ifname(environ=os.environ) -> tuple[str | None, str]:
    """(interface, why) for gloo; sets nothing. (None, why) when it should be left alone."""
    if environ.get("GLOO_SOCKET_IFNAME"):
        return None, f"GLOO_SOCKET_IFNAME={environ['GLOO_SOCKET_IFNAME']} (set by the user)"
    master = environ.get("MASTER_ADDR")
    if not master or int(environ.get("WORLD_SIZE", "1")) <= 1:
        return None, "one process"
    try:
        if ipaddress.ip_address(socket.gethostbyname(master)).is_loopback:
            return None, f"MASTER_ADDR {master} is a loopback address (one host)"
    except (OSError, ValueError):
        pass
    src = _route_source(master)
    if src is None:
        return None, f"no route to MASTER_ADDR {master}"
    name = _ifname_of(src)
    if name is None:
        return None, f"no interface holds {src}, the source address of the route to {master}"
    return name, f"the interface of the route to MASTER_ADDR {master} (local address {src})"


def set_gloo_ifname(log) -> None:
    name, why = pick_gloo_ifname()
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log(f"gloo process group on interface {name}: {why} (set GLOO_SOCKET_IFNAME to choose another)")
    elif "user" in why:
        log(f"gloo process group: {why}")


def local_address() -> str:
    """The address this rank's gloo pairs use (of GLOO_SOCKET_IFNAME when set)."""
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    if name:
        try:
            import psutil

            for a in psutil.net_if_addrs().get(name.split(",")[0], []):
                if a.family == socket.AF_INET:
                    return a.address
        except Exception:
            pass
    master = os.environ.get("MASTER_ADDR")
    return (_route_source(master) if master else None) or "127.0.0.1"


PEER_FAILURE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Timed out waiting|"
    r"timed out|Socket Timeout|Connection refused|No route to host|Read error|Write error|"
    r"NCCL communicator was aborted|ProcessGroup.*(aborted|timeout)|gloo",
    re.IGNORECASE,
)


def is_peer_failure(exc: BaseException) -> bool:
    """A collective failed because another rank is gone (its host died or vanished)."""
    import torch.distributed as dist

    for e in (exc, exc.__cause__, exc.__context__):
        if e is None:
            continue
        if isinstance(e, getattr(dist, "DistError", ())) and not isinstance(e, KeyboardInterrupt):
            return True
        if isinstance(e, RuntimeError) and PEER_FAILURE.search(str(e)):
            return True
    return False


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)
    return line.split(". This is typically")[0].rstrip(".")[:200]


class PeerTable:
    """rank -> (hostname, address), the same on every rank."""

    def __init__(self, entries: list[tuple[int, str, str]]):
        self.entries = sorted(entries)

    def hosts(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for r, host, addr in self.entries:
            out.setdefault(f"{host} ({addr})", []).append(r)
        return out

    def gone(self, exc: BaseException, me: int) -> str:
        """Which ranks/hosts the error names (by address), else every other host."""
        text = " ".join(str(e) for e in (exc, exc.__cause__, exc.__context__) if e is not None)
        addrs = set(re.findall(r"\[?(\d{1,3}(?:\.\d{1,3}){3})\]?:\d+", text))
        mine = next((a for r, _, a in self.entries if r == me), None)
        named = [(r, h, a) for r, h, a in self.entries if a in addrs and a != mine]
        if named:
            by: dict[str, list[int]] = {}
            for r, h, a in named:
                by.setdefault(f"host {h} ({a})", []).append(r)
            return "; ".join(f"rank {','.join(map(str, rs))} on {hp}" for hp, rs in by.items())
        others = [(r, h, a) for r, h, a in self.entries if a != mine]
        if not others:
            others = [(r, h, a) for r, h, a in self.entries if r != me]
        by = {}
        for r, h, a in others:
            by.setdefault(f"host {h} ({a})", []).append(r)
        hosts = " or ".join(f"rank {','.join(map(str, rs))} on {hp}" for hp, rs in by.items())
        return f"{hosts} (no answer in time)"
