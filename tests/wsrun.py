"""What a test WebSocket client saw: the events of one session and its close code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Run:
    events: list[dict[str, Any]] = field(default_factory=list)
    close_code: int | None = None
    partials_before_end: int = 0

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    @property
    def final_text(self) -> str:
        return " ".join(e["text"] for e in self.of("final"))

    @property
    def error(self) -> dict[str, Any]:
        errors = self.of("error")
        assert errors, f"no error event in {self.events}"
        return errors[0]
