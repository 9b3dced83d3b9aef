"""The web console's routes under /console: sign-in, the jobs list, a job (curves, logs, checkpoints,
cancel), its transcripts, Tinker sessions and inference jobs, and the operator's pools and queue.

    app.include_router(console_router(settings, store))     (opentinker/control/gateway/app.py)

Pages are server-rendered (Jinja2, autoescape on) with one script, `static/console.js`, that polls
the JSON routes and writes with textContent. Every answer carries a Content-Security-Policy with no
inline script; every POST must come from the console's own origin and carry the session's CSRF
token (403 otherwise). Another tenant's job reads as a job that does not exist (404).

Every page and JSON read of a session is bounded (bounds.py: a few at once per session, a few for
all sessions together, on the console's own threads; past that it waits briefly in line, then 429
with Retry-After) and answers are kept a second or two per tenant (recent.py), so that many tabs
polling at once cannot slow the tenant API or `/v1/health`, which never wait on the console.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from opentinker.control.console import listing, views
from opentinker.control.console.bounds import Busy, ReadBounds
from opentinker.control.console.recent import CACHE_S, LIVE_S, Recent, job_keep, logs_keep
from opentinker.control.console.session import COOKIE, LIFETIME_S, Session, Sessions
from opentinker.control.gateway.jobs import JobConflict, JobNotFound
from opentinker.control.gateway.tenants import TenantStore
from opentinker.core.spec_limits import control_problem

HERE = Path(__file__).resolve().parent
STATIC = {p.name: p for p in [*(HERE / "static").glob("*.*"), *(HERE / "static" / "uplot").glob("*.*")]}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
       "form-action 'self'; base-uri 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
           "X-Frame-Options": "DENY", "Cache-Control": "no-store"}
TYPES = {".js": "text/javascript", ".css": "text/css", ".txt": "text/plain"}


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _templates():
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True, default_for_string=True))
    env.filters["pct"] = lambda v: "-" if v is None else f"{100 * float(v):.1f}%"
    env.filters["num"] = lambda v: "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))
    env.filters["url"] = lambda v: quote(str(v), safe="")
    return env


def _valid_id(job_id: str) -> bool:
    return 0 < len(job_id) <= 256 and not control_problem(job_id)


def console_router(settings: Any, store: TenantStore, bounds: ReadBounds | None = None) -> APIRouter:
    router = APIRouter(prefix="/console", include_in_schema=False)
    sessions = Sessions(settings, store)
    env = _templates()
    bounds = bounds or ReadBounds()
    recent = Recent()
    static_files = {name: path.read_bytes() for name, path in STATIC.items()}

    def secured(response: Response) -> Response:
        response.headers.update(HEADERS)
        return response

    def render(name: str, session: Session | None, status: int = 200, **context: Any) -> Response:
        html = env.get_template(name).render(session=session, csrf=sessions.csrf(session) if session else "",
                                             public_url=settings.public_gateway_url, **context)
        return secured(HTMLResponse(html, status_code=status))

    def current(request: Request) -> Session | None:
        return sessions.read(request.cookies.get(COOKIE))

    def same_origin(request: Request) -> None:
        origin = request.headers.get("origin")
        if origin and origin != "null" and origin.rstrip("/") != f"{request.url.scheme}://{request.headers.get('host', '')}":
            raise Refused(403, "cross-origin request refused")
        if origin == "null":
            raise Refused(403, "cross-origin request refused")

    async def form(request: Request) -> dict[str, str]:
        body = (await request.body())[:16384].decode("utf-8", "replace")
        return {k: v[0] for k, v in parse_qs(body).items()}

    def jobs_of(session: Session):
        return views.view(settings, session.tenant)

    def not_found(session: Session | None, job_id: str) -> Response:
        return render("notfound.html", session, status=404, what=f"job {job_id}")

    def signin_redirect() -> Response:
        return secured(RedirectResponse("/console/signin", status_code=303))

    def sign_in_json() -> Response:
        return secured(JSONResponse({"detail": "sign in"}, status_code=401))

    def busy(err: Busy, session: Session | None = None, html: bool = False) -> Response:
        message = f"the console is busy: {err}; retry in {err.retry_after_s} s"
        response = (render("error.html", session, status=429, message=message) if html else
                    secured(JSONResponse({"detail": message}, status_code=429)))
        response.headers["Retry-After"] = str(err.retry_after_s)
        return response

    async def rendered(name: str, session: Session, **context: Any) -> Response:
        """A page rendered in the console's line of renders."""
        async with bounds.rendering():
            return render(name, session, **context)

    async def answered(data: Any) -> Response:
        async with bounds.rendering():
            return secured(JSONResponse(data))

    async def kept(session: Session, key: tuple, ttl_s: Any, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the console's threads, or its answer for this tenant from `ttl_s` ago."""
        return await recent.get(session.tenant, key, ttl_s, lambda: bounds.run(fn, *args))

    # --- sign-in ----------------------------------------------------------------------------
    @router.get("")
    @router.get("/")
    async def home(request: Request) -> Response:
        return secured(RedirectResponse("/console/jobs" if current(request) else "/console/signin", status_code=303))

    @router.get("/signin")
    async def signin_page(request: Request) -> Response:
        return render("signin.html", None, error=None)

    @router.post("/signin")
    async def signin(request: Request) -> Response:
        try:
            same_origin(request)
        except Refused as err:
            return render("signin.html", None, status=err.status, error=str(err))
        found = await asyncio.to_thread(sessions.sign_in, (await form(request)).get("key", ""))
        if found is None:
            return render("signin.html", None, status=401, error="unknown key")
        response = secured(RedirectResponse("/console/jobs", status_code=303))
        response.set_cookie(COOKIE, found[1], max_age=LIFETIME_S, path="/console", httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
        return response

    @router.post("/signout")
    async def signout(request: Request) -> Response:
        session = current(request)
        if session is None:
            return signin_redirect()
        fields = await form(request)
        try:
            same_origin(request)
            if not sessions.csrf_ok(session, fields.get("csrf") or request.headers.get("x-csrf-token")):
                raise Refused(403, "missing or wrong CSRF token")
        except Refused as err:
            return render("error.html", session, status=err.status, message=str(err))
        sessions.end(session)
        response = signin_redirect()
        response.delete_cookie(COOKIE, path="/console", httponly=True, samesite="strict")
        return response

    # --- static files (the script, the style, uPlot): fixed names only -------------------------
    @router.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in static_files:
            return secured(Response("not found", status_code=404, media_type="text/plain"))
        response = Response(static_files[name], media_type=TYPES.get(STATIC[name].suffix, "application/octet-stream"))
        secured(response).headers["Cache-Control"] = "max-age=300"
        return response

    # --- jobs -------------------------------------------------------------------------------
    async def jobs_data(session: Session, *query: Any) -> dict[str, Any]:
        query = listing.query(*query)
        return await recent.get(session.tenant, ("jobs", *query), CACHE_S,
                                lambda: bounds.run(listing.read_jobs_page, settings, session.tenant, *query))

    @router.get("/jobs")
    async def jobs_list(request: Request, state: str = "", kind: str = "", q: str = "", page: int = 0) -> Response:
        session = current(request)
        if session is None:
            return signin_redirect()
        try:
            async with bounds.request(session.nonce):
                data = await jobs_data(session, state, kind, q, page)
                return await rendered("jobs.html", session, data=data, states=listing.STATES, kinds=list(listing.KINDS),
                                      state=state, kind=kind, q=q, page_no=data["page"])
        except Busy as err:
            return busy(err, session, html=True)

    @router.get("/api/jobs")
    async def jobs_json(request: Request, state: str = "", kind: str = "", q: str = "", page: int = 0) -> Response:
        session = current(request)
        if session is None:
            return sign_in_json()
        try:
            async with bounds.request(session.nonce):
                return await answered(await jobs_data(session, state, kind, q, page))
        except Busy as err:
            return busy(err)

    @router.get("/jobs/{job_id}")
    async def job_page(request: Request, job_id: str) -> Response:
        session = current(request)
        if session is None:
            return signin_redirect()
        if not _valid_id(job_id):
            return not_found(session, job_id[:100])
        try:
            async with bounds.request(session.nonce):
                data = await kept(session, ("page", job_id), job_keep(CACHE_S), views.job_page, settings, jobs_of(session), job_id)
                return await rendered("job.html", session, job=data["job"], spec=data["spec"], checkpoints=data["checkpoints"],
                                      transcripts=data["transcripts"])
        except Busy as err:
            return busy(err, session, html=True)
        except JobNotFound:
            return not_found(session, job_id)

    @router.get("/api/jobs/{job_id}")
    async def job_json(request: Request, job_id: str) -> Response:
        session = current(request)
        if session is None:
            return sign_in_json()
        try:
            if not _valid_id(job_id):
                raise JobNotFound(job_id)
            async with bounds.request(session.nonce):
                return await answered(await kept(session, ("poll", job_id), job_keep(LIVE_S), views.job_poll, jobs_of(session), job_id))
        except Busy as err:
            return busy(err)
        except JobNotFound:
            return secured(JSONResponse({"detail": "no such job"}, status_code=404))

    @router.get("/api/jobs/{job_id}/logs")
    async def job_logs(request: Request, job_id: str, offset: int = 0) -> Response:
        session = current(request)
        if session is None:
            return sign_in_json()
        offset = max(0, min(offset, 10**9))
        try:
            if not _valid_id(job_id):
                raise JobNotFound(job_id)
            async with bounds.request(session.nonce):
                return await answered(await kept(session, ("logs", job_id, offset), logs_keep, jobs_of(session).logs, job_id, offset, 200))
        except Busy as err:
            return busy(err)
        except JobNotFound:
            return secured(JSONResponse({"detail": "no such job"}, status_code=404))

    @router.post("/jobs/{job_id}/cancel")
    async def cancel(request: Request, job_id: str) -> Response:
        session = current(request)
        if session is None:
            return sign_in_json()
        fields = await form(request)
        try:
            same_origin(request)
            if not sessions.csrf_ok(session, fields.get("csrf") or request.headers.get("x-csrf-token")):
                raise Refused(403, "missing or wrong CSRF token")
            if not _valid_id(job_id):
                raise JobNotFound(job_id)
            async with bounds.request(session.nonce):
                await bounds.run(jobs_of(session).cancel, job_id)
            recent.forget(session.tenant)  # the job's page shows its new state at once
        except Refused as err:
            return render("error.html", session, status=err.status, message=str(err))
        except Busy as err:
            return busy(err, session, html=True)
        except JobNotFound:
            return not_found(session, job_id[:256])
        except JobConflict as err:
            return render("error.html", session, status=409, message=str(err))
        return secured(RedirectResponse(f"/console/jobs/{quote(job_id, safe='')}", status_code=303))

    @router.get("/jobs/{job_id}/transcripts")
    async def transcripts(request: Request, job_id: str, file: str = "") -> Response:
        session = current(request)
        if session is None:
            return signin_redirect()
        jobs = jobs_of(session)

        def read() -> tuple[list[str], str | None, list[dict[str, Any]]]:
            if not jobs.owns(job_id):
                raise JobNotFound(job_id)
            files = views.transcript_files(jobs, job_id)
            chosen = file if file in files else (files[0] if files else None)
            return files, chosen, views.transcripts(jobs, job_id, chosen) if chosen else []

        try:
            if not _valid_id(job_id):
                raise JobNotFound(job_id)
            async with bounds.request(session.nonce):
                files, chosen, episodes = await bounds.run(read)  # a file of up to 8 MiB: not kept
                return await rendered("transcripts.html", session, job_id=job_id, files=files, chosen=chosen, episodes=episodes)
        except Busy as err:
            return busy(err, session, html=True)
        except JobNotFound:
            return not_found(session, job_id[:256])
        except ValueError as err:
            return render("error.html", session, status=413, message=str(err))

    # --- Tinker sessions, inference jobs, the operator's view --------------------------------
    @router.get("/tinker")
    async def tinker(request: Request) -> Response:
        session = current(request)
        if session is None:
            return signin_redirect()
        jobs = jobs_of(session)

        def served_urls(served: dict[str, Any]) -> list[dict[str, Any]]:
            out = []
            for r in served["jobs"]:
                try:
                    out.append({**r, **{k: v for k, v in views.job_summary(jobs, r["job_id"]).items()
                                        if k in ("openai_base_url", "model", "model_path", "reason")}})
                except JobNotFound:
                    continue
            return out

        async def read() -> dict[str, Any]:
            sessions_page = await jobs_data(session, None, "tinker")
            inference = await bounds.run(served_urls, await jobs_data(session, None, "inference"))
            runs = await bounds.run(views.tinker_overview, jobs) if session.tenant else {"training_runs": []}
            return {"sessions_rows": sessions_page["jobs"], "inference": inference, **runs}

        try:
            async with bounds.request(session.nonce):
                return await rendered("tinker.html", session, **await recent.get(session.tenant, ("tinker",), CACHE_S, read))
        except Busy as err:
            return busy(err, session, html=True)

    @router.get("/operator")
    async def operator(request: Request) -> Response:
        session = current(request)
        if session is None:
            return signin_redirect()
        if not session.operator:
            return render("notfound.html", session, status=404, what="page")
        try:
            async with bounds.request(session.nonce):
                return await rendered("operator.html", session, **await kept(session, ("operator",), CACHE_S, views.operator_overview, settings))
        except Busy as err:
            return busy(err, session, html=True)

    return router
