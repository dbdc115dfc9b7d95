"""``GET /status``: a live page of the lanes, drawn from ``GET /status.json``.

The page (``gateway/static/status.html`` and ``status.js``: plain SVG, no library, no
external service) polls ``/status.json`` every ``status_sample_s``. The JSON is
computed here, on request, from the gateway's own partial-latency histogram, each
worker's ``/metrics`` (step duration, live stall, long-prefill seconds), the worker
registry (sessions, slots) and the job stream (depth, oldest job): per lane, the
percentiles over the last ``status_window_s``, a history of samples for the charts,
and one sentence saying whether this traffic would gain from the split (the design's
rule: live partial p99 over the red line while long uploads run), and whether the
realtime lane keeps its own lines: partial p99 against the red line, step p99 against
the step budget its engine runs under (and, when over, what that points to).

Sampling is lazy (no page open: no work) and shared by every viewer of this gateway:
at most one sample per ``status_sample_s``. Partial latency is this gateway's view;
behind a load balancer each replica shows its own streams.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from gateway.state import HTTP, REDIS, SETTINGS
from gateway.status_sources import Sample, Window, take_sample, window
from lanegate.settings import EngineName, Settings
from lanes.queue import backlog
from lanes.registry import WorkerInfo, list_workers

STATIC = Path(__file__).parent / "static"
PARTIAL = "lanegate_partial_latency_seconds"
STEP = "lanegate_step_duration_seconds"
STALL = "lanegate_live_stall_seconds"
PREFILL = "lanegate_long_prefill_seconds"
LIVE_LANES = ("realtime", "mixed")


@dataclass(frozen=True)
class Verdict:
    #: True: would gain from the split; False: no sign it would; None: nothing to judge
    gain: bool | None
    sentence: str
    #: live partial p99 above the red line (None: no live partial in the window)
    over_red_line: bool | None = None
    #: realtime step p99 above the step budget (None: no step, or a mixed pool: uncapped)
    over_step_budget: bool | None = None


def _over(value: float | None, line: float) -> bool | None:
    return None if value is None else value > line


def _cause(step_over: bool | None, streams: int) -> str:
    """What a realtime lane over its red line points to."""
    if step_over:
        return (f"the engine's step on this hardware is too slow for the {streams} live "
                "stream(s) it holds (fewer streams per worker, a faster device or a smaller "
                "model bring it down)")
    return (f"too many streams for the realtime core ({streams} open): each waits for the "
            "steps of the others (fewer streams per worker, or another realtime worker)")


def _split_verdict(rt: dict[str, Any], red_line_ms: float, budget_ms: float,
                   span: str) -> Verdict:
    partial = rt.get("partial_latency_ms", {}).get("p99")
    step = rt.get("step_duration_ms", {}).get("p99")
    streams = int(rt.get("active_sessions") or 0)
    red, over_budget = _over(partial, red_line_ms), _over(step, budget_ms)
    steps = f"step p99 {_ms(step)} against a {budget_ms:.0f} ms budget"
    batch = ("Long uploads run on the batch worker, so they are not the cause: "
             if red else "long uploads run on the batch worker, so ")
    if red:
        return Verdict(None, f"The realtime lane is over its {red_line_ms:.0f} ms red line: "
                       f"partial p99 {_ms(partial)}, {steps}. {batch}"
                       f"{_cause(over_budget, streams)}.", True, over_budget)
    head = f"The lanes are split: {batch}live streams never wait behind them"
    if red is None:
        return Verdict(None, f"{head}; no live partial in {span} to judge ({steps}).",
                       None, over_budget)
    if over_budget:
        return Verdict(None, f"{head}; partial p99 {_ms(partial)} is under the "
                       f"{red_line_ms:.0f} ms red line, but the steps run over their budget "
                       f"({steps}): the realtime core is near its limit with {streams} "
                       "stream(s) open.", False, True)
    return Verdict(None, f"{head}, and the realtime lane keeps its lines: partial p99 "
                   f"{_ms(partial)}, under the {red_line_ms:.0f} ms red line; step p99 "
                   f"{_ms(step)}, within the {budget_ms:.0f} ms budget.", False, over_budget)


def verdict(design: str, lanes: dict[str, dict[str, Any]], red_line_ms: float,
            window_s: float, step_budget_ms: float = 0.0) -> Verdict:
    """The design's rule over the window, in one sentence: live streams held past the
    red line while long uploads run means the split would help. A split pool is judged
    against its red line and its realtime ``step_budget_ms``, and told what a lane over
    them points to.

    The evidence is the live stall (how long live streams waited behind the uploads'
    prefills), not the gateway's partial latency: that one times a partial from the
    newest audio it covers, and after a stall one partial may cover all that waited."""
    span = f"the last {window_s:.0f} s"
    if design != "mixed":
        return _split_verdict(lanes.get("realtime", {}), red_line_ms, step_budget_ms, span)
    mixed = lanes.get("mixed", {})
    share = float(mixed.get("long_prefill_share", 0.0))
    stall = mixed.get("live_stall_ms", {})
    p99 = mixed.get("partial_latency_ms", {}).get("p99")
    red = _over(p99, red_line_ms)
    if share <= 0:
        slow = (f" It is over the {red_line_ms:.0f} ms red line all the same, so not because "
                "of uploads: " + _cause(None, int(mixed.get("active_sessions") or 0)) + "."
                ) if red else ""
        return Verdict(False, f"No long upload ran in {span} (live partial p99 {_ms(p99)}): "
                       "nothing here says this traffic needs the split; look again while "
                       f"uploads run.{slow}", red)
    took = f"took {share:.0%} of the mixed worker's time in {span}"
    if not stall.get("count"):
        return Verdict(None, f"Long uploads {took}, but no live stream was open while they "
                       "ran: nothing to judge yet.", red)
    waited = float(stall.get("p99") or 0.0)
    if waited > red_line_ms:
        return Verdict(True, f"Live streams waited {_ms(waited)} (p99) behind long uploads, "
                       f"over the {red_line_ms:.0f} ms line, while those {took}: this "
                       "traffic would gain from the split (lanes=split).", red)
    return Verdict(False, f"Live streams waited at most {_ms(waited)} (p99) behind long "
                   f"uploads, under the {red_line_ms:.0f} ms line, while those {took}: "
                   "this traffic does not need the split yet.", red)


def _ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"


def _percentiles(win: Window, family: str, lane: str) -> dict[str, Any]:
    return {"p50": win.quantile_ms(family, lane, 0.5), "p90": win.quantile_ms(family, lane, 0.9),
            "p99": win.quantile_ms(family, lane, 0.99), "count": win.count(family, lane)}


def lane_summaries(workers: list[WorkerInfo], win: Window) -> dict[str, dict[str, Any]]:
    lanes: dict[str, dict[str, Any]] = {}
    for worker in workers:
        lane = lanes.setdefault(worker.lane, {"workers": 0, "slots": 0, "active_sessions": 0,
                                              "free_slots": 0, "draining": 0})
        lane["workers"] += 1
        lane["slots"] += worker.slots_total
        lane["free_slots"] += worker.slots_free
        lane["active_sessions"] += worker.slots_total - worker.slots_free
        lane["draining"] += int(worker.draining)
    for name, lane in lanes.items():
        lane["step_duration_ms"] = _percentiles(win, STEP, name)
        if name in LIVE_LANES:
            lane["partial_latency_ms"] = _percentiles(win, PARTIAL, name)
            lane["live_stall_ms"] = _percentiles(win, STALL, name)
            lane["long_prefill_share"] = round(win.share(PREFILL, name), 4)
    return lanes


def history_point(t: float, lanes: dict[str, dict[str, Any]], queue: dict[str, Any]
                  ) -> dict[str, Any]:
    point: dict[str, Any] = {"t": round(t, 3), "queue_depth": queue.get("depth"),
                             "oldest_job_age_s": queue.get("oldest_age_s"), "lanes": {}}
    for name, lane in lanes.items():
        entry = {"step_p50_ms": lane["step_duration_ms"]["p50"],
                 "step_p99_ms": lane["step_duration_ms"]["p99"],
                 "active_sessions": lane["active_sessions"], "free_slots": lane["free_slots"]}
        if name in LIVE_LANES:
            entry.update(partial_p50_ms=lane["partial_latency_ms"]["p50"],
                         partial_p99_ms=lane["partial_latency_ms"]["p99"],
                         stall_p99_ms=lane["live_stall_ms"]["p99"],
                         long_prefill_share=lane["long_prefill_share"])
        point["lanes"][name] = entry
    return point


class StatusBoard:
    """Samples (at most one per ``status_sample_s``), the window and the history."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started = time.time()
        self._samples: deque[Sample] = deque()
        self._history: deque[dict[str, Any]] = deque(maxlen=max(1, settings.status_history))
        self._latest: dict[str, Any] | None = None
        self._lock = asyncio.Lock()

    async def status(self, app: web.Application) -> dict[str, Any]:
        async with self._lock:
            latest = self._latest
            if latest is not None and time.time() - latest["time"] < \
                    self.settings.status_sample_s * 0.9:
                return latest
            self._latest = await self._compute(app)
            return self._latest

    async def _compute(self, app: web.Application) -> dict[str, Any]:
        settings = self.settings
        workers, queue, redis_error = await _cluster(app, settings.status_scrape_timeout_s)
        sample, silent = await take_sample(app[HTTP], workers, settings.status_scrape_timeout_s)
        baseline = self._remember(sample)
        win = window(sample, baseline, self.started)
        lanes = lane_summaries(workers, win)
        budget_ms = settings.step_budget(redecodes=settings.engine is EngineName.WHISPER)
        verdict_ = verdict(settings.lanes, lanes, settings.status_red_line_ms, win.seconds,
                           budget_ms)
        self._history.append(history_point(sample.t, lanes, queue))
        return {
            "time": sample.t, "design": settings.lanes, "engine": settings.engine,
            "window_s": round(win.seconds, 1), "poll_s": settings.status_sample_s,
            "red_line_ms": settings.status_red_line_ms,
            "step_budget_ms": budget_ms,
            "lanes": lanes, "queue": queue, "redis_error": redis_error,
            "silent_workers": silent,
            "split": {"gain": verdict_.gain, "sentence": verdict_.sentence,
                      "over_red_line": verdict_.over_red_line,
                      "over_step_budget": verdict_.over_step_budget},
            "history": list(self._history),
        }

    def _remember(self, sample: Sample) -> Sample | None:
        """Keep ``sample``; the newest kept sample at least a window old is the baseline
        (None until the gateway has watched a whole window: then since it started)."""
        self._samples.append(sample)
        edge = sample.t - self.settings.status_window_s
        while len(self._samples) >= 2 and self._samples[1].t <= edge:
            self._samples.popleft()
        first = self._samples[0]
        return first if first.t <= edge else None


