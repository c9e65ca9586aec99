"""The ``trainmover`` command line.

Each subcommand lives in its own module, which exposes
``add_parser(subparsers) -> argparse.ArgumentParser`` and sets ``func`` (a
callable taking the parsed namespace and returning an exit code) with
``parser.set_defaults(func=...)``. Modules are imported lazily so that
``trainmover --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from trainmover_ext.errors import USER_ERRORS

# Subcommand modules, in the order --help lists them.
SUBCOMMAND_MODULES = (
    "trainmover_ext.launch.cli",
    "trainmover_ext.control.cli",
    "trainmover_ext.simulate.cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="trainmover",
        description="TrainMover: resilient Megatron-core training with warm standbys and live migration.",
    )
    parser.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        default=None,
        help="Python logging level of this command and of the processes `launch` starts "
        "(env TRAINMOVER_LOG_LEVEL; default WARNING).",
    )
    parser.add_argument("--log-json", action="store_true", help="Log JSON lines (env TRAINMOVER_LOG_JSON=1).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # that capability is not built yet
            raise
        module.add_parser(sub)
    if "events" in sub.choices:
        from trainmover_ext.timeline_plot import extend_events_parser

        extend_events_parser(sub.choices["events"])  # `events --plot`: kept out of the control-plane CLI
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``trainmover`` console script; returns the exit code."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    if rest and not getattr(args, "accepts_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)} (see `trainmover {args.command} --help`)")
    if getattr(args, "accepts_rest", False):
        args.rest = rest
    from trainmover_ext.logconfig import ENV_JSON, ENV_LEVEL, configure

    if args.log_level:
        os.environ[ENV_LEVEL] = args.log_level  # the processes `launch` starts inherit it
    if args.log_json:
        os.environ[ENV_JSON] = "1"
    try:
        configure()
        return int(args.func(args) or 0)
    except USER_ERRORS as exc:
        print(f"trainmover {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
