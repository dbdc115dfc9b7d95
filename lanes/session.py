"""One realtime session's state: audio in, decode cursor, VAD cut points, events out.

Audio is resampled to 16 kHz into a buffer and run through the VAD as it
arrives (cheap). The decoder is fed the buffer continuously from the last
cut; each VAD ``SegmentEnded`` queues a cut point, and a step's chunk never
crosses the next cut. When the cursor reaches a cut the utterance is finished
into a ``final`` and a new one starts. A max-window cut found behind the
cursor keeps only the words that end before it and rewinds the cursor there;
the re-feed is scheduled in capped chunks like any audio. The buffer keeps
only what a rewind or a future event can still reach.

A re-decoding engine (Whisper) is fed the same way; its stream keeps the
utterance's audio and re-decodes a bounded window of it each step (the whole
utterance once, for its final), so the session's candidate also says how much
audio that decode holds besides the new audio (``context_samples``), the part of
a step's cost that the new audio does not show.

No I/O here: the worker drives ``receive``/``take``/``after_chunk``/``settle``
between engine steps and sends the events these return.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import Any

from engines.base import BYTES_PER_SAMPLE, DecodeOptions, EngineStream, Hypothesis, Task
from engines.resample import StreamResampler
from lanegate.constants import ENGINE_SAMPLE_RATE
from lanegate.transcript import Word
from lanes.scheduler import GRANULE_SAMPLES, Candidate
from vad import SegmentEnded, SpeechStarted, StreamingSegmenter, VadSettings

Event = dict[str, Any]
RATE = ENGINE_SAMPLE_RATE
# Trim the buffer front only when this much can go (amortises the copy).
TRIM_SAMPLES = RATE
# Tolerance when keeping the words that end before a max-window cut.
CUT_TOLERANCE_S = 0.02
# An idle decoder restarts only if no open VAD segment reaches further back than this.
RESTART_SLACK = RATE
# Audio the VAD analyses at once when it arrives; more waits for the step loop,
# which analyses VAD_STEP_SAMPLES per session per iteration (about 1-3 ms of VAD).
VAD_INLINE_SAMPLES = RATE
VAD_STEP_SAMPLES = 2 * RATE


@dataclass(frozen=True)
class CutPoint:
    segment: SegmentEnded  # in 16 kHz samples
    decided_at: int  # VAD position (samples) when the cut was decided


def _first(arrival: tuple[int, float]) -> int:
    return arrival[0]


def ms(samples: int) -> int:
    return samples * 1000 // RATE


def decode_options(language: object = None, prompt: object = None,
                   temperature: object = None, task: object = None) -> DecodeOptions:
    """A session's decoder options from its wire values (None or "" where absent);
    ``ValueError`` names the bad one. ``en-US`` is passed on as ``en``; ``task`` is
    ``transcribe`` (the default) or ``translate`` (English text)."""
    if language is not None and not isinstance(language, str):
        raise ValueError("language must be a string")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError("prompt must be a string")
    temp = 0.0
    if temperature not in (None, ""):
        try:
            temp = float(str(temperature))
        except ValueError:
            raise ValueError("temperature must be a number") from None
        if not 0.0 <= temp <= 1.0:
            raise ValueError("temperature must be from 0 to 1")
    if task not in (None, "") and task not in tuple(Task):
        raise ValueError(f"task must be one of {', '.join(Task)}")
    code = (language or "").strip().lower().split("-")[0] or None
    return DecodeOptions(language=code, prompt=prompt or "", temperature=temp,
                         task=Task(str(task)) if task else Task.TRANSCRIBE)


class RealtimeSession:
    def __init__(self, session_id: str, sample_rate: int, stream: EngineStream,
                 vad_settings: VadSettings, max_utterance_samples: int,
                 vad_inline_samples: int = VAD_INLINE_SAMPLES,
                 partial_interval_s: float = 0.0) -> None:
        self.session_id = session_id
        self.sample_rate = sample_rate
        self.stream = stream
        self._resampler = StreamResampler(sample_rate, RATE)
        self._vad = StreamingSegmenter(vad_settings)
        self._buf = bytearray()
        self._base = 0  # sample index of _buf[0]
        self.cursor = 0  # next sample to decode
        self._origin = 0  # sample where the current utterance began
        self._cuts: deque[CutPoint] = deque()
        # (first sample, its paced arrival time) of each piece of audio received
        self._arrivals: deque[tuple[int, float]] = deque()
        self._paced_until = 0.0  # paced arrival time of the end of the audio so far
        self._max_utterance = max_utterance_samples
        self._vad_inline = vad_inline_samples
        self.segment = 0
        # a partial goes out when its text changed, at most every partial_interval_s
        self._partial_interval = partial_interval_s
        self._partial_text = ""  # the last partial sent, in this utterance
        self._partial_at = -float("inf")
        # speech_started/speech_stopped events, out with the next settle (before finals)
        self._notices: list[Event] = []
        self.ended = False  # the client sent its last audio
        self._vad_flushed = False
        self.closed = False
        self.audio_received_s = 0.0

    # --- audio in ---------------------------------------------------------
    @property
    def buffered_end(self) -> int:
        return self._base + len(self._buf) // BYTES_PER_SAMPLE

    def receive(self, pcm: bytes, now: float) -> None:
        self.audio_received_s += len(pcm) / BYTES_PER_SAMPLE / self.sample_rate
        self._append(self._resampler.push(pcm), now)
        self.analyse(self._vad_inline)

    def end(self, now: float) -> None:
        """No more audio: drain the resampler; the VAD is flushed once it has seen
        everything (an open segment then ends with reason "end")."""
        if self.ended:
            return
        self._append(self._resampler.flush(), now)
        self.ended = True
        self.analyse(self._vad_inline)

    def _append(self, pcm16k: bytes, now: float) -> None:
        if not pcm16k:
            return
        start = self.buffered_end
        self._buf += pcm16k
        if now > self._paced_until or not self._arrivals:
            self._arrivals.append((start, now))
        # else the last entry already paces this audio: it would be logged as (start,
        # _paced_until), exactly what the last one extrapolates to; a burst adds nothing
        self._paced_until = max(now, self._paced_until) + (self.buffered_end - start) / RATE

    def analyse(self, max_samples: int) -> None:
        """Run the VAD over at most ``max_samples`` more of the buffered audio.

        Live frames are analysed as they arrive; a burst (10 s, or a 200 s
        simulated prefill) is analysed a slice per loop iteration, so that no
        single call blocks the worker's event loop for long.
        """
        todo = min(max_samples, self.buffered_end - self._vad.position)
        if todo > 0:
            off = (self._vad.position - self._base) * BYTES_PER_SAMPLE
            self._queue_cuts(self._vad.push(self._buf[off : off + todo * BYTES_PER_SAMPLE]))
        if self.ended and not self._vad_flushed and self._vad.position == self.buffered_end:
            self._queue_cuts(self._vad.flush())
            self._vad_flushed = True

    def commit(self) -> None:
        """The client committed its audio so far: the utterance ends at the end of the
        audio received, and a ``final`` with cut "commit" follows even if it held no
        speech (the client waits for one answer per commit)."""
        if self.ended:
            return
        self.analyse(self.buffered_end)
        cuts = [e for e in self._vad.cut() if isinstance(e, SegmentEnded)]
        end = self.buffered_end
        start = cuts[0].start if cuts else end
        cut = SegmentEnded(start, end, "commit")
        if cuts:  # the commit closed the VAD's open segment
            self._stopped(cut)
        self._cuts.append(CutPoint(cut, self._vad.position))

    def _queue_cuts(self, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, SegmentEnded):
                self._stopped(event)
                if not self._cuts and event.end < self.cursor:
                    self._rewind_to(event.end)
                self._cuts.append(CutPoint(event, self._vad.position))
            elif isinstance(event, SpeechStarted):
                self._notices.append({"type": "speech_started",
                                      "segment": self.segment + len(self._cuts),
                                      "start_ms": ms(event.start)})

    def _rewind_to(self, cut: int) -> None:
        """A cut behind the cursor (the max window's, found late): a re-decoding engine
        drops its audio past it, less one granule that the next step feeds again, so
        that the segment's final is decoded in a step (off the event loop) like any
        other. An incremental engine cannot; ``_final`` keeps its words before the cut."""
        target = max(cut - GRANULE_SAMPLES, self._origin, self._base)
        if target < self.cursor and self.stream.rewind(target - self._origin):
            self.cursor = target

    def _stopped(self, segment: SegmentEnded) -> None:
        """``speech_stopped`` when the VAD closes a segment, not at its final: the final
        waits for the decoder, which may be behind the VAD's next ``speech_started``."""
        self._notices.append({"type": "speech_stopped",
                              "segment": self.segment + len(self._cuts),
                              "end_ms": ms(segment.end), "cut": segment.reason})

    @property
    def undecoded_s(self) -> float:
        """Audio received and not yet decoded (what a fast sender makes the worker hold)."""
        return (self.buffered_end - self.cursor) / RATE

    @property
    def arrivals_logged(self) -> int:
        return len(self._arrivals)

    @property
    def analysis_pending(self) -> bool:
        """Audio (or the end) the VAD has yet to see."""
        return self._vad.position < self.buffered_end or (self.ended and not self._vad_flushed)

    # --- the scheduler's view -----------------------------------------------
    @property
    def decode_limit(self) -> int:
        """How far the cursor may go now: the next cut, or all buffered audio."""
        if self._cuts:
            return min(self._cuts[0].segment.end, self.buffered_end)
        # Audio the VAD has not seen yet may still hold a cut. The cursor also stops short
        # of an open segment's trailing silence, so it reaches the endpoint cut exactly:
        # an utterance always ends at its cut and the next begins there, whatever the
        # timing of the steps (pocketsphinx's words depend on where its utterance began,
        # through the cepstral mean it carries), and the segment's last chunk is
        # decoded as its last (Whisper's final is then a fresh decode of the segment).
        if self._vad_flushed:
            return self.cursor
        return max(self.cursor, self._vad.settled)

    def candidate(self) -> Candidate:
        pending = max(0, self.decode_limit - self.cursor)
        # the step that reaches a cut decodes the utterance for its final
        last = bool(self._cuts) and self.cursor + pending >= self._cuts[0].segment.end
        return Candidate(self.session_id, pending, self._oldest_pending_at(),
                         self._context_samples(last),
                         for_good=pending > 0 and self.stream.decodes_for_good(last))

    def _context_samples(self, last: bool) -> int:
        """What a re-decoding engine decodes besides the pending audio."""
        return min(self.cursor - self._origin, self.stream.context_samples(last))

    def _oldest_pending_at(self) -> float:
        """Paced arrival time of the sample at the cursor.

        Audio counts as arriving no faster than real time: a burst (a client that
        buffered 10 s, a short upload) is aged as if it had been streamed live from
        the moment it came. Oldest-first then serves live streams on their beat and
        still digests a burst faster than real time whenever the budget allows.
        """
        # A bisection, not a scan: a session that fell behind (a dump, an overloaded
        # worker) has many arrivals past its cursor, and this runs every iteration.
        i = bisect_right(self._arrivals, self.cursor, key=_first) - 1
        if i < 0:
            return 0.0
        start, paced = self._arrivals[i]
        return paced + (self.cursor - start) / RATE

    @property
    def finished(self) -> bool:
        """Ended and every final sent: only ``done`` is left."""
        return self._vad_flushed and not self._cuts

    def take(self, samples: int) -> bytes:
        """The next ``samples`` of audio for the decoder; advances the cursor."""
        samples = min(samples, self.decode_limit - self.cursor)
        off = (self.cursor - self._base) * BYTES_PER_SAMPLE
        self.cursor += samples
        if self._cuts and self.cursor >= self._cuts[0].segment.end:
            self.stream.last_chunk()
        return bytes(self._buf[off : off + samples * BYTES_PER_SAMPLE])

    # --- events out ------------------------------------------------------------
    def after_chunk(self, hyp: Hypothesis, now: float) -> list[Event]:
        """Events after a decoded chunk: a partial if it carries news (its text changed
        and ``partial_interval_s`` passed since the last one), then any finals."""
        events: list[Event] = []
        if hyp.text and hyp.text != self._partial_text \
                and now - self._partial_at >= self._partial_interval:
            self._partial_text, self._partial_at = hyp.text, now
            events.append({"type": "partial", "segment": self.segment, "text": hyp.text,
                           "audio_end_ms": ms(self.cursor)})
        return events + self.settle()

    def settle(self) -> list[Event]:
        """Finals for every cut the cursor has reached; then trim the buffer."""
        events, self._notices = self._notices, []
        while self._cuts and self._cuts[0].segment.end <= self.cursor:
            events.append(self._final(self._cuts.popleft()))
        if not self._cuts and not self.ended:
            self._restart_if_idle()
        self._trim()
        return events

    def flush_now(self) -> list[Event]:
        """Drain timeout: finals for every queued cut with what is decoded so far."""
        self.analyse(self.buffered_end)
        events, self._notices = self._notices, []  # in audio order, before the finals
        while self._cuts:
            cut = self._cuts.popleft()
            events.append(self._final(cut))
        return events

    def _final(self, cut: CutPoint) -> Event:
        seg = cut.segment
        hyp = self.stream.finish()
        words = [self._absolute(w) for w in hyp.words]
        if seg.reason == "max_window" and seg.end < self.cursor:
            limit = seg.end / RATE + CUT_TOLERANCE_S
            words = [w for w in words if w.end <= limit]
            self.cursor = seg.end
        text = " ".join(w.word for w in words)
        self.stream.start()
        self._partial_text = ""  # the next utterance's first words are news
        self._origin = self.cursor
        event: Event = {
            "type": "final", "segment": self.segment, "text": text,
            **({"language": hyp.language} if hyp.language else {}),
            "start_ms": ms(seg.start), "end_ms": ms(seg.end), "cut": seg.reason,
            "audio_end_ms": ms(cut.decided_at),
            "words": [{"word": w.word, "start": round(w.start, 3), "end": round(w.end, 3)}
                      for w in words],
        }
        self.segment += 1
        return event

    def _absolute(self, word: Word) -> Word:
        offset = self._origin / RATE
        return Word(word.word, word.start + offset, word.end + offset)

    def _restart_if_idle(self) -> None:
        """Bound a decoder fed nothing but non-speech: restart it, dropping its output.

        Only when no segment is open (the VAD needs at most ``RESTART_SLACK`` behind
        the cursor); the utterance restarts where a future segment could begin, and
        the little audio between there and the cursor is decoded again.
        """
        restart_at = min(self.cursor, self._vad.earliest_needed)
        if (self.cursor - self._origin >= self._max_utterance
                and self.cursor - restart_at <= RESTART_SLACK):
            self.stream.finish()
            self.stream.start()
            self._origin = self.cursor = restart_at

    def _trim(self) -> None:
        keep = min([self.cursor, self._vad.earliest_needed]
                   + [c.segment.end for c in self._cuts])
        drop = keep - self._base
        if drop < TRIM_SAMPLES:
            return
        del self._buf[: drop * BYTES_PER_SAMPLE]
        self._base = keep
        while len(self._arrivals) > 1 and self._arrivals[1][0] <= keep:
            self._arrivals.popleft()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.stream.close()
