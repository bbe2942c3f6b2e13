"""Command line: ``python -m offload <command> ...``.

    python -m offload probe [--device D] [--spill-dir P] [--refresh] [--json]

Each command is one entry in ``_COMMANDS``: a help line, a function that adds its arguments to
its sub-parser, and a function that runs it and returns the exit code. Bad input exits with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ._probe import Figures, Source, probe_report

_EXIT_OK = 0
_EXIT_USAGE = 2
"""argparse's exit code for bad arguments; used for every kind of bad input."""


class _Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default=None, help="compute device, e.g. cuda:0 or cpu (default: cuda if available)"
    )
    parser.add_argument("--spill-dir", default=None, help="directory the engine spills to (default: the temp dir)")
    parser.add_argument("--refresh", action="store_true", help="measure again, ignoring the cache")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--size-mb", type=int, default=64, help="MiB per timed transfer (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (default: 3)")


def _run_probe(args: argparse.Namespace) -> int:
    try:
        report = probe_report(
            args.device, spill_dir=args.spill_dir, refresh=args.refresh, size_mb=args.size_mb, repeats=args.repeats
        )
    except ValueError as e:
        print(f"offload probe: error: {e}", file=sys.stderr)
        return _EXIT_USAGE
    profile = report.profile
    provenance = [("link, per tensor", _provenance(report.link)), ("disk", _provenance(report.disk))]
    if args.json:  # stdout stays one JSON object of the figures; where they came from goes to stderr
        print(json.dumps(dataclasses.asdict(profile)))
        for name, text in provenance:
            print(f"offload probe: {name}: {text}", file=sys.stderr)
        return _EXIT_OK

    def gb_per_s(value: float) -> str:
        return f"{value:8.2f} GB/s" if value > 0 else f"{'n/a':>8}"

    rows = [
        ("device", f"{profile.device_type} ({profile.device_name})"),
        ("device -> host", gb_per_s(profile.d2h_gb_per_s)),
        ("host -> device", gb_per_s(profile.h2d_gb_per_s)),
        ("disk write", gb_per_s(profile.disk_write_gb_per_s) + f"  (spill file, {_io(report.disk)})"),
        ("disk read", gb_per_s(profile.disk_read_gb_per_s) + f"  (spill file, {_io(report.disk)})"),
        ("per tensor", f"{profile.per_tensor_overhead_us:8.2f} us"),
        *provenance,
        ("cache", str(report.cache_file)),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return _EXIT_OK


def _io(disk: Figures) -> str:
    return "direct I/O, as the spill tier does it" if disk.disk_io == "direct" else disk.disk_io


def _provenance(figures: Figures) -> str:
    if figures.source is Source.MEASURED:
        return f"measured now ({figures.measured_at})"
    return f"cached, measured {figures.measured_at} (--refresh measures again)"


_COMMANDS: dict[str, _Command] = {
    "probe": _Command("measure link, disk and per-tensor costs on this machine", _add_probe_arguments, _run_probe),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return its exit code."""
    parser = argparse.ArgumentParser(prog="python -m offload", description="offload: activation offloading tools")
    subparsers = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, command in _COMMANDS.items():
        command.add_arguments(subparsers.add_parser(name, help=command.help, description=command.help))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help (0) and on bad arguments (2)
        return e.code if isinstance(e.code, int) else _EXIT_USAGE
    return _COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
