"""Streaming quality of the realtime lane with Whisper on long speech (issue 31).

``python -m bench live-quality --wav ../shared/speech/two_cities.wav --ref
../shared/speech/two_cities.txt --out bench/results/live_quality`` starts a split stack
(Whisper base in both lanes, the realtime worker on ``--rt-cpus``) and measures, each
stream sent at real time in 100 ms frames over ``/v1/stream``:

* ``accuracy``: WER of the finals of the recording and of an espeak-ng clip (sentences
  with pauses, ``bench.corpus.live_clip``) against their references, beside the batch
  lane's decode of the same audio (its VAD segments, ``transcribe_batch``, in this
  process), and the 6-word phrases the finals repeat that the reference says once;
* ``latency``: live streams of the recording, alone and beside a batch flood: partial
  latency (arrival minus the send time of the frame holding its ``audio_end_ms``) p50
  and p99, partials per stream-second;
* ``realtime_api``: the recording over ``/v1/realtime`` (server_vad), its WER;
* from every stream: word lag, a final word's end in the audio to its first partial and
  to its final (p50, p99), and the share of partial words the final changed.

Results go to ``live_quality.json`` in ``--out`` and to BENCHMARKS.md's section between
``<!-- live-quality:begin -->`` and its end marker (``--markdown``), with ``--host`` (the
conditions, in words) beside them. ``python -m bench live-quality --render FILE`` puts
the section back from a results file without running anything.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import webrtcvad

from bench import audio, sections
from bench.corpus import live_clip
from bench.dialogue import dialogue
from bench.measure import submit
from bench.stack import Stack
from bench.wer import edit_distance, normalize
from bench.whisper_bench import WhisperOptions, model_dir, whisper_plan
from lanegate.settings import ENV_PREFIX, Settings, SettingsError, env_names
from lanegate.stream_client import stream_url

FRAME_MS = 100
PHRASE_WORDS = 6
#: the issue's targets: partials never stop for more than this much speech
MAX_GAP_S = 1.5
#: ... and a core holds a count of streams at this partial p99 and partial rate
HOLD_P99_MS = 1500.0
HOLD_RATE = 0.8


@dataclass
class Run:
    """One stream: when each frame went out and each event came in."""

    sent: list[float] = field(default_factory=list)  # send time of frame k
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    seconds: float = 0.0

    def of(self, kind: str) -> list[tuple[float, dict[str, Any]]]:
        return [(t, e) for t, e in self.events if e["type"] == kind]

    @property
    def text(self) -> str:
        return " ".join(e["text"] for _, e in self.of("final") if e["text"])

    def sent_at(self, audio_ms: float) -> float:
        """Send time of the frame holding ``audio_ms``."""
        k = min(len(self.sent) - 1, max(0, int(audio_ms // FRAME_MS)))
        return self.sent[k]


def read_audio(path: Path) -> tuple[bytes, int]:
    if path.suffix == ".pcm":
        return path.read_bytes(), audio.RATE
    with wave.open(str(path)) as w:
        return w.readframes(w.getnframes()), w.getframerate()


async def stream(base: str, pcm: bytes, rate: int) -> Run:
    run = Run(seconds=len(pcm) / 2 / rate)
    frame = rate * FRAME_MS // 1000 * 2
    async with aiohttp.ClientSession() as http, \
            http.ws_connect(stream_url(base, rate, "en")) as ws:

        async def read() -> None:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    run.events.append((time.monotonic(), json.loads(msg.data)))

        reader = asyncio.create_task(read())
        started = time.monotonic()
        for k, off in enumerate(range(0, len(pcm), frame)):
            run.sent.append(time.monotonic())
            await ws.send_bytes(pcm[off : off + frame])
            await asyncio.sleep(max(0.0, started + (k + 1) * FRAME_MS / 1000 - time.monotonic()))
        await ws.send_str(json.dumps({"type": "end"}))
        await asyncio.wait_for(reader, 300)
    return run


async def realtime_api_text(base: str, pcm: bytes, rate: int) -> str:
    """The recording over ``/v1/realtime?intent=transcription`` (server_vad, 500 ms of
    silence ends a turn), appended in 100 ms pieces at real time, committed at the end:
    the completed transcripts in order."""
    from engines.resample import StreamResampler

    resampler = StreamResampler(rate, audio.RATE)
    pcm16k = resampler.push(pcm) + resampler.flush()
    url = base.replace("http", "ws", 1) + "/v1/realtime?intent=transcription"
    update = {"type": "session.update", "session": {
        "type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": audio.RATE},
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
            "transcription": {"language": "en"}}}}}
    texts: list[str] = []
    frame = audio.RATE * 2 * FRAME_MS // 1000
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        await ws.send_str(json.dumps(update))
        last = asyncio.Event()
        committed = False

        async def read() -> None:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    return
                event = json.loads(msg.data)
                if event["type"] == "conversation.item.input_audio_transcription.completed":
                    texts.append(str(event.get("transcript", "")))
                    if committed:
                        last.set()
                elif event["type"] == "error" and committed:  # nothing left to commit
                    last.set()

        reader = asyncio.create_task(read())
        started = time.monotonic()
        for k, off in enumerate(range(0, len(pcm16k), frame)):
            await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio":
                                          base64.b64encode(pcm16k[off : off + frame]).decode()}))
            await asyncio.sleep(max(0.0, started + (k + 1) * FRAME_MS / 1000 - time.monotonic()))
        await asyncio.sleep(2.0)  # server_vad ends the last turn on its own
        committed = True
        await ws.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(last.wait(), 60)
        reader.cancel()
    return " ".join(t for t in texts if t)


def pct(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else None


def wer(reference: str, text: str) -> float:
    ref = normalize(reference)
    return round(edit_distance(ref, normalize(text)) / len(ref), 4)


def repeated_phrases(reference: str, text: str) -> list[str]:
    def grams(words: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in range(len(words) - PHRASE_WORDS + 1):
            key = " ".join(words[i : i + PHRASE_WORDS])
            out[key] = out.get(key, 0) + 1
        return out
    said, ref = grams(normalize(text)), grams(normalize(reference))
    return [g for g, n in said.items() if n > max(1, ref.get(g, 0))]


def speech_between(pcm16k: bytes, start_ms: int, end_ms: int) -> float:
    """Seconds of voiced 30 ms frames (webrtcvad, aggressiveness 2) in the span."""
    vad = webrtcvad.Vad(2)
    frame = 480 * 2
    voiced = 0
    for off in range(start_ms * 32 // frame * frame, end_ms * 32 - frame + 1, frame):
        chunk = pcm16k[off : off + frame]
        if len(chunk) == frame and vad.is_speech(chunk, 16000):
            voiced += 1
    return voiced * 0.03


def longest_speech_gap(run: Run, pcm16k: bytes) -> dict[str, Any]:
    """The most speech between two consecutive marks of what the client has seen (a
    partial's ``audio_end_ms``, a final's ``end_ms``; the audio's ends): how long the text
    froze while someone spoke."""
    end_ms = len(pcm16k) // 32
    marks = sorted({0, end_ms, *(min(end_ms, int(e["audio_end_ms"])) for _, e in run.of("partial")),
                    *(min(end_ms, int(e["end_ms"])) for _, e in run.of("final"))})
    speech, start, end = max((speech_between(pcm16k, a, b), a, b)
                             for a, b in itertools.pairwise(marks))
    return {"speech_s": round(speech, 2), "from_ms": start, "to_ms": end}


def common_words(a: list[list[str]], b: list[list[str]]) -> int:
    """Length of the longest common subsequence of two word lists: the partial's words
    that the final kept, in order."""
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], prev + 1 if x == y else max(row[j], row[j - 1])
    return row[len(b)]


def timing(runs: list[Run]) -> dict[str, Any]:
    """Partial latency, partial rate, word lags and the partial words the final changed."""
    latency: list[float] = []
    to_partial: list[float] = []
    to_final: list[float] = []
    shown = changed = 0
    for run in runs:
        for t, e in run.of("partial"):
            latency.append((t - run.sent_at(e["audio_end_ms"])) * 1000)
        partials: dict[int, list[tuple[float, list[str]]]] = {}
        for t, e in run.of("partial"):
            partials.setdefault(e["segment"], []).append((t, e["text"].split()))
        for t, f in run.of("final"):
            seen = partials.get(f["segment"], [])
            final_words = [normalize(w["word"]) for w in f["words"]]
            for i, w in enumerate(f["words"]):
                said_at = run.sent_at(w["end"] * 1000)
                to_final.append((t - said_at) * 1000)
                first = next((pt for pt, words in seen if len(words) > i), None)
                if first is not None:
                    to_partial.append((first - said_at) * 1000)
            if seen:
                last = [normalize(w) for w in seen[-1][1]]
                shown += len(last)
                changed += len(last) - common_words(last, final_words)
    stream_s = sum(r.seconds for r in runs)
    return {
        "partial_ms": {"p50": pct(latency, 0.5), "p99": pct(latency, 0.99)},
        "partials_per_stream_s": round(len(latency) / stream_s, 2) if stream_s else None,
        "word_to_partial_ms": {"p50": pct(to_partial, 0.5), "p99": pct(to_partial, 0.99)},
        "word_to_final_ms": {"p50": pct(to_final, 0.5), "p99": pct(to_final, 0.99)},
        "partial_words_changed": round(changed / shown, 4) if shown else None,
        "errors": [e for r in runs for _, e in r.of("error")],
    }


def batch_text(pcm: bytes, rate: int) -> str:
    """The batch lane's decode of the same audio: its decode windows (VAD segments
    joined up to ``batch_window_s``), ``transcribe_batch``."""
    from engines.resample import StreamResampler
    from engines.whisper import WhisperEngine
    from lanegate.settings import Settings
    from lanes.job_audio import pcm_windows
    from vad import VadSettings

    resampler = StreamResampler(rate, audio.RATE)
    pcm16k = resampler.push(pcm) + resampler.flush()
    settings = Settings()
    engine = WhisperEngine(settings, slots=1)
    hyps = engine.transcribe_batch(pcm_windows(pcm16k, VadSettings.from_settings(settings),
                                               settings.batch_window_s))
    return " ".join(h.text for h in hyps if h.text)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    o = WhisperOptions(workdir=args.workdir, rt_cpus=args.rt_cpus, batch_cpus=args.batch_cpus,
                       flood_jobs=args.flood_jobs, flood_job_s=args.flood_job_s,
                       env={"LANEGATE_SLOTS": str(max(args.streams + args.flood_streams) + 2),
                            **dict(args.set)})  # a slot for every stream run at once
    model = model_dir("base")
    if model is None:
        raise SystemExit("Whisper base is not available")
    wav_pcm, wav_rate = read_audio(args.wav)
    reference = args.ref.read_text()
    clip, clip_ref, _ = live_clip(args.espeak_s, 31, args.workdir)
    clip_pcm, clip_rate = read_audio(clip)
    out: dict[str, Any] = {"wav": str(args.wav), "espeak_s": args.espeak_s,
                           "rt_cpus": args.rt_cpus, "streams": args.streams,
                           "settings": dict(args.set)}
    async with Stack(whisper_plan("split", o, model), args.workdir / "stack") as stack:
        base = stack.url
        rt_text = await realtime_api_text(base, wav_pcm, wav_rate)
        out["realtime_api"] = {"wer": wer(reference, rt_text), "text": rt_text,
                               "repeated": repeated_phrases(reference, rt_text)}
        print("realtime API", out["realtime_api"], flush=True)
        if args.realtime_only:
            return out
        rec = await stream(base, wav_pcm, wav_rate)
        esp = await stream(base, clip_pcm, clip_rate)
        out["accuracy"] = {
            "recording": {"stream": wer(reference, rec.text), "text": rec.text,
                          "repeated": repeated_phrases(reference, rec.text)},
            "espeak": {"stream": wer(clip_ref, esp.text), "text": esp.text,
                       "repeated": repeated_phrases(clip_ref, esp.text)}}
        out["one_stream"] = timing([rec, esp])
        if args.dialogue_runs:
            path = dialogue(args.workdir)
            pcm16k, _ = read_audio(path)
            gaps = [longest_speech_gap(await stream(base, pcm16k, audio.RATE), pcm16k)
                    for _ in range(args.dialogue_runs)]
            out["dialogue"] = {"seconds": round(len(pcm16k) / 2 / audio.RATE, 1), "gaps": gaps}
            print("dialogue", out["dialogue"], flush=True)
        latency: dict[str, Any] = {}
        for n in args.streams:
            runs = await asyncio.gather(*(stream(base, wav_pcm, wav_rate) for _ in range(n)))
            latency[f"{n} alone"] = timing(list(runs))
            print(f"{n} alone", latency[f"{n} alone"], flush=True)
        for n in args.flood_streams or args.streams[:1] if args.flood_jobs else ():
            # a fresh flood for each count: every count meets the same batch load
            files = [audio.upload_file(o.flood_job_s, o.workdir, k) for k in range(o.flood_jobs)]
            await submit(stack, files)
            await asyncio.sleep(2.0)
            runs = await asyncio.gather(*(stream(base, wav_pcm, wav_rate) for _ in range(n)))
            latency[f"{n} beside flood"] = timing(list(runs))
            print(f"{n} beside flood", latency[f"{n} beside flood"], flush=True)
        out["latency"] = latency
    out["accuracy"]["recording"]["batch"] = wer(reference, batch_text(wav_pcm, wav_rate))
    out["accuracy"]["espeak"]["batch"] = wer(clip_ref, batch_text(clip_pcm, clip_rate))
    return out


def _ms(fig: dict[str, Any], key: str) -> str:
    v = fig[key]
    return f"{v['p50']} / {v['p99']}"


def streams_held(rows: dict[str, Any]) -> dict[str, str]:
    """Per condition (``alone``, ``beside flood``), the most live streams run that met
    the six-stream targets, with the smallest count that did not ("4, not 6"); a
    condition none of whose counts met them says so."""
    out: dict[str, str] = {}
    for cond in ("alone", "beside flood"):
        runs = sorted((int(name.split()[0]), fig) for name, fig in rows.items()
                      if name.endswith(cond) and name.split()[0].isdigit())
        if not runs:
            continue
        met = [n for n, fig in runs if _holds(fig)]
        missed = [n for n, fig in runs if not _holds(fig) and n > max(met, default=0)]
        held = f"{max(met)}" if met else f"none of {', '.join(str(n) for n, _ in runs)}"
        out[cond] = held + (f" (not {min(missed)})" if met and missed else "")
    return out


def _holds(fig: dict[str, Any]) -> bool:
    p99 = fig["partial_ms"]["p99"]
    rate = fig["partials_per_stream_s"]
    return p99 is not None and p99 <= HOLD_P99_MS and rate is not None and rate >= HOLD_RATE


def render(result: dict[str, Any]) -> str:
    """BENCHMARKS.md's section for ``result``, markers included."""
    acc = result.get("accuracy", {})
    lines = [sections.LIVE_QUALITY.begin,
             "## Live text on long speech (issue 31)", "",
             f"`python -m bench live-quality --wav {result['wav']}` — host: "
             f"{result.get('host') or 'not stated'}. Whisper base int8, the realtime worker "
             f"on CPU set `{result['rt_cpus']}`; every stream sent at real time in 100 ms "
             "frames over `/v1/stream` (`/v1/realtime` with server_vad, 500 ms)."
             + (" Settings other than the defaults: "
                + ", ".join(f"`{k}={v}`" for k, v in result["settings"].items()) + "."
                if result.get("settings") else ""), "",
             "| audio | streamed finals WER | batch lane WER | repeated 6-word phrases |",
             "|---|---|---|---|"]
    for name, label in (("recording", "shared recording (two_cities.wav)"),
                        ("espeak", f"espeak-ng clip, {result['espeak_s']:.0f} s")):
        if name in acc:
            a = acc[name]
            lines.append(f"| {label} | {a['stream']} | {a.get('batch')} | "
                         f"{len(a['repeated'])} |")
    if "realtime_api" in result:
        rt = result["realtime_api"]
        lines.append(f"| shared recording over /v1/realtime | {rt['wer']} | "
                     f"{acc.get('recording', {}).get('batch')} | {len(rt['repeated'])} |")
    lines += ["", "| live streams | partial ms p50 / p99 | partials per stream-s | "
              "word to partial ms p50 / p99 | word to final ms p50 / p99 | "
              "partial words the final changed | errors |", "|---|---|---|---|---|---|---|"]
    rows = dict(result.get("latency", {}))
    if "one_stream" in result:
        rows = {"1 (the two accuracy streams)": result["one_stream"], **rows}
    for name, fig in rows.items():
        lines.append(f"| {name} | {_ms(fig, 'partial_ms')} | {fig['partials_per_stream_s']} "
                     f"| {_ms(fig, 'word_to_partial_ms')} | {_ms(fig, 'word_to_final_ms')} "
                     f"| {fig['partial_words_changed']} | {len(fig['errors'])} |")
    if "dialogue" in result:
        dia = result["dialogue"]
        worst = [g["speech_s"] for g in dia["gaps"]]
        lines += ["", f"Two-voice espeak-ng dialogue ({dia['seconds']} s, short pauses, lines "
                  "repeated on purpose, one VAD segment until the max-window cut), streamed "
                  f"{len(worst)} times: the most speech without a partial was "
                  + ", ".join(f"{w:.2f}" for w in worst)
                  + f" s (target {MAX_GAP_S} s: "
                  + ("met" if max(worst) <= MAX_GAP_S else "missed") + ")."]
    held = streams_held(rows)
    if held:
        lines += ["", "Streams one realtime core holds at partial p99 <= "
                  f"{HOLD_P99_MS:,.0f} ms and >= {HOLD_RATE} partials per stream-second, of "
                  "the counts run: " + "; ".join(f"{cond} {n}" for cond, n in held.items())
                  + "."]
    if result.get("notes"):
        lines += ["", str(result["notes"])]
    lines.append(sections.LIVE_QUALITY.end)
    return "\n".join(lines) + "\n"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("live-quality", help="the realtime lane's text and timing on long "
                       "speech (issue 31)")
    p.add_argument("--wav", type=Path, default=audio.SHARED_SPEECH)
    p.add_argument("--ref", type=Path, default=audio.SHARED_SPEECH.with_suffix(".txt"))
    p.add_argument("--out", type=Path, default=Path("bench/results/live_quality"))
    p.add_argument("--workdir", type=Path, default=Path("bench/.work/live_quality"))
    p.add_argument("--espeak-s", type=float, default=40.0)
    p.add_argument("--streams", type=counts,
                   default=(2, 6), help="live stream counts, the first also beside the flood")
    p.add_argument("--flood-streams", type=counts, default=(),
                   help="live stream counts beside the flood (default: the first of "
                   "--streams)")
    p.add_argument("--dialogue-runs", type=int, default=3,
                   help="times the two-voice dialogue is streamed for its longest speech "
                   "without a partial (0: not)")
    p.add_argument("--flood-jobs", type=int, default=2)
    p.add_argument("--flood-job-s", type=float, default=222.0)
    p.add_argument("--realtime-only", action="store_true",
                   help="only the shared recording over /v1/realtime")
    p.add_argument("--host", default="", help="the host and its load, in words, for the "
                   "section")
    p.add_argument("--markdown", type=Path, default=Path("BENCHMARKS.md"))
    p.add_argument("--render", type=Path, default=None,
                   help="only put the section back from this live_quality.json")
    p.add_argument("--rt-cpus", default="0")
    p.add_argument("--batch-cpus", default="1")
    p.add_argument("--set", type=setting, action="append", default=[], metavar="NAME=VALUE",
                   help="a setting of the stack other than its default, as in "
                   "whisper_step_window_s=5 (repeatable; checked as LANEGATE_* would be)")


def counts(raw: str) -> tuple[int, ...]:
    """``2,6,8`` as stream counts (each at least 1)."""
    try:
        out = tuple(int(x) for x in raw.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r}: use counts such as 2,6,8") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{raw!r}: every count is at least 1")
    return out


def setting(raw: str) -> tuple[str, str]:
    """``name=value`` as the stack's ``LANEGATE_NAME`` variable, checked as the service
    checks its environment (an unknown name or a bad value fails here)."""
    name, sep, value = raw.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{raw!r}: use NAME=VALUE")
    env = ENV_PREFIX + name.strip().upper()
    if env not in env_names():
        raise argparse.ArgumentTypeError(f"{name!r} is not a setting")
    try:
        Settings.from_env({env: value})
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return env, value


def main(args: argparse.Namespace) -> int:
    if args.render is not None:
        sections.LIVE_QUALITY.put(render(json.loads(args.render.read_text())), args.markdown)
        return 0
    result = asyncio.run(measure(args))
    result["host"] = args.host
    sections.LIVE_QUALITY.put(render(result), args.markdown)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "live_quality.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0
