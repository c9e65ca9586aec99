"""The ``trainmover`` command line.

Each subcommand lives in its own module, which exposes
``add_parser(subparsers) -> argparse.ArgumentParser`` and sets ``func`` (a
callable taking the parsed namespace and returning an exit code) with
``parser.set_defaults(func=...)``. Modules are imported lazily so that
``trainmover --help`` stays fast.

``--log-level`` and ``--log-json`` are accepted before and after the
subcommand. For ``launch``, :func:`place_launch_flags` first puts every
``--trainmover``/``--tm-*`` flag where it takes effect, whichever side of the
script it was given on (see its docstring), and a TrainMover script's flags are
checked against the world size before anything starts (:func:`preflight`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import sys

from trainmover_ext.errors import USER_ERRORS, ConfigError

# Subcommand modules, in the order --help lists them.
SUBCOMMAND_MODULES = (
    "trainmover_ext.launch.cli",
    "trainmover_ext.control.cli",
    "trainmover_ext.simulate.cli",
)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def version_line() -> str:
    """``trainmover X (torch Y, megatron-core Z, Python P)``, read from package metadata (torch is not imported)."""

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return (
        f"trainmover {version('trainmover')} (torch {version('torch')}, megatron-core {version('megatron-core')}, "
        f"Python {platform.python_version()})"
    )


def _add_log_flags(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=default,
        help="Python logging level of this command and of the processes `launch` starts "
        "(env TRAINMOVER_LOG_LEVEL; default WARNING).",
    )
    parser.add_argument(
        "--log-json", action="store_true", default=default, help="Log JSON lines (env TRAINMOVER_LOG_JSON=1)."
    )


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="trainmover",
        description="TrainMover: resilient Megatron-core training with warm standbys and live migration.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    _add_log_flags(parser, None)
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
    for subparser in sub.choices.values():
        _add_log_flags(subparser, argparse.SUPPRESS)  # after the subcommand too; the top-level value otherwise
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``trainmover`` console script; returns the exit code."""
    from trainmover_ext.launch.process import fork_safe_cuda_checks

    fork_safe_cuda_checks()  # before any CUDA check: `launch` forks its ranks from this process
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        argv = place_launch_flags(argv, parser)
    except ConfigError as exc:
        print(f"trainmover launch: error: {exc}", file=sys.stderr)
        return 2
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    if rest and not getattr(args, "accepts_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)} (see `trainmover {args.command} --help`)")
    if getattr(args, "accepts_rest", False):
        args.rest = rest
    if args.command == "launch":
        args.preflight = preflight
        global _LEFT_AT_ONCE
        _LEFT_AT_ONCE = True
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


# -- launch: the --tm-* flags on either side of the script ---------------------------------------------

LAUNCH_ONLY_AFTER_SCRIPT = {
    "--tm-etcd-tls": None,
    "--tm-etcd-timeout": (
        "--tm-etcd-timeout bounds the calls of status/events/migrate/drain/controller; `trainmover launch`'s "
        "own etcd calls follow the job's --tm-lease-ttl. Drop it"
    ),
    "--tm-role": (
        "--tm-role after the script: the launcher sets each process's role itself. To make this node a "
        "standby machine, put --tm-role standby before the script (`trainmover launch --tm-role standby ... "
        "pretrain_gpt.py ...`)"
    ),
}
"""Flags of ``launch`` that a user may put after the script: moved before it (None), or refused (why)."""


def _script_parser() -> argparse.ArgumentParser:
    from trainmover_ext.config import add_trainmover_args

    return add_trainmover_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))


def _option(token: str, options: dict[str, argparse.Action]) -> tuple[argparse.Action | None, str, bool]:
    """(action, option name, value attached with '=') of a command-line token."""
    name, eq, _ = token.partition("=")
    return options.get(name), name, bool(eq)


