"""Megatron-LM's whole flag surface against the generated list (``trainmover_training/data/
megatron_lm_flags.json``, from ``megatron/training/arguments.py`` at a pinned commit): every flag is
implemented, accepted without effect and named in the log, or refused by name with the reason. Pure
parser logic, in process."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from helpers import tiny_args
from trainmover_ext.config import add_trainmover_args
from trainmover_training.arguments import build_parser, parse_args
from trainmover_training.megatron_lm_flags import (
    LISTING,
    listing,
    megatron_flags,
    no_effect_given,
    refusal,
    surface_counts,
    surface_gaps,
)


def _parser() -> argparse.ArgumentParser:
    return build_parser(add_trainmover_args)


def _drop(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    """Remove ``flag``'s action from ``parser`` (argparse has no public way), as a careless edit would."""
    action = parser._option_string_actions[flag]
    parser._remove_action(action)
    for group in parser._action_groups:
        if action in group._group_actions:
            group._group_actions.remove(action)
    for s in action.option_strings:
        del parser._option_string_actions[s]
    return action


def _values(nargs) -> list[str]:
    return [] if nargs == 0 else ["1"]


def test_the_list_is_pinned_and_in_the_generators_format():
    import sys

    sys.path.insert(0, "scripts")
    try:
        from gen_megatron_lm_flags import render
    finally:
        sys.path.remove("scripts")
    head = listing()
    assert head["source"] == "https://github.com/NVIDIA/Megatron-LM" and head["ref"] == "core_v0.16.1"
    assert re.fullmatch(r"[0-9a-f]{40}", head["commit"]) and head["generator"] == "scripts/gen_megatron_lm_flags.py"
    assert len(megatron_flags()) > 600  # Megatron-LM 0.16.1 has 651 options
    with open(LISTING) as f:
        assert render(json.loads(f.read())) == open(LISTING).read(), "hand-edited: regenerate it"


def test_the_parser_implements_accepts_or_refuses_every_megatron_lm_flag():
    parser = _parser()
    assert surface_gaps(parser) == []
    counts = surface_counts(parser)
    assert sum(counts.values()) == len(megatron_flags()), counts
    assert counts["implemented"] >= 90 and counts["no effect"] > 100 and counts["refused"] > 100


def test_a_flag_removed_from_the_parser_is_a_gap():
    """The companion: the check fails for an implemented flag removed, a flag without effect removed, and an
    implemented switch that takes a value here (a script's ``--swiglu --next`` would misparse)."""
    parser = _parser()
    _drop(parser, "--recompute-num-layers")
    _drop(parser, "--manual-gc")
    _drop(parser, "--swiglu")
    parser.add_argument("--swiglu", type=str)
    gaps = surface_gaps(parser)
    assert "--recompute-num-layers: in megatron_lm_rules.IMPLEMENTED, but the parser lacks it" in gaps
    assert "--manual-gc: accepted without effect by the rules, but the parser lacks it" in gaps
    assert "--swiglu: takes a value here, unlike Megatron-LM" in gaps
    assert len(gaps) == 3, gaps


def test_every_flag_without_effect_parses_with_megatron_lms_arity_and_is_named():
    parser = _parser()
    accepted = [
        m
        for m in megatron_flags()
        if parser._option_string_actions.get(m.flags[0]) is not None
        and parser._option_string_actions[m.flags[0]].dest.startswith("megatron_lm_no_effect__")
    ]
    assert len(accepted) > 100
    argv = tiny_args(None)
    for m in accepted:
        argv += [m.flags[0], *_values(m.nargs)]
    args = parse_args(add_trainmover_args, argv=argv, world_size=1)
    named = [n.split(" ")[0] for n in no_effect_given(args)]
    assert named == [m.flags[0] for m in accepted]
    assert all("(" in n and n.endswith(")") for n in no_effect_given(args))  # each with its reason
    assert no_effect_given(parse_args(add_trainmover_args, argv=tiny_args(None), world_size=1)) == []


def test_every_refused_flag_is_named_with_its_reason_never_argparses_generic_error(capsys):
    parser = _parser()
    refused = [m for m in megatron_flags() if not any(f in parser._option_string_actions for f in m.flags)]
    assert len(refused) > 100
    for m in refused:
        why = refusal(m.flags[0])
        assert why, m.flags[0]
        with pytest.raises(SystemExit) as exc:
            _parser().parse_args(tiny_args(None) + [m.flags[0], *_values(m.nargs)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"{m.flags[0]} is not supported: {why}" in err and "unrecognized" not in err, err


def test_an_unknown_flag_is_still_named_as_unknown(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(tiny_args(None) + ["--no-such-flag", "--fp8-format", "hybrid"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no-such-flag" in err and "--fp8-format is not supported: fp8" in err


def test_only_adam_is_an_optimizer(capsys):
    assert (
        parse_args(add_trainmover_args, argv=tiny_args(None) + ["--optimizer", "adam"], world_size=1).optimizer
        == "adam"
    )
    with pytest.raises(SystemExit):
        _parser().parse_args(tiny_args(None) + ["--optimizer", "sgd"])
    assert "--optimizer: invalid choice: 'sgd'" in capsys.readouterr().err


def test_a_new_megatron_lm_flag_without_a_rule_is_a_gap(monkeypatch):
    """A regenerated list with a flag of a new group asks for a decision instead of being refused silently."""
    from trainmover_training import megatron_lm_flags
    from trainmover_training.megatron_lm_flags import MegatronFlag

    grown = (*megatron_flags(), MegatronFlag(("--brand-new-thing",), 0, "a new group"))
    monkeypatch.setattr(megatron_lm_flags, "megatron_flags", lambda: grown)
    assert surface_gaps(_parser()) == [
        "--brand-new-thing: no rule decides it (group 'a new group'): add one to megatron_lm_rules"
    ]
