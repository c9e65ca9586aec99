"""The job's model fingerprint (trainmover_ext.control.fingerprint): pure comparison, plus the one key
and the refusal event against the in-memory store. No process is started."""

from __future__ import annotations

import json
import threading

import pytest

from trainmover_ext.config import add_trainmover_args
from trainmover_ext.control.fingerprint import (
    FINGERPRINT_FIELDS,
    check_standby,
    fingerprint_digest,
    fingerprint_record,
    model_fingerprint,
    publish_fingerprint,
    read_refusal,
    refusal_event,
    wait_job_fingerprint,
)
from trainmover_ext.control.records import FingerprintRecord
from trainmover_ext.errors import (
    STANDBY_REFUSED_EXIT_CODE,
    ConfigError,
    ConfigMismatch,
    StandbyRefused,
    StoreTimeout,
    exit_on_error,
)
from trainmover_ext.kv.job import JobSpace
from trainmover_ext.kv.memory import MemoryKV
from trainmover_training.arguments import parse_args

BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
    "--mock-data",
    "--vocab-size",
    "256",
    "--pipeline-model-parallel-size",
    "2",
]


def _args(*extra: str, world_size: int = 4):
    args = parse_args(add_trainmover_args, BASE + list(extra), world_size=world_size)
    args.padded_vocab_size = 256  # what build_tokenizer sets before a standby or a worker compares
    return args


def test_equal_configs_pass_and_share_a_digest():
    job, mine = model_fingerprint(_args()), model_fingerprint(_args("--tm-role", "standby"))
    check_standby(job, mine, member="standby-a")  # no error: --tm-* flags are not part of the model
    assert fingerprint_digest(job) == fingerprint_digest(mine)


def test_a_differing_field_refuses_the_standby_naming_both_values():
    job, mine = model_fingerprint(_args()), model_fingerprint(_args("--hidden-size", "64"))
    with pytest.raises(StandbyRefused) as info:
        check_standby(job, mine, member="standby-a")
    exc = info.value
    assert "hidden_size: job 32, standby 64" in str(exc) and "standby-a" in str(exc)
    # kv_channels follows from hidden size / heads: megatron derives it, so it differs too
    assert exc.fields == {"hidden_size": (32, 64), "ffn_hidden_size": (128, 256), "kv_channels": (8, 16)}
    assert "num_layers" not in str(exc)  # only what differs
    assert isinstance(exc, ConfigMismatch) and exc.exit_code == STANDBY_REFUSED_EXIT_CODE
    assert fingerprint_digest(job) != fingerprint_digest(mine)


def test_every_difference_is_named():
    job = model_fingerprint(_args())
    mine = model_fingerprint(
        _args("--tensor-model-parallel-size", "2", "--bf16", "--use-distributed-optimizer", world_size=8)
    )
    with pytest.raises(StandbyRefused) as info:
        check_standby(job, mine, member="s")
    assert set(info.value.fields) == {
        "tensor_model_parallel_size",
        "world_size",
        "bf16",
        "params_dtype",
        "use_distributed_optimizer",
    }
    assert "params_dtype: job 'float32', standby 'bfloat16'" in str(info.value)
    # a field only one side has (an older or newer writer) reads None, and differs
    with pytest.raises(StandbyRefused, match="new_field: job None, standby 1"):
        check_standby(job, {**job, "new_field": 1}, member="s")


def test_fingerprint_covers_shape_precision_layout_optimizer_batch_and_version():
    fp = model_fingerprint(_args())
    for name in (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "kv_channels",
        "num_query_groups",
        "seq_length",
        "max_position_embeddings",
        "vocab_size",
        "padded_vocab_size",
        "tokenizer_type",
        "position_embedding_type",
        "normalization",
        "swiglu",
        "untie_embeddings_and_output_weights",
        "bf16",
        "fp16",
        "params_dtype",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "data_parallel_size",
        "world_size",
        "virtual_pipeline_model_parallel_size",
        "sequence_parallel",
        "use_tp_pp_dp_mapping",
        "optimizer",
        "use_distributed_optimizer",
        "micro_batch_size",
        "global_batch_size",
        "megatron_core_version",
    ):
        assert name in FINGERPRINT_FIELDS and name in fp
    assert fp["megatron_core_version"] not in (None, "absent")
    assert json.loads(json.dumps(fp)) == fp  # JSON scalars: the record round-trips exactly
    # spelling a default out changes nothing
    assert model_fingerprint(_args("--ffn-hidden-size", "128")) == fp


def test_the_first_worker_publishes_and_a_differing_worker_fails():
    space = JobSpace.create(MemoryKV(), "fp", "tok")
    first = fingerprint_record(_args(), published_by="worker-0")
    assert publish_fingerprint(space, first) == first
    same = fingerprint_record(_args(), published_by="worker-1")
    assert publish_fingerprint(space, same).published_by == "worker-0"  # written once
    other = fingerprint_record(_args("--seq-length", "16"), published_by="worker-2")
    with pytest.raises(ConfigMismatch, match="seq_length: job 32, this worker 16.*--tm-job"):
        publish_fingerprint(space, other)
    stored = FingerprintRecord.from_bytes(space.kv.get(space.key("fingerprint")).value, key="fingerprint")
    assert stored.digest == first.digest == fingerprint_digest(stored.fields)


def test_a_standby_waits_for_the_fingerprint_within_its_timeout():
    space = JobSpace.create(MemoryKV(), "fp", "tok")
    with pytest.raises(StoreTimeout, match="--tm-fingerprint-timeout"):
        wait_job_fingerprint(space, 0.2)
    record = fingerprint_record(_args(), published_by="worker-0")
    timer = threading.Timer(0.2, publish_fingerprint, (space, record))
    timer.start()
    try:
        assert wait_job_fingerprint(space, 10).digest == record.digest
    finally:
        timer.cancel()


def test_the_refusal_is_in_the_timeline():
    space = JobSpace.create(MemoryKV(), "fp", "tok")
    space.commit([], [refusal_event(space, "standby-a", {"hidden_size": (32, 64)})])
    assert read_refusal(space, "standby-a") == {"hidden_size": (32, 64)}
    assert read_refusal(space, "standby-b") is None


def test_a_refused_process_exits_with_the_refusal_code(capsys):
    with pytest.raises(SystemExit) as info:
        with exit_on_error("pretrain_gpt.py"):
            raise StandbyRefused("standby s refused by the job: hidden_size: job 32, standby 64", {})
    assert info.value.code == STANDBY_REFUSED_EXIT_CODE == 78
    assert "hidden_size: job 32, standby 64" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        with exit_on_error("pretrain_gpt.py"):
            raise ConfigError("bad flag")
    assert info.value.code == 2
