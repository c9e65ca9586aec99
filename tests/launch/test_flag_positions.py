"""Every ``--trainmover``/``--tm-*`` flag takes effect or is refused with a message, before and after the script.

``trainmover launch [LAUNCH FLAGS] pretrain_gpt.py [SCRIPT FLAGS]``: a user puts a TrainMover flag on
either side. Each flag of both parsers (found from the parsers themselves, so a new flag is covered
the day it is added) is given alone on each side, and the launch is built as ``trainmover launch``
builds it, up to the point where the agent would start (nothing is started). The flag must then
either be where it acts (the launcher's parsed flags for the job and etcd flags, the ranks' arguments
for the script's flags, with the value given) or be refused with an error naming it.
"""

from __future__ import annotations

import argparse

import pytest

from harness.jobs import PRETRAIN
from trainmover_ext.cli import _script_parser, build_parser, place_launch_flags
from trainmover_ext.config import config_from_args
from trainmover_ext.errors import ConfigError
from trainmover_ext.launch.cli import build

SAMPLE = {
    "--tm-role": "standby",
    "--tm-etcd-endpoints": "127.0.0.1:1",
    "--tm-inject-fault": "1:3:forward",
    "--tm-inject-slowdown": "1:1.5:10",
    "--tm-inject-link-delay": "0:2:0.005:10",
    "--tm-standby-duty": "0.5",
    "--tm-standby-nice": "5",
    "--tm-keep-role": "first",
    "--tm-comm": "native",
    "--tm-log-level": "INFO",
    "--tm-record-dir": "recordings-here",
    "--tm-optimizer-mirror": "off",
}


def _launch_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["launch"]


def _tm_flags() -> dict[str, argparse.Action]:
    flags: dict[str, argparse.Action] = {}
    for parser in (_script_parser(), _launch_parser()):
        for option, action in parser._option_string_actions.items():
            if option == "--trainmover" or option.startswith("--tm-"):
                flags.setdefault(option, action)
    flags["--tm-etcd-timeout"] = argparse.Action(["--tm-etcd-timeout"], "tm_etcd_timeout")  # status & co only
    return flags


def _value(option: str, action: argparse.Action) -> list[str]:
    if action.nargs == 0:
        return []
    if option in SAMPLE:
        return [SAMPLE[option]]
    if action.choices:
        return [next(c for c in action.choices if c != action.default)]
    if action.type is int:
        return ["2"]
    if action.type is float:
        return ["3.5"]
    return ["given-value"]


FLAGS = _tm_flags()


def _run_to_start(argv: list[str], place=place_launch_flags):
    """What ``trainmover main`` does up to the agent's start: (parsed launch flags, config) or the error."""
    parser = build_parser()
    argv = place(argv, parser)
    args, rest = parser.parse_known_args(argv)
    if rest:
        raise ConfigError(f"unrecognized arguments: {' '.join(rest)}")
    config, _ = build(args)
    return args, config


def _check(option: str, position: str, capsys, place=place_launch_flags) -> None:
    """Assert that ``option`` alone on side ``position`` of the script acts or is refused by name."""
    action = FLAGS[option]
    given = [option, *_value(option, action)]
    base = ["--trainmover", "--mock-data"]
    launch = ["launch", "--nproc-per-node", "2"]
    if option.startswith("--tm-etcd-") and option not in ("--tm-etcd-endpoints", "--tm-etcd-tls"):
        launch += ["--tm-etcd-endpoints", "127.0.0.1:1"]  # credentials of an external etcd
    if position == "before":
        argv = [*launch, *given, PRETRAIN, *base]
    else:
        argv = [*launch, PRETRAIN, *base, *given]
    try:
        args, config = _run_to_start(argv, place)
    except ConfigError as exc:
        assert option in str(exc), f"{option} {position} the script refused without naming it: {exc}"
        return
    except SystemExit:
        err = capsys.readouterr().err
        assert option in err, f"{option} {position} the script refused without naming it: {err}"
        return
    launch = _launch_parser()._option_string_actions
    if option in launch:
        # the job and etcd flags: the launcher acts on them, and they leave the ranks' command line
        expected = given[1] if len(given) > 1 else True
        assert getattr(args, action.dest) == expected, (option, position, getattr(args, action.dest))
        assert option not in config.script_args, (option, position, config.script_args)
        return
    # the script's flags reach the ranks with their value, whatever side they were given on
    ranks = _script_parser().parse_known_args(config.script_args)[0]
    got = getattr(ranks, action.dest)
    if action.nargs == 0:
        assert got is not None, (option, position, config.script_args)
    else:
        want = action.type(given[1]) if callable(action.type) else given[1]
        assert got == want, (option, position, got, want)
    assert config_from_args(ranks, environ={}) is not None  # the ranks accept it


