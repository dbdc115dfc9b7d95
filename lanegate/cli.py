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

from lanegate.gateway_url import DEFAULT_URL
from lanegate.logs import guard_output
from lanegate.loops import loop_factory
from lanegate.settings import SettingsError, add_cli_flags, from_args, markdown_table

#: subcommand -> "module:function"; the function takes the parsed namespace
#: and returns a process exit code.
COMMANDS: dict[str, str] = {
    "up": "lanegate.supervisor:main",
    "gateway": "gateway.app:main",
    "worker": "workers.main:main",
    "stream": "lanegate.stream_client:main",
    "transcribe": "lanegate.upload_client:main",
    "models": "engines.models:main",
}
#: the subcommands that run a service: a log reader that goes away or stops reading
#: must not stop them (``lanegate.logs.guard_output``)
SERVICES = frozenset({"up", "gateway", "worker"})


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lanegate", formatter_class=DefaultsHelp,
        description="ASR gateway and lane scheduler. Every setting also reads LANEGATE_<NAME>.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start redis (unless --redis-url), gateway and workers",
                        formatter_class=DefaultsHelp)
    add_cli_flags(up)

    gw = sub.add_parser("gateway", help="run the public gateway", formatter_class=DefaultsHelp)
    add_cli_flags(gw)

    worker = sub.add_parser("worker", help="run a realtime, batch or mixed worker",
                            formatter_class=DefaultsHelp)
    worker.add_argument("--lane", choices=("realtime", "batch", "mixed"), required=True,
                        help="which lane this worker serves (required)")
    add_cli_flags(worker)

    stream = sub.add_parser("stream", help="stream an audio file at real-time pace",
                            formatter_class=DefaultsHelp)
    stream.add_argument("file", help="audio file (wav, flac, ogg, mp3, m4a, webm; any rate "
                        "and channels: decoded and resampled to 16 kHz mono)")
    _client_flags(stream)
    stream.add_argument("--speed", type=float, default=1.0,
                        help="pace multiplier; 0 sends as fast as possible")
    stream.add_argument("--partials", action="store_true",
                        help="when stdout is not a terminal, print partials as "
                        "'(partial) ...' lines too (on a terminal they are always shown)")

    tr = sub.add_parser("transcribe", help="upload a file and print or save its transcript",
                        formatter_class=DefaultsHelp)
    tr.add_argument("file", help="audio file (wav, flac, ogg, mp3, m4a, webm)")
    _client_flags(tr)
    tr.add_argument("--format", default="text", choices=("json", "text", "srt", "vtt"),
                    help="result format")
    tr.add_argument("--async", dest="async_", action="store_true",
                    help="always queue as a batch job")
    tr.add_argument("--output", "-o", default=None,
                    help="write the result to this file (default: stdout)")

    models = sub.add_parser("models", help="list, verify and locate the bundled Whisper models",
                            formatter_class=DefaultsHelp)
    models.add_argument("--no-verify", dest="verify", action="store_false",
                        help="do not assemble and check digests, only list")
    add_cli_flags(models, ["data_dir"])

    settings = sub.add_parser("settings", help="print the settings table",
                              formatter_class=DefaultsHelp)
    settings.add_argument("--markdown", action="store_true",
                          help="as a Markdown table")
    return parser


def _client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL,
                        help="gateway base URL; 'host:port' and a trailing /v1 are accepted")
    parser.add_argument("--api-key", default=None,
                        help="API key (default: env LANEGATE_API_KEY, else none)")


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
        loop_factory(from_args(args).event_loop)  # a bad setting stops here, in one line
        if args.command in SERVICES:
            guard_output()
        return resolve(COMMANDS[args.command])(args)
    except SettingsError as exc:
        print(f"lanegate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
