"""Pure-logic unit tests: data order, config, patches, tokenizer."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from helpers import tiny_args
from trainmover_ext.config import add_trainmover_args, config_from_args
from trainmover_ext.errors import ConfigError, PatchError
from trainmover_training.arguments import parse_args
from trainmover_training.data import BatchPlan, GPTBatchIterator, IndexedGPTDataset, MockGPTDataset, micro_batch_indices
from trainmover_training.tokenizer import ByteLevelTokenizer


def test_dp_ranks_read_disjoint_consecutive_samples():
    ds = MockGPTDataset(100, 8, seed=1)
    plans = [BatchPlan(micro_batch_size=2, data_parallel_size=3, data_parallel_rank=d) for d in range(3)]
    iters = [GPTBatchIterator(ds, p, consumed_samples=12) for p in plans]
    seen = []
    for _ in range(2):
        for it in iters:
            seen += next(it)["sample_indices"]
    assert sorted(seen) == list(range(12, 24))
    assert all(it.consumed_samples == 24 for it in iters)


def test_samples_do_not_depend_on_layout():
    ds = MockGPTDataset(100, 8, seed=7)
    one = GPTBatchIterator(ds, BatchPlan(micro_batch_size=4, data_parallel_size=1, data_parallel_rank=0))
    two = [
        GPTBatchIterator(ds, BatchPlan(micro_batch_size=2, data_parallel_size=2, data_parallel_rank=d))
        for d in range(2)
    ]
    a = next(one)["tokens"]
    b = np.concatenate([next(it)["tokens"].numpy() for it in two])
    assert np.array_equal(a.numpy(), b)


def test_indexed_dataset_windows_and_epochs(corpus):
    ds = IndexedGPTDataset([corpus + "_text_document"], seq_length=64, seed=3)
    first_epoch = {tuple(ds[i][:8]) for i in range(ds.windows)}
    assert len(first_epoch) > ds.windows * 0.9  # a permutation of distinct windows
    assert len(ds[5]) == 65
    assert not np.array_equal(ds[0], ds[ds.windows])  # a new epoch has a new order


def test_byte_tokenizer_round_trip():
    tok = ByteLevelTokenizer()
    assert tok.detokenize(tok.tokenize("héllo") + [tok.eod]) == "héllo"


def test_padded_vocab_independent_of_tp():
    from trainmover_training.tokenizer import build_tokenizer

    sizes = set()
    for tp in (1, 2, 4):
        args = parse_args(add_trainmover_args, tiny_args(None, tp=tp), world_size=tp)
        build_tokenizer(args)
        sizes.add(args.padded_vocab_size)
    assert sizes == {384}


def test_micro_batch_indices():
    assert micro_batch_indices(BatchPlan(micro_batch_size=2, data_parallel_size=2, data_parallel_rank=1), 8) == [10, 11]


def test_trainmover_flags_parse_and_unwired_flags_refuse(monkeypatch):
    import trainmover_ext.config as config

    parser = add_trainmover_args(argparse.ArgumentParser())
    cfg = config_from_args(parser.parse_args(["--trainmover", "--tm-job", "j1", "--tm-lease-ttl", "1.5"]))
    assert cfg.enabled and cfg.job == "j1" and cfg.lease_ttl_s == 1.5
    assert config_from_args(parser.parse_args(["--trainmover", "--tm-leaver-becomes-standby"])).leaver_becomes_standby
    with pytest.raises(ConfigError, match="--tm-leaver-becomes-standby needs --trainmover"):
        config_from_args(parser.parse_args(["--tm-leaver-becomes-standby"]))
    monkeypatch.setitem(config.NOT_WIRED, "tm_compile", "not built in this test")
    with pytest.raises(ConfigError, match="--tm-compile is declared but not available in this build: not built"):
        config_from_args(parser.parse_args(["--tm-compile"]))
    with pytest.raises(ConfigError, match="--tm-lease-ttl"):
        config_from_args(parser.parse_args(["--tm-lease-ttl", "0"]))


def test_patch_version_gate():
    import trainmover_ext.patches as patches

    assert patches.check_version("0.16.1") == "0.16.1"
    with pytest.raises(PatchError, match="megatron-core==0.16.1"):
        patches.check_version("0.17.0")


def test_rewrite_fails_loudly_on_changed_source():
    from trainmover_ext.patches._rewrite import rewrite

    with pytest.raises(PatchError, match="no longer contains"):
        rewrite("megatron.core.transformer.utils", "get_default_causal_mask", [("not in source", "x")])


def test_interleaved_pp2_on_gloo_never_batches_p2p():
    from trainmover_training.model import transformer_config_from_args

    args = parse_args(
        add_trainmover_args, tiny_args(None, pp=2, extra=["--num-layers-per-virtual-pipeline-stage", "1"]), world_size=2
    )
    gloo = type("L", (), {"backend": "gloo"})
    assert transformer_config_from_args(args, gloo).batch_p2p_comm is False


def _child_exiting_after(seconds: float, code: int):
    import os
    import time

    from trainmover_ext.launch.process import RankProcess

    pid = os.fork()
    if pid == 0:
        time.sleep(seconds)
        os._exit(code)
    return RankProcess(rank=0, pid=pid)


def test_the_agent_wakes_when_a_child_exits_not_at_its_next_poll():
    import signal
    import time

    from trainmover_ext.launch.process import wait_any_exit

    child = _child_exiting_after(0.3, 3)
    t0 = time.monotonic()
    wait_any_exit([child], timeout_s=20)
    assert time.monotonic() - t0 < 5, "woke at the timeout, not at the exit"
    assert child.poll() == 3 and child.exit_fd() is None  # reaped, descriptor closed
    t0 = time.monotonic()
    wait_any_exit([], timeout_s=0.2)  # nothing to watch: a plain sleep
    assert time.monotonic() - t0 >= 0.2
    proc = _child_exiting_after(60, 0)
    t0 = time.monotonic()
    wait_any_exit([proc], timeout_s=0.3)  # alive: returns at the timeout
    assert 0.25 <= time.monotonic() - t0 < 5 and proc.poll() is None
    proc.signal(signal.SIGKILL)
    wait_any_exit([proc], timeout_s=20)
    assert proc.poll() == -signal.SIGKILL


def test_metrics_log_restores_only_a_missing_iteration_record(tmp_path):
    """A logging rank's replacement writes the record its predecessor died before writing, and only that."""
    from trainmover_training.training import MetricsLog

    path = str(tmp_path / "metrics.jsonl")
    log = MetricsLog(path, True)
    assert log.last_iteration() is None
    for it in (1, 2):
        log.write(event="iteration", iteration=it, loss=1.0 / it)
    log.write(event="recovered", epoch=1)
    record = {"event": "iteration", "iteration": 3, "loss": 0.25}
    assert log.last_iteration() == 2
    assert not log.restore({**record, "iteration": 2}, source_rank=6), "iteration 2 is there already"
    assert log.restore(record, source_rank=6)
    assert not log.restore(record, source_rank=6), "written twice"
    log.close()
    lines = [json.loads(line) for line in open(path)]
    assert [r.get("iteration") for r in lines] == [1, 2, None, 3]
    assert lines[-1] == {**record, "restored_from_rank": 6}
    # only the logging rank writes, and a missing record is no error
    other = MetricsLog(path, False)
    assert not other.restore(record, source_rank=6) and not MetricsLog(path, True).restore(None, source_rank=6)


