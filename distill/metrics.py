"""Prometheus endpoints for operators (`teacher.metrics_port`, `student.metrics_port`).

An endpoint is prometheus_client's HTTP server with a registry of its own holding one collector:
at every scrape it calls `read()`, which returns the current values as `Metric` records (read from
counters the process keeps anyway: the Publisher's or Subscriber's stats, the journal, the trainer).
Names follow vLLM's style with a `distill_` prefix: counters end in `_total`, gauges do not.
Nothing is computed between scrapes.

    server = serve(9400, read, "teacher.metrics_port")   # ConfigError (one line) when the port is taken
    ...
    server.close()

This module imports neither vLLM nor Accelerate.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from distill.errors import ConfigError

log = logging.getLogger("distill.metrics")

HOST = "0.0.0.0"  # every interface, as the transport endpoints of the example run files


@dataclass
class Metric:
    """One metric family at scrape time: `value` for an unlabelled one, else `by` (label values ->
    value) with `labels` naming the labels."""

    kind: str  # "counter" | "gauge"
    name: str  # counters end in _total
    doc: str
    value: float | None = None
    labels: tuple[str, ...] = ()
    by: dict[tuple[str, ...], float] = field(default_factory=dict)


def check_port_free(port: int, what: str) -> None:
    """ConfigError (one line) when `port` cannot be bound on every interface: another process
    listens there."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError as e:
            raise ConfigError(_busy(port, what, e)) from None


def _busy(port: int, what: str, e: OSError) -> str:
    return (
        f"{what}: port {port} cannot serve metrics ({e.strerror or e}): another process listens "
        f"there; choose a free port, or 0 to turn the endpoint off"
    )


class _Collector:
    def __init__(self, read: Callable[[], list[Metric]]):
        self.read = read

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for m in self.read():
            cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
            name = m.name[: -len("_total")] if m.kind == "counter" and m.name.endswith("_total") else m.name
            if not m.labels:
                yield cls(name, m.doc, value=float(m.value or 0))
                continue
            fam = cls(name, m.doc, labels=list(m.labels))
            for values, v in m.by.items():
                fam.add_metric(list(values), float(v))
            yield fam


class MetricsServer:
    """A running endpoint; `close()` stops it (the port is free again)."""

    def __init__(self, server, thread, port: int):
        self._server, self._thread, self.port = server, thread, port

    def close(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._server = None


def serve(port: int, read: Callable[[], list[Metric]], what: str) -> MetricsServer:
    """Serve `read()`'s metrics on http://<host>:`port`/metrics (a daemon thread). Raises
    ConfigError naming `what` when the port is taken."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(read))
    try:
        server, thread = start_http_server(port, addr=HOST, registry=registry)
    except OSError as e:
        raise ConfigError(_busy(port, what, e)) from None
    log.info("metrics on http://%s:%d/metrics (%s)", HOST, port, what)
    return MetricsServer(server, thread, port)
