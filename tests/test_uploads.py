"""The upload API end to end: a real gateway, realtime and batch workers, Redis and speech.

One stack serves the whole module (``stack`` fixture). Short uploads are answered
synchronously by the realtime lane; long or async ones become batch jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from audio_files import FORMATS, MIME, encode, silence_wav
from conftest import free_port
from phrases import LONG, MOST, SHORT
from phrases import recall as overlap
from stack import Stack, start_stack

KEY_A, KEY_B, KEY_C = "key-alpha", "key-bravo", "key-charlie"
WEBHOOK_SECRET = "uploads-webhook-secret"
MAX_UPLOAD = 2_000_000
MAX_AUDIO_S = 120



@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(tmp_path_factory.mktemp("uploads-stack"), settings={
        "LANEGATE_API_KEYS": f"{KEY_A},{KEY_B},{KEY_C}",
        "LANEGATE_MAX_UPLOAD_BYTES": str(MAX_UPLOAD),
        "LANEGATE_MAX_AUDIO_SECONDS": str(MAX_AUDIO_S),
        "LANEGATE_WEBHOOK_SECRET": WEBHOOK_SECRET,
        "LANEGATE_WEBHOOK_ALLOW_PRIVATE": "true",  # the test receiver is on loopback
        "LANEGATE_MAX_SESSIONS_PER_KEY": "1",
        "LANEGATE_UPLOAD_RESERVE_SLOTS": "1",
    })
    yield running
    running.stop()


@pytest.fixture(scope="module")
def short_wav(speech: Callable[..., Path]) -> Path:
    return speech(SHORT, rate=22050)


@pytest.fixture(scope="module")
def long_wav(speech: Callable[..., Path]) -> Path:
    return speech(LONG)


@pytest.fixture(scope="module")
def encoded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("encoded")


@pytest.fixture
async def http(stack: Stack) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=stack.url,
                                     headers={"Authorization": f"Bearer {KEY_A}"}) as session:
        yield session


def form(path: Path, content_type: str = "audio/wav", **fields: str) -> aiohttp.FormData:
    data = aiohttp.FormData()
    for name, value in fields.items():
        data.add_field(name, value)
    data.add_field("file", path.read_bytes(), filename=path.name, content_type=content_type)
    return data


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def post(http: aiohttp.ClientSession, data: Any, *, headers: dict[str, str] | None = None,
               params: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    async with http.post("/v1/transcriptions", data=data, headers=headers,
                         params=params) as resp:
        return resp.status, dict(resp.headers), await resp.text()


async def error_of(resp: aiohttp.ClientResponse) -> dict[str, str]:
    body = await resp.json()
    assert set(body) == {"error"}
    assert {"code", "message"} <= set(body["error"])
    return dict(body["error"])


async def wait_done(http: aiohttp.ClientSession, job_id: str,
                    headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Poll a job until it is terminal; every status seen along the way."""
    seen: list[dict[str, Any]] = []
    for _ in range(1200):
        async with http.get(f"/v1/transcriptions/{job_id}", headers=headers) as resp:
            assert resp.status == 200
            job = await resp.json()
        seen.append(job)
        if job["status"] in ("completed", "failed", "cancelled"):
            return seen
        await asyncio.sleep(0.1)
    raise AssertionError(f"job {job_id} never finished: {seen[-1]}")


# --- synchronous (realtime lane) -------------------------------------------------------


async def test_short_upload_is_answered_synchronously(http: aiohttp.ClientSession,
                                                      short_wav: Path) -> None:
    status, headers, body = await post(http, form(short_wav, response_format="json"))
    assert status == 200, body
    assert headers["X-Lanegate-Lane"] == "realtime"
    result = json.loads(body)
    assert overlap(SHORT, result["text"]) >= MOST, result["text"]
    assert result["duration"] == pytest.approx(6.5, abs=3)
    assert result["segments"]
    assert all(s["end"] >= s["start"] for s in result["segments"])


