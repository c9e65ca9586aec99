"""Mixture-of-experts through megatron-core's MoE layer: Megatron-LM's MoE flags, their checks, the
``TransformerConfig`` fields and layer spec they select, and the expert layout used by the
layout-independent initialisation.

Expert parallelism (EP) splits the experts of every MoE layer over EP ranks of the data-parallel
dimension; an expert's replicas are then the *expert-data-parallel* group (the DP ranks with the same EP
rank), of size DP x TP / (EP x ETP). The token dispatcher moves tokens to their experts with an
all-to-all (``alltoall``) or an all-gather (``allgather``) over the EP group.
"""

from __future__ import annotations

import argparse
import re

from trainmover_training.errors import ConfigError

MOE_FLAGS = (
    "--moe-router-topk",
    "--moe-router-load-balancing-type",
    "--moe-aux-loss-coeff",
    "--moe-token-dispatcher-type",
    "--moe-grouped-gemm",
    "--moe-ffn-hidden-size",
    "--expert-tensor-parallel-size",
)
"""The MoE flags implemented beside ``--num-experts`` and ``--expert-model-parallel-size``."""

LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts (megatron-core's MoE layer)")
    g.add_argument(
        "--num-experts",
        type=int,
        default=None,
        help="Experts of every MoE layer (each transformer layer's MLP becomes one). Default: a dense model.",
    )
    g.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="Expert parallelism (EP): the experts of a layer are split over this many ranks of the "
        "data-parallel dimension; it must divide --num-experts and DP x TP / --expert-tensor-parallel-size.",
    )
    g.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="Tensor parallelism inside each expert (default: --tensor-model-parallel-size, as in Megatron-LM).",
    )
    g.add_argument("--moe-router-topk", type=int, default=None, help="Experts each token is routed to (default 2).")
    g.add_argument(
        "--moe-router-load-balancing-type",
        nargs="+",
        choices=LOAD_BALANCING,
        default=None,
        help="The router's load balancing: GShard's auxiliary loss (aux_loss, the default), its per-sequence "
        "form (seq_aux_loss), Sinkhorn, or none.",
    )
    g.add_argument(
        "--moe-aux-loss-coeff",
        type=float,
        nargs="+",
        default=None,
        help="Weight of the load-balancing loss (default 0: off; 1e-2 is a usual start).",
    )
    g.add_argument(
        "--moe-token-dispatcher-type",
        choices=("allgather", "alltoall"),
        default=None,
        help="How tokens reach their experts over the EP group: all-to-all (Megatron-LM's choice for large "
        "EP) or all-gather (the default, as in megatron-core). Megatron-LM's 'flex' (DeepEP) is not supported.",
    )
    g.add_argument(
        "--moe-grouped-gemm",
        action="store_true",
        help="All local experts in one grouped GEMM (TransformerEngine on CUDA). Without TransformerEngine "
        "and CUDA the experts run one after another (the same result; named once in the log).",
    )
    g.add_argument(
        "--moe-ffn-hidden-size",
        type=int,
        default=None,
        help="Hidden size of each expert's MLP (default: --ffn-hidden-size).",
    )


