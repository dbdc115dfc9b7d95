"""The relay phase of a ``/v1/stream`` session: both directions between the client's
WebSocket and an open worker session, until ``done``, an error or either side leaving.
(Over 400 lines: the two directions and the failover share one session's state.)

``Relay`` exists only once the worker session is open, so everything it holds is
there. It ends with an :data:`Outcome` and sends the client what that outcome
owes it (``done``, or the ``error`` event) before the close.

When the worker is lost, the relay moves the session to another worker (failover):
it keeps the client's audio since the last final it relayed (``gateway/replay.py``),
opens the session elsewhere, replays that audio and goes on; the new worker's
segment numbers and times are mapped onto the client's, and its partials for audio
the client already has partials for are dropped. Only when no worker can take the
session does the client get ``worker_lost``. A relay made without ``reopen`` does not
fail over. (The OpenAI Realtime API's relay also repeats, in place, the commits that
no final has answered yet: ``gateway/realtime_api.py``.)

A relay made with ``park=True`` (the OpenAI Realtime API's, Deepgram's live API's)
keeps a silent session cheap: once no audio has come for ``realtime_park_after_s``
(with no speech open and no commit unanswered; with speech open, after
``idle_timeout_s``) it ends the worker session's audio, relays the last finals and
gives the slot back (*parks*); the client's socket and its per-key lease stay. The
next audio (or commit, or end) opens the session again, the way a failover does,
and goes on from there: segment numbers and times continue where they were. The
session is closed only after ``realtime_idle_timeout_s`` without audio or a client
event (``touch``: any Realtime API event) or at ``realtime_max_session_s``
(``parked_deadline``; an adapter may override ``deadline``: Deepgram's keeps
Deepgram's rule, no audio or ``KeepAlive`` for ``idle_timeout_s``, and touches its
relays at each ``KeepAlive``). When no slot is free at that next audio, the session
ends ``overloaded``, as a new one would be refused.

Latency metrics use the gateway's own clock: a compact timeline of (cumulative
audio ms, arrival time) per received frame, trimmed as events pass, maps each
event's ``audio_end_ms`` back to when that audio arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from aiohttp import WSCloseCode, WSMsgType, web
from redis.exceptions import RedisError

from gateway.replay import ReplayBuffer
from gateway.workers_client import NoWorkers, Overloaded, WorkerLost, WorkerSession
from lanegate import metrics
from lanegate.constants import SAMPLE_WIDTH
from lanegate.logs import get_logger
from lanegate.metrics import FailoverOutcome
from lanegate.settings import Settings

#: close code for each error ``code`` (worker errors included)
CLOSE_FOR_CODE = {
    "bad_request": WSCloseCode.POLICY_VIOLATION,
    "unauthorized": WSCloseCode.POLICY_VIOLATION,
    "timeout": WSCloseCode.POLICY_VIOLATION,
    "too_large": WSCloseCode.MESSAGE_TOO_BIG,
    "overloaded": WSCloseCode.TRY_AGAIN_LATER,
    "worker_lost": WSCloseCode.INTERNAL_ERROR,
    "internal": WSCloseCode.INTERNAL_ERROR,
}
#: error codes counted in ``lanegate_rejections_total`` when they end a running stream
REJECTED_CODES = frozenset({"bad_request", "too_large", "timeout"})
#: public fields of each worker event; anything else is internal and dropped
PUBLIC_FIELDS = {
    "partial": ("type", "segment", "text", "audio_end_ms"),
    "final": ("type", "segment", "text", "start_ms", "end_ms", "cut", "audio_end_ms", "words",
              "language"),
    "error": ("type", "code", "message"),
    "done": ("type",),
}
#: what a client is told when its worker is lost and no other can take the session
WORKER_LOST = "the realtime worker serving this stream was lost; reconnect to continue"

#: opens the session again on a worker other than the given (lost) ones
Reopen = Callable[[frozenset[str]], Awaitable[WorkerSession]]


@dataclass(frozen=True)
class Failure:
    """Why a session ends abnormally: the ``error`` event and the close code."""

    code: str
    message: str
    graceful: bool = False  # relay the worker's last finals before the error

    @property
    def close_code(self) -> WSCloseCode:
        return CLOSE_FOR_CODE.get(self.code, WSCloseCode.INTERNAL_ERROR)


class Ending(enum.Enum):
    """How a session ends when nothing went wrong."""

    DONE = "done"  # the worker sent its last final and ``done``
    CLIENT_GONE = "client_gone"  # the client closed or dropped the socket


Outcome = Ending | Failure


class Client(Protocol):
    """The public side of the relay: ``gateway.stream.StreamSession`` (a ``SocketClient``,
    whose WebSocket the relay reads), or a session whose relay reads its own transport
    (``gateway/wyoming.py``: its relay overrides ``_pump_client``)."""

    shutting_down: bool

    async def send(self, event: dict[str, Any]) -> bool: ...

    def error_event(self, code: str, message: str) -> dict[str, Any]: ...

    async def close(self, code: int, message: str = "") -> None: ...


@runtime_checkable
class SocketClient(Client, Protocol):
    """A client on a public WebSocket."""

    ws: web.WebSocketResponse


class Timeline:
    """(cumulative audio ms, arrival time) per received frame, trimmed as events pass."""

    def __init__(self, sample_rate: int, maxlen: int = 20_000) -> None:
        self._bytes_per_ms = sample_rate * SAMPLE_WIDTH / 1000.0
        self._entries: deque[tuple[float, float]] = deque(maxlen=maxlen)
        self.audio_bytes = 0
        self.first_arrival: float | None = None
        self.last_arrival: float | None = None

    @property
    def audio_ms(self) -> float:
        return self.audio_bytes / self._bytes_per_ms

    def ms_of(self, nbytes: int) -> float:
        return nbytes / self._bytes_per_ms

    def add(self, nbytes: int, now: float) -> None:
        self.audio_bytes += nbytes
        self._entries.append((self.audio_ms, now))
        if self.first_arrival is None:
            self.first_arrival = now
        self.last_arrival = now

    def arrival_of(self, audio_end_ms: float) -> float | None:
        """When the frame holding ``audio_end_ms`` arrived (entries before it are dropped)."""
        entries = self._entries
        while len(entries) > 1 and entries[0][0] < audio_end_ms:
            entries.popleft()
        if not entries:
            return None
        return entries[0][1]


def stall_deadline(settings: Settings, started: float,
                   timeline: Timeline) -> tuple[float, Failure]:
    """When a stream that receives no more audio must end, and why: the first of
    ``idle_timeout_s`` after its last audio, ``max_session_wall_s`` after it opened, and
    the moment its audio has stayed below ``min_realtime_ratio`` of its wall time for
    ``idle_timeout_s`` (audio < ratio x (open time - idle_timeout_s): a trickle of tiny
    frames, each of which resets the idle timer, still ends)."""
    idle = settings.idle_timeout_s
    candidates = [
        ((timeline.last_arrival or started) + idle,
         Failure("timeout", f"no audio for {idle:g} s (idle_timeout_s)", graceful=True)),
        (started + settings.max_session_wall_s,
         Failure("timeout", f"stream open for max_session_wall_s "
                 f"({settings.max_session_wall_s:g} s)", graceful=True)),
    ]
    ratio = settings.min_realtime_ratio
    if ratio > 0:
        candidates.append((
            started + timeline.audio_ms / 1000.0 / ratio + idle,
            Failure("timeout", f"audio arrives at under {ratio:g} x real time "
                    "(min_realtime_ratio)", graceful=True)))
    return min(candidates, key=lambda c: c[0])


def parked_deadline(settings: Settings, started: float, last_activity: float,
                    attached: tuple[float, float] | None,
                    timeline: Timeline) -> tuple[float, Failure]:
    """``stall_deadline`` for a relay that parks (``park=True``): the first of
    ``realtime_idle_timeout_s`` after the client's last audio or event,
    ``realtime_max_session_s`` after it opened, and, only while it holds a slot
    (``attached``: since when, and the audio ms then), the ``min_realtime_ratio`` rule
    counted from that attachment: a trickle of tiny frames cannot hold a slot, and
    neither can a session that parked between turns be charged for its silence."""
    idle = settings.realtime_idle_timeout_s
    candidates = [
        (last_activity + idle,
         Failure("timeout", f"no audio or client event for {idle:g} s "
                 "(realtime_idle_timeout_s)", graceful=True)),
        (started + settings.realtime_max_session_s,
         Failure("timeout", f"session open for realtime_max_session_s "
                 f"({settings.realtime_max_session_s:g} s)", graceful=True)),
    ]
    ratio = settings.min_realtime_ratio
    if ratio > 0 and attached is not None:
        since, audio_ms = attached
        candidates.append((
            since + (timeline.audio_ms - audio_ms) / 1000.0 / ratio + settings.idle_timeout_s,
            Failure("timeout", f"audio arrives at under {ratio:g} x real time "
                    "(min_realtime_ratio)", graceful=True)))
    return min(candidates, key=lambda c: c[0])


def public_event(event: dict[str, Any]) -> dict[str, Any] | None:
    fields = PUBLIC_FIELDS.get(event["type"])
    if fields is None:
        return None
    return {k: event[k] for k in fields if k in event}


class SegmentMap:
    """A worker's segment numbers and times onto the client's: a worker that took the
    session over numbers from 0 and times from the start of the replayed audio."""

    def __init__(self, segment_base: int = 0, offset_ms: float = 0.0,
                 quiet_until_ms: float = -1.0) -> None:
        self.segment_base = segment_base
        self.offset_ms = offset_ms
        self.quiet_until_ms = quiet_until_ms  # partials up to here repeat replayed audio

    def apply(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """``event`` in the client's terms; None for a partial to drop."""
        if isinstance(event.get("segment"), int):
            event["segment"] += self.segment_base
        if self.offset_ms:
            for key in ("start_ms", "end_ms", "audio_end_ms"):
                if isinstance(event.get(key), int | float):
                    event[key] = round(event[key] + self.offset_ms)
            offset_s = self.offset_ms / 1000.0
            for word in event.get("words") or ():
                if isinstance(word, dict):
                    for key in ("start", "end"):
                        if isinstance(word.get(key), int | float):
                            word[key] = round(word[key] + offset_s, 3)
        if event["type"] == "partial" and self.quiet_until_ms >= 0:
            if float(event.get("audio_end_ms", -1)) <= self.quiet_until_ms:
                return None
            self.quiet_until_ms = -1.0
        return event


