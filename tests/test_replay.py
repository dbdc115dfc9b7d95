"""The failover's pieces that need no process: the replay buffer and the mapping of a
new worker's segment numbers and times onto the client's."""

from __future__ import annotations

from gateway.relay import SegmentMap
from gateway.replay import ReplayBuffer

RATE = 16000
MS = RATE * 2 // 1000  # bytes per ms


def frame(ms: int, fill: int) -> bytes:
    return bytes([fill]) * (ms * MS)


def test_keeps_everything_since_the_last_final_as_the_frames_came() -> None:
    buf = ReplayBuffer(RATE, max_s=10)
    frames = [frame(100, i) for i in range(5)]
    for f in frames:
        buf.append(f)
    assert buf.frames(0) == frames
    buf.covered_until(250)  # a final ending mid-frame
    kept = buf.frames(0)
    assert b"".join(kept) == b"".join(frames)[250 * MS:]
    assert kept[0] == frames[2][50 * MS:]
    assert buf.ms_of(buf.start) == 250
    assert b"".join(buf.frames(buf.offset_of(420))) == b"".join(frames)[420 * MS:]


def test_a_final_never_moves_the_start_back_or_past_the_end() -> None:
    buf = ReplayBuffer(RATE, max_s=10)
    buf.append(frame(100, 1))
    buf.covered_until(80)
    buf.covered_until(40)
    assert buf.ms_of(buf.start) == 80
    buf.covered_until(5000)
    assert buf.start == buf.end
    assert buf.frames(0) == []


def test_over_the_bound_the_oldest_audio_goes_and_is_counted() -> None:
    buf = ReplayBuffer(RATE, max_s=0.3)
    for i in range(5):
        buf.append(frame(100, i))
    kept = b"".join(buf.frames(0))
    assert len(kept) == 300 * MS
    assert kept == b"".join(frame(100, i) for i in (2, 3, 4))
    assert buf.dropped == 200 * MS


def test_offsets_land_on_whole_samples_at_any_rate() -> None:
    buf = ReplayBuffer(44100, max_s=1)
    assert buf.offset_of(10.5) % 2 == 0
    assert buf.offset_of(1000) == 88200


def test_a_new_workers_events_are_renumbered_and_shifted() -> None:
    mapping = SegmentMap(segment_base=3, offset_ms=4200.0, quiet_until_ms=4500.0)
    final = {"type": "final", "segment": 0, "text": "a b", "start_ms": 100, "end_ms": 900,
             "audio_end_ms": 1300, "cut": "endpoint",
             "words": [{"word": "a", "start": 0.15, "end": 0.4}]}
    assert mapping.apply(final) == {
        "type": "final", "segment": 3, "text": "a b", "start_ms": 4300, "end_ms": 5100,
        "audio_end_ms": 5500, "cut": "endpoint",
        "words": [{"word": "a", "start": 4.35, "end": 4.6}]}


def test_partials_for_audio_the_client_had_partials_for_are_dropped_once() -> None:
    mapping = SegmentMap(segment_base=1, offset_ms=1000.0, quiet_until_ms=1500.0)
    assert mapping.apply({"type": "partial", "segment": 0, "text": "x",
                          "audio_end_ms": 400}) is None
    later = mapping.apply({"type": "partial", "segment": 0, "text": "x y",
                           "audio_end_ms": 600})
    assert later == {"type": "partial", "segment": 1, "text": "x y", "audio_end_ms": 1600}
    # past that point partials pass, even a max-window rewind's
    assert mapping.apply({"type": "partial", "segment": 1, "text": "z",
                          "audio_end_ms": 100}) is not None


def test_frames_up_to_an_offset_split_a_frame_where_a_commit_fell() -> None:
    buf = ReplayBuffer(RATE, max_s=10)
    frames = [frame(100, i) for i in range(3)]
    for f in frames:
        buf.append(f)
    whole = b"".join(frames)
    head = buf.frames(0, buf.offset_of(150))
    assert b"".join(head) == whole[:150 * MS]
    assert head[-1] == frames[1][:50 * MS]
    rest = buf.frames(buf.offset_of(150), buf.offset_of(300))
    assert b"".join(head + rest) == whole
    assert buf.frames(buf.offset_of(150), buf.offset_of(150)) == []
    assert b"".join(buf.frames(buf.offset_of(250), 10**9)) == whole[250 * MS:]
