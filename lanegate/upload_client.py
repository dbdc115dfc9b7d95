"""``lanegate transcribe FILE [--format srt] [--async] [-o OUT]``: the upload client.

Uploads the file (streamed from disk) to ``POST /v1/transcriptions``. A short
file comes back at once (200); a long one, or one sent with ``--async``, is a
job (202): the client polls it, drawing a progress bar on stderr fed by the
job's ``progress``, then fetches the result in the chosen format. The result
goes to stdout, or to ``--output``. Exit status: 0 on success, 1 when the
server refuses the file or the job fails, 2 for a file that cannot be read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mimetypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from lanegate.gateway_url import BadURL, normalize_base_url

#: seconds between two polls of a queued or running job
POLL_S = 0.5
#: characters of the progress bar
BAR_WIDTH = 30
#: statuses after which a job no longer changes
TERMINAL = frozenset({"completed", "failed", "cancelled"})
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class ClientError(Exception):
    """Something the user must be told; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Request:
    file: Path
    url: str
    api_key: str | None
    fmt: str
    async_: bool
    output: Path | None


def main(args: argparse.Namespace) -> int:
    try:
        url = normalize_base_url(str(args.url))
    except BadURL as exc:
        print(f"lanegate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    request = Request(
        file=Path(args.file), url=url,
        api_key=args.api_key or os.environ.get("LANEGATE_API_KEY") or None,
        fmt=str(args.format), async_=bool(args.async_),
        output=Path(args.output) if args.output else None,
    )
    try:
        asyncio.run(run(request))
    except ClientError as exc:
        print(f"lanegate: {exc}", file=sys.stderr)
        return exc.code
    return EXIT_OK


async def run(request: Request, *, poll_s: float = POLL_S, err: TextIO | None = None) -> None:
    """Upload, wait for a queued job if needed, and deliver the result."""
    if not request.file.is_file():
        why = "not a file" if request.file.exists() else "no such file"
        raise ClientError(f"cannot read {request.file}: {why}", EXIT_USAGE)
    headers = {"Authorization": f"Bearer {request.api_key}"} if request.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    try:
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as http:
            text = await _transcribe(http, request, poll_s, err or sys.stderr)
    except (aiohttp.ClientConnectionError, aiohttp.InvalidURL, OSError, TimeoutError) as exc:
        raise ClientError(f"cannot reach {request.url}: {exc or type(exc).__name__}") from None
    except aiohttp.ClientError as exc:  # e.g. a malformed answer: not a lanegate gateway
        raise ClientError(f"{request.url} answered in a way this client cannot read: "
                          f"{exc or type(exc).__name__}") from None
    _deliver(text, request.output)


async def _transcribe(http: aiohttp.ClientSession, request: Request, poll_s: float,
                      err: TextIO) -> str:
    status, body = await _upload(http, request)
    if status == 200:
        return body
    job = _json(body)
    job_id = str(job["id"])
    print(f"queued as job {job_id} ({job.get('audio_seconds', 0):.1f} s of audio)", file=err)
    job = await _wait(http, request.url, job, poll_s, err)
    if job["status"] != "completed":
        reason = f": {job['error']}" if job.get("error") else ""
        raise ClientError(f"job {job_id} {job['status']}{reason}")
    return await _get_text(http, f"{request.url}/v1/transcriptions/{job_id}",
                           params={"format": request.fmt})


async def _upload(http: aiohttp.ClientSession, request: Request) -> tuple[int, str]:
    form = aiohttp.FormData()
    form.add_field("response_format", request.fmt)
    form.add_field("async", "true" if request.async_ else "false")
    content_type = mimetypes.guess_type(request.file.name)[0] or "application/octet-stream"
    try:
        handle = await asyncio.to_thread(open, request.file, "rb")
    except OSError as exc:
        raise ClientError(f"cannot read {request.file}: {exc.strerror}", EXIT_USAGE) from None
    try:
        form.add_field("file", handle, filename=request.file.name, content_type=content_type)
        async with http.post(f"{request.url}/v1/transcriptions", data=form) as resp:
            body = await resp.text()
            if resp.status not in (200, 202):
                raise ClientError(_error_text(resp.status, body))
            return resp.status, body
    finally:
        await asyncio.to_thread(handle.close)


async def _wait(http: aiohttp.ClientSession, url: str, job: dict[str, Any], poll_s: float,
                err: TextIO) -> dict[str, Any]:
    location = f"{url}/v1/transcriptions/{job['id']}"
    bar = ProgressBar(err)
    while True:
        bar.show(float(job.get("progress") or 0.0), str(job["status"]))
        if job["status"] in TERMINAL:
            bar.done()
            return job
        await asyncio.sleep(poll_s)
        job = _json(await _get_text(http, location))


async def _get_text(http: aiohttp.ClientSession, url: str,
                    params: dict[str, str] | None = None) -> str:
    async with http.get(url, params=params) as resp:
        body = await resp.text()
        if resp.status != 200:
            raise ClientError(_error_text(resp.status, body))
        return body


class ProgressBar:
    """``\\r[#########.....]  42%  processing`` redrawn in place on ``out``."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._last = ""

    def show(self, fraction: float, status: str) -> None:
        fraction = min(1.0, max(0.0, fraction))
        filled = round(fraction * BAR_WIDTH)
        line = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {fraction:4.0%}  {status:<10}"
        if line != self._last:
            self.out.write("\r" + line)
            self.out.flush()
            self._last = line

    def done(self) -> None:
        self.out.write("\n")
        self.out.flush()


def _deliver(text: str, output: Path | None) -> None:
    if not text.endswith("\n"):
        text += "\n"
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ClientError(f"cannot write {output}: {exc.strerror}", EXIT_USAGE) from None
    print(f"saved to {output}", file=sys.stderr)


def _json(body: str) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError:
        raise ClientError(f"the server sent an unreadable answer: {body[:200]!r}") from None
    if not isinstance(data, dict):
        raise ClientError(f"the server sent an unexpected answer: {body[:200]!r}")
    return data


def _error_text(status: int, body: str) -> str:
    """``error 413 (too_large): the upload is larger than ...``."""
    try:
        error = _json(body).get("error") or {}
    except ClientError:
        error = {}
    if isinstance(error, dict) and error.get("message"):
        text = f"error {status} ({error.get('code', 'error')}): {error['message']}"
    else:
        text = f"error {status}: {body.strip()[:200] or 'no details'}"
    if status == 404:
        text += " (is --url the base URL of a lanegate gateway?)"
    return text
