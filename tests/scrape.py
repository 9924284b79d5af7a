"""Scraping a Prometheus endpoint the way Prometheus reads it (prometheus_client's own parser)."""

from __future__ import annotations

import threading
import urllib.request


def scrape(port: int) -> dict | None:
    """{sample name: {sorted label items: value}}, plus "__type__": {metric name: type} (counters
    named with their `_total`), of one scrape of http://127.0.0.1:<port>/metrics; None when
    nothing answers."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    values: dict = {"__type__": {}}
    for fam in text_string_to_metric_families(text):
        values["__type__"][fam.name + ("_total" if fam.type == "counter" else "")] = fam.type
        for s in fam.samples:
            if not s.name.endswith("_created"):
                values.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return values


def one(m: dict, name: str, **labels) -> float:
    """The value of `name` with exactly these labels."""
    return m[name][tuple(sorted((k, str(v)) for k, v in labels.items()))]


class Scraper(threading.Thread):
    """Scrapes `port` every `every_s` until `stop()`; `seen` holds every answer, in order."""

    def __init__(self, port: int, every_s: float = 0.3):
        super().__init__(daemon=True)
        self.port, self.every_s = port, every_s
        self.seen: list[dict] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            m = scrape(self.port)
            if m is not None:
                self.seen.append(m)

    def stop(self) -> list[dict]:
        self._halt.set()
        self.join(timeout=10)
        return self.seen
