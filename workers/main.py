"""``lanegate worker --lane realtime|mixed|batch``: build the settings and run one worker."""

from __future__ import annotations

import argparse
import importlib

from lanegate.settings import from_args


def main(args: argparse.Namespace) -> int:
    settings = from_args(args)
    lane = str(args.lane)
    if lane in ("realtime", "mixed"):
        from workers import realtime

        return realtime.main(settings, lane)
    if lane == "batch":
        # Imported late so that a realtime worker never loads the batch lane.
        batch = importlib.import_module("workers.batch")
        code: int = batch.main(settings)
        return code
    raise ValueError(f"unknown lane {lane!r}")
