"""Prometheus scrapes of a real stack's processes, taken while it runs, and the check that what the
dashboards and alert rules query is there. A stack that `tether demo` or `tether up` started lists each
process's /metrics URL in `.tether/stack.json` (`metrics`, process name -> URL); `scraping(work)` reads
every one of them every few seconds in a thread while the body (a demo, say) runs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
from fault_helpers import stack_json
from prometheus_client.parser import text_string_to_metric_families


def series_names(text: str) -> set[str]:
    """The names of the series a Prometheus exposition holds, as PromQL selects them (a counter's
    `_total`, a histogram's `_bucket`, `_sum`, `_count`). A labelled metric none of whose label sets
    is used yet shows its HELP and TYPE lines but no series: no name."""
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def unexported(used: set[str], scraped: dict[str, set[str]]) -> set[str]:
    """The names of `used` of which no process's scrapes (process -> series names) held a series."""
    return used - set().union(*scraped.values())


@contextlib.contextmanager
def scraping(work: Path, every_s: float = 3.0) -> Iterator[dict[str, set[str]]]:
    """While the body runs, every `every_s` seconds, each /metrics that the stack started from `work`
    lists (read afresh each round: processes come up, restart, go). Yields process name -> every
    series name its scrapes held so far, complete once the body is done; a process that did not
    answer a round is tried again the next."""
    seen: dict[str, set[str]] = {}
    stop = threading.Event()

    def rounds() -> None:
        with httpx.Client(timeout=5) as client:
            while not stop.is_set():
                for name, url in ((stack_json(work) or {}).get("metrics") or {}).items():
                    try:
                        resp = client.get(url)
                    except httpx.HTTPError:
                        continue
                    if resp.status_code == 200:
                        seen.setdefault(name, set()).update(series_names(resp.text))
                stop.wait(every_s)

    thread = threading.Thread(target=rounds, name="scraping", daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(30)
