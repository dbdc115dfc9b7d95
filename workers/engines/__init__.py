"""Speech engines behind one protocol (``workers.engines.base``)."""

from __future__ import annotations

from lanegate.settings import Settings, SettingsError
from workers.engines.base import CostPrior, Engine, EngineStream, Hypothesis, NoFreeSlot

ENGINES = ("pocketsphinx", "simulated")

__all__ = ["ENGINES", "CostPrior", "Engine", "EngineStream", "Hypothesis", "NoFreeSlot",
           "create_engine"]


def create_engine(settings: Settings, *, slots: int, batch: bool = True) -> Engine:
    """The engine named by ``settings.engine`` with ``slots`` preloaded decoder slots;
    ``batch=False`` skips loading what only ``transcribe_batch`` needs."""
    if settings.engine == "pocketsphinx":
        from workers.engines.pocketsphinx import PocketsphinxEngine

        return PocketsphinxEngine(settings, slots=slots, batch_decoder=batch)
    if settings.engine == "simulated":
        from workers.engines.simulated import SimulatedEngine

        return SimulatedEngine(settings, slots=slots)
    raise SettingsError(f"unknown engine {settings.engine!r}; use one of {', '.join(ENGINES)}")
