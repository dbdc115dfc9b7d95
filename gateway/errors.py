"""JSON errors for every HTTP route: ``{"error": {"code": ..., "message": ...}}``.

Handlers raise ``json_error(...)`` (or any ``web.HTTPException``); the
``error_middleware`` turns whatever escapes a handler into that JSON shape with
the right status. Redis being unreachable becomes ``503`` with ``Retry-After``;
the redis client reconnects on its own, so the next request after Redis is
back succeeds without any restart.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lanegate.logs import get_logger

log = get_logger("gateway.errors")

#: seconds a client should wait after a 503 caused by Redis being down
REDIS_RETRY_AFTER_S = 1

#: default ``code`` for a status when the raiser did not give one
STATUS_CODES: dict[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
    422: "unprocessable",
    429: "too_many_requests",
    500: "internal",
    501: "not_implemented",
    503: "unavailable",
    504: "timeout",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_body(code: str, message: str) -> dict[str, dict[str, str]]:
    return {"error": {"code": code, "message": message}}


def json_error(
    status: int, code: str, message: str, *, headers: Mapping[str, str] | None = None
) -> web.HTTPException:
    """An HTTP exception with the JSON error body; ``raise json_error(404, ...)``."""
    exc = web.HTTPException(
        text=json.dumps(error_body(code, message)),
        content_type="application/json",
        headers=headers,
    )
    exc.set_status(status)
    return exc


def _is_json(exc: web.HTTPException) -> bool:
    return exc.content_type == "application/json"


def _as_json(exc: web.HTTPException) -> web.HTTPException:
    """Re-shape a plain aiohttp HTTP error (e.g. 404 from the router) as JSON."""
    if exc.status < 400 or _is_json(exc):
        return exc
    code = STATUS_CODES.get(exc.status, "bad_request" if exc.status < 500 else "internal")
    message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else exc.reason
    headers = {k: v for k, v in exc.headers.items()
               if k.lower() not in {"content-type", "content-length"}}
    return json_error(exc.status, code, message or exc.reason, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as JSON; Redis down is ``503`` + ``Retry-After``."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        raise _as_json(exc) from None
    except (RedisConnectionError, RedisTimeoutError) as exc:
        log.warning("redis_unavailable", path=request.path, error=str(exc))
        raise json_error(
            503, "unavailable", "the job store (Redis) is unreachable; retry shortly",
            headers={"Retry-After": str(REDIS_RETRY_AFTER_S)},
        ) from None
    except Exception:
        log.exception("internal_error", path=request.path, method=request.method)
        raise json_error(500, "internal", "internal server error") from None
