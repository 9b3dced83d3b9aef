"""The web console's routes under /console: sign-in, the jobs list, a job (curves, logs, checkpoints,
cancel), its transcripts, Tinker sessions and inference jobs, and the operator's pools and queue.

    app.include_router(console_router(settings, store))     (opentinker/control/gateway/app.py)

Pages are server-rendered (Jinja2, autoescape on) with one script, `static/console.js`, that polls
the JSON routes and writes with textContent. Every answer carries a Content-Security-Policy with no
inline script; every POST must come from the console's own origin and carry the session's CSRF
token (403 otherwise). Another tenant's job reads as a job that does not exist (404).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response

from opentinker.control.console import listing, views
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


def console_router(settings: Any, store: TenantStore) -> APIRouter:
    router = APIRouter(prefix="/console", include_in_schema=False)
    sessions = Sessions(settings, store)
    env = _templates()

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

    # --- sign-in ----------------------------------------------------------------------------
    @router.get("")
    @router.get("/")
    def home(request: Request) -> Response:
        return secured(RedirectResponse("/console/jobs" if current(request) else "/console/signin", status_code=303))

    @router.get("/signin")
    def signin_page(request: Request) -> Response:
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
    def static(name: str) -> Response:
        path = STATIC.get(name)
        if path is None:
            return secured(Response("not found", status_code=404, media_type="text/plain"))
        response = FileResponse(path, media_type=TYPES.get(path.suffix, "application/octet-stream"))
        secured(response).headers["Cache-Control"] = "max-age=300"
        return response

    # --- jobs -------------------------------------------------------------------------------
    @router.get("/jobs")
    async def jobs_list(request: Request, state: str = "", kind: str = "", q: str = "", page: int = 0) -> Response:
        session = current(request)
        if session is None:
            return signin_redirect()
        data = await listing.jobs_page(settings, session.tenant, state or None, kind or None, q or None, page)
        return render("jobs.html", session, data=data, states=listing.STATES, kinds=list(listing.KINDS), state=state, kind=kind, q=q,
                      page_no=data["page"])

    @router.get("/api/jobs")
    async def jobs_json(request: Request, state: str = "", kind: str = "", q: str = "", page: int = 0) -> Response:
        session = current(request)
        if session is None:
            return secured(JSONResponse({"detail": "sign in"}, status_code=401))
        data = await listing.jobs_page(settings, session.tenant, state or None, kind or None, q or None, page)
        return secured(JSONResponse(data))

    @router.get("/jobs/{job_id}")
    def job_page(request: Request, job_id: str) -> Response:
        session = current(request)
        if session is None:
            return signin_redirect()
        if not _valid_id(job_id):
            return not_found(session, job_id[:100])
        jobs = jobs_of(session)
        try:
            status = views.job_summary(jobs, job_id)
            ckpts = views.checkpoints(jobs, job_id)
            files = views.transcript_files(jobs, job_id)
        except JobNotFound:
            return not_found(session, job_id)
        return render("job.html", session, job=status, spec=views.spec_text(settings, session.tenant, job_id), checkpoints=ckpts,
                    transcripts=files)

    @router.get("/api/jobs/{job_id}")
    def job_json(request: Request, job_id: str) -> Response:
        session = current(request)
        if session is None:
            return secured(JSONResponse({"detail": "sign in"}, status_code=401))
        jobs = jobs_of(session)
        try:
            if not _valid_id(job_id):
                raise JobNotFound(job_id)
            status = views.job_summary(jobs, job_id)
            data = views.job_curves(jobs, job_id, status)
        except JobNotFound:
            return secured(JSONResponse({"detail": "no such job"}, status_code=404))
        keep = ("job_id", "tenant", "state", "reason", "step", "total_steps", "reward", "accuracy", "started", "ended", "failure")
        return secured(JSONResponse({"job": {k: status.get(k) for k in keep}, **data}))

    @router.get("/api/jobs/{job_id}/logs")
    def job_logs(request: Request, job_id: str, offset: int = 0) -> Response:
        session = current(request)
        if session is None:
            return secured(JSONResponse({"detail": "sign in"}, status_code=401))
        try:
            if not _valid_id(job_id):
                raise JobNotFound(job_id)
            return secured(JSONResponse(jobs_of(session).logs(job_id, max(0, min(offset, 10**9)), 200)))
        except JobNotFound:
            return secured(JSONResponse({"detail": "no such job"}, status_code=404))

    @router.post("/jobs/{job_id}/cancel")
    async def cancel(request: Request, job_id: str) -> Response:
        session = current(request)
        if session is None:
            return secured(JSONResponse({"detail": "sign in"}, status_code=401))
        fields = await form(request)
        try:
            same_origin(request)
            if not sessions.csrf_ok(session, fields.get("csrf") or request.headers.get("x-csrf-token")):
                raise Refused(403, "missing or wrong CSRF token")
            if not _valid_id(job_id):
                raise JobNotFound(job_id)
            await asyncio.to_thread(jobs_of(session).cancel, job_id)
        except Refused as err:
            return render("error.html", session, status=err.status, message=str(err))
        except JobNotFound:
            return not_found(session, job_id[:256])
        except JobConflict as err:
            return render("error.html", session, status=409, message=str(err))
        return secured(RedirectResponse(f"/console/jobs/{quote(job_id, safe='')}", status_code=303))

    @router.get("/jobs/{job_id}/transcripts")
    def transcripts(request: Request, job_id: str, file: str = "") -> Response:
        session = current(request)
        if session is None:
            return signin_redirect()
        jobs = jobs_of(session)
        try:
            if not _valid_id(job_id):
                raise JobNotFound(job_id)
            if not jobs.owns(job_id):
                raise JobNotFound(job_id)
            files = views.transcript_files(jobs, job_id)
            chosen = file if file in files else (files[0] if files else None)
            episodes = views.transcripts(jobs, job_id, chosen) if chosen else []
        except JobNotFound:
            return not_found(session, job_id[:256])
        except ValueError as err:
            return render("error.html", session, status=413, message=str(err))
        return render("transcripts.html", session, job_id=job_id, files=files, chosen=chosen, episodes=episodes)

    # --- Tinker sessions, inference jobs, the operator's view --------------------------------
    @router.get("/tinker")
    async def tinker(request: Request) -> Response:
        session = current(request)
        if session is None:
            return signin_redirect()
        sessions_page = await listing.jobs_page(settings, session.tenant, kind="tinker")
        served = await listing.jobs_page(settings, session.tenant, kind="inference")
        jobs = jobs_of(session)

        def urls() -> list[dict[str, Any]]:
            out = []
            for r in served["jobs"]:
                try:
                    out.append({**r, **{k: v for k, v in views.job_summary(jobs, r["job_id"]).items()
                                        if k in ("openai_base_url", "model", "model_path", "reason")}})
                except JobNotFound:
                    continue
            return out

        inference = await asyncio.to_thread(urls)
        runs = await asyncio.to_thread(views.tinker_overview, jobs) if session.tenant else {"training_runs": []}
        return render("tinker.html", session, sessions_rows=sessions_page["jobs"], inference=inference, **runs)

    @router.get("/operator")
    def operator(request: Request) -> Response:
        session = current(request)
        if session is None:
            return signin_redirect()
        if not session.operator:
            return render("notfound.html", session, status=404, what="page")
        return render("operator.html", session, **views.operator_overview(settings))

    return router
