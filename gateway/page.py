"""``GET /``: the browser page, and ``GET /static/{name}``: its script, worklet and style.

Plain files in ``gateway/static`` (package data), no build step. The page talks to
the public API only: ``/v1/stream`` for the microphone, ``/v1/transcriptions`` for
files. Files are read once per process; only the names in ``STATIC_FILES`` are
served, so a path never reaches the file system.
"""

from __future__ import annotations

import functools
from importlib import resources

from aiohttp import web

from gateway.errors import json_error

#: the served files and their content types
STATIC_FILES = {
    "page.js": "text/javascript",
    "pcm-worklet.js": "text/javascript",
    "page.css": "text/css",
}
INDEX = "index.html"
#: the page may change between releases; a browser checks again after this long
CACHE_CONTROL = "max-age=300"


@functools.cache
def read_static(name: str) -> bytes:
    return resources.files("gateway").joinpath("static", name).read_bytes()


async def index(request: web.Request) -> web.Response:
    return web.Response(body=read_static(INDEX), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": CACHE_CONTROL})


async def static_file(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    content_type = STATIC_FILES.get(name)
    if content_type is None:
        raise json_error(404, "not_found", f"no static file {name!r}")
    return web.Response(body=read_static(name), content_type=content_type, charset="utf-8",
                        headers={"Cache-Control": CACHE_CONTROL})


def setup_page(app: web.Application) -> None:
    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", static_file)
