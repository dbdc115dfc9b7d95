"""The ``lanegate`` console script: one entry, one subcommand per process or client.

Each subcommand imports its module lazily, so ``lanegate stream`` does not
load an engine and ``lanegate --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from lanegate.loops import use_event_loop
from lanegate.settings import SettingsError, add_cli_flags, from_args, markdown_table

#: subcommand -> "module:function"; the function takes the parsed namespace
#: and returns a process exit code.
COMMANDS: dict[str, str] = {
    "up": "lanegate.supervisor:main",
    "gateway": "gateway.app:main",
    "worker": "workers.main:main",
    "stream": "lanegate.stream_client:main",
    "transcribe": "lanegate.upload_client:main",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lanegate",
        description="ASR gateway and lane scheduler. Every setting also reads LANEGATE_<NAME>.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start redis (unless --redis-url), gateway and workers")
    add_cli_flags(up)

    gw = sub.add_parser("gateway", help="run the public gateway")
    add_cli_flags(gw)

    worker = sub.add_parser("worker", help="run a realtime, batch or mixed worker")
    worker.add_argument("--lane", choices=("realtime", "batch", "mixed"), required=True)
    add_cli_flags(worker)

    stream = sub.add_parser("stream", help="stream a WAV file at real-time pace")
    stream.add_argument("file", help="WAV file (PCM s16le mono)")
    stream.add_argument("--url", default="http://127.0.0.1:8080", help="gateway base URL")
    stream.add_argument("--api-key", default=None, help="API key (env LANEGATE_API_KEY)")
    stream.add_argument("--speed", type=float, default=1.0,
                        help="pace multiplier; 0 sends as fast as possible")

    tr = sub.add_parser("transcribe", help="upload a file and print or save its transcript")
    tr.add_argument("file", help="audio file (wav, flac, ogg, mp3, m4a, webm)")
    tr.add_argument("--url", default="http://127.0.0.1:8080", help="gateway base URL")
    tr.add_argument("--api-key", default=None, help="API key (env LANEGATE_API_KEY)")
    tr.add_argument("--format", default="text", choices=("json", "text", "srt", "vtt"))
    tr.add_argument("--async", dest="async_", action="store_true",
                    help="always queue as a batch job")
    tr.add_argument("--output", "-o", default=None, help="write the result to this file")

    settings = sub.add_parser("settings", help="print the settings table")
    settings.add_argument("--markdown", action="store_true", help="as a Markdown table")
    return parser


def resolve(target: str) -> Callable[[argparse.Namespace], int]:
    module_name, func_name = target.split(":")
    func: Callable[[argparse.Namespace], int] = getattr(
        importlib.import_module(module_name), func_name
    )
    return func


def main(argv: Sequence[str] | None = None) -> int:
    args: Any = build_parser().parse_args(argv)
    if args.command == "settings":
        print(markdown_table())
        return 0
    try:
        use_event_loop(from_args(args).event_loop)
        return resolve(COMMANDS[args.command])(args)
    except SettingsError as exc:
        print(f"lanegate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
