"""A /metrics scrape walks the engine's stats once, though two collectors
read them (each walk is every namespace, on the event loop), and never
reuses a walk of an earlier scrape."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from pegaflow.server.report import OncePerScrape


class Reads:
    def __init__(self, read, name: str) -> None:
        self.read, self.name = read, name

    def describe(self):
        return []

    def collect(self):
        yield GaugeMetricFamily(self.name, "walk number", value=self.read()["walk"])


def test_one_walk_per_scrape_and_a_fresh_one_each_time() -> None:
    walks = []

    def stats() -> dict:
        walks.append(1)
        return {"walk": len(walks)}

    share = OncePerScrape(stats)
    registry = CollectorRegistry()
    registry.register(Reads(share.first, "first"))
    registry.register(Reads(share.again, "again"))
    for scrape in (1, 2):
        text = generate_latest(registry).decode()
        assert f"first {scrape}.0" in text and f"again {scrape}.0" in text
    assert len(walks) == 2
    # A reader on another thread (another scrape) never takes this one's walk.
    share.first()
    other: list[dict] = []
    thread = threading.Thread(target=lambda: other.append(share.again()))
    thread.start()
    thread.join()
    assert other[0]["walk"] == 4 and share.again()["walk"] == 3
