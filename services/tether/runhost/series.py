"""The run host's /metrics: its own series and every hosted run's services' series, each labelled with
its run and service, in one exposition, so that one scrape target (compose's `runs` job, the chart's
PodMonitor) sees every run and a dashboard can filter by `run`.

A run's scheduler, merger and agent workers serve /metrics on loopback ports of the run host's own
(`Stack.metrics`); at each scrape they are read (concurrently, each within a timeout), parsed, given the
labels `run` and `service`, and merged by family with the run host's own, since one exposition may name
a family once (two runs' schedulers both export `tether_run_reward_mean`, every process
`process_resident_memory_bytes`). A service that does not answer is left out of that scrape and counted.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Iterator

import httpx
from prometheus_client import REGISTRY, CollectorRegistry, Counter
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_ERRORS = Counter(
    "tether_runhost_scrape_errors_total",
    "Scrapes of a hosted run's service that did not answer (its series left out of that scrape)",
)


def labelled(text: str, labels: dict[str, str]) -> Iterator[Metric]:
    """The families of one /metrics page, every sample given `labels` (over any of its own of those
    names: the run host knows which run and service the page came from)."""
    for family in text_string_to_metric_families(text):
        out = Metric(family.name, family.documentation, family.type, family.unit)
        for sample in family.samples:
            out.add_sample(
                sample.name, {**sample.labels, **labels}, sample.value, sample.timestamp, sample.exemplar
            )
        yield out


def merged(families: Iterable[Metric]) -> list[Metric]:
    """One family per name, its samples those of every family of that name, in first-seen order (the
    first one's type and help)."""
    by_name: dict[str, Metric] = {}
    for family in families:
        into = by_name.get(family.name)
        if into is None:
            by_name[family.name] = into = Metric(family.name, family.documentation, family.type, family.unit)
        into.samples.extend(family.samples)
    return list(by_name.values())


class HostedSeries:
    """A collector: the run host's own registry, then each hosted service's page, labelled and merged.
    `targets()` says what to scrape now: (run id, service name, /metrics URL) of the live processes."""

    def __init__(
        self,
        targets: Callable[[], list[tuple[str, str, str]]],
        own: CollectorRegistry = REGISTRY,
        timeout_s: float = 2.0,
    ) -> None:
        self.targets = targets
        self.own = own
        self.timeout_s = timeout_s

    def _page(self, url: str) -> str | None:
        try:
            resp = httpx.get(url, timeout=self.timeout_s)
            resp.raise_for_status()
            return resp.text
        except httpx.HTTPError:
            SCRAPE_ERRORS.inc()
            return None

    def collect(self) -> Iterator[Metric]:
        targets = self.targets()
        families: list[Metric] = list(self.own.collect())
        if targets:
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(targets))) as pool:
                pages = list(pool.map(self._page, [url for _, _, url in targets]))
            for (run, service, _), page in zip(targets, pages, strict=True):
                if page is not None:
                    families.extend(labelled(page, {"run": run, "service": service}))
        yield from merged(families)


def registry_of(collector: HostedSeries) -> CollectorRegistry:
    """A registry serving exactly `collector` (the run host's /metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
