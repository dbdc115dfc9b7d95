"""Receiving an upload: the request body streamed to the blob store, then decoded.

Both upload endpoints take ``multipart/form-data`` (a ``file`` part plus small
text fields); ``/v1/transcriptions`` also takes a raw body with an audio
content type (its options then come from the query string). The body is
written to ``BlobStore.path(upload_id, "upload")`` in chunks while the bytes
are counted, so nothing is held whole in memory and ``max_upload_bytes`` is
enforced both on ``Content-Length`` (before reading) and while streaming
(chunked bodies, lying headers). ``upload_id`` is server-generated and later
becomes the job id. After decoding, only ``audio.pcm`` remains.

One request never holds the event loop or the threads of others: every byte of
the body (multipart boundaries, part headers, empty values) counts against the
limit, a form has at most ``max_form_parts`` parts of bounded headers and
``max_field_bytes`` each, parsing yields to the loop after every part, each
read waits at most ``body_read_timeout_s`` (408), and disk writes and decoding
run on the gateway's upload pool (``upload_threads``), never the default one.
Below ``min_free_disk`` of free space new uploads are refused (507).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
from collections.abc import Awaitable, Callable, Collection, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import BodyPartReader, MultipartReader, web
from aiohttp.http_exceptions import BadHttpMessage

from lanegate.audio import AudioError, DecodedAudio, decode_to_pcm
from lanegate.blobs import BlobStore, new_id
from lanegate.settings import Settings

#: bytes read from the socket per write to disk
READ_CHUNK = 64 * 1024
#: bytes gathered before one write to disk (in a thread)
WRITE_BATCH = 1024 * 1024
#: a part's header lines: at most this many, each at most this long (400): the
#: Content-Disposition and Content-Type a form part needs, with room to spare
PART_HEADERS_MAX = 16
PART_HEADER_LINE_MAX = 8190
#: seconds a client should wait after a 507
STORAGE_RETRY_AFTER_S = 60
#: room for multipart boundaries and small fields when checking Content-Length;
#: also the most text all fields of one form may hold together
MULTIPART_SLACK = 64 * 1024
#: the blob file names of an upload before and after decoding
SOURCE_NAME = "upload"
PCM_NAME = "audio.pcm"
#: raw bodies with these content types are accepted as audio (besides audio/*)
RAW_TYPES = frozenset({
    "application/octet-stream", "application/ogg", "video/webm", "video/mp4", "video/ogg",
    "video/x-matroska",
})
#: query parameters that belong to the gateway, not to the upload options
IGNORED_QUERY = frozenset({"api_key"})

T = TypeVar("T")


class UploadError(Exception):
    """A request that cannot be served: HTTP ``status``, API ``code``, a message, the
    offending ``param`` and extra response ``headers``. Each endpoint renders it in
    its own error shape (native or OpenAI)."""

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    @classmethod
    def from_audio(cls, exc: AudioError) -> UploadError:
        return cls(exc.status, exc.code, str(exc), param="file")


@dataclass
class Upload:
    """An upload on disk and the options that came with it."""

    upload_id: str
    source: Path
    nbytes: int = 0
    filename: str | None = None
    content_type: str | None = None
    fields: dict[str, list[str]] = field(default_factory=dict)

    def get(self, name: str) -> str | None:
        values = self.fields.get(name)
        return values[-1] if values else None

    def get_all(self, name: str) -> list[str]:
        return list(self.fields.get(name, ()))


async def receive(request: web.Request, store: BlobStore, settings: Settings, *,
                  pool: Executor, fields: Collection[str], strict: bool,
                  raw_allowed: bool) -> Upload:
    """Stream the request's audio into the blob store; collect its option fields.

    ``fields`` are the option names known to the endpoint; with ``strict`` any
    other name is a 400. Disk work runs on ``pool``. On failure nothing is left in
    the store.
    """
    _check_declared_length(request, settings)
    await _check_free_space(store, settings, pool, request.content_length or 0)
    upload_id = new_id()
    upload = Upload(upload_id=upload_id, source=store.path(upload_id, SOURCE_NAME))
    body = Body(request, settings, pool)
    try:
        _take_query(request, upload, fields, strict=strict)
        if request.content_type == "multipart/form-data":
            await _read_multipart(body, upload, settings, fields, strict=strict)
        elif raw_allowed and _is_audio_type(request.content_type):
            upload.content_type = request.content_type
            upload.nbytes = await body.copy(lambda: request.content.read(READ_CHUNK),
                                            upload.source)
        else:
            raise _bad_content_type(request.content_type, raw_allowed=raw_allowed)
        if upload.nbytes == 0:
            raise UploadError(400, "empty_file", "the uploaded file is empty", param="file")
    except BaseException:
        store.delete(upload_id)
        raise
    return upload


async def decode(upload: Upload, store: BlobStore, settings: Settings,
                 pool: Executor) -> DecodedAudio:
    """Decode the upload to ``audio.pcm`` (on ``pool``) and drop the original file.

    Raises :class:`UploadError` (415/422 with the reason); on failure, and when the
    request is cancelled (its client left), the whole blob is deleted once the
    decoding thread has stopped writing it.
    """
    loop = asyncio.get_running_loop()
    work = loop.run_in_executor(pool, functools.partial(
        decode_to_pcm, upload.source, store.path(upload.upload_id, PCM_NAME),
        max_seconds=settings.max_audio_seconds))
    try:
        decoded = await asyncio.shield(work)
    except AudioError as exc:
        store.delete(upload.upload_id)
        raise UploadError.from_audio(exc) from None
    except BaseException:
        with contextlib.suppress(BaseException):
            await asyncio.wait({work})  # the thread cannot be stopped: let it finish first
        store.delete(upload.upload_id)
        raise
    with contextlib.suppress(FileNotFoundError):
        upload.source.unlink()
    return decoded


def _check_declared_length(request: web.Request, settings: Settings) -> None:
    declared = request.content_length
    if declared is None:
        return
    if declared > body_limit(request, settings):
        raise too_large(settings.max_upload_bytes)


def body_limit(request: web.Request, settings: Settings) -> int:
    """Most bytes the whole body may have: the file, plus for a form the room its
    boundaries, part headers and text fields take."""
    slack = MULTIPART_SLACK if request.content_type == "multipart/form-data" else 0
    return settings.max_upload_bytes + slack


async def _check_free_space(store: BlobStore, settings: Settings, pool: Executor,
                            incoming: int) -> None:
    """507 when the blob directory's filesystem has (or would have, after an upload
    of ``incoming`` bytes) less free space than ``min_free_disk``."""
    loop = asyncio.get_running_loop()
    usage = await loop.run_in_executor(pool, _disk_usage, store.root)
    floor = settings.free_disk_floor(usage.total)
    if floor and usage.free - incoming < floor:
        raise UploadError(507, "insufficient_storage",
                          "the server is low on disk space for uploads; try again later",
                          headers={"Retry-After": str(STORAGE_RETRY_AFTER_S)})


def _disk_usage(root: Path) -> Any:
    root.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(root)


def too_large(limit: int) -> UploadError:
    return UploadError(413, "too_large",
                       f"the upload is larger than the limit of {limit} bytes", param="file")


def _is_audio_type(content_type: str) -> bool:
    return content_type.startswith("audio/") or content_type in RAW_TYPES


def _bad_content_type(content_type: str, *, raw_allowed: bool) -> UploadError:
    hint = ("send multipart/form-data with a `file` part, or a raw body with an audio "
            "content type (audio/wav, audio/mpeg, ...)" if raw_allowed
            else "send multipart/form-data with a `file` part")
    return UploadError(415, "unsupported_media_type",
                       f"unsupported request content type {content_type!r}: {hint}")


def _take_query(request: web.Request, upload: Upload, fields: Collection[str], *,
                strict: bool) -> None:
    for name, value in request.query.items():
        if name in IGNORED_QUERY:
            continue
        _check_name(name, fields, strict=strict)
        upload.fields.setdefault(name, []).append(value)


def _check_name(name: str, fields: Collection[str], *, strict: bool) -> None:
    if strict and name not in fields:
        known = ", ".join(sorted(fields))
        raise UploadError(400, "unknown_field", f"unknown field {name!r}; known: file, {known}",
                          param=name)


class Body:
    """Reads of one request body: each waits at most ``body_read_timeout_s`` (408),
    every byte received (boundaries and part headers too) counts against
    :func:`body_limit` (413), disk writes run on ``pool``."""

    def __init__(self, request: web.Request, settings: Settings, pool: Executor) -> None:
        self.request = request
        self.settings = settings
        self.pool = pool
        self.limit = body_limit(request, settings)

    async def read(self, read: Awaitable[T]) -> T:
        """``read``'s result within the read timeout, then the byte count checked."""
        timeout = self.settings.body_read_timeout_s
        try:
            async with asyncio.timeout(timeout or None):
                result = await read
        except TimeoutError:
            raise UploadError(408, "timeout", f"the request body stalled: no data for "
                              f"{timeout:g} s (body_read_timeout_s)") from None
        if self.request.content.total_bytes > self.limit:
            raise too_large(self.settings.max_upload_bytes)
        return result

    async def copy(self, read: Callable[[], Awaitable[bytes]], dest: Path) -> int:
        """Copy chunks from ``read`` into ``dest`` until it returns b""; 413 past
        ``max_upload_bytes``.

        Disk writes go to the pool in ``WRITE_BATCH`` pieces, so a slow disk never
        blocks the event loop and at most one batch per upload is in memory.
        """
        limit = self.settings.max_upload_bytes
        loop = asyncio.get_running_loop()
        total = 0
        pending = bytearray()
        out = await loop.run_in_executor(self.pool, open, dest, "wb")
        try:
            while chunk := await self.read(read()):
                total += len(chunk)
                if total > limit:
                    raise too_large(limit)
                pending += chunk
                if len(pending) >= WRITE_BATCH:
                    await loop.run_in_executor(self.pool, out.write, bytes(pending))
                    pending.clear()
            if pending:
                await loop.run_in_executor(self.pool, out.write, bytes(pending))
        finally:
            await loop.run_in_executor(self.pool, out.close)
        return total


