"""The teacher's listening socket (`router_socket`: ROUTER options, the size bound on what students
may send, heartbeats, binding), a student's sockets (`dealer_sockets`: heartbeats, reconnects,
several connections on several I/O threads) and CURVE on both (`curve_server`, `curve_client`):
only students whose public keys are authorised get anything, and every frame is encrypted
(tests/distill/test_security.py, tests/system/test_security_netns.py). Keys: distill-keygen
(distill/keygen.py); settings: `transport.curve` (distill/config.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import zmq

from distill.config import TransportConfig
from distill.errors import TransportError
from distill.protocol import lane_name


def curve_server(ctx: zmq.Context, sock: zmq.Socket, curve):
    """Make `sock` a CURVE server that accepts only the students whose public keys are in
    `curve.authorized_keys`. Returns the running authenticator (stop it on close).

    Raises:
        ValueError, OSError: missing or unreadable keys (one line for the user).
    """
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator

    if not curve.authorized_keys or not Path(curve.authorized_keys).is_dir():
        raise ValueError(
            f"authorized_keys must be a folder of student public keys, got {curve.authorized_keys!r}"
        )
    public, secret = zmq.auth.load_certificate(curve.secret_key)
    if secret is None:
        raise ValueError(f"{curve.secret_key!r} holds no secret key (use the .key_secret file)")
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("distill.transport.auth"))
    auth.start()
    auth.configure_curve(domain="*", location=str(curve.authorized_keys))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


_CONTEXTS: dict[tuple[int, int], zmq.Context] = {}  # (pid, io_threads) -> context, io_threads > 1


def io_context(io_threads: int) -> zmq.Context:
    """The process's ZeroMQ context with `io_threads` I/O threads (1: the shared instance)."""
    if io_threads <= 1:
        return zmq.Context.instance()
    import os

    key = (os.getpid(), io_threads)  # a forked child makes its own
    if key not in _CONTEXTS:
        _CONTEXTS[key] = zmq.Context(io_threads=io_threads)
    return _CONTEXTS[key]


