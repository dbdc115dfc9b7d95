"""Speech engines behind one protocol (``engines.base``)."""

from __future__ import annotations

from engines.base import (
    DEFAULT_OPTIONS,
    CostPrior,
    DecodeOptions,
    Engine,
    EngineStream,
    Hypothesis,
    NoFreeSlot,
    StepProfile,
)
from lanegate.settings import EngineName, Settings, SettingsError

ENGINES = tuple(str(e.value) for e in EngineName)

__all__ = ["DEFAULT_OPTIONS", "ENGINES", "CostPrior", "DecodeOptions", "Engine", "EngineStream",
           "Hypothesis", "NoFreeSlot", "StepProfile", "create_engine"]


def create_engine(settings: Settings, *, slots: int, batch: bool = True) -> Engine:
    """The engine named by ``settings.engine`` with ``slots`` preloaded decoder slots;
    ``batch=False`` skips loading what only ``transcribe_batch`` needs."""
    if settings.engine == EngineName.WHISPER:
        from engines.whisper import WhisperEngine

        return WhisperEngine(settings, slots=slots)
    if settings.engine == EngineName.POCKETSPHINX:
        from engines.pocketsphinx import PocketsphinxEngine

        return PocketsphinxEngine(settings, slots=slots, batch_decoder=batch)
    if settings.engine == EngineName.SIMULATED:
        from engines.simulated import SimulatedEngine

        return SimulatedEngine(settings, slots=slots)
    raise SettingsError(f"unknown engine {settings.engine!r}; use one of {', '.join(ENGINES)}")