@pytest.mark.parametrize("ext", sorted(FORMATS))
async def test_every_format_transcribes(ext: str, http: aiohttp.ClientSession, short_wav: Path,
                                        encoded_dir: Path) -> None:
    source = encode(short_wav, ext, encoded_dir)
    status, _, body = await post(http, form(source, MIME[ext], response_format="text"))
    assert status == 200, body
    assert overlap(SHORT, body) >= MOST, body


async def test_raw_body_with_audio_content_type(http: aiohttp.ClientSession, short_wav: Path,
                                                encoded_dir: Path) -> None:
    source = encode(short_wav, "mp3", encoded_dir)
    status, headers, body = await post(http, source.read_bytes(),
                                       headers={"Content-Type": "audio/mpeg"},
                                       params={"response_format": "vtt"})
    assert status == 200, body
    assert headers["Content-Type"].startswith("text/vtt")
    assert body.startswith("WEBVTT\n\n")
    assert "-->" in body
    assert overlap(SHORT, body) >= MOST


# --- batch jobs ---------------------------------------------------------------------------


async def test_long_upload_becomes_a_job_that_completes(http: aiohttp.ClientSession,
                                                        long_wav: Path) -> None:
    status, headers, body = await post(http, form(long_wav, response_format="srt"))
    assert status == 202, body
    job = json.loads(body)
    assert headers["Location"] == f"/v1/transcriptions/{job['id']}"
    assert headers["X-Lanegate-Lane"] == "batch"
    assert re.fullmatch(r"[0-9a-f]{32}", job["id"])
    assert job["status"] in ("queued", "processing")
    assert job["audio_seconds"] > 30
    assert job["filename"] == long_wav.name

    seen = await wait_done(http, job["id"])
    final = seen[-1]
    assert final["status"] == "completed", final
    assert final["progress"] == 1.0
    progress = [j["progress"] for j in seen]
    assert progress == sorted(progress)
    assert final["started_at"] >= final["created_at"]
    assert final["finished_at"] >= final["started_at"]
    assert final["attempts"] >= 1

    results = {}
    for fmt in ("json", "text", "srt", "vtt"):
        async with http.get(f"/v1/transcriptions/{job['id']}", params={"format": fmt}) as resp:
            assert resp.status == 200
            results[fmt] = (resp.headers["Content-Type"], await resp.text())
    assert results["json"][0].startswith("application/json")
    assert results["text"][0].startswith("text/plain")
    assert results["srt"][0].startswith("application/x-subrip")
    assert results["vtt"][0].startswith("text/vtt")
    transcript = json.loads(results["json"][1])
    assert overlap(LONG, transcript["text"]) >= MOST, transcript["text"]
    assert len(transcript["segments"]) >= 2
    assert transcript["duration"] == pytest.approx(job["audio_seconds"], abs=0.01)
    assert results["srt"][1].startswith("1\n00:00:")
    assert any(seg["words"] for seg in transcript["segments"])


async def test_async_short_upload_is_queued(http: aiohttp.ClientSession,
                                            short_wav: Path) -> None:
    status, headers, body = await post(http, form(short_wav, **{"async": "true"}))
    assert status == 202, body
    job_id = headers["Location"].rsplit("/", 1)[1]
    final = (await wait_done(http, job_id))[-1]
    assert final["status"] == "completed"
    async with http.get(f"/v1/transcriptions/{job_id}", params={"format": "text"}) as resp:
        assert overlap(SHORT, await resp.text()) >= MOST


# --- limits and validation -------------------------------------------------------------------


async def test_too_big_is_413_from_content_length(http: aiohttp.ClientSession,
                                                  tmp_path: Path) -> None:
    big = tmp_path / "big.wav"
    big.write_bytes(b"RIFF" + bytes(MAX_UPLOAD + 100_000))
    status, _, body = await post(http, big.read_bytes(), headers={"Content-Type": "audio/wav"})
    assert status == 413
    assert '"too_large"' in body


