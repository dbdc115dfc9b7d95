"""``GET /openapi.json``: a valid OpenAPI 3.1 document, naming every route the app
registers, and the live gateway answering as it says (schemathesis, real stack).

The stack has auth on: schemathesis sends the key (and checks that requests
without it are refused), generates bounded examples for every operation, and
checks every response: no 5xx, and status, content type, headers and body as
documented.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance
from stack import REPO, Stack, start_stack

from gateway.app import create_app
from gateway.openapi import build
from lanegate.settings import Settings
from lanes.job_protocol import JobStatus

KEY = "openapi-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: examples per operation: enough to reach every documented error path once or twice
EXAMPLES = 40
#: the command-line run: examples per operation and phase, and a fixed seed so a CI
#: failure can be replayed (`schemathesis run ... --seed SEED`)
CLI_EXAMPLES = 25
CLI_SEED = "20261201"
#: no documented route or method is missing, nor one documented that does not exist
METHODS = frozenset({"get", "post", "put", "patch", "delete"})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(tmp_path_factory.mktemp("openapi-stack"), batch=False,
                          settings={"LANEGATE_API_KEYS": KEY})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def served(stack: Stack) -> dict[str, Any]:
    with urllib.request.urlopen(stack.url + "/openapi.json", timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("application/json")
        document: dict[str, Any] = json.load(resp)
    return document


def test_served_document_is_valid_openapi_31(served: dict[str, Any]) -> None:
    validate(served)  # raises on any violation of the 3.1 schema or a dangling $ref
    assert served["openapi"].startswith("3.1")
    assert served == build()


def _registered_routes() -> set[tuple[str, str]]:
    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0"))
    return {(route.method.lower(), route.resource.canonical)
            for route in app.router.routes()
            if route.resource is not None and route.method != "HEAD"}


def _documented_routes(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method, path) for path, item in document["paths"].items()
            for method in item if method in METHODS}


def test_every_registered_route_is_documented() -> None:
    registered = _registered_routes()
    documented = _documented_routes(build())
    assert ("post", "/v1/transcriptions") in registered  # the walk sees the real router
    assert registered - documented == set(), "routes missing from /openapi.json"
    assert documented - registered == set(), "documented routes the app does not have"


def test_every_operation_documents_its_errors_as_json() -> None:
    for path, item in build()["paths"].items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                content = set(response.get("content", {}))
                if int(status) < 400 or content == {"text/plain"}:  # the HTTP layer's 400
                    continue
                assert "application/json" in content, (method, path, status)


@pytest.fixture(scope="module")
def api_schema(stack: Stack) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(stack.url + "/openapi.json")


def _queued_job(stack: Stack, wav: Path) -> str:
    """A real job: the stack has no batch worker, so it stays queued."""
    request = urllib.request.Request(
        stack.url + "/v1/transcriptions?async=true", data=wav.read_bytes(), method="POST",
        headers={**AUTH, "Content-Type": "audio/wav"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.status == 202
        job_id: str = json.load(resp)["id"]
    return job_id


def _cases(document: dict[str, Any]) -> list[tuple[str, str, GenerationMode]]:
    """Valid input for every operation; invalid input for each that takes any.

    ``/v1/stream`` validates its query after the WebSocket upgrade (an ``error``
    event, ``tests/test_gateway_stream.py``); over plain HTTP every request to it
    is a 426, so only its valid-input run applies here; so is every plain GET of
    Deepgram's live ``/v1/listen``."""
    cases = []
    for method, path in sorted(_documented_routes(document)):
        operation = document["paths"][path][method]
        cases.append((method, path, GenerationMode.POSITIVE))
        takes_input = "parameters" in operation or "requestBody" in operation
        if takes_input and path != "/v1/stream" and (method, path) != ("get", "/v1/listen"):
            cases.append((method, path, GenerationMode.NEGATIVE))
    return cases


# schemathesis's own pytest loader (``from_fixture`` + ``parametrize``) does not run
# under pytest 9; each operation gets a hypothesis test of its generated cases here.
@pytest.mark.parametrize(("method", "path", "mode"), _cases(build()),
                         ids=lambda value: getattr(value, "value", value))
