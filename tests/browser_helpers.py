"""`tether ui` in a real browser: headless Chromium from Debian's packages (/usr/bin/chromium; `scripts/
setup.sh --test-all` installs it), driven by playwright's Python package, which launches that binary and
downloads no browser of its own.

`ui_server` runs `tether ui` where a stack ran, as a user does; `Browser` opens its pages, records each
page's HTTP status, console errors and uncaught page errors, writes a full-page screenshot of each, and
blocks (and records) every request that leaves this machine: the pages must work with no network."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from stack_helpers import TETHER

from tether.common.net import free_port

CHROMIUM = Path("/usr/bin/chromium")
LOCAL = {"127.0.0.1", "localhost"}
# The viewport of the screenshots (docs/images/ui-*.png): wide enough for the calls table.
VIEWPORT = {"width": 1280, "height": 800}


def chromium() -> Path:
    """Debian's Chromium. Absent: a skip, except under `make test-all` (TETHER_TEST_TIER=all), whose
    setup installs it, so that there its absence fails."""
    if CHROMIUM.exists():
        return CHROMIUM
    why = f"{CHROMIUM} absent (Debian's chromium: scripts/setup.sh --test-all installs it)"
    if os.environ.get("TETHER_TEST_TIER") == "all":
        pytest.fail(why)
    pytest.skip(why)


@contextmanager
def ui_server(cwd: Path, token: str) -> Iterator[str]:
    """`tether ui` run in `cwd` (where the stack ran: it reads .tether/stack.json, and opens the run's
    Redis data when the stack has stopped) behind the admin `token`; its base URL once /healthz answers."""
    port = free_port()
    # Not a Redis, namespace or model of the caller's environment (the defaults of its flags): the stack's.
    mine = ("TETHER_REDIS_URL", "TETHER_NAMESPACE", "TETHER_MODEL_DIR")
    env = {**{k: v for k, v in os.environ.items() if k not in mine}, "TETHER_ADMIN_TOKEN": token}
    proc = subprocess.Popen([*TETHER, "ui", "--port", str(port)], cwd=cwd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, f"tether ui exited with {proc.returncode}"
            assert time.monotonic() < deadline, "tether ui did not answer /healthz within 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@dataclass
class Visit:
    path: str
    status: int | None
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)


class Browser:
    """One headless Chromium page on `base`. Every request to another host than this machine is
    aborted and kept in `left_the_machine`; each `visit` records what the page answered and said."""

    def __init__(self, page, base: str, shots: list[Path]) -> None:  # page: playwright's Page
        self.page, self.base, self.shots = page, base, shots
        self.visits: list[Visit] = []
        self.left_the_machine: list[str] = []
        page.route("**/*", self._route)
        page.on(
            "console",
            lambda msg: self._current().console_errors.append(msg.text) if msg.type == "error" else None,
        )
        page.on("pageerror", lambda err: self._current().page_errors.append(str(err)))

    def _route(self, route) -> None:
        if urlsplit(route.request.url).hostname in LOCAL:
            route.continue_()
        else:
            self.left_the_machine.append(route.request.url)
            route.abort()

    def _current(self) -> Visit:
        return self.visits[-1] if self.visits else Visit("(before any page)", None)

    def visit(self, path: str) -> Visit:
        """Open `path` and wait until the network is idle."""
        visit = Visit(path, None)
        self.visits.append(visit)
        response = self.page.goto(self.base + path, wait_until="networkidle")
        visit.status = response.status if response is not None else None
        return visit

    def screenshot(self, name: str) -> None:
        """A full-page screenshot of the page open, as `name` in every directory of `shots`."""
        first = self.shots[0] / name
        self.page.screenshot(path=str(first), full_page=True)
        for folder in self.shots[1:]:
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(first, folder / name)


@contextmanager
def browser(executable: Path, base: str, shots: list[Path]) -> Iterator[Browser]:
    """A headless `executable` (chromium()) on `base` (Browser)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(executable))
        try:
            yield Browser(b.new_page(viewport=VIEWPORT), base, shots)
        finally:
            b.close()


def screenshot_dirs(tmp_path: Path) -> list[Path]:
    """Where the screenshots go: the test's tmp dir, and TETHER_UI_SCREENSHOTS when set."""
    extra = os.environ.get("TETHER_UI_SCREENSHOTS")
    return [tmp_path, *([Path(extra)] if extra else [])]


# Each sample section of a rollout page, in page order: its tokens' data-token-id and data-loss-mask
# attributes, as written (strings: "1.0" or " 1" is not "1").
SAMPLE_TOKENS_JS = """
sections => sections.map(s => {
  const toks = [...s.querySelectorAll("pre.tokens [data-token-id]")];
  return {token_ids: toks.map(t => t.getAttribute("data-token-id")),
          loss_mask: toks.map(t => t.getAttribute("data-loss-mask"))};
})
"""

# The rollouts table of a step page: rollout id, reward, training outcome and samples per row.
ROLLOUT_ROWS_JS = """
rows => rows.map(r => {
  const cells = [...r.querySelectorAll("td")].map(c => c.textContent.trim());
  return {rollout: cells[0], reward: Number(cells[2]), training: cells[4], samples: Number(cells[6] || 0)};
})
"""
