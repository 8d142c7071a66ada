"""The Starlette app of `tether ui`: thin routes that read through the store and render a page
(tether.cli.web.pages), the static files shipped in the package, and the admin token.

With an admin token (TETHER_ADMIN_TOKEN, as the gateway's admin routes) every page needs it, as the
gateway takes it ("Authorization: Bearer <token>", compared in constant time), or, for a browser, once
as `?token=<token>`, which sets a cookie scoped to the app for the pages that follow. `/healthz` alone
answers without it: the probes of compose and the chart call it, and it shows nothing of the run."""

from __future__ import annotations

import hmac
from importlib import resources

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import Route

from tether.cli.web import pages
from tether.cli.web.store import UiStore, groups_of_step

COOKIE = "tether_ui_token"
STATIC = {"ui.css": "text/css", "ui.js": "text/javascript"}
HEALTH = "/healthz"
NO_REDIS = "the run's Redis is not available: only the run directory's metrics.jsonl is shown"


def _matches(given: str | None, token: str) -> bool:
    return bool(given) and hmac.compare_digest(str(given).encode(), token.encode())


class AdminToken(BaseHTTPMiddleware):
    """Every request needs the admin token (Bearer, the cookie, or `?token=`, which sets the cookie)."""

    def __init__(self, app: object, token: str) -> None:
        super().__init__(app)  # type: ignore[arg-type]
        self.token = token

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        if request.url.path == HEALTH:
            return await call_next(request)
        auth = request.headers.get("authorization", "")
        bearer = auth[7:] if auth.lower().startswith("bearer ") else None
        query = request.query_params.get("token")
        if _matches(bearer, self.token) or _matches(request.cookies.get(COOKIE), self.token):
            return await call_next(request)
        if _matches(query, self.token):
            response = await call_next(request)
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
            return response
        return PlainTextResponse(
            "admin token required (Authorization: Bearer, or ?token=)",
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )


def build_app(store: UiStore, source: str, admin_token: str | None = None) -> Starlette:
    """The app over `store`; `source` says on the runs page where the run was read from."""
    note = "" if store.has_redis else NO_REDIS

    async def runs(request: Request) -> Response:
        return HTMLResponse(pages.runs_page(source, await store.metrics(), note))

    async def step(request: Request) -> Response:
        n = request.path_params["n"]
        metrics = await store.metrics()
        record = next((m for m in metrics if m.get("step") == n), None)
        if record is None:
            return HTMLResponse(pages.not_found(f"no step {n} in this run"), status_code=404)
        groups = groups_of_step(metrics, await store.group_results(), n)
        ids = {g["group_id"] for g in groups}
        events = await store.rollout_events(lambda ev: ev.get("group_id") in ids)
        samples = [s for s in await store.samples() if s.get("group_id") in ids]
        outcomes = await store.outcomes(list(dict.fromkeys(ev["rollout_id"] for ev in events)))
        return HTMLResponse(pages.step_page(record, groups, events, outcomes, samples, note))

    async def rollout(request: Request) -> Response:
        rid = request.path_params["rollout_id"]
        traces = await store.traces(rid)
        samples = await store.samples(rollout=rid)
        outcome = (await store.outcomes([rid])).get(rid)
        if not traces and not samples and outcome is None:
            return HTMLResponse(pages.not_found(f"no rollout {rid} recorded in this run"), status_code=404)
        mismatches = await store.mismatches([t["call_id"] for t in traces if "call_id" in t])
        return HTMLResponse(pages.rollout_page(rid, traces, samples, outcome, store.decode, mismatches))

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return PlainTextResponse("not found", status_code=404)
        text = resources.files("tether.cli.web").joinpath("static", name).read_text()
        return Response(text, media_type=STATIC[name])

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    middleware = [Middleware(AdminToken, token=admin_token)] if admin_token else []
    return Starlette(
        routes=[
            Route("/", runs),
            Route("/step/{n:int}", step),
            Route("/rollout/{rollout_id}", rollout),
            Route("/static/{name}", static),
            Route(HEALTH, healthz),
        ],
        middleware=middleware,
    )