def validate_moe(args: argparse.Namespace) -> None:
    """Check the MoE flags against the layout (``data_parallel_size`` filled); fill the defaults.

    Raises :class:`ConfigError` naming the flag to change."""
    tp, dp, ep = args.tensor_model_parallel_size, args.data_parallel_size, args.expert_model_parallel_size
    given = [f for f in MOE_FLAGS if _given(args, f)]
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp = args.expert_tensor_parallel_size
    if args.num_experts is None:
        if ep != 1 or given:
            flags = (["--expert-model-parallel-size"] if ep != 1 else []) + given
            raise ConfigError(f"{', '.join(flags)} need(s) --num-experts: a dense model has no experts")
        args.moe_layer = False
        return
    args.moe_layer = True
    defaults = {
        "moe_router_topk": 2,
        "moe_router_load_balancing_type": ["aux_loss"],
        "moe_aux_loss_coeff": [0.0],
        "moe_token_dispatcher_type": "allgather",
    }
    for dest, default in defaults.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if args.num_experts < 1:
        raise ConfigError("--num-experts must be >= 1")
    if ep < 1 or args.num_experts % ep != 0:
        raise ConfigError(f"--expert-model-parallel-size {ep} must divide --num-experts {args.num_experts}")
    if etp < 1 or (dp * tp) % (ep * etp) != 0:
        raise ConfigError(
            f"EP x ETP = {ep} x {etp} must divide DP x TP = {dp} x {tp}: change --expert-model-parallel-size "
            "or --expert-tensor-parallel-size, or the number of processes"
        )
    if etp != tp:
        raise ConfigError(
            f"--expert-tensor-parallel-size {etp} differs from --tensor-model-parallel-size {tp}: experts with "
            "their own tensor parallelism are not supported yet; leave the flag out"
        )
    if tp > 1 and not args.sequence_parallel:
        raise ConfigError("megatron-core's MoE layer with TP > 1 needs --sequence-parallel (with TransformerEngine)")
    if etp > 1 and not args.disable_bias_linear:
        raise ConfigError(
            f"experts with biases need expert tensor parallelism 1 (megatron-core), and it is {etp} (= TP): "
            "add --disable-bias-linear, as Megatron-LM's MoE examples do"
        )
    if not 1 <= args.moe_router_topk <= args.num_experts:
        raise ConfigError(f"--moe-router-topk must be in [1, --num-experts {args.num_experts}]")
    if getattr(args, "use_tp_pp_dp_mapping", False):
        raise ConfigError("--use-tp-pp-dp-mapping with --num-experts is not supported: leave out the mapping flag")
    if args.context_parallel_size > 1:
        raise ConfigError("--context-parallel-size > 1 with --num-experts is not supported yet: leave out one of them")


def _given(args: argparse.Namespace, flag: str) -> bool:
    return getattr(args, flag.removeprefix("--").replace("-", "_"), None) not in (None, False)


def _single(value):
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def grouped_gemm(args: argparse.Namespace) -> bool:
    """Whether the local experts run as one grouped GEMM: asked for, with TransformerEngine and CUDA."""
    from trainmover_training.model import use_transformer_engine

    return bool(getattr(args, "moe_grouped_gemm", False)) and use_transformer_engine(args)


def moe_config_kwargs(args: argparse.Namespace) -> dict:
    """megatron-core ``TransformerConfig`` fields for the MoE flags (empty for a dense model)."""
    if not getattr(args, "moe_layer", False):
        return {}
    return {
        "num_moe_experts": args.num_experts,
        "moe_router_topk": args.moe_router_topk,
        "moe_router_load_balancing_type": _single(args.moe_router_load_balancing_type),
        "moe_aux_loss_coeff": _single(args.moe_aux_loss_coeff),
        "moe_token_dispatcher_type": args.moe_token_dispatcher_type,
        "moe_grouped_gemm": grouped_gemm(args),
        "moe_ffn_hidden_size": args.moe_ffn_hidden_size or args.ffn_hidden_size or 4 * args.hidden_size,
        "expert_model_parallel_size": args.expert_model_parallel_size,
        "expert_tensor_parallel_size": args.expert_tensor_parallel_size,
        # megatron-core's default permutes through a fused kernel only with TransformerEngine
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
    }


def moe_no_effect(args: argparse.Namespace) -> list[str]:
    """MoE flags given that change nothing here, as ``--flag (why)`` for the start-up log line."""
    if getattr(args, "moe_grouped_gemm", False) and not grouped_gemm(args):
        return ["--moe-grouped-gemm (no TransformerEngine with CUDA: the experts run one after another)"]
    return []


_EXPERT_RE = re.compile(r"\.experts\.local_experts\.(\d+)\.")
"""An expert of megatron-core's SequentialMLP (the local layers): ``...experts.local_experts.<i>.linear_fc1...``."""
_GROUPED_RE = re.compile(r"\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
"""An expert of TransformerEngine's grouped GEMM (TEGroupedMLP): ``...experts.linear_fc1.weight<i>``."""


def global_expert_name(name: str, num_local_experts: int, ep_rank: int) -> str:
    """``name`` with a local expert's index replaced by its global one, so that every EP layout starts
    from the same expert weights and no two experts start alike (``...local_experts.1.`` on EP rank 2 of
    2 local experts is expert 5). Both megatron-core's layouts of experts are named the same way."""
    match = _EXPERT_RE.search(name)
    if match is not None:
        index = ep_rank * num_local_experts + int(match.group(1))
        return name.replace(match.group(0), f".experts.local_experts.{index}.", 1)
    match = _GROUPED_RE.search(name)
    if match is not None:
        index = ep_rank * num_local_experts + int(match.group(3))
        return name[: match.start()] + f".experts.local_experts.{index}.{match.group(1)}.{match.group(2)}"
    return name