def place_launch_flags(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``trainmover launch`` arguments with every TrainMover flag where it takes effect; other commands as given.

    - A flag of the training script (``--trainmover``, ``--tm-standbys`` ...) given before the script is
      moved after it: the agent reads those from the script's arguments and the ranks parse them.
    - The job and etcd flags (``--tm-job``, ``--tm-job-token``, ``--tm-etcd-endpoints``, ``--tm-etcd-ca``
      ...) given after the script are moved before it: the launcher connects with them and hands them to
      every process it starts in the environment (so the token is not in every rank's command line).
      ``--tm-etcd-endpoints`` takes ``HOST:PORT,HOST:PORT`` on both sides (space-separated ones after the
      script are joined).
    - ``--tm-etcd-tls`` after the script is moved before it; ``--tm-role`` and ``--tm-etcd-timeout`` after
      it are refused with the reason (:data:`LAUNCH_ONLY_AFTER_SCRIPT`).
    - A flag given on both sides with two values raises :class:`ConfigError`.
    """
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    at = 0
    while at < len(argv) and argv[at].startswith("-"):  # the top-level options
        action, _, attached = _option(argv[at], parser._option_string_actions)
        at += 1 if action is None or attached or action.nargs == 0 else 2
    if sub is None or at >= len(argv) or argv[at] != "launch" or "launch" not in sub.choices:
        return argv
    launch_opts = sub.choices["launch"]._option_string_actions
    script_opts = {k: v for k, v in _script_parser()._option_string_actions.items() if _is_tm(k)}
    head, moved_after, i = argv[: at + 1], [], at + 1
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-") or token == "-":
            break
        action, name, attached = _option(token, launch_opts)
        if action is None and name in script_opts:
            action = script_opts[name]
            n = 1 if attached or action.nargs == 0 else 2
            moved_after += argv[i : i + n]
            i += n
            continue
        if action is None and _is_tm(name):
            raise ConfigError(
                LAUNCH_ONLY_AFTER_SCRIPT.get(name)
                or f"{name} is neither a flag of `trainmover launch` nor of the training script: see "
                "`trainmover launch --help` and `python pretrain_gpt.py --help`"
            )
        n = 1 if action is None or attached or action.nargs == 0 else 2
        head += argv[i : i + n]
        i += n
    if i >= len(argv) or argv[i] == "--":
        return head + argv[i:] + moved_after  # no script: argparse says so
    script, after = argv[i], argv[i + 1 :]
    kept: list[str] = []
    j = 0
    while j < len(after):
        token = after[j]
        action, name, attached = _option(token, launch_opts)
        reason = LAUNCH_ONLY_AFTER_SCRIPT.get(name)
        if reason:
            raise ConfigError(reason)
        if action is None or not _is_tm(name):
            kept.append(token)
            j += 1
            continue
        if attached or action.nargs == 0:
            values, j = ([token.partition("=")[2]] if attached else []), j + 1
        else:
            values, j = [], j + 1
            while j < len(after) and not after[j].startswith("-"):
                values.append(after[j])
                j += 1
                if name != "--tm-etcd-endpoints":
                    break
            if not values:
                raise ConfigError(f"{name} after the script needs a value")
        value = ",".join(v.strip(",") for v in values) if values else None
        _add_once(head, launch_opts, action, name, value)
    return head + [script] + kept + moved_after


def _is_tm(option: str) -> bool:
    return option == "--trainmover" or option.startswith("--tm-")


def _add_once(
    head: list[str], options: dict[str, argparse.Action], action: argparse.Action, name: str, value: str | None
) -> None:
    """Append ``name [value]`` to the launch flags unless given there; refuse a second, different value."""
    for k, token in enumerate(head):
        other, _, attached = _option(token, options)
        if other is not action:
            continue
        if value is None:
            return  # a switch given on both sides
        before = token.partition("=")[2] if attached else (head[k + 1] if k + 1 < len(head) else "")
        if before != value:
            raise ConfigError(
                f"{name} is given twice with two values ({before!r} before the script, {value!r} after it): "
                "give it once"
            )
        return
    head += [name] if value is None else [name, value]


def preflight(script: str, script_args: list[str], world_size: int) -> None:
    """Check a TrainMover script's flags against the world size before anything starts.

    Only for a script that takes TrainMover's flags (its source calls ``add_trainmover_args``, as
    ``pretrain_gpt.py`` does): its arguments are parsed and validated exactly as each rank will, so a
    layout that does not fit the world (a TP that does not divide it), a missing dataset or a misspelled
    flag is reported in well under a second, not after etcd and the ranks have started. Raises
    :class:`ConfigError` (argparse's own errors exit 2 with the script's usage).
    """
    try:
        with open(script, encoding="utf-8", errors="replace") as f:
            ours = "add_trainmover_args" in f.read()
    except OSError:
        return  # LaunchConfig says the script does not exist
    if not ours:
        return
    from trainmover_ext.config import add_trainmover_args, config_from_args
    from trainmover_training.arguments import parse_args

    try:
        args = parse_args(add_trainmover_args, argv=script_args, world_size=world_size)
        config_from_args(args)
    except USER_ERRORS as exc:
        raise ConfigError(f"{os.path.basename(script)} on {world_size} ranks: {exc}") from exc


def entry() -> None:
    """The ``trainmover`` console script and ``python -m trainmover_ext.cli``: :func:`main`, then exit.

    After ``launch`` the process leaves at once (``os._exit``, streams and log handlers flushed): a
    launcher holds torch and megatron-core, imported before it forks its ranks, and the interpreter's
    teardown of them took 1 to 2 s on 2 cores, after the job's processes and etcd had all been stopped."""
    code = main()
    if not _LEFT_AT_ONCE:
        sys.exit(code)
    import logging

    from trainmover_ext.launch.logs import wait_for_tees

    wait_for_tees()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_LEFT_AT_ONCE = False
"""Set by :func:`main` for the commands whose process :func:`entry` ends with ``os._exit``."""


if __name__ == "__main__":
    entry()