async def test_too_big_is_413_while_streaming(http: aiohttp.ClientSession) -> None:
    async def chunks() -> AsyncIterator[bytes]:  # chunked: no Content-Length to check
        for _ in range(MAX_UPLOAD // 65536 + 4):
            yield bytes(65536)

    async with http.post("/v1/transcriptions", data=chunks(),
                         headers={"Content-Type": "audio/wav"}) as resp:
        assert resp.status == 413
        assert (await error_of(resp))["code"] == "too_large"


async def test_too_long_is_422(http: aiohttp.ClientSession, tmp_path: Path,
                               encoded_dir: Path) -> None:
    long_silence = encode(silence_wav(tmp_path / "silence.wav", MAX_AUDIO_S + 30), "flac",
                          encoded_dir)  # small on the wire, long in time
    async with http.post("/v1/transcriptions", data=form(long_silence, "audio/flac")) as resp:
        assert resp.status == 422
        error = await error_of(resp)
    assert error["code"] == "audio_too_long"
    assert f"{MAX_AUDIO_S}" in error["message"]


async def test_unknown_format_is_415(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("these are meeting notes, not a recording\n" * 20)
    async with http.post("/v1/transcriptions", data=form(notes, "audio/wav")) as resp:
        assert resp.status == 415
        error = await error_of(resp)
    assert error["code"] == "unsupported_format"
    assert "unrecognised audio format" in error["message"]


async def test_damaged_file_is_422_with_reason(http: aiohttp.ClientSession, short_wav: Path,
                                               encoded_dir: Path, tmp_path: Path) -> None:
    whole = encode(short_wav, "m4a", encoded_dir).read_bytes()
    cut = tmp_path / "cut.m4a"
    cut.write_bytes(whole[: len(whole) // 2])
    async with http.post("/v1/transcriptions", data=form(cut, "audio/mp4")) as resp:
        assert resp.status == 422
        error = await error_of(resp)
    assert error["code"] == "undecodable_audio"
    assert "damaged mp4" in error["message"]


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"language": "English!"}, "invalid_language"),
        ({"response_format": "docx"}, "invalid_response_format"),
        ({"async": "maybe"}, "invalid_boolean"),
        ({"webhook_url": "ftp://example.com/hook"}, "invalid_webhook_url"),
        ({"webhook_url": "not a url"}, "invalid_webhook_url"),
        # refused even with webhook_allow_private (the stack's setting)
        ({"webhook_url": "http://169.254.169.254/latest/meta-data/"}, "invalid_webhook_url"),
        ({"webhook_url": "http://[::ffff:a9fe:a9fe]/"}, "invalid_webhook_url"),
        ({"webhook_url": "http://0.0.0.0:8080/hook"}, "invalid_webhook_url"),
        ({"webhook_url": "http://224.0.0.251/hook"}, "invalid_webhook_url"),
        ({"format": "srt"}, "unknown_field"),
    ],
)
async def test_bad_fields_are_400(fields: dict[str, str], code: str,
                                  http: aiohttp.ClientSession, short_wav: Path) -> None:
    async with http.post("/v1/transcriptions", data=form(short_wav, **fields)) as resp:
        assert resp.status == 400
        assert (await error_of(resp))["code"] == code


@pytest.mark.parametrize(("language", "kept"), [("en_US", "en-us"), ("en-US", "en-us")])
async def test_region_tags_are_accepted_in_either_spelling(
    language: str, kept: str, http: aiohttp.ClientSession, short_wav: Path
) -> None:
    status, _, body = await post(http, form(short_wav, language=language))
    assert status == 200, body
    assert json.loads(body)["language"] == kept


async def test_missing_file_and_bad_content_type(http: aiohttp.ClientSession) -> None:
    data = aiohttp.FormData()
    data.add_field("language", "en")
    data.add_field("other", b"x", filename="x.bin")  # forces multipart
    async with http.post("/v1/transcriptions", data=data) as resp:
        assert resp.status == 400
    async with http.post("/v1/transcriptions", data=b"hello",
                         headers={"Content-Type": "text/plain"}) as resp:
        assert resp.status == 415
        assert "multipart/form-data" in (await error_of(resp))["message"]
    async with http.post("/v1/transcriptions", data=b"",
                         headers={"Content-Type": "audio/wav"}) as resp:
        assert resp.status == 400
        assert (await error_of(resp))["code"] == "empty_file"


