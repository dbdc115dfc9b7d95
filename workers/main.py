"""``lanegate worker --lane realtime|mixed|batch``: build the settings and run one worker."""

from __future__ import annotations

import argparse
import importlib

from lanegate.constants import WorkerLane
from lanegate.settings import from_args


def main(args: argparse.Namespace) -> int:
    settings = from_args(args)
    lane = WorkerLane(args.lane)
    if lane in (WorkerLane.REALTIME, WorkerLane.MIXED):
        from workers import realtime

        return realtime.main(settings, lane)
    if lane is WorkerLane.BATCH:
        # Imported late so that a realtime worker never loads the batch lane.
        batch = importlib.import_module("workers.batch")
        code: int = batch.main(settings)
        return code
    raise ValueError(f"unknown lane {lane!r}")
