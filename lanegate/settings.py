"""One settings object for every process.
(Over 400 lines: one field per setting, each with its documented default.)

Every field has an environment variable ``LANEGATE_<NAME>`` and a documented
default; fields marked ``cli`` also get a ``--name`` flag. Every number declares
its range beside its field (``ge``/``gt``/``le``, or ``choices``), and must be
finite: a value outside it is a :class:`SettingsError`, one line that names the
variable (or the flag it came from). ``lanegate settings
--markdown`` prints the README table from this file, so the docs cannot drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum
from typing import Any

from lanegate.redis_url import RedisUrlError, parse_redis_url

ENV_PREFIX = "LANEGATE_"


class EngineName(StrEnum):
    WHISPER = "whisper"
    POCKETSPHINX = "pocketsphinx"
    SIMULATED = "simulated"


class Device(StrEnum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class ComputeType(StrEnum):
    """CTranslate2's compute types; AUTO: int8 on CPU, float16 on CUDA."""

    AUTO = "auto"
    INT8 = "int8"
    INT8_FLOAT16 = "int8_float16"
    INT8_FLOAT32 = "int8_float32"
    INT8_BFLOAT16 = "int8_bfloat16"
    INT16 = "int16"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


@dataclass(frozen=True)
class Range:
    """The values a setting takes: bounds for a number (finite always), or a list."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[Any, ...] = ()

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is out of this range, or None."""
        if self.choices:
            return None if value in self.choices else f"use one of {self.text(', ')}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        if not math.isfinite(value):
            return f"must be a finite number ({self.text()})"
        low_ok = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        if low_ok and (self.le is None or value <= self.le):
            return None
        if self.ge is not None and self.le is not None:
            return f"must be from {_num(self.ge)} to {_num(self.le)}"
        words = [f"at least {_num(self.ge)}" if self.ge is not None else "",
                 f"above {_num(self.gt)}" if self.gt is not None else "",
                 f"at most {_num(self.le)}" if self.le is not None else ""]
        return "must be " + " and ".join(w for w in words if w)

    def text(self, sep: str = ", ") -> str:
        """The range as the README table writes it: ``1-65535``, ``> 0``, ``0-1``."""
        if self.choices:
            return sep.join(str(c) for c in self.choices)
        if self.ge is not None and self.le is not None:
            return f"{_num(self.ge)}-{_num(self.le)}"
        parts = [f">= {_num(self.ge)}" if self.ge is not None else "",
                 f"> {_num(self.gt)}" if self.gt is not None else "",
                 f"<= {_num(self.le)}" if self.le is not None else ""]
        return ", ".join(p for p in parts if p) or "any finite number"


def _num(x: float | None) -> str:
    if x is not None and float(x).is_integer():
        return str(int(x))
    return f"{x:g}"


#: a number whose field declares no range yet: finite and not negative
UNDECLARED = Range(ge=0)


def _s(default: Any, doc: str, *, cli: bool = False, ge: float | None = None,
       gt: float | None = None, le: float | None = None,
       choices: tuple[Any, ...] = ()) -> Any:
    """A setting: its default, its documentation, a ``--flag`` if ``cli``, and its range.

    A number declares its range here, beside the field: ``ge`` (at least), ``gt``
    (above), ``le`` (at most), or ``choices``; every number must also be finite.
    """
    metadata: dict[str, Any] = {"doc": doc, "cli": cli}
    if ge is not None or gt is not None or le is not None or choices:
        metadata["range"] = Range(ge=ge, gt=gt, le=le, choices=choices)
    return field(default=default, metadata=metadata)


def value_range(f: dataclasses.Field[Any]) -> Range | None:
    """The range a field declared; UNDECLARED for a number that declared none."""
    declared: Range | None = f.metadata.get("range")
    if declared is not None:
        return declared
    if isinstance(f.default, int | float) and not isinstance(f.default, bool | Enum):
        return UNDECLARED
    return None