def router_socket(cfg: TransportConfig) -> tuple[zmq.Socket, object]:
    """The teacher's ROUTER socket, bound to every endpoint (CURVE server when configured), on a
    context with `cfg.io_threads` I/O threads. Returns (socket, CURVE authenticator or None).
    Raises TransportError."""
    ctx = io_context(cfg.io_threads)
    sock = ctx.socket(zmq.ROUTER)
    auth = None
    if cfg.curve is not None:
        try:
            auth = curve_server(ctx, sock, cfg.curve)
        except (OSError, ValueError) as e:
            sock.close(0)
            raise TransportError(f"transport.curve: {e}") from None
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.SNDHWM, 0)  # credits bound what we queue; never drop
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    # Students send control records only: nothing larger than a header is accepted.
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_header_bytes + 64 * 1024)
    # ZeroMQ heartbeats close connections silent for heartbeat_timeout_s (a link that was down),
    # so a student's reconnect is not stuck behind a dead TCP connection.
    hb_ms = max(1, int(cfg.heartbeat_interval_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, hb_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(hb_ms, int(cfg.heartbeat_timeout_s * 1000)))
    if cfg.socket_buffer_bytes:
        sock.setsockopt(zmq.SNDBUF, cfg.socket_buffer_bytes)
        sock.setsockopt(zmq.RCVBUF, cfg.socket_buffer_bytes)
    for ep in cfg.bind:
        try:
            _bind(sock, ep)
        except zmq.ZMQError as e:
            sock.close(0)
            if auth is not None:
                auth.stop()
            raise TransportError(f"cannot bind teacher endpoint {ep!r}: {e}") from None
    return sock, auth


# Endpoints whose ROUTER this process closed, and when. ZeroMQ closes a socket in its I/O thread,
# after close() returns: the listening port is free a few milliseconds later (longer on a loaded
# host), so the next Publisher on the same endpoint (distill-teacher's serve phase after its
# engine phase) waits for it, briefly, instead of failing with "Address already in use".
_RELEASED: dict[str, float] = {}
_REBIND_WAIT_S = 5.0


def _bind(sock: zmq.Socket, ep: str) -> None:
    import time

    released = _RELEASED.get(ep)
    deadline = time.monotonic() + _REBIND_WAIT_S
    while True:
        try:
            sock.bind(ep)
            return
        except zmq.ZMQError as e:
            mine = released is not None and time.monotonic() - released < 2 * _REBIND_WAIT_S
            if e.errno != zmq.EADDRINUSE or not mine or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def close_router(sock: zmq.Socket, cfg: TransportConfig, linger_ms: int) -> None:
    """Close the teacher's ROUTER; a new one may bind the same endpoints at once (`router_socket`
    waits up to 5 s for ZeroMQ to let the port go)."""
    import time

    sock.close(linger=linger_ms)
    now = time.monotonic()
    for ep in cfg.bind:
        _RELEASED[ep] = now


def _dealer_socket(
    cfg: TransportConfig, name: str, endpoint: str, lane: int, settle_s: float
) -> tuple[zmq.Socket, bool]:
    """A student's DEALER socket to one teacher endpoint, connected (CURVE client when configured);
    `lane`: which of the student's `connections` to that endpoint it is. With `settle_s` > 0 it
    waits that long at most for the connection's handshake to finish. Returns (socket, whether the
    handshake finished). Raises TransportError."""
    import uuid

    # One I/O thread per connection to a teacher: several connections (`connections`) spread
    # CURVE's decryption over that many cores. ZeroMQ would put a new connection on the least
    # loaded I/O thread, but connections made back to back all find every thread idle and share
    # the first one: the affinity pins connection `lane` to I/O thread `lane`.
    sock = io_context(cfg.connections).socket(zmq.DEALER)
    if cfg.connections > 1:
        sock.setsockopt(zmq.AFFINITY, 1 << lane)  # lane < connections = the context's I/O threads
    sock.setsockopt(zmq.ROUTING_ID, f"{name}-{uuid.uuid4().hex[:8]}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_frame_bytes)
    # A link that was down longer than the heartbeat timeout leaves a TCP connection that
    # retransmits with a backoff of up to minutes: ZeroMQ's own heartbeats drop it after
    # heartbeat_timeout_s of silence, and short connect timeouts make the reconnect succeed soon
    # after the link is back.
    hb_ms = max(1, int(cfg.heartbeat_interval_s * 1000))
    to_ms = max(hb_ms, int(cfg.heartbeat_timeout_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, hb_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, to_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, to_ms)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, to_ms)
    # Reconnect attempts at least every second: a teacher that rebinds its endpoint (the serving
    # Publisher after the engine's) is found within ~1 s, not after a backoff of up to
    # heartbeat_timeout_s, by which time a teacher with nothing left to serve has left.
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(hb_ms, 1000))
    if cfg.socket_buffer_bytes:
        sock.setsockopt(zmq.SNDBUF, cfg.socket_buffer_bytes)
        sock.setsockopt(zmq.RCVBUF, cfg.socket_buffer_bytes)
    if cfg.curve is not None:
        try:
            curve_client(sock, cfg.curve)
        except (OSError, ValueError) as e:
            sock.close(0)
            raise TransportError(f"transport.curve: {e}") from None
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED) if settle_s > 0 else None
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(0)
        sock.close(0)
        raise TransportError(f"cannot connect to teacher endpoint {endpoint!r}: {e}") from None
    settled = False
    if monitor is not None:
        settled = bool(monitor.poll(int(settle_s * 1000)))
        sock.disable_monitor()
        monitor.close(0)
    return sock, settled


# How long a student waits for one of its connections to a teacher to finish its handshake
# before it opens the next (several `connections` only).
SETTLE_S = 1.0


def dealer_sockets(cfg: TransportConfig, name: str, endpoint: str) -> list[zmq.Socket]:
    """The student's `cfg.connections` DEALER sockets to one teacher endpoint, connection `lane`
    named `lane_name(name, lane)`. Raises TransportError.

    With several, each waits (at most SETTLE_S) for the one before it to finish its handshake:
    the teacher's ROUTER puts an accepted connection on its least loaded I/O thread, and
    connections accepted back to back all find the same thread least loaded (its load counts a
    connection only once that thread has taken it up), so CURVE would encrypt them all on one core.
    A teacher not listening yet ends the waiting (the rest connect at once)."""
    socks: list[zmq.Socket] = []
    settle_s = SETTLE_S if cfg.connections > 1 else 0.0
    try:
        for lane in range(cfg.connections):
            wait_s = settle_s if lane < cfg.connections - 1 else 0.0
            sock, settled = _dealer_socket(cfg, lane_name(name, lane), endpoint, lane, wait_s)
            socks.append(sock)
            if wait_s and not settled:
                settle_s = 0.0
    except TransportError:
        for sock in socks:
            sock.close(0)
        raise
    return socks


def curve_client(sock: zmq.Socket, curve) -> None:
    """Make `sock` a CURVE client of the teacher whose public key is in `curve.server_key`."""
    import zmq.auth

    if not curve.server_key:
        raise ValueError("students need curve.server_key (the teacher's public .key file)")
    server_public, _ = zmq.auth.load_certificate(curve.server_key)
    public, secret = zmq.auth.load_certificate(curve.secret_key)
    if secret is None:
        raise ValueError(f"{curve.secret_key!r} holds no secret key (use the .key_secret file)")
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public
