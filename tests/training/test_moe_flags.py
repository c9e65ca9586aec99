"""The MoE flags: their checks against the layout (each refusal names what to change), the
fingerprint's MoE fields, and the global expert names of the layout-independent initialisation. Pure
logic, in process; training and recovery are in tests/training/test_moe_training.py and
tests/migration/test_moe.py."""

from __future__ import annotations

import pytest

from helpers import tiny_args
from trainmover_ext.config import add_trainmover_args
from trainmover_ext.control.fingerprint import fingerprint_diff, model_fingerprint
from trainmover_training.arguments import parse_args
from trainmover_training.errors import ConfigError
from trainmover_training.moe import global_expert_name, moe_config_kwargs, moe_no_effect

MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2"]


def _args(*extra: str, world: int = 4, tp: int = 1, pp: int = 1):
    return parse_args(add_trainmover_args, argv=tiny_args(None, tp=tp, pp=pp, extra=list(extra)), world_size=world)


def test_moe_flags_reach_megatron_cores_config_with_megatron_lms_defaults():
    args = _args(*MOE, "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall")
    kw = moe_config_kwargs(args)
    assert kw["num_moe_experts"] == 4 and kw["expert_model_parallel_size"] == 2
    assert kw["moe_router_topk"] == 2 and kw["moe_router_load_balancing_type"] == "aux_loss"
    assert kw["moe_aux_loss_coeff"] == 1e-2 and kw["moe_token_dispatcher_type"] == "alltoall"
    assert kw["expert_tensor_parallel_size"] == 1 and kw["moe_ffn_hidden_size"] == 4 * 32
    assert kw["moe_grouped_gemm"] is False
    assert moe_config_kwargs(_args()) == {}  # a dense model


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--moe-router-topk", "2"], "--moe-router-topk need\\(s\\) --num-experts"),
        (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size need\\(s\\) --num-experts"),
        (["--num-experts", "3", "--expert-model-parallel-size", "2"], "must divide --num-experts 3"),
        (["--num-experts", "8", "--expert-model-parallel-size", "8"], "EP x ETP = 8 x 1 must divide DP x TP = 4 x 1"),
        ([*MOE, "--expert-tensor-parallel-size", "2"], "experts with their own tensor parallelism"),
        ([*MOE, "--moe-router-topk", "5"], "--moe-router-topk must be in \\[1, --num-experts 4\\]"),
        ([*MOE, "--use-tp-pp-dp-mapping"], "--use-tp-pp-dp-mapping with --num-experts"),
        (["--num-experts", "0"], "--num-experts must be >= 1"),
    ],
)
def test_bad_moe_flags_are_refused_with_what_to_change(extra, message):
    with pytest.raises(ConfigError, match=message):
        _args(*extra)


def test_moe_with_tensor_parallelism_needs_sequence_parallelism_and_transformer_engine():
    """megatron-core's MoE layer refuses TP > 1 without sequence parallelism at its first forward, and its
    local layers' torch norms refuse sequence parallelism: both are refused before anything starts."""
    with pytest.raises(ConfigError, match="MoE layer with TP > 1 needs --sequence-parallel"):
        _args("--num-experts", "4", "--disable-bias-linear", tp=2)
    with pytest.raises(ConfigError, match="--sequence-parallel needs TransformerEngine"):
        _args("--sequence-parallel", tp=2)  # dense too: this machine has no TransformerEngine


def test_grouped_gemm_without_transformer_engine_is_named_as_without_effect():
    args = _args(*MOE, "--moe-grouped-gemm")
    assert moe_config_kwargs(args)["moe_grouped_gemm"] is False
    assert moe_no_effect(args) == [
        "--moe-grouped-gemm (no TransformerEngine with CUDA: the experts run one after another)"
    ]
    assert moe_no_effect(_args(*MOE)) == []


def test_the_fingerprint_covers_the_expert_layout():
    dense, moe = model_fingerprint(_args()), model_fingerprint(_args(*MOE))
    assert dense["num_experts"] is None and dense["expert_tensor_parallel_size"] is None
    assert set(fingerprint_diff(dense, moe)) >= {"num_experts", "expert_model_parallel_size", "moe_router_topk"}
    other = model_fingerprint(_args("--num-experts", "4", "--expert-model-parallel-size", "4"))
    assert set(fingerprint_diff(moe, other)) == {"expert_model_parallel_size"}
    spelled = model_fingerprint(_args(*MOE, "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0"))
    assert fingerprint_diff(moe, spelled) == {}  # spelling a default out changes nothing


def test_an_expert_is_named_by_its_global_index():
    name = "decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight"
    assert global_expert_name(name, num_local_experts=2, ep_rank=1) == (
        "decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight"
    )
    assert global_expert_name(name, num_local_experts=4, ep_rank=0) == name
    # TransformerEngine's grouped GEMM names its experts weight<i>: the same global names
    grouped = "decoder.layers.3.mlp.experts.linear_fc2.weight1"
    assert global_expert_name(grouped, num_local_experts=2, ep_rank=1) == (
        "decoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight"
    )
    assert global_expert_name(grouped, 2, 0) != global_expert_name(grouped, 2, 1)  # no two experts start alike
    dense = "decoder.layers.3.mlp.linear_fc1.weight"
    assert global_expert_name(dense, num_local_experts=2, ep_rank=1) == dense