@dataclass(frozen=True)
class Settings:
    # --- service ---------------------------------------------------------
    host: str = _s("127.0.0.1", "Address the gateway binds to.", cli=True)
    port: int = _s(8080, "Gateway port.", cli=True, ge=1, le=65535)
    redis_url: str = _s(
        "", "Redis URL: `redis://[:password@]host:port/db`, or through Sentinel "
        "`redis+sentinel://[:password@]host:port[,host:port]/service_name[/db]`. "
        "Empty: `lanegate up` starts its own redis-server child.", cli=True
    )
    data_dir: str = _s(
        "~/.lanegate", "Directory for the embedded redis data and the blob store.", cli=True
    )
    blob_dir: str = _s("", "Blob store directory for uploaded audio. Empty: DATA_DIR/blobs.")
    api_keys: str = _s(
        "", "Comma-separated API keys. Empty: auth is off (a warning is logged at start)."
    )
    allow_anonymous: bool = _s(
        False, "Let the gateway start with auth off (no API_KEYS) on an address other than "
        "loopback. Off: such a start is refused with an error (exit 2)."
    )
    log_level: str = _s("info", "Log level: debug, info, warning, error.", cli=True,
                        choices=("debug", "info", "warning", "error"))
    log_format: str = _s(
        "auto", "Log lines: `console` (readable), `json`, or `auto`: console when stderr is "
        "a terminal, JSON otherwise.", cli=True, choices=("auto", "console", "json")
    )
    event_loop: str = _s(
        "uvloop", "Event loop of the gateway and workers: `uvloop` (less CPU per socket "
        "operation) or `asyncio` (the standard library's).", choices=("uvloop", "asyncio")
    )
    lanes: str = _s(
        "split",
        "Design: `split` (realtime and batch lanes in separate processes) or `mixed` "
        "(one worker serves both in one loop, no chunk cap; for comparison).",
        cli=True, choices=("split", "mixed")
    )
    engine: EngineName = _s(
        EngineName.WHISPER, "Engine of both lanes: `whisper` (faster-whisper on CTranslate2), "
        "`pocketsphinx` (light, English only) or `simulated` (a GPU cost model).", cli=True)
    worker_id: str = _s("", "Worker id in the registry. Empty: host-pid.")
    pin_cpus: bool = _s(True, "`lanegate up`: pin the workers to disjoint CPU sets.")
    redis_appendfsync: str = _s(
        "everysec", "`lanegate up`'s redis-server `appendfsync`: `everysec` (an OS crash or "
        "power loss can lose the last second or two of writes), `always` (fsync every write: "
        "nothing acknowledged is lost, slower) or `no` (the OS decides when; up to ~30 s).",
        choices=("everysec", "always", "no")
    )
    realtime_workers: int = _s(
        1, "`lanegate up`: realtime worker processes to start (each with its own id and "
        "port; pinned, they split the realtime CPU half when it has a core for each).",
        cli=True, ge=1
    )

    # --- realtime lane ---------------------------------------------------
    worker_host: str = _s("127.0.0.1", "Address a worker binds its internal server to.")
    worker_port: int = _s(0, "Port of a worker's internal server. 0: a free port.", cli=True,
                          ge=0, le=65535)
    worker_advertise_host: str = _s(
        "", "Host the gateway uses to reach this worker. Empty: WORKER_HOST."
    )
    slots: int = _s(8, "Decoder slots (concurrent sessions) per realtime worker.", cli=True, ge=1)
    max_chunk_ms: int = _s(200, "Most audio one session contributes to one step.", ge=1)
    partial_interval_ms: int = _s(
        100, "Least time between two partials of one stream; a partial goes out only when "
        "its text changed. Finals are never delayed.", ge=0
    )
    step_budget_ms: float = _s(50.0, "Estimated compute at which a step stops adding work.", gt=0)
    chunk_cap: bool = _s(
        True, "Cap chunks and steps (capped chunked prefill). false: the `split-nocap` design."
    )
    cost_ewma_alpha: float = _s(0.2, "Weight of the newest step in the learned cost per second.",
                                gt=0, le=1)
    heartbeat_s: float = _s(1.0, "Worker heartbeat period into Redis.", gt=0)
    heartbeat_ttl_s: float = _s(3.0, "A worker whose heartbeat is older than this is gone.", gt=0)
    drain_timeout_s: float = _s(10.0, "On SIGTERM, how long active sessions may finish.", ge=0)
    link_timeout_s: float = _s(
        10.0, "A worker frees every slot of a gateway it has not heard from for this long "
        "(link or session socket), and a gateway declares a silent worker lost within it "
        "(WORKER_LOST_TIMEOUT_S if shorter).", gt=0
    )
    step_stall_s: float = _s(
        10.0, "A realtime step running longer than this means a hung engine: the worker "
        "leaves the registry, answers /readyz 503 and exits for its supervisor to restart.", gt=0
    )
    max_undecoded_s: float = _s(
        120.0, "Most audio one session may have buffered ahead of its decoder at a worker; a "
        "client sending faster than real time for longer gets `overloaded` (close 1013), "
        "its session alone. Keep it above SYNC_MAX_SECONDS (short uploads arrive at once).", gt=0
    )
    max_arrival_log: int = _s(
        20000, "Most entries in one session's arrival log at a worker (one per piece of "
        "audio that arrived after a pause); past it the session gets `overloaded` (1013).", ge=1
    )
    internal_token: str = _s(
        "", "Shared secret of a deployment's gateways and realtime workers: the gateway sends "
        "it on `/internal/v1/*`, a worker refuses (401) a request without it. Empty: not "
        "checked, and a worker refuses to start on a non-loopback WORKER_HOST. `lanegate up` "
        "generates one for its children."
    )

    # --- gateway limits --------------------------------------------------
    max_frame_bytes: int = _s(1_048_576, "Largest binary frame on /v1/stream (close 1009).", ge=1)
    max_session_s: float = _s(3600.0, "Longest audio one stream session may send.", gt=0)
    idle_timeout_s: float = _s(30.0, "A stream with no audio for this long is closed.", gt=0)
    max_session_wall_s: float = _s(
        7200.0, "Longest a stream may stay open, in wall-clock time, however little audio it "
        "sends (close 1008 `timeout`, after its last finals).", gt=0
    )
    min_realtime_ratio: float = _s(
        0.5, "A stream whose audio stays below this fraction of its wall time for longer than "
        "IDLE_TIMEOUT_S (audio < ratio x (open time - IDLE_TIMEOUT_S)) is closed `timeout`: "
        "a trickle of tiny frames cannot hold a slot. 0: off.", ge=0, le=1
    )
    realtime_park_after_s: float = _s(
        2.0, "An OpenAI Realtime or Deepgram live session that has sent no audio for this "
        "long, with no speech open and no commit unanswered, gives its decoder slot back "
        "(its audio so far finalized) and takes one again at its next audio; with speech "
        "still open it does so after IDLE_TIMEOUT_S. Its socket and per-key lease stay.",
        gt=0, le=3600
    )
    realtime_idle_timeout_s: float = _s(
        600.0, "An OpenAI Realtime API session with no audio and no client event for this "
        "long is closed `timeout` (a Deepgram live stream keeps Deepgram's rule: "
        "IDLE_TIMEOUT_S without audio or KeepAlive).",
        gt=0, le=86400
    )
    realtime_max_session_s: float = _s(
        1800.0, "Longest an OpenAI Realtime API session may stay open, in wall-clock time "
        "(OpenAI's own limit is 30 minutes); then it is closed `timeout` after its last "
        "finals.", gt=0, le=86400
    )
    max_sessions_per_key: int = _s(
        16, "Concurrent realtime sessions (streams and short uploads) per API key; with auth "
        "off, per client address. 0: no absolute cap.", ge=0
    )
    max_key_share: float = _s(
        0.5, "Most of the live realtime slots (all workers' slots in the registry) one API key "
        "(or, with auth off, one client address) may hold at once, combined with "
        "MAX_SESSIONS_PER_KEY (the lower wins; at least 1). 0 or 1: no share limit.", ge=0, le=1
    )
    max_stream_channels: int = _s(
        8, "Most audio channels one Deepgram `/v1/listen` stream may declare (`channels`); "
        "with `multichannel=true` each channel is a realtime session of its own, counted "
        "against MAX_SESSIONS_PER_KEY.", ge=1, le=64
    )
    deepgram_min_endpointing_ms: int = _s(
        300, "Deepgram `endpointing` values below this are raised to it: lanegate's VAD ends a "
        "segment on trailing silence alone, and a few tens of ms would cut between words.",
        ge=30, le=10000
    )
    body_read_timeout_s: float = _s(
        30.0, "Longest wait for the next bytes of a request body; a body that trickles slower "
        "is refused 408 `timeout` and its partial upload deleted.", gt=0
    )
    max_form_parts: int = _s(
        32, "Most parts in one multipart upload (the file and the option fields); more is 400 "
        "`too_many_parts`.", ge=1
    )
    max_field_bytes: int = _s(
        8192, "Largest text form field of an upload (400 `field_too_long`). Every byte of a "
        "multipart body (boundaries, part headers, empty values) also counts against "
        "MAX_UPLOAD_BYTES.", ge=1
    )
    upload_threads: int = _s(
        4, "Threads of the gateway's own pool for upload decoding, blob writes and webhook "
        "address lookups, so uploads never take the threads live streams use.", ge=1
    )
    min_free_disk: str = _s(
        "1%", "Free space the blob directory's filesystem keeps: new uploads are refused 507 "
        "`insufficient_storage` below it. Bytes (`5000000000`) or a percentage (`5%`). "
        "`0`: off."
    )
    metrics_cache_s: float = _s(
        2.0, "How long the gateway's cluster gauges (workers, queue depth, oldest job age) are "
        "reused between `/metrics` scrapes before Redis is read again.", ge=0
    )
    max_channel_events: int = _s(
        1000, "Most worker events the gateway holds for one stream whose client reads them "
        "too slowly; past it the stream ends with `overloaded` (1013) and its worker "
        "session is abandoned.", ge=1
    )
    link_linger_ms: float = _s(
        2.0, "How long the gateway holds audio for a worker link before sending it, so "
        "that many streams' frames leave in one message: fewer writes per stream for at "
        "most this much added latency (at 200 streams 2 ms took a median 14 % off the "
        "gateway's CPU in one A/B and no clear share in others: bench/results/notes.md). "
        "0 sends what one event-loop tick queued.",
        ge=0, le=50
    )
    worker_lost_timeout_s: float = _s(2.0, "A silent worker connection is lost after this.", gt=0)
    worker_connect_timeout_s: float = _s(
        5.0, "Opening a session on a worker (connect + `accepted`) may take this long before "
        "the gateway tries the next worker.", gt=0
    )
    failover_buffer_s: float = _s(
        40.0, "Audio the gateway keeps per stream since its last final, replayed to another "
        "worker when the stream's worker is lost (transparent failover). The soft cut keeps "
        "speech under MAX_WINDOW_S; past this bound (long silence, a worker far behind) the "
        "oldest audio is dropped, and its words may be missing after a failover. 0: no "
        "failover (a lost worker ends its streams with `worker_lost`).", ge=0
    )
    mixed_lost_timeout_s: float = _s(
        30.0, "`worker_lost_timeout_s` for a `mixed` worker, which cannot answer pings while "
        "it decodes an upload in its loop.", gt=0
    )
    session_lease_s: float = _s(
        30.0, "TTL of a stream's entry in the per-key session count in Redis (refreshed "
        "while the stream lives; frees the count if a gateway dies).", gt=0
    )
    gateway_lease_s: float = _s(
        3.0, "TTL of a gateway's heartbeat in Redis (refreshed every third of it): the "
        "per-key session count forgets the streams of a gateway that died (SIGKILL, lost "
        "host) this long after, so its clients' reconnects are admitted.", gt=0
    )
    start_timeout_s: float = _s(90.0, "`lanegate up`: how long the children may take to be ready.",
                                gt=0)
    stop_timeout_s: float = _s(
        15.0, "`lanegate up`: after SIGTERM, how long a child may take before SIGKILL.", gt=0
    )

    # --- Wyoming (Home Assistant) ------------------------------------------
    wyoming_port: int = _s(
        10300, "Wyoming (Home Assistant's speech protocol) on this TCP port of HOST, served by "
        "the gateway while auth is off (no API_KEYS): Wyoming has no authentication, so its "
        "callers are anonymous, counted per client address. With API_KEYS set it stays "
        "closed. 0: off.", cli=True, ge=0, le=65535
    )
    wyoming_max_event_bytes: int = _s(
        65536, "Largest Wyoming event header line, and largest data part, in bytes; a bigger "
        "one gets an `error` event and the connection is closed. Audio payloads are bounded "
        "by MAX_FRAME_BYTES.", ge=256, le=16_777_216
    )
    wyoming_max_connections: int = _s(
        256, "Most open Wyoming connections per gateway; one more gets an `error` event and is "
        "closed. A connection holds a decoder slot only while its audio flows.",
        ge=1, le=65535
    )

    # --- status page (GET /status) ----------------------------------------
    status_window_s: float = _s(
        30.0, "The status page's percentiles, shares and verdict cover this many recent "
        "seconds (since the gateway started, until it has watched that long).", gt=0
    )
    status_sample_s: float = _s(
        2.0, "The status page polls this often; the gateway samples its sources (its own "
        "metrics, each worker's /metrics, the registry, the queue) at most this often. 0: "
        "every read samples afresh.", ge=0
    )
    status_history: int = _s(150, "Samples kept for the status page's charts.", ge=1)
    status_red_line_ms: float = _s(
        300.0, "The realtime red line: live partial p99 above it while long uploads run "
        "means a `mixed` pool would gain from the split.", gt=0
    )
    status_scrape_timeout_s: float = _s(
        1.0, "How long the status page waits for one worker's /metrics, and for Redis's "
        "worker list and job backlog.", gt=0
    )

    # --- batch lane ------------------------------------------------------
    sync_max_seconds: float = _s(30.0, "Uploads up to this long are answered synchronously.", ge=0)
    upload_reserve_slots: int = _s(
        1, "Realtime slots kept free for live streams: a short upload is answered on the "
        "realtime lane only while more slots than this are free, else it becomes a job.", ge=0
    )
    max_upload_bytes: int = _s(512 * 1024 * 1024, "Largest upload accepted (413).", ge=1)
    max_audio_seconds: float = _s(4 * 3600.0, "Longest upload accepted (422).", gt=0)
    batch_max_audio_s: float = _s(
        200.0, "Most audio in one batch-engine call across jobs (200: Whisper's batch of 8 "
        "fills with 25 s decode windows).", gt=0
    )
    batch_window_s: float = _s(
        25.0, "Batch lane, Whisper transcription: consecutive VAD segments joined into "
        "one decode window up to this long, pauses included (Whisper hears 30 s at a "
        "time, and a sentence decoded alone loses the words around it); the transcript "
        "keeps one cue per segment. Translation and pocketsphinx decode each segment "
        "alone. 0: each segment alone.", ge=0, le=30
    )
    claim_idle_s: float = _s(60.0, "A job entry idle this long in a dead worker is reclaimed.",
                             gt=0)
    max_attempts: int = _s(3, "Deliveries of a job before it goes to the dead-letter stream.", ge=1)
    batch_max_jobs: int = _s(8, "Most jobs one batch worker holds (and batches across) at once.",
                             ge=1)
    batch_fair_window: int = _s(
        4, "Fair scheduling across API keys: most undelivered jobs on the job stream; the "
        "others wait in their key's own queue and join the stream one key at a time, "
        "round-robin. Smaller is fairer; at least 1.", ge=1
    )
    max_queued_jobs_per_key: int = _s(
        1000, "Unfinished (queued or processing) batch jobs one API key may have; more are "
        "refused 429 with Retry-After. 0: no limit.", ge=0
    )
    max_queued_audio_hours_per_key: float = _s(
        100.0, "Audio hours of one API key's unfinished batch jobs; a job that would pass it "
        "is refused 429 with Retry-After. 0: no limit.", ge=0
    )
    job_ttl_s: float = _s(7 * 86400.0, "How long finished jobs and results are kept.", gt=0)
    blob_sweep_interval_s: float = _s(
        600.0, "How often a batch worker sweeps orphaned audio blobs (a gateway that died "
        "before submit, jobs skipped or lost); one worker per interval. 0: never.", ge=0
    )
    blob_sweep_min_age_s: float = _s(
        3600.0, "A blob is swept only when nothing was written to it for this long and no "
        "queued or processing job has its id. Keep it above the longest upload.", ge=0
    )
    idempotency_ttl_s: float = _s(86400.0, "How long an Idempotency-Key maps to its job.", gt=0)
    wait_base_s: float = _s(
        30.0, "A request waiting for its transcript (a short upload on the realtime lane, an "
        "OpenAI request waiting for a batch job) times out after WAIT_BASE_S + "
        "WAIT_PER_AUDIO_S x audio seconds (504).", gt=0
    )
    wait_per_audio_s: float = _s(2.0, "Seconds of waiting allowed per audio second (504).", ge=0)
    webhook_secret: str = _s(
        "", "HMAC-SHA256 key for X-Lanegate-Signature on webhooks. Empty: webhooks are off "
        "(a job with `webhook_url` is refused 400 `webhooks_disabled`; nothing is sent unsigned)."
    )
    webhook_allow_private: bool = _s(
        False, "Let webhook URLs resolve to loopback and private (RFC 1918, CGNAT, IPv6 ULA) "
        "addresses, for internal receivers and tests. Link-local (cloud metadata), multicast, "
        "reserved and unspecified addresses are refused regardless."
    )
    webhook_max_response_bytes: int = _s(
        16384, "Most bytes of a webhook receiver's response body read; the rest is dropped.", ge=0
    )
    webhook_max_attempts: int = _s(8, "Webhook delivery attempts before giving up.", ge=1)
    webhook_backoff_s: float = _s(
        1.0, "First webhook retry delay; doubles each attempt (capped at 1 h), each delay "
        "jittered between half and all of it.", ge=0)
    webhook_timeout_s: float = _s(10.0, "Timeout of one webhook POST.", gt=0)

    # --- VAD -------------------------------------------------------------
    vad_aggressiveness: int = _s(2, "webrtcvad aggressiveness 0-3.", ge=0, le=3)
    vad_frame_ms: int = _s(30, "VAD frame length: 10, 20 or 30 ms.", choices=(10, 20, 30))
    endpoint_silence_ms: int = _s(600, "Trailing silence that ends a segment.", ge=1)
    pad_ms: int = _s(200, "Speech padding kept on both sides of a segment.", ge=0)
    min_speech_ms: int = _s(150, "Speech blips shorter than this are dropped.", ge=0)
    max_window_s: float = _s(25.0, "No segment is longer than this (soft cut).", gt=0)
    soft_cut_search_s: float = _s(3.0, "The soft cut looks for the quietest frame this far back.",
                                  ge=0)

    # --- engines ---------------------------------------------------------
    ps_hmm: str = _s("", "pocketsphinx acoustic model dir. Empty: the wheel's en-us model.")
    ps_lm: str = _s("", "pocketsphinx language model. Empty: the wheel's en-us LM.")
    ps_dict: str = _s("", "pocketsphinx dictionary. Empty: the wheel's cmudict.")
    ps_maxhmmpf: int = _s(1500, "pocketsphinx max active HMMs per frame (speed knob).", ge=1)
    ps_ds: int = _s(2, "pocketsphinx frame downsampling (speed knob).", ge=1)
    ps_fwdflat: bool = _s(
        False, "pocketsphinx second pass at the end of each realtime utterance (about "
        "25 ms per audio second in one call; the batch decoder always runs it).",
    )
    whisper_model: str = _s(
        "base", "Whisper model: a bundled name (`base`; see `lanegate models`) or a "
        "CTranslate2 Whisper directory. Nothing is downloaded.", cli=True)
    device: Device = _s(Device.AUTO, "Whisper device: `auto` (CUDA if a GPU is visible), "
                        "`cpu` or `cuda`.", cli=True)
    compute_type: ComputeType = _s(
        ComputeType.AUTO, "Whisper compute type (CTranslate2's: `int8`, `int8_float16`, "
        "`int8_float32`, `int8_bfloat16`, `int16`, `float16`, `bfloat16`, `float32`). "
        "`auto`: `int8` on CPU, `float16` on CUDA.")
    cpu_threads: int = _s(0, "Whisper threads on CPU. 0: the CPUs this process may run on "
                          "(its lane's CPU set).", ge=0)
    beam_size: int = _s(1, "Whisper beam size (1: greedy, the fastest).", ge=1)
    whisper_batch_size: int = _s(8, "Batch lane: decode windows in one batched Whisper call.", ge=1)
    whisper_pad_ms: int = _s(
        500, "Trailing silence encoded after a segment: with less the decoder more often "
        "says the sentence again; more costs encoder time (figures in docs/ARCHITECTURE.md).", ge=0)
    whisper_step_budget_ms: float = _s(
        1000.0, "`step_budget_ms` for Whisper: a step's estimated encoder + decoder time, "
        "at which it stops adding sessions (a step always holds one).", gt=0)
    whisper_tokens_per_s: float = _s(
        5.0, "Most tokens Whisper generates per audio second (+8) in one decode (speech takes "
        "3-4; a decoder looping on noise stops there).", gt=0)
    no_speech_threshold: float = _s(
        0.6, "Whisper: a decode whose no-speech probability is above this gives no text if "
        "its average token log-probability is also below LOGPROB_THRESHOLD / 2.", ge=0, le=1)
    logprob_threshold: float = _s(
        -1.4, "Whisper: a decode whose average token log-probability is below this gives no "
        "text (brown noise decodes near -1.9, espeak-ng English above -0.5, its Spanish "
        "near -1.0).", le=0)
    compression_ratio_threshold: float = _s(
        3.0, "Whisper: text that compresses (zlib) by more than this is a decoder loop, "
        "not speech, and is dropped (a 23 s segment saying sentences twice: up to 2.7).", gt=0)
    whisper_commit_margin_ms: int = _s(
        500, "Realtime Whisper: a word is committed (shown in partials) only if it ends "
        "this far before the end of the audio so far.", ge=0)
    whisper_commit_lag_ms: int = _s(
        1000, "Realtime Whisper: a word that ends this far before the end of the audio so far "
        "is committed even if two decodes did not agree on it (partials never stall while "
        "speech flows; the final corrects it). At least WHISPER_COMMIT_MARGIN_MS.",
        ge=0, le=10000)
    whisper_step_window_s: float = _s(
        10.0, "Realtime Whisper: most audio one step re-decodes; a longer segment is decoded "
        "for good in pieces at its pauses, so its final decodes about this much too.",
        ge=2, le=30)
    whisper_lookback_ms: int = _s(
        1000, "Realtime Whisper: committed speech a step's window re-decodes before the first "
        "word not yet committed (acoustic context; the words it says again are dropped).",
        ge=0, le=10000)
    sim_step_fixed_ms: float = _s(3.0, "Simulated engine: fixed cost per step (ms).", ge=0)
    sim_prefill_frame_ms: float = _s(0.02, "Simulated engine: cost per 10 ms audio frame (ms).",
                                     ge=0)
    sim_decode_seq_ms: float = _s(0.05, "Simulated engine: cost per sequence in a step (ms).", ge=0)
    sim_busy_wait: bool = _s(
        False, "Simulated engine: spin (holding the GIL, like a CPU engine) instead of sleeping."
    )
    sim_fail_on: str = _s(
        "", "Simulated engine, fault injection for tests: a batch decode of audio whose "
        "made-up transcript contains this word raises `SimulatedFault`, as a real engine "
        "that chokes on one input would. Empty: never."
    )
    sim_fail_exit: bool = _s(
        False, "Simulated engine, fault injection for tests: on SIM_FAIL_ON, end the process "
        "at once (exit 70, no clean-up), as a native engine that crashes would."
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            if isinstance(f.default, Enum):
                object.__setattr__(self, f.name, _as_enum(f.name, type(f.default),
                                                          getattr(self, f.name)))
        for f in fields(self):
            check_value(f.name, getattr(self, f.name))
        if self.redis_url:
            try:
                parse_redis_url(self.redis_url)
            except RedisUrlError as exc:
                raise SettingsError(f"{ENV_PREFIX}REDIS_URL: {exc}") from None
        self.free_disk_floor(0)  # raises for a malformed MIN_FREE_DISK

    def step_budget(self, *, redecodes: bool) -> float:
        """The realtime step budget (ms) an engine runs under: a re-decoding engine
        (Whisper, ``CostPrior.redecodes``) has its own, WHISPER_STEP_BUDGET_MS."""
        return self.whisper_step_budget_ms if redecodes else self.step_budget_ms

    def free_disk_floor(self, total_bytes: int) -> int:
        """The bytes ``min_free_disk`` keeps free on a filesystem of ``total_bytes``."""
        raw = self.min_free_disk.strip()
        try:
            if raw.endswith("%"):
                share = float(raw[:-1])
                if not 0.0 <= share <= 100.0:
                    raise ValueError(raw)
                return int(total_bytes * share / 100.0)
            floor = int(raw)
            if floor < 0:
                raise ValueError(raw)
            return floor
        except ValueError:
            raise SettingsError(f"{ENV_PREFIX}MIN_FREE_DISK={self.min_free_disk!r}: use a byte "
                                "count (5000000000) or a percentage (5%)") from None

    @property
    def api_key_set(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())

    @property
    def data_path(self) -> str:
        return os.path.abspath(os.path.expanduser(self.data_dir))

    @property
    def blob_path(self) -> str:
        if self.blob_dir:
            return os.path.abspath(os.path.expanduser(self.blob_dir))
        return os.path.join(self.data_path, "blobs")

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, **overrides: Any
    ) -> Settings:
        """Defaults, then ``LANEGATE_*`` variables, then explicit overrides."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = parse_value(f.name, type(f.default), raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The environment that reproduces these settings in a child process."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[ENV_PREFIX + f.name.upper()] = (
                ("true" if value else "false") if isinstance(value, bool) else str(value)
            )
        return out


class SettingsError(ValueError):
    """A setting has a value that cannot be used."""


class Appendfsync(enum.StrEnum):
    """Redis ``appendfsync``: when the AOF reaches the disk."""

    EVERYSEC = "everysec"
    ALWAYS = "always"
    NO = "no"

_FIELDS = {f.name: f for f in fields(Settings)}


def check_value(name: str, value: Any, flag: str | None = None) -> None:
    """Raise :class:`SettingsError` if ``value`` is outside the range of setting ``name``.

    The message is one line naming the environment variable, or the ``flag`` the value
    came from and then the variable.
    """
    rng = value_range(_FIELDS[name])
    problem = rng.problem(value) if rng is not None else None
    if problem is not None:
        env = ENV_PREFIX + name.upper()
        where = f"{env}={value!r}" if flag is None else f"{flag}={value!r} ({env})"
        raise SettingsError(f"{where}: {problem}")


def _as_enum(name: str, kind: type[Enum], value: Any) -> Enum:
    try:
        return kind(value)
    except ValueError:
        raise SettingsError(
            f"{ENV_PREFIX}{name.upper()}={value!r}: use one of "
            f"{', '.join(str(m.value) for m in kind)}") from None


def parse_value(name: str, kind: type, raw: str) -> Any:
    if issubclass(kind, Enum):
        return _as_enum(name, kind, raw.strip())
    return _parse_plain(name, kind, raw)


def _parse_plain(name: str, kind: Any, raw: str) -> Any:
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered in {"1", "true", "yes", "on"}:
                return True
            if lowered in {"0", "false", "no", "off"}:
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError as exc:
        raise SettingsError(
            f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind.__name__}"
        ) from exc


def setting_names() -> frozenset[str]:
    return frozenset(f.name for f in fields(Settings))


def env_names() -> frozenset[str]:
    return frozenset(ENV_PREFIX + n.upper() for n in setting_names())


def add_cli_flags(parser: argparse.ArgumentParser, names: Sequence[str] | None = None) -> None:
    """Add ``--flag`` options for the settings marked ``cli`` (or the ones named)."""
    for f in fields(Settings):
        wanted = f.name in names if names is not None else f.metadata.get("cli", False)
        if not wanted:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = type(f.default)
        if kind is bool:
            parser.add_argument(
                flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                help=f"{f.metadata['doc']} Default: {f.default!r}. "
                f"(env {ENV_PREFIX}{f.name.upper()})",
            )
        elif isinstance(f.default, Enum):
            values = [str(m.value) for m in type(f.default)]
            parser.add_argument(
                flag, dest=f.name, default=None, type=str, metavar="{" + ",".join(values) + "}",
                help=f"{f.metadata['doc']} Default: {f.default.value}. "
                f"(env {ENV_PREFIX}{f.name.upper()})",
            )
        else:
            parser.add_argument(
                flag, dest=f.name, default=None, type=kind,
                help=f"{f.metadata['doc']} Default: {f.default!r}. "
                f"(env {ENV_PREFIX}{f.name.upper()})",
            )


def from_args(args: argparse.Namespace) -> Settings:
    """Settings from the environment and the flags; a bad flag's error names the flag."""
    overrides = {n: getattr(args, n) for n in setting_names() if hasattr(args, n)}
    for name, value in overrides.items():
        if value is not None and not isinstance(_FIELDS[name].default, Enum):
            check_value(name, value, flag="--" + name.replace("_", "-"))
    return Settings.from_env(**overrides)


def markdown_table() -> str:
    rows = ["| setting | env | default | range | meaning |", "|---|---|---|---|---|"]
    for f in fields(Settings):
        flag = f" / `--{f.name.replace('_', '-')}`" if f.metadata.get("cli") else ""
        default = repr(f.default) if not isinstance(f.default, str) else f'"{f.default}"'
        rng = value_range(f)
        allowed = rng.text() if rng is not None else ""
        rows.append(
            f"| `{f.name}`{flag} | `{ENV_PREFIX}{f.name.upper()}` | `{default}` "
            f"| {allowed} | {f.metadata['doc']} |"
        )
    return "\n".join(rows)
