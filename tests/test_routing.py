"""The sync-versus-async decision for uploads."""

from __future__ import annotations

import pytest

from lanegate.settings import Settings
from lanes.routing import (
    Lane,
    Reason,
    busy_fallback,
    realtime_admits,
    route_upload,
    wait_timeout_s,
)

SETTINGS = Settings(sync_max_seconds=30.0, wait_base_s=30.0, wait_per_audio_s=2.0)
#: more free realtime slots than any reserve these tests set
FREE = 8


@pytest.mark.parametrize(
    ("seconds", "async_requested", "lane", "reason"),
    [
        (0.5, False, Lane.REALTIME, Reason.SHORT),
        (30.0, False, Lane.REALTIME, Reason.SHORT),  # the limit itself is still short
        (30.01, False, Lane.BATCH, Reason.LONG),
        (3600.0, False, Lane.BATCH, Reason.LONG),
        (0.5, True, Lane.BATCH, Reason.ASYNC),
        (3600.0, True, Lane.BATCH, Reason.ASYNC),
    ],
)
def test_route_upload(seconds: float, async_requested: bool, lane: Lane, reason: Reason) -> None:
    route = route_upload(seconds, async_requested=async_requested, free_realtime_slots=FREE,
                         settings=SETTINGS)
    assert (route.lane, route.reason) == (lane, reason)
    assert route.sync is (lane is Lane.REALTIME)


def test_sync_limit_is_a_setting() -> None:
    settings = SETTINGS.replace(sync_max_seconds=5.0)
    assert route_upload(6.0, async_requested=False, free_realtime_slots=FREE,
                        settings=settings).lane is Lane.BATCH
    assert route_upload(6.0, async_requested=False, free_realtime_slots=FREE,
                        settings=SETTINGS).lane is Lane.REALTIME


def test_busy_realtime_lane_falls_back_to_batch() -> None:
    route = busy_fallback()
    assert route.lane is Lane.BATCH
    assert route.reason is Reason.REALTIME_BUSY
    assert not route.sync


def test_wait_timeout_scales_with_audio() -> None:
    assert wait_timeout_s(0.0, SETTINGS) == pytest.approx(30.0)
    assert wait_timeout_s(90.0, SETTINGS) == pytest.approx(210.0)


def test_uploads_leave_reserved_realtime_slots_to_streams() -> None:
    settings = SETTINGS.replace(upload_reserve_slots=1)
    assert realtime_admits(2, settings)
    assert not realtime_admits(1, settings)
    assert not realtime_admits(0, settings)
    assert realtime_admits(1, settings.replace(upload_reserve_slots=0))
    assert not realtime_admits(0, settings.replace(upload_reserve_slots=0))


def test_a_webhook_asks_for_a_job() -> None:
    route = route_upload(0.5, async_requested=False, webhook=True, free_realtime_slots=FREE,
                         settings=SETTINGS)
    assert (route.lane, route.reason) == (Lane.BATCH, Reason.ASYNC)


def test_short_upload_without_a_spare_slot_goes_to_batch() -> None:
    settings = SETTINGS.replace(upload_reserve_slots=1)
    busy = route_upload(0.5, async_requested=False, free_realtime_slots=1, settings=settings)
    assert (busy.lane, busy.reason) == (Lane.BATCH, Reason.REALTIME_BUSY)
    free = route_upload(0.5, async_requested=False, free_realtime_slots=2, settings=settings)
    assert free.lane is Lane.REALTIME
    long = route_upload(60.0, async_requested=False, free_realtime_slots=0, settings=settings)
    assert long.reason is Reason.LONG
