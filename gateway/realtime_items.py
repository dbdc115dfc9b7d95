"""Which conversation item each worker event belongs to, and the Realtime API events it
owes the client. No I/O: ``Items`` turns worker events and client commits into
server events.

With ``server_vad`` every VAD segment (one ``final`` of the worker) is an item:
``speech_started`` when the VAD opens it, ``speech_stopped`` and ``committed`` when
the VAD closes it (the worker's ``speech_stopped``, in audio order with the next
``speech_started``: the final waits for the decoder, which may be behind the VAD),
``completed`` at its final. ``speech_started`` and ``speech_stopped`` alternate,
whatever the worker repeats (a failover replays audio whose events were sent).

With ``turn_detection: null`` an item is everything between two client commits:
``committed`` at once, ``completed`` when the worker's final with cut ``"commit"``
comes back (the worker's events arrive in audio order, so until then every event
belongs to the oldest committed item still waiting).

Deltas carry the *stable* text: the words two consecutive partials agree on, short
of each one's last word (a decoder revises the words it is still hearing), and at
the final the rest of the final's text if it extends what was sent.
``completed.transcript`` is the final text and is authoritative: a revision the
deltas could not express shows there.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]

TRANSCRIPTION = "conversation.item.input_audio_transcription"


class EventIds:
    """``event_...`` ids for server events and ``item_...`` ids for items."""

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:8]
        self._count = itertools.count(1)

    def event(self) -> str:
        return f"event_{self._prefix}{next(self._count):06d}"

    @staticmethod
    def item() -> str:
        return f"item_{uuid.uuid4().hex[:20]}"


def _common_prefix(a: list[str], b: list[str]) -> list[str]:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def _join(*texts: str) -> str:
    return " ".join(t for t in texts if t)


@dataclass
class Turn:
    """One item: its finals so far and the text its deltas have sent."""

    item_id: str
    text: str = ""
    emitted: str = ""
    last_words: list[str] = field(default_factory=list)
    started: bool = False  # server_vad: speech_started sent
    stopped: bool = False  # server_vad: speech_stopped sent
    committed: bool = False

    def delta(self, hypothesis: str, *, final: bool) -> str | None:
        words = hypothesis.split()
        # a partial's last word is still being decoded: stable are the words before it
        # that the previous partial had too
        stable = words if final else _common_prefix(words[:-1], self.last_words[:-1])
        self.last_words = words
        text = " ".join(stable)
        if len(text) <= len(self.emitted) or not text.startswith(self.emitted):
            return None
        delta, self.emitted = text[len(self.emitted):], text
        return delta


class Items:
    """The items of one session (see the module docstring)."""

    def __init__(self, ids: EventIds, *, server_vad: bool) -> None:
        self.ids = ids
        self.server_vad = server_vad
        self.previous: str | None = None  # the last committed item
        self._segments: dict[int, Turn] = {}  # server_vad: the item of each open segment
        self._current: Turn | None = None  # commit mode: the item being spoken
        # commit mode: committed items waiting for their final (None: a cleared buffer);
        # server_vad: per client commit, whether it was a clear (its item is dropped)
        self._waiting: deque[tuple[Turn | None, float]] = deque()
        self._vad_commits: deque[bool] = deque()
        self._speaking = False  # server_vad: a speech_started not yet stopped
        self._next_segment = 0  # server_vad: segments below this are completed

    def _event(self, kind: str, **fields: Any) -> Event:
        return {"type": kind, "event_id": self.ids.event(), **fields}

    # --- client actions ------------------------------------------------------------
    def commit(self, seconds: float) -> list[Event]:
        """The client committed ``seconds`` of buffered audio."""
        if self.server_vad:
            self._vad_commits.append(False)
            return []
        turn = self._current or Turn(self.ids.item())
        self._current = None
        self._waiting.append((turn, seconds))
        return [self._committed(turn)]

    def clear(self) -> None:
        """The client cleared its buffer: the item being spoken is dropped."""
        if self.server_vad:
            self._vad_commits.append(True)
        else:
            self._current = None
            self._waiting.append((None, 0.0))

    # --- worker events -------------------------------------------------------------
    def speech_started(self, segment: int, start_ms: int) -> list[Event]:
        if not self.server_vad or self._speaking or segment < self._next_segment:
            return []
        turn = self._segments.setdefault(segment, Turn(self.ids.item()))
        if turn.started:
            return []
        turn.started = self._speaking = True
        return [self._event("input_audio_buffer.speech_started", audio_start_ms=start_ms,
                            item_id=turn.item_id)]

    def speech_stopped(self, segment: int, end_ms: int, cut: str) -> list[Event]:
        """The VAD closed ``segment`` at ``end_ms``: ``speech_stopped``, and unless a
        client commit closed it (committed at its final, or dropped by a clear), the
        item is committed now."""
        turn = self._segments.get(segment)
        if not self.server_vad or turn is None or not turn.started or turn.stopped:
            return []
        events = self._stop(turn, end_ms)
        if cut != "commit":
            events.append(self._committed(turn))
        return events

    def partial(self, segment: int, text: str) -> list[Event]:
        turn = self._owner(segment)
        if turn is None:
            return []
        return self._delta(turn, _join(turn.text, text), final=False)

    def final(self, segment: int, text: str, *, start_ms: int, end_ms: int,
              cut: str) -> list[Event]:
        if self.server_vad:
            return self._vad_final(segment, text, start_ms, end_ms, cut)
        turn = self._owner(segment)
        if turn is None:  # a cleared buffer's final
            if cut == "commit" and self._waiting:
                self._waiting.popleft()
            return []
        turn.text = _join(turn.text, text)
        events = self._delta(turn, turn.text, final=True)
        if cut != "commit" or not self._waiting:
            return events  # a max-window cut inside a turn: the turn goes on
        _, seconds = self._waiting.popleft()
        return [*events, self._completed(turn, seconds)]

    def pending(self) -> list[Turn]:
        """Committed items not yet completed."""
        return [turn for turn, _ in self._waiting if turn is not None]

    def failed(self, code: str, message: str) -> list[Event]:
        """``failed`` for every committed item still waiting (the session is ending)."""
        events = [self._event(f"{TRANSCRIPTION}.failed", item_id=turn.item_id,
                              content_index=0,
                              error={"type": "server_error", "code": code,
                                     "message": message, "param": None})
                  for turn in self.pending()]
        self._waiting.clear()
        return events

    # --- helpers ---------------------------------------------------------------------
    def _owner(self, segment: int) -> Turn | None:
        if self.server_vad:
            return self._segments.setdefault(segment, Turn(self.ids.item()))
        if self._waiting:
            return self._waiting[0][0]
        if self._current is None:
            self._current = Turn(self.ids.item())
        return self._current

    def _vad_final(self, segment: int, text: str, start_ms: int, end_ms: int,
                   cut: str) -> list[Event]:
        turn = self._segments.pop(segment, None) or Turn(self.ids.item())
        self._next_segment = max(self._next_segment, segment + 1)
        events = []
        if turn.started and not turn.stopped:  # no speech_stopped came before the final
            events += self._stop(turn, end_ms)
        if cut == "commit" and self._vad_commits and self._vad_commits.popleft():
            return events  # the client cleared this audio
        if not turn.committed:
            events.append(self._committed(turn))
        turn.text = text
        events += self._delta(turn, text, final=True)
        events.append(self._completed(turn, max(0, end_ms - start_ms) / 1000))
        return events

    def _stop(self, turn: Turn, end_ms: int) -> list[Event]:
        turn.stopped, self._speaking = True, False
        return [self._event("input_audio_buffer.speech_stopped", audio_end_ms=end_ms,
                            item_id=turn.item_id)]

    def _delta(self, turn: Turn, hypothesis: str, *, final: bool) -> list[Event]:
        delta = turn.delta(hypothesis, final=final)
        if delta is None:
            return []
        return [self._event(f"{TRANSCRIPTION}.delta", item_id=turn.item_id,
                            content_index=0, delta=delta)]

    def _committed(self, turn: Turn) -> Event:
        event = self._event("input_audio_buffer.committed", item_id=turn.item_id,
                            previous_item_id=self.previous)
        self.previous, turn.committed = turn.item_id, True
        return event

    def _completed(self, turn: Turn, seconds: float) -> Event:
        return self._event(f"{TRANSCRIPTION}.completed", item_id=turn.item_id,
                           content_index=0, transcript=turn.text,
                           usage={"type": "duration", "seconds": round(seconds, 3)})
