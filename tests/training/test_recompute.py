"""Activation recomputation (Megatron-LM's --recompute-* flags, megatron-core's implementation): the losses
are those of the run that keeps every activation, bit for bit, at bf16 and dropout 0.1 with tensor and
pipeline parallelism (the recomputed forward draws the same dropout masks). Real processes."""

from __future__ import annotations

import pytest

from helpers import losses_by_iteration, run_job, tiny_args

ITERS = 4


def _losses(tmp_path, name: str, flags: list[str]) -> dict[int, float]:
    job = run_job(tmp_path, 4, tiny_args(None, tp=2, pp=2, iters=ITERS, gbs=4, extra=["--bf16", *flags]), name=name)
    return losses_by_iteration(job.metrics_path)


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("kept"), "kept", [])


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--recompute-activations"], id="selective"),
        pytest.param(
            ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
            id="full-uniform",
        ),
        pytest.param(
            ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
            id="full-block",
        ),
    ],
)
def test_recomputation_changes_no_loss(tmp_path, kept, flags):
    got = _losses(tmp_path, "recomputed", flags)
    assert sorted(got) == list(range(1, ITERS + 1))
    assert got == kept


def test_recomputation_flags_are_checked_before_anything_starts():
    from trainmover_training.arguments import parse_args
    from trainmover_training.errors import ConfigError

    base = tiny_args(None, pp=2)
    with pytest.raises(ConfigError, match="needs --recompute-method"):
        parse_args(argv=[*base, "--recompute-granularity", "full"], world_size=2)
    with pytest.raises(ConfigError, match="between 1 and the layers of one pipeline stage .2."):
        parse_args(
            argv=[
                *base,
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
                "--recompute-num-layers",
                "3",
            ],
            world_size=2,
        )
    with pytest.raises(ConfigError, match="--recompute-method applies to --recompute-granularity full only"):
        parse_args(argv=[*base, "--recompute-activations", "--recompute-method", "uniform"], world_size=2)
    assert parse_args(argv=[*base, "--recompute-activations"], world_size=2).recompute_granularity == "selective"


def test_the_flags_reach_megatron_cores_config():
    """What makes the loss test above meaningful: megatron-core is told to recompute."""
    from types import SimpleNamespace

    from trainmover_training.arguments import parse_args
    from trainmover_training.model import transformer_config_from_args

    flags = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"]
    args = parse_args(argv=[*tiny_args(None, pp=2), *flags], world_size=2)
    config = transformer_config_from_args(args, SimpleNamespace(backend="gloo", comm=""))
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 2)
    plain = transformer_config_from_args(
        parse_args(argv=tiny_args(None, pp=2), world_size=2), SimpleNamespace(backend="gloo", comm="")
    )
    assert plain.recompute_granularity is None