async def _cluster(app: web.Application, timeout_s: float
                   ) -> tuple[list[WorkerInfo], dict[str, Any], str]:
    """The workers and the backlog, or why Redis did not give them within ``timeout_s``:
    the gateway's client has no socket timeout (its blocking reads are legitimate), and
    a read that never returns would hold the board's lock, and so every viewer, for good."""
    redis = app[REDIS]
    try:
        async with asyncio.timeout(timeout_s):
            workers = (await list_workers(redis, "realtime")
                       + await list_workers(redis, "batch"))
            queued = await backlog(redis)
    except TimeoutError:
        return [], {"depth": None, "oldest_age_s": None}, \
            f"Redis does not answer within {timeout_s:g} s"
    except (RedisError, OSError) as exc:
        return [], {"depth": None, "oldest_age_s": None}, f"Redis does not answer: {exc}"
    return workers, {"depth": queued.depth, "oldest_age_s": round(queued.oldest_age_s(), 1)}, ""


BOARD = web.AppKey("status_board", StatusBoard)


async def status_json(request: web.Request) -> web.Response:
    return web.json_response(await request.app[BOARD].status(request.app),
                             headers={"Cache-Control": "no-store"})


def _static(name: str, content_type: str) -> Any:
    body = (STATIC / name).read_bytes()

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type, charset="utf-8")

    return handler


def setup_status(app: web.Application) -> None:
    app[BOARD] = StatusBoard(app[SETTINGS])
    app.router.add_get("/status", _static("status.html", "text/html"))
    app.router.add_get("/status.js", _static("status.js", "text/javascript"))
    app.router.add_get("/status.json", status_json)
