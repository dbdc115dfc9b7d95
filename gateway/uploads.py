"""The upload API: ``/v1/transcriptions`` (upload, job status, result, list, cancel)."""

from __future__ import annotations

from aiohttp import web


async def _not_ready(request: web.Request) -> web.Response:
    return web.json_response(
        {"error": {"code": "not_implemented", "message": "upload API is being built"}},
        status=501,
    )


def setup_uploads(app: web.Application) -> None:
    """Register the ``/v1/transcriptions`` routes on ``app``."""
    app.router.add_post("/v1/transcriptions", _not_ready)
    app.router.add_get("/v1/transcriptions", _not_ready)
    app.router.add_get("/v1/transcriptions/{job_id}", _not_ready)
    app.router.add_delete("/v1/transcriptions/{job_id}", _not_ready)
