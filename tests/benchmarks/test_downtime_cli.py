"""`benchmarks/downtime.py`'s arguments: each mistake is refused with what to change, before any run."""

from __future__ import annotations

import downtime
import pytest


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--trials", "0"], "--trials must be at least 1"),
        (["--strategies", "trainmover,restrat"], "unknown: ['restrat']"),
        (["--strategies", ""], "--strategies: choose from"),
        (["--trials", "1", "--distopt-trials", "3"], "--distopt-trials 3: between 0 and --trials (1)"),
        (["--trials", "2", "--planned-trials", "-1"], "--planned-trials -1: between 0 and --trials (2)"),
        (["--iters", "20"], "--at-iteration (10) < --iters (20) - --window-after (20)"),
    ],
)
def test_a_bad_argument_is_refused_with_what_to_change(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        downtime.main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