@pytest.mark.parametrize("position", ["before", "after"])
@pytest.mark.parametrize("option", sorted(FLAGS))
def test_every_tm_flag_acts_or_is_refused(option, position, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("TRAINMOVER_JOB", "TRAINMOVER_JOB_TOKEN", "TRAINMOVER_ETCD_ENDPOINTS", "TRAINMOVER_ETCD_CA"):
        monkeypatch.delenv(var, raising=False)
    _check(option, position, capsys)


def test_the_launcher_acts_on_script_flags_from_either_side(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for flags in (["--tm-standbys", "2", "--tm-lease-ttl", "1.5"],):
        _, before = _run_to_start(["launch", *flags, PRETRAIN, "--trainmover", "--mock-data"])
        _, after = _run_to_start(["launch", PRETRAIN, "--trainmover", "--mock-data", *flags])
        for config in (before, after):
            assert config.standbys == 2 and config.lease_ttl_s == 1.5


def test_a_standby_machine_takes_the_job_flags_after_the_script(tmp_path, monkeypatch):
    """The issue's case: connection flags after the script used to be refused with 'pass --tm-job-token'."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRAINMOVER_JOB_TOKEN", raising=False)
    args, config = _run_to_start(
        ["launch", "--tm-role", "standby", "--nproc-per-node", "2", PRETRAIN, "--trainmover", "--mock-data"]
        + ["--tm-etcd-endpoints", "10.0.0.1:2379", "10.0.0.2:2379", "--tm-job", "j", "--tm-job-token", "T"]
    )
    assert config.role == "standby" and config.rendezvous.token == "T" and config.rendezvous.job == "j"
    assert config.rendezvous.endpoints == ["10.0.0.1:2379", "10.0.0.2:2379"]
    assert "T" not in config.script_args  # the token is not on every rank's command line


def test_a_flag_given_twice_with_two_values_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="--tm-job is given twice"):
        _run_to_start(["launch", "--tm-job", "a", PRETRAIN, "--trainmover", "--tm-job", "b"])


def test_the_rank_refuses_job_flags_its_launcher_did_not_give():
    parser = _script_parser()
    with pytest.raises(ConfigError, match="--tm-job names a TrainMover job: add --trainmover"):
        config_from_args(parser.parse_args(["--tm-job", "j"]), environ={})
    with pytest.raises(ConfigError, match="--tm-etcd-endpoints .* differs from what this process's launcher"):
        config_from_args(
            parser.parse_args(["--trainmover", "--tm-etcd-endpoints", "a:1"]),
            environ={"TRAINMOVER_ETCD_ENDPOINTS": "b:2"},
        )
    cfg = config_from_args(
        parser.parse_args(["--trainmover", "--tm-etcd-endpoints", "a:1,b:2"]),
        environ={"TRAINMOVER_ETCD_ENDPOINTS": "a:1,b:2"},
    )
    assert cfg.etcd_endpoints == ["a:1", "b:2"]


def test_companion_a_silently_ignored_flag_fails_the_check(capsys, tmp_path, monkeypatch):
    """The check can fail: without the placement step (as before it existed), --tm-etcd-endpoints after the
    script was accepted by the ranks and read by nobody, and the check says so."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRAINMOVER_ETCD_ENDPOINTS", raising=False)
    with pytest.raises(AssertionError):
        _check("--tm-etcd-endpoints", "after", capsys, place=lambda argv, parser: argv)