def test_live_gateway_conforms(api_schema: schemathesis.BaseSchema, method: str, path: str,
                               mode: GenerationMode) -> None:
    operation = api_schema[path][method.upper()]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case) -> None:
        # Valid-looking uploads are random bytes, not audio, so a 4xx for schema-valid
        # input is right here; every other check (no 5xx, status, content type,
        # headers, body, refused without the key, refused for invalid input) applies.
        case.call_and_validate(headers=AUTH, excluded_checks=[positive_data_acceptance])

    check()


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_live_gateway_conforms_for_a_real_job(api_schema: schemathesis.BaseSchema, stack: Stack,
                                              speech: Callable[..., Path], method: str) -> None:
    """Generated queries for a job that exists: the job JSON, 409 for a result not yet
    there, the cancelled job, 409 for cancelling it twice, all as documented."""
    job_id = _queued_job(stack, speech("one two three"))
    operation = api_schema["/v1/transcriptions/{job_id}"][method]
    statuses: set[int] = set()

    @given(case=operation.as_strategy(path_parameters={"job_id": job_id}))
    @settings(max_examples=EXAMPLES // 2, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case) -> None:
        response = case.call_and_validate(headers=AUTH,
                                          excluded_checks=[positive_data_acceptance])
        statuses.add(response.status_code)

    check()
    assert 200 in statuses  # the job itself was reached, not only 404s


def test_schemathesis_command_line_finds_nothing(stack: Stack, tmp_path: Path) -> None:
    """The README's command (every phase: examples, coverage, fuzzing, stateful), with
    the repository's ``schemathesis.toml``; its crash cache goes to ``tmp_path``."""
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--config-file",
         str(REPO / "schemathesis.toml"), "run", stack.url + "/openapi.json",
         "-n", str(CLI_EXAMPLES), "--seed", CLI_SEED, "-H", f"Authorization: Bearer {KEY}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False)
    assert run.returncode == 0, run.stdout[-6000:]


BOUNDARY = "lanegate-boundary"
#: the 500s schemathesis found, kept as plain regression cases
MALFORMED = {
    "control character in a part header": (
        f"multipart/form-data; boundary={BOUNDARY}",
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="\x13"\r\n\r\n1\r\n'
        f"--{BOUNDARY}--\r\n"),
    "no boundary": ("multipart/form-data", "--x\r\n\r\n--x--\r\n"),
}


@pytest.mark.parametrize("path", ["/v1/transcriptions", "/v1/audio/transcriptions"])
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_multipart_is_a_json_400(stack: Stack, path: str, case: str) -> None:
    content_type, body = MALFORMED[case]
    request = urllib.request.Request(stack.url + path, data=body.encode(), method="POST",
                                     headers={**AUTH, "Content-Type": content_type})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400
    error = json.load(refused.value)["error"]
    assert error["code"] == "bad_request"
    assert "multipart" in error["message"]


#: language tags as users send them; the first nine are accepted (``en_US`` and
#: ``zh-Hant-TW`` were refused by the document's own copy of the rule, issue 34)
LANGUAGES_ACCEPTED = ("en", "EN", "en-US", "en_US", "zh-Hant-TW", "yue", "sr-Latn-RS",
                      "de-CH-1996", "")
LANGUAGES_REFUSED = ("e", "english", "en-", "en--us", "en US", "1en", "en-toolongtag",
                     "en.us", "en;drop")


def _parameter_schema(document: dict[str, Any], path: str, name: str) -> dict[str, Any]:
    for parameter in document["paths"][path]["get"]["parameters"]:
        if parameter["name"] == name:
            schema: dict[str, Any] = parameter["schema"]
            return schema
    raise AssertionError(f"{path} documents no {name!r}")


async def _stream_accepts(url: str, language: str) -> bool:
    """Open /v1/stream as a client would: ``ready`` (accepted) or ``bad_request``."""
    async with aiohttp.ClientSession() as http, http.ws_connect(
            url + "/v1/stream", params={"language": language, "api_key": KEY}) as ws:
        first = await ws.receive_json(timeout=30)
        if first["type"] == "ready":
            return True
        assert (first["type"], first["code"]) == ("error", "bad_request"), first
        return False


def test_the_document_and_the_stream_endpoint_agree_on_languages(stack: Stack) -> None:
    validator = Draft202012Validator(_parameter_schema(build(), "/v1/stream", "language"))
    for language in LANGUAGES_ACCEPTED + LANGUAGES_REFUSED:
        documented = validator.is_valid(language)
        accepted = asyncio.run(_stream_accepts(stack.url, language))
        assert (language, documented) == (language, accepted)
        assert (language, accepted) == (language, language in LANGUAGES_ACCEPTED)


def test_job_statuses_are_the_job_protocols() -> None:
    job = build()["components"]["schemas"]["Job"]
    assert job["properties"]["status"]["enum"] == [s.value for s in JobStatus]