# --- idempotency, tenants, cancel, listing -------------------------------------------------


async def test_idempotency_key_returns_the_same_job(http: aiohttp.ClientSession,
                                                    short_wav: Path, stack: Stack) -> None:
    key = {"Idempotency-Key": "upload-2026-11-29-0001"}
    first = await post(http, form(short_wav, **{"async": "true"}), headers=key)
    second = await post(http, form(short_wav, **{"async": "true"}), headers=key)
    other_tenant = await post(http, form(short_wav, **{"async": "true"}),
                              headers={**key, **bearer(KEY_B)})
    assert first[0] == second[0] == other_tenant[0] == 202
    job_id = json.loads(first[2])["id"]
    assert json.loads(second[2])["id"] == job_id
    assert second[1]["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first[1]
    assert json.loads(other_tenant[2])["id"] != job_id
    await wait_done(http, job_id)
    await wait_done(http, json.loads(other_tenant[2])["id"],
                    headers=bearer(KEY_B))
    assert not list(stack.blob_dir.glob("*/*"))  # the replayed upload left no audio behind

    async with http.post("/v1/transcriptions", data=form(short_wav),
                         headers={"Idempotency-Key": "x" * 300}) as resp:
        assert resp.status == 400


async def test_other_tenants_get_404(http: aiohttp.ClientSession, short_wav: Path,
                                     stack: Stack) -> None:
    status, headers, _ = await post(http, form(short_wav, **{"async": "true"}))
    assert status == 202
    path = headers["Location"]
    job_id = path.rsplit("/", 1)[1]
    async with aiohttp.ClientSession(base_url=stack.url, headers=bearer(KEY_B)) as other:
        async with other.get(path) as resp:
            assert resp.status == 404
            assert (await error_of(resp))["code"] == "not_found"
        async with other.get(path, params={"format": "text"}) as resp:
            assert resp.status == 404
        async with other.delete(path) as resp:
            assert resp.status == 404
        async with other.get("/v1/transcriptions", params={"limit": "100"}) as resp:
            listed = [j["id"] for j in (await resp.json())["data"]]
        assert job_id not in listed
    async with aiohttp.ClientSession(base_url=stack.url) as anonymous, \
            anonymous.get(path) as resp:
        assert resp.status == 401
    async with http.get("/v1/transcriptions/" + "0" * 32) as resp:
        assert resp.status == 404
    async with http.get("/v1/transcriptions/../../etc/passwd") as resp:
        assert resp.status == 404
    await wait_done(http, job_id)


async def test_cancel_a_queued_job(http: aiohttp.ClientSession, short_wav: Path,
                                   stack: Stack) -> None:
    with stack.paused("batch"):  # no worker takes the job while the test looks at it
        status, headers, body = await post(http, form(short_wav, **{"async": "true"}))
        assert status == 202, body
        path = headers["Location"]
        job_id = path.rsplit("/", 1)[1]
        async with http.get(path, params={"format": "text"}) as resp:
            assert resp.status == 409
            assert "queued" in (await error_of(resp))["message"]
        async with http.delete(path) as resp:
            assert resp.status == 200
            job = await resp.json()
        assert job["status"] == "cancelled"
        assert not (stack.blob_dir / job_id[:2] / job_id).exists()
        async with http.delete(path) as resp:  # DELETE is idempotent
            assert resp.status == 200
    async with http.get(path) as resp:
        assert (await resp.json())["status"] == "cancelled"
    async with http.get(path, params={"format": "json"}) as resp:
        assert resp.status == 409


async def test_finished_job_cannot_be_cancelled(http: aiohttp.ClientSession,
                                                short_wav: Path) -> None:
    status, headers, _ = await post(http, form(short_wav, **{"async": "true"}))
    assert status == 202
    path = headers["Location"]
    assert (await wait_done(http, path.rsplit("/", 1)[1]))[-1]["status"] == "completed"
    async with http.delete(path) as resp:
        assert resp.status == 409
        assert (await error_of(resp))["code"] == "not_cancellable"


async def test_listing_pages_newest_first(stack: Stack, short_wav: Path) -> None:
    async with aiohttp.ClientSession(base_url=stack.url, headers=bearer(KEY_C)) as http:
        created = []
        for _ in range(5):
            status, headers, _ = await post(http, form(short_wav, **{"async": "true"}))
            assert status == 202
            created.append(headers["Location"].rsplit("/", 1)[1])
        pages: list[list[str]] = []
        cursor: str | None = None
        while True:
            params = {"limit": "2", **({"cursor": cursor} if cursor else {})}
            async with http.get("/v1/transcriptions", params=params) as resp:
                assert resp.status == 200
                page = await resp.json()
            pages.append([j["id"] for j in page["data"]])
            cursor = page["next_cursor"]
            assert page["has_more"] is (cursor is not None)
            if cursor is None:
                break
        assert [len(p) for p in pages] == [2, 2, 1]
        assert [i for p in pages for i in p] == created[::-1]
        for bad in ({"limit": "0"}, {"limit": "1000"}, {"limit": "x"}, {"cursor": "nonsense"}):
            async with http.get("/v1/transcriptions", params=bad) as resp:
                assert resp.status == 400
        for job_id in created:
            await wait_done(http, job_id)


async def test_unresponsive_realtime_lane_falls_back_to_a_job(http: aiohttp.ClientSession,
                                                              short_wav: Path,
                                                              stack: Stack) -> None:
    with stack.paused("realtime"):  # connects, never answers: the gateway gives up on it
        status, headers, body = await post(http, form(short_wav, response_format="text"))
    assert status == 202, body
    assert headers["X-Lanegate-Lane"] == "batch"
    job_id = headers["Location"].rsplit("/", 1)[1]
    assert (await wait_done(http, job_id))[-1]["status"] == "completed"
    async with http.get(f"/v1/transcriptions/{job_id}", params={"format": "text"}) as resp:
        assert overlap(SHORT, await resp.text()) >= MOST


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus series in a /metrics text (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_refusals_and_jobs_are_counted(http: aiohttp.ClientSession, short_wav: Path,
                                             tmp_path: Path) -> None:
    async with http.get("/metrics") as resp:
        before = await resp.text()
    notes = tmp_path / "notes.txt"
    notes.write_text("not audio\n" * 50)
    async with http.post("/v1/transcriptions", data=form(notes)) as resp:
        assert resp.status == 415
    status, headers, _ = await post(http, form(short_wav, **{"async": "true"}))
    assert status == 202
    async with http.get("/metrics") as resp:
        after = await resp.text()
    for name, labels in (
        ("lanegate_rejections_total", {"lane": "batch", "reason": "undecodable"}),
        ("lanegate_jobs_total", {"lane": "batch", "status": "queued"}),
    ):
        assert metric(after, name, **labels) == metric(before, name, **labels) + 1, name
    await wait_done(http, headers["Location"].rsplit("/", 1)[1])


async def test_webhook_url_makes_a_job_and_is_called(http: aiohttp.ClientSession,
                                                     short_wav: Path) -> None:
    received: asyncio.Queue[tuple[bytes, dict[str, str]]] = asyncio.Queue()

    async def hook(request: web.Request) -> web.Response:
        await received.put((await request.read(), dict(request.headers)))
        return web.Response(status=204)

    receiver = web.Application()
    receiver.router.add_post("/hook", hook)
    runner = web.AppRunner(receiver)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        url = f"http://127.0.0.1:{port}/hook"
        status, _, body = await post(http, form(short_wav, webhook_url=url))
        assert status == 202, body  # short, but a webhook asks for a job
        job = json.loads(body)
        assert job["webhook_url"] == url
        payload, hook_headers = await asyncio.wait_for(received.get(), timeout=60)
    finally:
        await runner.cleanup()
    assert json.loads(payload) == {"id": job["id"], "status": "completed"}
    timestamp = hook_headers["X-Lanegate-Signature"].split(",")[0].removeprefix("t=")
    digest = hmac.new(WEBHOOK_SECRET.encode(), f"{timestamp}.".encode() + payload,
                      hashlib.sha256).hexdigest()
    assert hook_headers["X-Lanegate-Signature"] == f"t={timestamp},v1={digest}"


async def test_client_gone_mid_upload_leaves_nothing(http: aiohttp.ClientSession,
                                                     stack: Stack) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", stack.port)
    writer.write(
        b"POST /v1/transcriptions HTTP/1.1\r\nHost: lanegate\r\n"
        b"Authorization: Bearer " + KEY_A.encode() + b"\r\n"
        b"Content-Type: audio/wav\r\nContent-Length: 1000000\r\n\r\n" + bytes(300_000)
    )
    await writer.drain()
    assert await blobs_become(stack, present=True)  # the gateway is streaming it to disk
    writer.close()  # gone with 700 kB still owed
    await writer.wait_closed()
    assert await blobs_become(stack, present=False)
    async with http.get("/healthz") as resp:
        assert resp.status == 200


async def blobs_become(stack: Stack, *, present: bool) -> bool:
    for _ in range(200):
        if bool(list(stack.blob_dir.glob("*/*"))) is present:
            return True
        await asyncio.sleep(0.05)
    return False


@contextlib.asynccontextmanager
async def live_streams(stack: Stack, key: str, count: int) -> AsyncIterator[None]:
    """``count`` live /v1/stream sessions of ``key``, each holding a realtime slot."""
    async with aiohttp.ClientSession(base_url=stack.url, headers=bearer(key)) as http:
        sockets = []
        try:
            for _ in range(count):
                ws = await http.ws_connect("/v1/stream?sample_rate=16000")
                ready = await ws.receive_json(timeout=30)
                assert ready["type"] == "ready", ready
                await ws.send_bytes(bytes(3200))
                sockets.append(ws)
            yield
        finally:
            for ws in sockets:
                await ws.close()


async def free_slots_become(http: aiohttp.ClientSession, want: int) -> None:
    """Wait until the registry (one heartbeat behind) shows ``want`` free realtime slots."""
    for _ in range(200):
        async with http.get("/readyz") as resp:
            if (await resp.json()).get("free_slots") == want:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"free realtime slots never became {want}")


async def test_uploads_leave_the_reserved_slot_to_live_streams(
        http: aiohttp.ClientSession, short_wav: Path, stack: Stack) -> None:
    async with live_streams(stack, KEY_B, 1), live_streams(stack, KEY_C, 1):
        await free_slots_become(http, 1)  # 3 slots, 2 live streams: only the reserve left
        status, headers, body = await post(http, form(short_wav, response_format="text"))
    assert status == 202, body
    assert headers["X-Lanegate-Lane"] == "batch"
    await wait_done(http, headers["Location"].rsplit("/", 1)[1])
    await free_slots_become(http, 3)


async def test_uploads_count_as_realtime_sessions_of_their_key(
        http: aiohttp.ClientSession, short_wav: Path, stack: Stack) -> None:
    async with live_streams(stack, KEY_B, 1):  # KEY_B is at its limit of 1 session
        await free_slots_become(http, 2)
        status, queued, _ = await post(http, form(short_wav), headers=bearer(KEY_B))
        assert status == 202
        assert queued["X-Lanegate-Lane"] == "batch"
        status, answered, _ = await post(http, form(short_wav))  # KEY_A is not
        assert status == 200
        assert answered["X-Lanegate-Lane"] == "realtime"
    await wait_done(http, queued["Location"].rsplit("/", 1)[1], headers=bearer(KEY_B))
