"""Receiving an upload: the request body streamed to the blob store, then decoded.

Both upload endpoints take ``multipart/form-data`` (a ``file`` part plus small
text fields); ``/v1/transcriptions`` also takes a raw body with an audio
content type (its options then come from the query string). The body is
written to ``BlobStore.path(upload_id, "upload")`` in chunks while the bytes
are counted, so nothing is held whole in memory and ``max_upload_bytes`` is
enforced both on ``Content-Length`` (before reading) and while streaming
(chunked bodies, lying headers). ``upload_id`` is server-generated and later
becomes the job id. After decoding, only ``audio.pcm`` remains.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import BodyPartReader, web

from lanegate.audio import AudioError, DecodedAudio, decode_upload
from lanegate.blobs import BlobStore, new_id
from lanegate.settings import Settings

#: bytes read from the socket per write to disk
READ_CHUNK = 64 * 1024
#: bytes gathered before one write to disk (in a thread)
WRITE_BATCH = 1024 * 1024
#: a text form field (language, prompt, ...) longer than this is refused (400)
FIELD_MAX_BYTES = 8 * 1024
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
                  fields: Collection[str], strict: bool, raw_allowed: bool) -> Upload:
    """Stream the request's audio into the blob store; collect its option fields.

    ``fields`` are the option names known to the endpoint; with ``strict`` any
    other name is a 400. On failure nothing is left in the store.
    """
    _check_declared_length(request, settings)
    upload_id = new_id()
    upload = Upload(upload_id=upload_id, source=store.path(upload_id, SOURCE_NAME))
    try:
        _take_query(request, upload, fields, strict=strict)
        if request.content_type == "multipart/form-data":
            await _read_multipart(request, upload, settings, fields, strict=strict)
        elif raw_allowed and _is_audio_type(request.content_type):
            upload.content_type = request.content_type
            upload.nbytes = await _copy(lambda: request.content.read(READ_CHUNK),
                                        upload.source, settings.max_upload_bytes)
        else:
            raise _bad_content_type(request.content_type, raw_allowed=raw_allowed)
        if upload.nbytes == 0:
            raise UploadError(400, "empty_file", "the uploaded file is empty", param="file")
    except BaseException:
        store.delete(upload_id)
        raise
    return upload


async def decode(upload: Upload, store: BlobStore, settings: Settings) -> DecodedAudio:
    """Decode the upload to ``audio.pcm`` (in a thread) and drop the original file.

    Raises :class:`UploadError` (415/422 with the reason); on failure the whole
    blob is deleted.
    """
    try:
        decoded = await decode_upload(upload.source, store.path(upload.upload_id, PCM_NAME),
                                      max_seconds=settings.max_audio_seconds)
    except AudioError as exc:
        store.delete(upload.upload_id)
        raise UploadError.from_audio(exc) from None
    except BaseException:
        store.delete(upload.upload_id)
        raise
    with contextlib.suppress(FileNotFoundError):
        upload.source.unlink()
    return decoded


def _check_declared_length(request: web.Request, settings: Settings) -> None:
    declared = request.content_length
    if declared is None:
        return
    slack = MULTIPART_SLACK if request.content_type == "multipart/form-data" else 0
    if declared > settings.max_upload_bytes + slack:
        raise too_large(settings.max_upload_bytes)


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


async def _read_multipart(request: web.Request, upload: Upload, settings: Settings,
                          fields: Collection[str], *, strict: bool) -> None:
    reader = await request.multipart()
    seen_file = False
    field_bytes = 0
    form: dict[str, list[str]] = {}
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            raise UploadError(400, "bad_request", "nested multipart bodies are not supported")
        name = part.name or ""
        if name == "file":
            if seen_file:
                raise UploadError(400, "bad_request", "more than one `file` part", param="file")
            seen_file = True
            upload.filename = _safe_filename(part.filename)
            upload.content_type = part.headers.get("Content-Type")
            upload.nbytes = await _copy(lambda: part.read_chunk(READ_CHUNK),
                                        upload.source, settings.max_upload_bytes)
            continue
        _check_name(name, fields, strict=strict)
        value = await _read_field(part, name)
        field_bytes += len(value)
        if field_bytes > MULTIPART_SLACK:
            raise UploadError(400, "fields_too_long",
                              f"the form's text fields exceed {MULTIPART_SLACK} bytes")
        if name in fields:  # fields unknown to a lenient endpoint are read and dropped
            form.setdefault(name, []).append(value)
    if not seen_file:
        raise UploadError(400, "missing_file", "the `file` part is missing", param="file")
    upload.fields.update(form)  # form fields win over the query string


async def _read_field(part: BodyPartReader, name: str) -> str:
    data = bytearray()
    while chunk := await part.read_chunk(READ_CHUNK):
        data += chunk
        if len(data) > FIELD_MAX_BYTES:
            raise UploadError(400, "field_too_long",
                              f"field {name!r} is longer than {FIELD_MAX_BYTES} bytes",
                              param=name)
    try:
        return data.decode(part.get_charset(default="utf-8")).strip()
    except (UnicodeDecodeError, LookupError):
        raise UploadError(400, "bad_request", f"field {name!r} is not valid text",
                          param=name) from None


async def _copy(read: Callable[[], Awaitable[bytes]], dest: Path, limit: int) -> int:
    """Copy chunks from ``read`` into ``dest`` until it returns b""; 413 past ``limit``.

    Disk writes go through a thread in ``WRITE_BATCH`` pieces, so a slow disk never
    blocks the event loop and at most one batch per upload is in memory.
    """
    total = 0
    pending = bytearray()
    out = await asyncio.to_thread(open, dest, "wb")
    try:
        while chunk := await read():
            total += len(chunk)
            if total > limit:
                raise too_large(limit)
            pending += chunk
            if len(pending) >= WRITE_BATCH:
                await asyncio.to_thread(out.write, bytes(pending))
                pending.clear()
        if pending:
            await asyncio.to_thread(out.write, bytes(pending))
    finally:
        await asyncio.to_thread(out.close)
    return total


def _safe_filename(name: str | None) -> str | None:
    """The client's file name for display only (never a path): basename, printable, short."""
    if not name:
        return None
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    cleaned = "".join(ch for ch in base if ch.isprintable())[:255]
    return cleaned or None
