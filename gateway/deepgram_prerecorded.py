"""Deepgram's prerecorded API, ``POST /v1/listen`` (README, "Deepgram API"): the body's
audio through the upload path (``take_upload``, ``serve_upload``), answered in
Deepgram's response shape (``lanegate/deepgram_response.py``) from the realtime lane,
or from a batch job the request waits for.

``callback=URL`` makes it a batch job at once, answered ``{"request_id"}``: the job's
``response_format`` is ``deepgram``, so the batch worker's webhook dispatcher POSTs
Deepgram's response to the URL (``lanegate/webhooks.py``), under the webhook address
policy, signature and retries. A JSON body (Deepgram's ``{"url": ...}``) is refused:
lanegate fetches no audio. The audio is one channel: the upload path mixes it down.
"""

from __future__ import annotations

import uuid

from aiohttp import web

from gateway.auth import lease_subject
from gateway.deepgram_params import DeepgramParams, check_key, http_error, params_or_400
from gateway.dispatch import Transcribed, UploadAsk, serve_upload, take_upload, wait_for_job
from gateway.intake import UploadError
from gateway.state import SETTINGS, UPLOAD_POOL
from gateway.uploads import check_webhook, count_rejection, parse_webhook_url
from lanegate.deepgram_response import DEEPGRAM_FORMAT, created_now, prerecorded, request_id
from lanes.routing import Lane, wait_timeout_s


async def transcribe(request: web.Request) -> web.StreamResponse:
    """``POST /v1/listen``: the body's audio, answered in Deepgram's prerecorded shape."""
    app = request.app
    settings = app[SETTINGS]
    rid = request_id(uuid.uuid4().hex)
    tenant = check_key(request, rid)
    if request.content_type == "application/json":
        raise http_error(400, "Bad Request", "lanegate does not fetch audio from a URL: POST "
                         "the audio itself as the request body (Content-Type: audio/wav, "
                         "application/octet-stream, ...)", rid)
    params = params_or_400(request, rid, live=False)
    callback = None
    try:
        if params.callback is not None:
            callback = parse_webhook_url(params.callback)

        async def check(_: DeepgramParams) -> None:
            if callback is not None:
                await check_webhook(callback, settings, app[UPLOAD_POOL])

        upload, _, decoded = await take_upload(request, fields=frozenset(), strict=False,
                                               raw_allowed=True, parse=lambda _: params,
                                               check=check)
        rid = request_id(upload.upload_id)
        ask = UploadAsk(tenant=tenant, language=params.language, prompt=params.prompt,
                        subject=lease_subject(request, tenant), webhook_url=callback,
                        async_requested=callback is not None,
                        response_format=DEEPGRAM_FORMAT if callback else "json")
        served = await serve_upload(app, upload, decoded, ask)
        if isinstance(served, Transcribed):
            transcript, lane = served.transcript, Lane.REALTIME
        elif callback is not None:
            return web.json_response({"request_id": request_id(served.job.id)},
                                     headers={"dg-request-id": request_id(served.job.id),
                                              "X-Lanegate-Lane": Lane.BATCH})
        else:
            transcript = await wait_for_job(app, served.job, tenant,
                                            wait_timeout_s(decoded.seconds, settings))
            lane = Lane.BATCH
    except UploadError as exc:
        count_rejection(exc)
        raise http_error(exc.status, exc.code, exc.message, rid, exc.headers) from None
    body = prerecorded(transcript, rid=rid, created=created_now(),
                       detected=params.language == "")
    return web.json_response(body, headers={"dg-request-id": rid, "X-Lanegate-Lane": lane})
