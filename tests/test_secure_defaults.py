"""Safe to put on a network: the gateway refuses webhook URLs into the private
network at submit, refuses webhooks without a secret, and will not start open to
the network with auth off. A real gateway (in-process on 127.0.0.1, or the real
``lanegate gateway`` CLI) and a real redis-server; no traffic leaves loopback (the
private and metadata URLs are refused before anything is sent, and no batch worker
runs here to send anything)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from audio_files import silence_wav
from conftest import RedisServer, free_port

from gateway.app import create_app
from lanegate.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
SECRET = "submit-secret"

Gateway = Callable[..., Awaitable[str]]


@pytest_asyncio.fixture
async def gateway(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[Gateway]:
    runners: list[web.AppRunner] = []

    async def start(**changes: Any) -> str:
        settings = Settings(redis_url=redis_server.url, blob_dir=str(tmp_path / "blobs"),
                            **{"webhook_secret": SECRET, **changes})
        runner = web.AppRunner(create_app(settings), shutdown_timeout=5)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
def wav(tmp_path: Path) -> bytes:
    return silence_wav(tmp_path / "one-second.wav", 1.0).read_bytes()


async def upload(base: str, wav: bytes, webhook_url: str) -> tuple[int, dict[str, Any]]:
    data = aiohttp.FormData()
    data.add_field("webhook_url", webhook_url)
    data.add_field("file", wav, filename="a.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as http, \
            http.post(base + "/v1/transcriptions", data=data) as resp:
        return resp.status, await resp.json()


def blobs_left(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]


@pytest.mark.parametrize(("url", "why"), [
    ("http://127.0.0.1:6379/", "127.0.0.1 is loopback"),
    ("http://localhost:9000/internal/v1/session", "is loopback"),
    ("http://localhost./", "is loopback"),
    ("http://2130706433:8080/", "127.0.0.1 is loopback"),
    ("http://0x7f.1/", "127.0.0.1 is loopback"),
    ("http://[::1]:8080/", "::1 is loopback"),
    ("http://[::ffff:127.0.0.1]/", "is loopback"),
    ("http://10.0.0.5/hook", "10.0.0.5 is private"),
    ("http://192.168.1.1/hook", "is private"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is link-local"),
    ("http://0xA9FEA9FE/", "169.254.169.254 is link-local"),
    ("http://[fe80::1]/", "is link-local"),
    ("http://0.0.0.0:8080/", "is unspecified"),
    ("http://239.1.2.3/", "is multicast"),
    ("https://[2002:a00:1::]/", "is private"),  # 6to4 of 10.0.0.1
])
async def test_webhook_urls_into_the_private_network_are_refused_at_submit(
    gateway: Gateway, wav: bytes, tmp_path: Path, url: str, why: str,
) -> None:
    base = await gateway()
    status, body = await upload(base, wav, url)
    assert status == 400, body
    assert body["error"]["code"] == "invalid_webhook_url"
    assert why in body["error"]["message"]
    assert blobs_left(tmp_path) == []


async def test_a_public_webhook_url_is_accepted(gateway: Gateway, wav: bytes) -> None:
    base = await gateway()
    # a literal, so no DNS is needed; no batch worker runs, so nothing is ever sent
    status, body = await upload(base, wav, "https://93.184.216.34/hooks/lanegate")
    assert status == 202, body
    assert body["webhook_url"] == "https://93.184.216.34/hooks/lanegate"


async def test_the_allow_list_lets_loopback_through_but_not_metadata(
    gateway: Gateway, wav: bytes,
) -> None:
    base = await gateway(webhook_allow_private=True)
    status, body = await upload(base, wav, "http://127.0.0.1:9/hook")
    assert status == 202, body
    status, body = await upload(base, wav, "http://169.254.169.254/")
    assert (status, body["error"]["code"]) == (400, "invalid_webhook_url")


async def test_webhooks_without_a_secret_are_refused(gateway: Gateway, wav: bytes,
                                                     tmp_path: Path) -> None:
    base = await gateway(webhook_secret="")
    status, body = await upload(base, wav, "https://93.184.216.34/hook")
    assert status == 400, body
    assert body["error"]["code"] == "webhooks_disabled"
    assert "secret" in body["error"]["message"]
    assert blobs_left(tmp_path) == []


# --- the gateway will not start open to the network with auth off -------------------------


def _gateway_cli(host: str, port: int, redis_url: str, **env: str) -> subprocess.Popen[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LANEGATE_")}
    environment.update({"PYTHONPATH": str(ROOT), "LANEGATE_REDIS_URL": redis_url,
                        "LANEGATE_EVENT_LOOP": "asyncio", **env})
    return subprocess.Popen(
        [sys.executable, "-m", "lanegate.cli", "gateway", "--host", host, "--port", str(port)],
        env=environment, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _serves(proc: subprocess.Popen[str], port: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    return False


def _stop(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10"])
def test_no_keys_on_a_network_address_exits_with_the_reason(redis_server: RedisServer,
                                                            host: str) -> None:
    proc = _gateway_cli(host, free_port(), redis_server.url)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "refusing to serve without API keys" in stderr
    assert "LANEGATE_ALLOW_ANONYMOUS" in stderr


@pytest.mark.parametrize(("host", "env"), [
    ("127.0.0.1", {}),                                  # loopback: auth off is fine
    ("0.0.0.0", {"LANEGATE_ALLOW_ANONYMOUS": "true"}),  # the explicit opt-in
    ("0.0.0.0", {"LANEGATE_API_KEYS": "k1"}),           # auth on: compose's setup
])
def test_loopback_opt_in_or_keys_start(redis_server: RedisServer, host: str,
                                       env: dict[str, str]) -> None:
    port = free_port()
    proc = _gateway_cli(host, port, redis_server.url, **env)
    try:
        assert _serves(proc, port), proc.communicate()[1] if proc.poll() is not None else ""
    finally:
        assert _stop(proc) == 0


# --- the docs say how it is defended ---------------------------------------------------------

#: variables of docker-compose.yml that are not lanegate settings
COMPOSE_VARIABLES = {"LANEGATE_REDIS_PASSWORD"}


def test_threat_model_covers_every_interface_with_stride() -> None:
    text = (ROOT / "docs" / "THREAT_MODEL.md").read_text()
    sections = {s.split("\n", 1)[0]: s for s in text.split("\n## ")[1:]}
    wanted = ("Public API", "Internal link", "Redis", "Blob store", "Webhooks", "Metrics",
              "Browser page")
    for name in wanted:
        (section,) = [body for title, body in sections.items() if title.startswith(name)]
        letters = {row.split("|")[1].strip() for row in section.splitlines()
                   if row.startswith("| ") and not row.startswith("| |")}
        assert letters, name
        assert set("".join(letters)) <= set("STRIDE/"), name
    public = next(body for title, body in sections.items() if title.startswith("Public API"))
    stride = {row.split("|")[1].strip() for row in public.splitlines() if row.startswith("| ")}
    assert set("STRIDE") <= set("".join(stride))


def test_security_docs_name_only_real_settings() -> None:
    names = {f"LANEGATE_{n.upper()}" for n in Settings.__dataclass_fields__}
    readme = (ROOT / "README.md").read_text()
    security = readme[readme.index("## Security"):readme.index("## Engines")]
    threat_model = (ROOT / "docs" / "THREAT_MODEL.md").read_text()
    for text in (security, threat_model):
        for variable in re.findall(r"LANEGATE_[A-Z_]+", text):
            assert variable in names | COMPOSE_VARIABLES, variable
    for setting in ("allow_anonymous", "webhook_allow_private", "redis_appendfsync",
                    "webhook_secret", "api_keys"):
        assert f"LANEGATE_{setting.upper()}" in security, setting
