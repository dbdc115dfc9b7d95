"""A Realtime API transcription session's configuration: parsed from ``session.update``
(the GA shape) or ``transcription_session.update`` (the beta shape), rendered back in
either shape for ``session.created``/``session.updated``.

``turn_detection`` maps onto lanegate's VAD (webrtcvad) like this:

* ``threshold`` (0-1, speech probability) -> ``vad_aggressiveness`` 0-3:
  ``floor(threshold * 4)``, capped at 3 (OpenAI's default 0.5 is our default 2);
* ``prefix_padding_ms`` -> ``pad_ms`` (padding kept before, and after, the speech);
* ``silence_duration_ms`` -> ``endpoint_silence_ms`` (at least one VAD frame);
* ``null`` -> no endpointing: a turn ends only when the client commits (or at the
  max-window soft cut, or the end of the stream);
* ``semantic_vad`` is refused (lanegate has no semantic turn model).

A field not given keeps the service's setting. ``idle_timeout_ms``,
``create_response`` and ``interrupt_response`` concern responses, which a
transcription session has none of; they are accepted and ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from gateway.audio_formats import G711_RATE, OPENAI_PCM_RATE, AudioFormat
from gateway.intake import UploadError
from gateway.params import parse_language
from lanegate.audio import MAX_STREAM_SAMPLE_RATE, MIN_STREAM_SAMPLE_RATE
from lanegate.settings import Settings
from vad import VadError, VadSettings

#: the model a session reports when the client names none
DEFAULT_MODEL = "lanegate"


class ConfigError(Exception):
    """A ``session.update`` lanegate cannot apply: an ``invalid_request_error``."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ServerVad:
    threshold: float
    prefix_padding_ms: int
    silence_duration_ms: int

    @property
    def aggressiveness(self) -> int:
        return min(3, math.floor(self.threshold * 4))

    def render(self) -> dict[str, Any]:
        return {"type": "server_vad", "threshold": self.threshold,
                "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms}


@dataclass(frozen=True)
class TranscriptionConfig:
    format: AudioFormat = AudioFormat.PCM
    rate: int = OPENAI_PCM_RATE
    model: str = DEFAULT_MODEL
    language: str = ""  # "": the engine detects it
    prompt: str = ""
    turn_detection: ServerVad | None = None
    noise_reduction: dict[str, Any] | None = None
    include: tuple[str, ...] = field(default=())

    @classmethod
    def initial(cls, settings: Settings) -> TranscriptionConfig:
        return cls(turn_detection=ServerVad(
            threshold=settings.vad_aggressiveness / 4,
            prefix_padding_ms=settings.pad_ms,
            silence_duration_ms=settings.endpoint_silence_ms))

    # --- what the worker session is opened with ----------------------------------
    def vad_overrides(self) -> dict[str, int | None]:
        """The ``vad`` of the worker's ``open`` op (``workers/validation.VAD_FIELDS``)."""
        if self.turn_detection is None:
            return {"endpoint_silence_ms": None}
        td = self.turn_detection
        return {"aggressiveness": td.aggressiveness, "pad_ms": td.prefix_padding_ms,
                "endpoint_silence_ms": td.silence_duration_ms}

    def worker_key(self) -> tuple[Any, ...]:
        """What a worker session is opened with: a change needs another one."""
        return (self.rate, self.language, tuple(sorted(self.vad_overrides().items())))

    # --- rendering -----------------------------------------------------------------
    def render(self, *, beta: bool) -> dict[str, Any]:
        td = None if self.turn_detection is None else self.turn_detection.render()
        transcription = {"model": self.model, "language": self.language,
                         "prompt": self.prompt}
        if beta:
            return {"object": "realtime.transcription_session",
                    "input_audio_format": self.format.beta,
                    "input_audio_transcription": transcription, "turn_detection": td,
                    "input_audio_noise_reduction": self.noise_reduction,
                    "include": list(self.include)}
        fmt: dict[str, Any] = {"type": self.format.mime}
        if self.format is AudioFormat.PCM:
            fmt["rate"] = self.rate
        return {"type": "transcription", "object": "realtime.transcription_session",
                "audio": {"input": {"format": fmt, "transcription": transcription,
                                    "turn_detection": td,
                                    "noise_reduction": self.noise_reduction}},
                "include": list(self.include)}

    # --- parsing -------------------------------------------------------------------
    def updated(self, event: dict[str, Any], settings: Settings) -> TranscriptionConfig:
        """This configuration with a ``session.update`` or
        ``transcription_session.update`` applied; ``ConfigError`` if it cannot be."""
        session = event.get("session")
        if not isinstance(session, dict):
            raise ConfigError("session", "session must be an object",
                              "missing_required_parameter")
        if event["type"] == "transcription_session.update":
            return self._beta(session, settings)
        return self._ga(session, settings)

    def _ga(self, session: dict[str, Any], settings: Settings) -> TranscriptionConfig:
        kind = session.get("type", "transcription")
        if kind != "transcription":
            raise ConfigError("session.type", f"session.type {kind!r} is not supported: "
                              "lanegate serves transcription sessions only "
                              "(connect with ?intent=transcription)")
        new = self._include(session.get("include"), "session.include")
        audio = _object(session.get("audio"), "session.audio")
        inp = _object(audio.get("input"), "session.audio.input")
        prefix = "session.audio.input"
        if "format" in inp:
            new = new._format_ga(_object(inp["format"], f"{prefix}.format"), f"{prefix}.format")
        if "transcription" in inp:
            new = new._transcription(inp["transcription"], f"{prefix}.transcription")
        if "turn_detection" in inp:
            new = new._turn_detection(inp["turn_detection"], f"{prefix}.turn_detection",
                                      settings)
        if "noise_reduction" in inp:
            new = dataclasses.replace(new, noise_reduction=_nullable_object(
                inp["noise_reduction"], f"{prefix}.noise_reduction"))
        return new

    def _beta(self, session: dict[str, Any], settings: Settings) -> TranscriptionConfig:
        new = self._include(session.get("include"), "session.include")
        if "input_audio_format" in session:
            raw = session["input_audio_format"]
            fmt = AudioFormat.of_beta(raw) if isinstance(raw, str) else None
            if fmt is None:
                raise ConfigError("session.input_audio_format",
                                  f"input_audio_format {raw!r} is not one of pcm16, "
                                  "g711_ulaw, g711_alaw")
            rate = G711_RATE if fmt.is_g711 else OPENAI_PCM_RATE
            new = dataclasses.replace(new, format=fmt, rate=rate)
        if "input_audio_transcription" in session:
            new = new._transcription(session["input_audio_transcription"],
                                     "session.input_audio_transcription")
        if "turn_detection" in session:
            new = new._turn_detection(session["turn_detection"], "session.turn_detection",
                                      settings)
        if "input_audio_noise_reduction" in session:
            new = dataclasses.replace(new, noise_reduction=_nullable_object(
                session["input_audio_noise_reduction"],
                "session.input_audio_noise_reduction"))
        return new

    def _include(self, raw: Any, param: str) -> TranscriptionConfig:
        if raw is None:
            return self
        if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
            raise ConfigError(param, "include must be a list of strings")
        return dataclasses.replace(self, include=tuple(raw))

    def _format_ga(self, fmt: dict[str, Any], param: str) -> TranscriptionConfig:
        kind = fmt.get("type")
        audio_format = AudioFormat.of_mime(kind) if isinstance(kind, str) else None
        if audio_format is None:
            raise ConfigError(f"{param}.type", f"format type {kind!r} is not one of "
                              "audio/pcm, audio/pcmu, audio/pcma")
        if audio_format.is_g711:
            return dataclasses.replace(self, format=audio_format, rate=G711_RATE)
        rate = fmt.get("rate", OPENAI_PCM_RATE)
        if isinstance(rate, bool) or not isinstance(rate, int) \
                or not MIN_STREAM_SAMPLE_RATE <= rate <= MAX_STREAM_SAMPLE_RATE:
            raise ConfigError(f"{param}.rate", f"rate must be an integer from "
                              f"{MIN_STREAM_SAMPLE_RATE} to {MAX_STREAM_SAMPLE_RATE} "
                              f"(OpenAI's is {OPENAI_PCM_RATE}), got {rate!r}")
        return dataclasses.replace(self, format=audio_format, rate=rate)

    def _transcription(self, raw: Any, param: str) -> TranscriptionConfig:
        spec = _object(raw, param)
        new = self
        if spec.get("model") is not None:
            if not isinstance(spec["model"], str):
                raise ConfigError(f"{param}.model", "model must be a string")
            new = dataclasses.replace(new, model=spec["model"])
        if spec.get("language") is not None:
            try:
                language = parse_language(str(spec["language"]))
            except UploadError as exc:
                raise ConfigError(f"{param}.language", exc.message) from None
            new = dataclasses.replace(new, language=language)
        if spec.get("prompt") is not None:
            new = dataclasses.replace(new, prompt=str(spec["prompt"]))
        return new

    def _turn_detection(self, raw: Any, param: str, settings: Settings) -> TranscriptionConfig:
        if raw is None:
            return dataclasses.replace(self, turn_detection=None)
        spec = _object(raw, param)
        kind = spec.get("type", "server_vad")
        if kind == "semantic_vad":
            raise ConfigError(f"{param}.type", "semantic_vad is not supported: lanegate "
                              "detects turns with a voice activity detector; use "
                              "server_vad, or null and commit the buffer yourself")
        if kind != "server_vad":
            raise ConfigError(f"{param}.type", f"turn_detection type {kind!r} is not "
                              "server_vad")
        base = self.turn_detection or TranscriptionConfig.initial(settings).turn_detection
        assert base is not None
        td = ServerVad(
            threshold=_number(spec, "threshold", base.threshold, param, 0.0, 1.0),
            prefix_padding_ms=int(_number(spec, "prefix_padding_ms", base.prefix_padding_ms,
                                          param, 0, 10_000)),
            silence_duration_ms=int(_number(spec, "silence_duration_ms",
                                            base.silence_duration_ms, param, 1, 60_000)))
        _check_vad(td, settings, param)
        return dataclasses.replace(self, turn_detection=td)


def _check_vad(td: ServerVad, settings: Settings, param: str) -> None:
    """Refuse here what the worker's VadSettings would refuse, naming the field."""
    try:
        dataclasses.replace(VadSettings.from_settings(settings),
                            aggressiveness=td.aggressiveness, pad_ms=td.prefix_padding_ms,
                            endpoint_silence_ms=td.silence_duration_ms)
    except VadError as exc:
        raise ConfigError(param, f"turn_detection cannot be applied: {exc}") from None


def _object(raw: Any, param: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(param, f"{param} must be an object")
    return raw


def _nullable_object(raw: Any, param: str) -> dict[str, Any] | None:
    return None if raw is None else _object(raw, param)


def _number(spec: dict[str, Any], name: str, default: float, param: str,
            low: float, high: float) -> float:
    value = spec.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not low <= value <= high:
        raise ConfigError(f"{param}.{name}", f"{name} must be a number from {low:g} to "
                          f"{high:g}, got {value!r}")
    return value