class Relay:
    """One stream's relay between ``client`` and an open ``worker`` session; ``reopen``
    opens it again elsewhere when the worker is lost (None: no failover)."""

    def __init__(self, client: Client, worker: WorkerSession, *, session_id: str,
                 sample_rate: int, settings: Settings, started: float,
                 reopen: Reopen | None = None, park: bool = False) -> None:
        self.client = client
        self.worker = worker  # the current one; a failover replaces it
        self.session_id = session_id
        self.settings = settings
        self.lane = worker.lane
        self.timeline = Timeline(sample_rate)
        # the per-frame limits in bytes (``_take_audio`` runs for every frame)
        self._max_frame_bytes = settings.max_frame_bytes
        self._max_session_bytes = settings.max_session_s * sample_rate * SAMPLE_WIDTH
        self.started = started
        self.log = get_logger("gateway.stream").bind(session_id=session_id, lane=self.lane,
                                                     worker=worker.worker_id)
        self.ended = False  # the client's audio is over (``end``, or a limit ended it)
        self.first_partial_seen = False
        self.reopen = reopen
        self.replay = (ReplayBuffer(sample_rate, settings.failover_buffer_s)
                       if reopen is not None and settings.failover_buffer_s > 0 else None)
        self.switching = False  # a failover is under way: audio is only kept
        self.mapping = SegmentMap()
        self.next_segment = 0  # the client's number for the segment after the last final
        self.last_partial_ms = -1.0
        self.lost_at: dict[str, float] = {}  # worker id -> when this stream lost it
        self.failovers = 0
        self.outcome: Outcome | None = None  # how it ended; set before the client is told
        # stream offsets of the client's commits (OpenAI Realtime API) that no final has
        # answered yet: a failover repeats them, each after the same audio
        self.commits: deque[int] = deque()
        # parking (module docstring): only with ``park`` and a way to reopen the session
        self.park = park and reopen is not None
        self.parks = 0
        self.detached = False  # parking, parked or resuming: audio waits in _held
        self._parking = False  # ``end`` went to the worker to park; its ``done`` is due
        self._held: list[bytes | None] = []  # audio (None: a commit) while detached
        self._held_bytes = 0
        self._park_mark = 0  # stream offset (bytes) where the parked worker's audio ended
        self._wanted = asyncio.Event()  # a parked session has audio, a commit or its end
        self._touched = time.monotonic()  # the client's last event without audio (touch)
        self._attached = (time.monotonic(), 0.0)  # holds a slot since when, audio ms then
        self._speaking = False  # the worker's VAD has a segment open
        self._unanswered = 0  # commits sent to the worker that no final answered yet
        # the lane's latency histograms, looked up once: ``labels()`` per event costs
        self._latency = {"partial": metrics.PARTIAL_LATENCY.labels(lane=self.lane),
                         "final": metrics.FINAL_LATENCY.labels(lane=self.lane)}

    async def run(self) -> Outcome:
        """Run both directions, then tell the client how it ended."""
        client = asyncio.create_task(self._pump_client(), name=f"client-{self.session_id}")
        worker = asyncio.create_task(self._pump_worker(), name=f"worker-{self.session_id}")
        idle = asyncio.create_task(self._watch_idle(), name=f"idle-{self.session_id}")
        tasks = (client, worker, idle)
        try:
            await asyncio.wait({client, worker, idle}, return_when=asyncio.FIRST_COMPLETED)
            outcome: Outcome
            if worker.done():
                outcome = worker.result()
            else:
                outcome = client.result() if client.done() else idle.result()
                client.cancel()  # no more reads once the client side has an outcome
                if isinstance(outcome, Failure) and outcome.graceful:
                    outcome = await self._finish_gracefully(worker, outcome)
            return await self.end(outcome)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def touch(self) -> None:
        """The client is there without audio (a Realtime API event, a Deepgram
        ``KeepAlive``): with ``parked_deadline`` a relay that parks is closed only
        ``realtime_idle_timeout_s`` after the last audio or touch. Its slot still goes
        back after ``realtime_park_after_s`` without audio."""
        self._touched = time.monotonic()

    @property
    def last_activity(self) -> float:
        """The client's last audio or ``touch``."""
        return max(self._touched, self.timeline.last_arrival or self.started)

    async def end(self, outcome: Outcome) -> Outcome:
        """Record how the session ended, then tell the client (``conclude``). Recorded
        first: a client that hangs up right after the close cancels the rest."""
        self.outcome = outcome
        await self.conclude(outcome)
        return outcome

    async def end_audio(self) -> None:
        """Tell the worker no more audio comes (once); it then sends its last finals.
        During a failover the new worker gets ``end`` after the replay."""
        if not self.ended:
            self.ended = True
            if self.detached:  # a parked session ends here, a resuming one after it
                self._wanted.set()
            elif not self.switching:
                with contextlib.suppress(WorkerLost):  # the worker pump fails over
                    await self.worker.end()

    async def _finish_gracefully(self, worker: asyncio.Task[Outcome],
                                 failure: Failure) -> Outcome:
        """End the worker's audio, relay its last finals, then report ``failure``."""
        await self.end_audio()
        try:
            result = await asyncio.wait_for(asyncio.shield(worker),
                                            self.settings.drain_timeout_s)
        except TimeoutError:
            return failure
        if isinstance(result, Failure) and not result.graceful:
            return result
        return failure

    # --- the seams a relay for another public protocol overrides (gateway/realtime_api.py)
    async def on_binary(self, data: bytes) -> Failure | None:
        """A binary frame from the client: PCM for the worker."""
        taken = self._take_audio(data)  # _on_audio, without a coroutine more per frame
        if taken is False:
            await self._send_waiting(data)
            return None
        return None if taken is True else taken

    async def on_text(self, data: str) -> Failure | None:
        """A text frame from the client: a control message."""
        return await self._on_control(data)

    async def forward(self, event: dict[str, Any]) -> bool:
        """One worker event (not ``done``/``error``) to the client; False once it is gone."""
        out = public_event(event)
        if out is None:
            return True
        self._observe(event["type"], out)
        return await self.client.send(out)

    async def conclude(self, outcome: Outcome) -> None:
        """Tell the client how the session ended, and close its socket."""
        client = self.client
        if outcome is Ending.CLIENT_GONE:  # answer the client's close only now (autoclose
            await client.close(WSCloseCode.OK)  # off), after the lease is released
            return
        if outcome is Ending.DONE:
            await client.send({"type": "done"})
            await client.close(WSCloseCode.GOING_AWAY if client.shutting_down
                               else WSCloseCode.OK)
            return
        if outcome.code in REJECTED_CODES:
            metrics.REJECTIONS.labels(lane=self.lane, reason=outcome.code).inc()
        await client.send(client.error_event(outcome.code, outcome.message))
        await client.close(outcome.close_code, outcome.code)

    # --- client -> worker --------------------------------------------------------

    async def _pump_client(self) -> Outcome:
        if not isinstance(self.client, SocketClient):
            raise TypeError("a relay over another transport reads it in _pump_client")
        ws = self.client.ws
        while True:
            msg = await ws.receive()
            if msg.type is WSMsgType.BINARY:
                failure = await self.on_binary(msg.data)
            elif msg.type is WSMsgType.TEXT:
                failure = await self.on_text(msg.data)
            elif msg.type is WSMsgType.ERROR and ws.close_code == WSCloseCode.MESSAGE_TOO_BIG:
                return Failure("too_large", "frame larger than the hard cap")
            else:  # CLOSE / CLOSING / CLOSED / ERROR: the client left
                return Ending.CLIENT_GONE
            if failure is not None:
                return failure

    async def _watch_idle(self) -> Failure:
        """End the stream at the first of its deadlines (``stall_deadline``). One timer
        per deadline, not one per frame: at hundreds of streams, a timeout armed and
        cancelled around every read is a measurable share of the gateway's CPU."""
        while True:
            if self.ended:  # waiting for the worker's last finals; no audio expected
                await asyncio.get_running_loop().create_future()  # until cancelled
            deadline, failure = self.deadline()
            now = time.monotonic()
            if deadline <= now:
                return failure
            if self.park:
                park_at = self._park_at()
                if park_at is not None and park_at <= now:
                    await self._start_park()
                    continue
                # speech, commits and the attachment change without waking this task
                deadline = min(deadline, now + self.settings.realtime_park_after_s,
                               *(() if park_at is None else (park_at,)))
            await asyncio.sleep(deadline - now)

    def deadline(self) -> tuple[float, Failure]:
        """When the session ends if nothing more comes, and why."""
        if not self.park:
            return stall_deadline(self.settings, self.started, self.timeline)
        return parked_deadline(self.settings, self.started, self.last_activity,
                               None if self.detached else self._attached, self.timeline)

    # --- parking (module docstring) ---------------------------------------------------
    def _park_at(self) -> float | None:
        """When the session gives its slot back if no audio comes; None while it holds
        none, or is failing over."""
        if self.detached or self.switching:
            return None
        last_audio = max(self.timeline.last_arrival or self.started, self._attached[0])
        quiet = not self._speaking and not self._unanswered
        return last_audio + (self.settings.realtime_park_after_s if quiet
                             else self.settings.idle_timeout_s)

    async def _start_park(self) -> None:
        """End the worker session's audio: its last finals and ``done`` follow, and the
        worker pump then parks (``_parked``). Audio from now on waits in ``_held``."""
        self.detached = self._parking = True
        self._park_mark = self.timeline.audio_bytes
        with contextlib.suppress(WorkerLost):  # the worker pump fails over
            await self.worker.end()

    def _hold(self, data: bytes) -> Failure | bool:
        self._held.append(data)
        self._held_bytes += len(data)
        self._wanted.set()
        if self.timeline.ms_of(self._held_bytes) > self.settings.max_undecoded_s * 1000:
            return Failure("overloaded", "audio arrives faster than this session can be "
                           f"resumed (over max_undecoded_s, {self.settings.max_undecoded_s:g} "
                           "s, waiting)")
        return True

    async def _parked(self) -> Outcome | None:
        """The worker sent the last finals and ``done``: the slot is back. Wait for the
        next audio, commit or end, then resume (None); an ``Outcome`` if it ends."""
        self._parking = False
        await self.worker.close()
        if self.replay is not None:  # every final is in: a parked session keeps no audio
            self.replay.covered_until(self.timeline.ms_of(self._park_mark))
        self.parks += 1
        parked = time.monotonic()
        self.log.info("stream_parked", audio_s=round(self.timeline.audio_ms / 1000, 3))
        gauge = metrics.PARKED_SESSIONS.labels(lane=self.lane)
        gauge.inc()
        try:
            while not self._held:
                if self.ended:
                    return Ending.DONE
                self._wanted.clear()
                await self._wanted.wait()
        finally:  # also when the session ends meanwhile (its tasks are cancelled)
            gauge.dec()
        failure = await self._resume()
        if failure is None:
            self.log.info("stream_resumed", parked_s=round(time.monotonic() - parked, 3))
        return failure

    async def _resume(self) -> Failure | None:
        """Open the session on a worker again, as a failover does (without a replay:
        everything before ``_park_mark`` is final), and send what was held."""
        assert self.reopen is not None
        try:
            worker = await self.reopen(self._recently_lost())
        except (NoWorkers, Overloaded) as exc:
            return Failure("overloaded", f"{exc}: no decoder slot to resume this session "
                           "after its silence; try again later")
        except RedisError:
            return Failure("overloaded", "service unavailable; try again later")
        self.worker = worker
        offset_ms = self.timeline.ms_of(self._park_mark)
        self.mapping = SegmentMap(self.next_segment, offset_ms)
        self._attached = (time.monotonic(), offset_ms)
        self._speaking = False
        self.log = self.log.bind(worker=worker.worker_id)
        while self._held:  # no await between the last check and the switch
            held, self._held, self._held_bytes = self._held, [], 0
            for item in held:
                if item is None:
                    self._unanswered += 1
                    await worker.commit()
                else:
                    await worker.send_audio(item)
        self.detached = False
        if self.ended:
            await worker.end()
        return None

    async def _on_audio(self, data: bytes) -> Failure | None:
        taken = self._take_audio(data)
        if isinstance(taken, Failure):
            return taken
        if not taken:
            await self._send_waiting(data)
        return None

    def _take_audio(self, data: bytes) -> Failure | bool:
        """Check one client frame, record it and queue it for the worker without
        waiting (no coroutine per layer for every frame): the ``Failure`` that ends the
        stream, True once it is handled, False when the link's batch is full (then
        ``_send_waiting`` sends it)."""
        size = len(data)
        timeline = self.timeline
        if (self.ended or size > self._max_frame_bytes or size % SAMPLE_WIDTH or not size
                or timeline.audio_bytes + size > self._max_session_bytes):
            return self._refuse_audio(size)
        timeline.add(size, time.monotonic())
        if self.replay is not None:
            self.replay.append(data)
        if self.switching:
            return True  # the failover replays it
        if self.detached:
            return self._hold(data)  # the session resumes with it
        try:
            return self.worker.queue_audio(data)
        except WorkerLost:
            self._lost_audio()
            return True

    def _refuse_audio(self, size: int) -> Failure | bool:
        """``_take_audio`` for a frame that is not simply taken: the ``Failure`` that
        ends the stream, or True for one dropped (late in a drain, or empty)."""
        settings = self.settings
        if self.ended:
            if self.client.shutting_down:
                return True  # the gateway is draining this session; drop late audio
            return Failure("bad_request", "audio after {\"type\":\"end\"}")
        if size > settings.max_frame_bytes:
            return Failure("too_large", f"frame of {size} bytes is over max_frame_bytes "
                           f"({settings.max_frame_bytes})")
        if size % SAMPLE_WIDTH:
            return Failure("bad_request", f"odd byte count {size}: audio must be "
                           "PCM s16le, 2 bytes per sample")
        if not size:
            return True
        return Failure("timeout", f"session audio over max_session_s "
                       f"({settings.max_session_s:g} s)", graceful=True)

    async def _send_waiting(self, data: bytes) -> None:
        try:
            await self.worker.send_audio(data)
        except WorkerLost:
            self._lost_audio()

    def _lost_audio(self) -> None:
        if self.replay is None:
            self.ended = True  # the worker pump reports the loss

    async def _on_control(self, data: str) -> Failure | None:
        try:
            message = json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: nested too deep to parse
            return Failure("bad_request", "text frames must be JSON control messages; "
                           "audio goes in binary frames")
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            return Failure("bad_request", 'control messages are objects with a "type"')
        if message["type"] != "end":
            return Failure("bad_request", f"unknown message type {message['type']!r}")
        await self.end_audio()
        return None

    async def commit(self) -> bool:
        """End the utterance at the audio so far (a client commit); False when the
        worker was lost and no failover will repeat it."""
        if self.replay is not None:
            self.commits.append(self.replay.end)
            if self.switching:
                return True  # the failover's replay commits it in place
        if self.detached:
            self._held.append(None)  # the session resumes with it, after its audio
            self._wanted.set()
            return True
        self._unanswered += 1
        try:
            await self.worker.commit()
        except WorkerLost:
            if self.replay is None:
                self.ended = True  # the worker pump reports the loss
                return False
        return True

    # --- worker -> client --------------------------------------------------------

    async def _pump_worker(self) -> Outcome:
        while True:
            try:
                outcome = await self._relay_events()
                if outcome is not Ending.DONE or not self._parking:
                    return outcome
                ended = await self._parked()
                if ended is not None:
                    return ended
                # resumed: relay the new worker's events
            except WorkerLost as exc:
                self.log.warning("worker_lost", reason=str(exc))
                if self.detached and self.replay is not None:  # it replays what was held
                    self.detached = self._parking = False
                    self._held, self._held_bytes = [], 0
                failure = await self._fail_over()
                if failure is not None:
                    return failure

    async def _relay_events(self) -> Outcome:
        async for event in self.worker.events():
            kind = event["type"]
            if kind == "done":
                return Ending.DONE
            if kind == "error":
                return Failure(str(event.get("code") or "internal"),
                               str(event.get("message") or "worker error"))
            mapped = self.mapping.apply(event)  # each event is this channel's own
            if mapped is None:
                continue
            if not await self.forward(mapped):
                return Ending.CLIENT_GONE
            self._advance(kind, mapped)
        return Failure("worker_lost", "the worker ended the session without done")

    def _advance(self, kind: str, event: dict[str, Any]) -> None:
        """What a relayed event tells the failover (where the next segment starts) and
        the parking (whether speech is open, commits unanswered)."""
        if kind == "partial" and isinstance(event.get("audio_end_ms"), int | float):
            self.last_partial_ms = float(event["audio_end_ms"])
        elif kind == "final":
            if isinstance(event.get("segment"), int):
                self.next_segment = event["segment"] + 1
            if event.get("cut") == "commit":
                self._unanswered = max(0, self._unanswered - 1)
                if self.commits:
                    self.commits.popleft()  # finals answer commits in order
            if self.replay is not None and isinstance(event.get("end_ms"), int | float):
                self.replay.covered_until(self._next_start_ms(event))
        elif kind == "speech_started":
            self._speaking = True
        elif kind == "speech_stopped":
            self._speaking = False

    def _next_start_ms(self, final: dict[str, Any]) -> float:
        """The earliest the segment after ``final`` can start. A max-window cut is in
        the middle of speech: right at its end. After an endpoint the VAD had heard
        ``endpoint_silence_ms`` of silence by ``audio_end_ms``, so the next segment
        (speech, padded by ``pad_ms``) starts no earlier than ``audio_end_ms - pad_ms``;
        replaying that silence too only starts the new decoder somewhere else than the
        lost one did, which changes what it hears."""
        end = float(final["end_ms"])
        decided = final.get("audio_end_ms")
        if final.get("cut") != "endpoint" or not isinstance(decided, int | float):
            return end
        return max(end, float(decided) - self.settings.pad_ms)

    # --- failover ------------------------------------------------------------------

    async def _fail_over(self) -> Failure | None:
        """Move the session to another worker and replay its audio since the last final;
        the ``worker_lost`` failure when that cannot be done."""
        lost = self.worker
        self.lost_at[lost.worker_id] = time.monotonic()
        await lost.close()
        if self.replay is None or self.reopen is None:
            return Failure("worker_lost", WORKER_LOST)
        self.switching = True
        began = time.monotonic()
        try:
            worker = await self.reopen(self._recently_lost())
        except (NoWorkers, Overloaded, RedisError) as exc:
            outcome = (FailoverOutcome.FAILED if isinstance(exc, RedisError)
                       else FailoverOutcome.NO_WORKER)
            return self._failover_failed(outcome, lost, str(exc))
        self.worker = worker
        start = self.replay.start
        self.mapping = SegmentMap(self.next_segment, self.replay.ms_of(start),
                               self.last_partial_ms)
        try:
            replayed = await self._replay(worker, start)
        except WorkerLost as exc:  # the new worker is lost too: the next round moves on
            self._count(FailoverOutcome.FAILED)
            self.log.warning("stream_failover_failed", worker=worker.worker_id,
                             reason=str(exc))
            return None
        self.failovers += 1
        self._count(FailoverOutcome.OK)
        self.log = self.log.bind(worker=worker.worker_id)
        self.log.info("stream_failover", lost=lost.worker_id, replay_s=round(
            replayed / SAMPLE_WIDTH / self.replay.sample_rate, 3),
            dropped_s=round(self.replay.dropped / SAMPLE_WIDTH / self.replay.sample_rate, 3),
            took_s=round(time.monotonic() - began, 3), segment=self.next_segment)
        return None

    def _recently_lost(self) -> frozenset[str]:
        """The workers this stream lost less than ``heartbeat_ttl_s`` ago: the registry
        may still list them from before. One lost longer ago and listed again has
        heartbeated since (a false loss: a worker too busy to answer a ping in time) and
        is a candidate like any other."""
        now = time.monotonic()
        return frozenset(w for w, at in self.lost_at.items()
                         if now - at < self.settings.heartbeat_ttl_s)

    async def _replay(self, worker: WorkerSession, start: int) -> int:
        """Send the kept audio from ``start``, then what arrives meanwhile; return to
        direct relaying (and send ``end`` if it came) with no await between the last
        check and the switch, so no frame is skipped or sent twice."""
        assert self.replay is not None
        sent, k = start, 0  # k: the next of the unanswered commits to repeat
        while sent < self.replay.end or k < len(self.commits):
            mark = self.commits[k] if k < len(self.commits) else None
            until = self.replay.end if mark is None else min(max(mark, sent), self.replay.end)
            frames = self.replay.frames(sent, until)
            sent = max(sent, until)
            for frame in frames:
                await worker.send_audio(frame)
            if mark is not None and mark <= sent:
                await worker.commit()  # in place: the same audio before it as the first time
                k += 1
        self.switching = False
        if self.ended:
            await worker.end()
        return sent - start

    def _failover_failed(self, outcome: FailoverOutcome, lost: WorkerSession,
                         reason: str) -> Failure:
        self._count(outcome)
        self.log.warning("stream_failover_failed", lost=lost.worker_id,
                         outcome=outcome.value, reason=reason)
        return Failure("worker_lost", WORKER_LOST)

    def _count(self, outcome: FailoverOutcome) -> None:
        metrics.FAILOVERS.labels(lane=self.lane, outcome=outcome.value).inc()

    def _observe(self, kind: str, event: dict[str, Any]) -> None:
        now = time.monotonic()
        if kind == "partial" and not self.first_partial_seen:
            self.first_partial_seen = True
            if self.timeline.first_arrival is not None:
                metrics.FIRST_PARTIAL.labels(lane=self.lane).observe(
                    now - self.timeline.first_arrival)
        end_ms = event.get("audio_end_ms")
        if not isinstance(end_ms, int | float) or kind not in ("partial", "final"):
            return
        arrival = self.timeline.arrival_of(float(end_ms))
        if arrival is None:
            return
        self._latency[kind].observe(max(0.0, now - arrival))

