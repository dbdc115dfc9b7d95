"""One settings object for every process.

Every field has an environment variable ``LANEGATE_<NAME>`` and a documented
default; fields marked ``cli`` also get a ``--name`` flag. ``lanegate settings
--markdown`` prints the README table from this file, so the docs cannot drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

ENV_PREFIX = "LANEGATE_"


def _s(default: Any, doc: str, *, cli: bool = False) -> Any:
    return field(default=default, metadata={"doc": doc, "cli": cli})


@dataclass(frozen=True)
class Settings:
    # --- service ---------------------------------------------------------
    host: str = _s("127.0.0.1", "Address the gateway binds to.", cli=True)
    port: int = _s(8080, "Gateway port.", cli=True)
    redis_url: str = _s(
        "", "Redis URL. Empty: `lanegate up` starts its own redis-server child.", cli=True
    )
    data_dir: str = _s(
        "~/.lanegate", "Directory for the embedded redis data and the blob store.", cli=True
    )
    blob_dir: str = _s("", "Blob store directory for uploaded audio. Empty: DATA_DIR/blobs.")
    api_keys: str = _s(
        "", "Comma-separated API keys. Empty: auth is off (a warning is logged at start)."
    )
    log_level: str = _s("info", "Log level: debug, info, warning, error.", cli=True)
    event_loop: str = _s(
        "uvloop", "Event loop of the gateway and workers: `uvloop` (less CPU per socket "
        "operation) or `asyncio` (the standard library's)."
    )
    lanes: str = _s(
        "split",
        "Design: `split` (realtime and batch lanes in separate processes) or `mixed` "
        "(one worker serves both in one loop, no chunk cap; for comparison).",
        cli=True,
    )
    engine: str = _s("pocketsphinx", "Engine: `pocketsphinx` or `simulated`.", cli=True)
    worker_id: str = _s("", "Worker id in the registry. Empty: host-pid.")
    pin_cpus: bool = _s(True, "`lanegate up`: pin the workers to disjoint CPU sets.")

    # --- realtime lane ---------------------------------------------------
    worker_host: str = _s("127.0.0.1", "Address a worker binds its internal server to.")
    worker_port: int = _s(0, "Port of a worker's internal server. 0: a free port.", cli=True)
    worker_advertise_host: str = _s(
        "", "Host the gateway uses to reach this worker. Empty: WORKER_HOST."
    )
    slots: int = _s(8, "Decoder slots (concurrent sessions) per realtime worker.", cli=True)
    max_chunk_ms: int = _s(200, "Most audio one session contributes to one step.")
    step_budget_ms: float = _s(50.0, "Estimated compute at which a step stops adding work.")
    chunk_cap: bool = _s(
        True, "Cap chunks and steps (capped chunked prefill). false: the `split-nocap` design."
    )
    cost_ewma_alpha: float = _s(0.2, "Weight of the newest step in the learned cost per second.")
    heartbeat_s: float = _s(1.0, "Worker heartbeat period into Redis.")
    heartbeat_ttl_s: float = _s(3.0, "A worker whose heartbeat is older than this is gone.")
    drain_timeout_s: float = _s(10.0, "On SIGTERM, how long active sessions may finish.")

    # --- gateway limits --------------------------------------------------
    max_frame_bytes: int = _s(1_048_576, "Largest binary frame on /v1/stream (close 1009).")
    max_session_s: float = _s(3600.0, "Longest audio one stream session may send.")
    idle_timeout_s: float = _s(30.0, "A stream with no audio for this long is closed.")
    max_sessions_per_key: int = _s(16, "Concurrent stream sessions per API key.")
    worker_lost_timeout_s: float = _s(2.0, "A silent worker connection is lost after this.")
    worker_connect_timeout_s: float = _s(
        5.0, "Opening a session on a worker (connect + `accepted`) may take this long before "
        "the gateway tries the next worker."
    )
    mixed_lost_timeout_s: float = _s(
        30.0, "`worker_lost_timeout_s` for a `mixed` worker, which cannot answer pings while "
        "it decodes an upload in its loop."
    )
    session_lease_s: float = _s(
        30.0, "TTL of a stream's entry in the per-key session count in Redis (refreshed "
        "while the stream lives; frees the count if a gateway dies)."
    )
    start_timeout_s: float = _s(90.0, "`lanegate up`: how long the children may take to be ready.")
    stop_timeout_s: float = _s(
        15.0, "`lanegate up`: after SIGTERM, how long a child may take before SIGKILL."
    )

    # --- batch lane ------------------------------------------------------
    sync_max_seconds: float = _s(30.0, "Uploads up to this long are answered synchronously.")
    upload_reserve_slots: int = _s(
        1, "Realtime slots kept free for live streams: a short upload is answered on the "
        "realtime lane only while more slots than this are free, else it becomes a job."
    )
    max_upload_bytes: int = _s(512 * 1024 * 1024, "Largest upload accepted (413).")
    max_audio_seconds: float = _s(4 * 3600.0, "Longest upload accepted (422).")
    batch_max_audio_s: float = _s(120.0, "Most audio in one batch-engine call across jobs.")
    claim_idle_s: float = _s(60.0, "A job entry idle this long in a dead worker is reclaimed.")
    max_attempts: int = _s(3, "Deliveries of a job before it goes to the dead-letter stream.")
    batch_max_jobs: int = _s(8, "Most jobs one batch worker holds (and batches across) at once.")
    job_ttl_s: float = _s(7 * 86400.0, "How long finished jobs and results are kept.")
    idempotency_ttl_s: float = _s(86400.0, "How long an Idempotency-Key maps to its job.")
    wait_base_s: float = _s(
        30.0, "A request waiting for its transcript (a short upload on the realtime lane, an "
        "OpenAI request waiting for a batch job) times out after WAIT_BASE_S + "
        "WAIT_PER_AUDIO_S x audio seconds (504).",
    )
    wait_per_audio_s: float = _s(2.0, "Seconds of waiting allowed per audio second (504).")
    webhook_secret: str = _s("", "HMAC-SHA256 key for X-Lanegate-Signature on webhooks.")
    webhook_max_attempts: int = _s(8, "Webhook delivery attempts before giving up.")
    webhook_backoff_s: float = _s(1.0, "First webhook retry delay; doubles each attempt.")
    webhook_timeout_s: float = _s(10.0, "Timeout of one webhook POST.")

    # --- VAD -------------------------------------------------------------
    vad_aggressiveness: int = _s(2, "webrtcvad aggressiveness 0-3.")
    vad_frame_ms: int = _s(30, "VAD frame length: 10, 20 or 30 ms.")
    endpoint_silence_ms: int = _s(600, "Trailing silence that ends a segment.")
    pad_ms: int = _s(200, "Speech padding kept on both sides of a segment.")
    min_speech_ms: int = _s(150, "Speech blips shorter than this are dropped.")
    max_window_s: float = _s(25.0, "No segment is longer than this (soft cut).")
    soft_cut_search_s: float = _s(3.0, "The soft cut looks for the quietest frame this far back.")

    # --- engines ---------------------------------------------------------
    ps_hmm: str = _s("", "pocketsphinx acoustic model dir. Empty: the wheel's en-us model.")
    ps_lm: str = _s("", "pocketsphinx language model. Empty: the wheel's en-us LM.")
    ps_dict: str = _s("", "pocketsphinx dictionary. Empty: the wheel's cmudict.")
    ps_maxhmmpf: int = _s(1500, "pocketsphinx max active HMMs per frame (speed knob).")
    ps_ds: int = _s(2, "pocketsphinx frame downsampling (speed knob).")
    ps_fwdflat: bool = _s(
        False, "pocketsphinx second pass at the end of each realtime utterance (about "
        "25 ms per audio second in one call; the batch decoder always runs it).",
    )
    sim_step_fixed_ms: float = _s(3.0, "Simulated engine: fixed cost per step (ms).")
    sim_prefill_frame_ms: float = _s(0.02, "Simulated engine: cost per 10 ms audio frame (ms).")
    sim_decode_seq_ms: float = _s(0.05, "Simulated engine: cost per sequence in a step (ms).")
    sim_busy_wait: bool = _s(
        False, "Simulated engine: spin (holding the GIL, like a CPU engine) instead of sleeping."
    )

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise SettingsError(
                    f"{ENV_PREFIX}{name.upper()}={getattr(self, name)!r}: "
                    f"use one of {', '.join(allowed)}"
                )
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
                raise SettingsError(f"{ENV_PREFIX}{f.name.upper()}={value!r} must not be negative")

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


_CHOICES: dict[str, tuple[str, ...]] = {
    "lanes": ("split", "mixed"),
    "engine": ("pocketsphinx", "simulated"),
    "log_level": ("debug", "info", "warning", "error"),
    "event_loop": ("uvloop", "asyncio"),
}


def parse_value(name: str, kind: type, raw: str) -> Any:
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
                help=f"{f.metadata['doc']} (env {ENV_PREFIX}{f.name.upper()})",
            )
        else:
            parser.add_argument(
                flag, dest=f.name, default=None, type=kind,
                help=f"{f.metadata['doc']} Default: {f.default!r}. "
                f"(env {ENV_PREFIX}{f.name.upper()})",
            )


def from_args(args: argparse.Namespace) -> Settings:
    overrides = {n: getattr(args, n) for n in setting_names() if hasattr(args, n)}
    return Settings.from_env(**overrides)


def markdown_table() -> str:
    rows = ["| setting | env | default | meaning |", "|---|---|---|---|"]
    for f in fields(Settings):
        flag = f" / `--{f.name.replace('_', '-')}`" if f.metadata.get("cli") else ""
        default = repr(f.default) if not isinstance(f.default, str) else f'"{f.default}"'
        rows.append(
            f"| `{f.name}`{flag} | `{ENV_PREFIX}{f.name.upper()}` | `{default}` "
            f"| {f.metadata['doc']} |"
        )
    return "\n".join(rows)