def test_metrics_log_reads_only_the_tail(tmp_path, monkeypatch):
    from trainmover_training.training import MetricsLog

    monkeypatch.setattr(MetricsLog, "TAIL_BYTES", 200)
    log = MetricsLog(str(tmp_path / "m.jsonl"), True)
    for it in range(1, 50):
        log.write(event="iteration", iteration=it, loss=0.5)
    assert log.last_iteration() == 49


def test_fault_phases_parse():
    from trainmover_ext.errors import ConfigError
    from trainmover_ext.runtime.faults import FaultSpec

    spec = FaultSpec.parse("4:6:log")
    assert (spec.rank, spec.iteration, spec.phase) == (4, 6, "log")
    with pytest.raises(ConfigError, match="log"):
        FaultSpec.parse("4:6:logging")


def test_a_fault_that_could_never_fire_is_refused():
    """A drill naming a rank outside the world, or an iteration the job never runs, is an error on
    every rank instead of a run in which nothing happens."""
    from types import SimpleNamespace

    from trainmover_ext.errors import ConfigError
    from trainmover_ext.runtime.faults import FaultSpec, install

    session = SimpleNamespace(layout=SimpleNamespace(world_size=8, rank=0), args=SimpleNamespace(train_iters=12))
    with pytest.raises(ConfigError, match=r"rank 8, but the job has ranks 0..7"):
        install(FaultSpec.parse_all("8:6:forward"), session)
    with pytest.raises(ConfigError, match=r"iteration 13, but the job trains iterations 1..12"):
        install(FaultSpec.parse_all("3:6:forward, 3:13:forward"), session)
    with pytest.raises(ConfigError, match=r"rank 9, but the job has ranks 0..7"):
        install(FaultSpec.parse_all("9:1:join"), session)  # a migration phase: ITERATION is the epoch
    with pytest.raises(ConfigError, match=r"epoch 0; epochs start at 1"):
        install(FaultSpec.parse_all("2:0:send"), session)
    install(FaultSpec.parse_all("3:6:forward"), session)  # another rank's drill: nothing to arm here


def test_a_checkpoint_that_needs_code_to_load_is_refused(tmp_path):
    """Checkpoints load with weights_only: a file whose unpickling would run code is a CheckpointError,
    and the code never runs."""
    from types import SimpleNamespace

    import torch

    from trainmover_ext.errors import CheckpointError
    from trainmover_training import checkpointing

    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    layout = SimpleNamespace(tp_rank=0, pp_rank=0, dp_rank=0, device="cpu")
    path = checkpointing._rank_file(str(tmp_path), 3, layout)
    import os

    os.makedirs(os.path.dirname(path))
    torch.save({"version": checkpointing.FORMAT_VERSION, "payload": Exploit()}, path)
    (tmp_path / checkpointing.LATEST).write_text("3")
    args = SimpleNamespace(exit_on_missing_checkpoint=False)
    with pytest.raises(CheckpointError, match="needs code to load is refused"):
        checkpointing.load_checkpoint(str(tmp_path), None, None, None, args, layout)
    assert not marker.exists()