async def _read_multipart(body: Body, upload: Upload, settings: Settings,
                          fields: Collection[str], *, strict: bool) -> None:
    try:
        reader = MultipartReader(body.request.headers, body.request.content,
                                 max_field_size=PART_HEADER_LINE_MAX,
                                 max_headers=PART_HEADERS_MAX)
        await _read_parts(body, reader, upload, settings, fields, strict=strict)
    except (ValueError, LookupError, AssertionError, BadHttpMessage) as exc:
        # aiohttp's parser on a malformed body (no boundary, a part header too long, ...)
        raise UploadError(400, "bad_request", f"malformed multipart body: {exc}") from None


async def _read_parts(body: Body, reader: MultipartReader, upload: Upload,
                      settings: Settings, fields: Collection[str], *, strict: bool) -> None:
    seen_file = False
    field_bytes = 0
    parts = 0
    form: dict[str, list[str]] = {}
    while (part := await body.read(reader.next())) is not None:
        parts += 1
        if parts > settings.max_form_parts:
            raise UploadError(400, "too_many_parts", "the form has more than "
                              f"{settings.max_form_parts} parts (max_form_parts)")
        await asyncio.sleep(0)  # a body already buffered is parsed without yielding
        if not isinstance(part, BodyPartReader):
            raise UploadError(400, "bad_request", "nested multipart bodies are not supported")
        name = part.name or ""
        if name == "file":
            if seen_file:
                raise UploadError(400, "bad_request", "more than one `file` part", param="file")
            seen_file = True
            upload.filename = _safe_filename(part.filename)
            upload.content_type = part.headers.get("Content-Type")
            upload.nbytes = await body.copy(lambda: part.read_chunk(READ_CHUNK), upload.source)
            continue
        _check_name(name, fields, strict=strict)
        value = await _read_field(body, part, name, settings.max_field_bytes)
        field_bytes += len(value)
        if field_bytes > MULTIPART_SLACK:
            raise UploadError(400, "fields_too_long",
                              f"the form's text fields exceed {MULTIPART_SLACK} bytes")
        if name in fields:  # fields unknown to a lenient endpoint are read and dropped
            form.setdefault(name, []).append(value)
    if not seen_file:
        raise UploadError(400, "missing_file", "the `file` part is missing", param="file")
    upload.fields.update(form)  # form fields win over the query string


async def _read_field(body: Body, part: BodyPartReader, name: str, limit: int) -> str:
    data = bytearray()
    while chunk := await body.read(part.read_chunk(READ_CHUNK)):
        data += chunk
        if len(data) > limit:
            raise UploadError(400, "field_too_long",
                              f"field {name!r} is longer than {limit} bytes (max_field_bytes)",
                              param=name)
    try:
        return data.decode(part.get_charset(default="utf-8")).strip()
    except (UnicodeDecodeError, LookupError):
        raise UploadError(400, "bad_request", f"field {name!r} is not valid text",
                          param=name) from None


def _safe_filename(name: str | None) -> str | None:
    """The client's file name for display only (never a path): basename, printable, short."""
    if not name:
        return None
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    cleaned = "".join(ch for ch in base if ch.isprintable())[:255]
    return cleaned or None
