"""OpenAI-compatible ``POST /v1/audio/transcriptions``."""

from __future__ import annotations

from aiohttp import web


async def _not_ready(request: web.Request) -> web.Response:
    return web.json_response(
        {"error": {"message": "not implemented yet", "type": "server_error",
                   "param": None, "code": "not_implemented"}},
        status=501,
    )


def setup_openai(app: web.Application) -> None:
    """Register ``POST /v1/audio/transcriptions`` on ``app``."""
    app.router.add_post("/v1/audio/transcriptions", _not_ready)