def test_the_training_layer_does_not_import_the_runtime():
    """``pretrain()`` takes its runtime as hooks (``trainmover_ext.hooks``): nothing under
    trainmover_training imports the migration path, the standby or the hooks themselves."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "trainmover_training"
    banned = ("trainmover_ext.migration", "trainmover_ext.runtime", "trainmover_ext.hooks")
    found = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{path.name}: {n}" for n in names if n.startswith(banned)]
    assert not found, found


def test_llama_flags_build_what_they_name():
    """The architecture flags reach megatron-core's config and layer spec."""
    import torch

    from helpers import LLAMA
    from trainmover_training.model import gpt_layer_spec, transformer_config_from_args

    args = parse_args(argv=tiny_args(None, tp=2, extra=LLAMA + ["--norm-epsilon", "1e-6"]), world_size=2)

    class Layout:
        backend = "gloo"

    cfg = transformer_config_from_args(args, Layout)
    assert (cfg.normalization, cfg.layernorm_epsilon, cfg.num_query_groups) == ("RMSNorm", 1e-6, 2)
    assert cfg.gated_linear_unit and cfg.activation_func is torch.nn.functional.silu and not cfg.add_bias_linear
    norm = gpt_layer_spec(args).submodules.input_layernorm(config=cfg, hidden_size=32, eps=cfg.layernorm_epsilon)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6, norm
    plain = transformer_config_from_args(parse_args(argv=tiny_args(None), world_size=1), Layout)
    assert (plain.normalization, plain.num_query_groups, plain.gated_linear_unit) == ("LayerNorm", 4, False)


@pytest.mark.parametrize(
    "extra,flag",
    [
        (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups 3 must divide"),
        (["--group-query-attention", "--num-query-groups", "1"], "must be a multiple of TP 2"),
        (["--position-embedding-type", "rope", "--rotary-percent", "0"], "--rotary-percent"),
    ],
)
def test_bad_architecture_flags_are_refused(extra, flag):
    from trainmover_training.errors import ConfigError as TrainingConfigError

    with pytest.raises(TrainingConfigError, match=flag):
        parse_args(argv=tiny_args(None, tp=2, extra=extra), world_size=2)


def _checkpoint_args(**kw) -> argparse.Namespace:
    base = dict(
        use_distributed_optimizer=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=None,
    )
    return argparse.Namespace(**{**base, **kw})


def test_a_torch_dist_checkpoint_is_read_in_the_optimizer_layout_it_names():
    """The distributed optimizer's bucket-space state loads at the saving TP/PP layout (any DP size), as
    the layout it records (a chained optimizer records it per member); the other kind of optimizer, or
    another TP/PP layout, is a CheckpointError that says what to do."""
    from trainmover_training.dist_checkpoint import DISTOPT_SHARDING, _check_optimizer_layout, saved_sharding
    from trainmover_training.errors import CheckpointError

    distopt = {"optimizer": {0: {"optimizer": {"param_groups": []}, "param_state_sharding_type": DISTOPT_SHARDING}}}
    plain = {"optimizer": {"optimizer": {"param_groups": []}, "state": {}}}
    assert saved_sharding(distopt["optimizer"]) == DISTOPT_SHARDING and saved_sharding(plain["optimizer"]) is None
    saved = _checkpoint_args(use_distributed_optimizer=True)
    assert (
        _check_optimizer_layout(distopt, saved, _checkpoint_args(use_distributed_optimizer=True), "p")
        == DISTOPT_SHARDING
    )
    assert _check_optimizer_layout(plain, _checkpoint_args(), _checkpoint_args(), "p") is None
    with pytest.raises(CheckpointError, match="holds the state of the distributed optimizer.*--no-load-optim"):
        _check_optimizer_layout(distopt, saved, _checkpoint_args(), "p")
    with pytest.raises(CheckpointError, match="holds the state of a plain optimizer"):
        _check_optimizer_layout(plain, _checkpoint_args(), _checkpoint_args(use_distributed_optimizer=True), "p")
    other = _checkpoint_args(use_distributed_optimizer=True, tensor_model_parallel_size=2)
    with pytest.raises(CheckpointError, match="tensor-model-parallel-size saved=1 now=2"):
        _check_optimizer_layout(distopt, saved, other, "p")


def test_poison_leaves_every_floating_parameter_nan_and_buffers_alone():
    """A rank whose state a transfer fills is built with NaN parameters: a value the transfer missed
    shows as NaN in the first loss (``model.poison_``)."""
    import torch

    from trainmover_training.model import poison_

    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4).to(torch.bfloat16))
    module.register_buffer("steps", torch.tensor([3]))
    poison_(module)
    assert all(torch.isnan(p).all() for p in module.parameters())
    assert module.steps.item() == 3
