"""Scrape an agent's metrics endpoint with a real HTTP client and read the samples back."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    """One scrape: ``value(name, **labels)`` is a sample's value (0.0 if absent), ``families`` their types."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.families: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            self.families[family.name] = family.type
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def value(self, name: str, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def total(self, name: str, **labels: str) -> float:
        """Sum over every sample of ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)

    def labels(self, name: str, label: str) -> set[str]:
        return {dict(ls)[label] for (n, ls), _ in self.samples.items() if n == name and label in dict(ls)}


def scrape(address: tuple[str, int], client: httpx.Client | None = None, timeout: float = 10.0) -> Scrape:
    """GET /metrics at ``address``; raises for an HTTP error or a body that is not the text format."""
    url = f"http://{address[0]}:{address[1]}/metrics"
    response = (client or httpx).get(url, timeout=timeout)
    response.raise_for_status()
    assert response.headers["content-type"].startswith("text/plain"), response.headers["content-type"]
    return Scrape(response.text)


def scrape_until(address: tuple[str, int], ready, timeout: float = 10.0,
                 client: httpx.Client | None = None) -> Scrape:
    """Scrape every 20 ms until ``ready(scrape)`` holds; return the last scrape either way.

    A handle's waiter wakes a moment before its done-callbacks (the metrics among them) run."""
    deadline = time.monotonic() + timeout
    while True:
        got = scrape(address, client)
        if ready(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)
