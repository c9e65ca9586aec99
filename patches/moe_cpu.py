"""Let megatron-core's MoE layer train on CPU (``--num-experts``): its router, its experts and both token
dispatchers.

Applied only when CUDA is absent (see :func:`patches.install`):
- the all-to-all dispatcher copies its split sizes to the host on a side CUDA stream and waits for the
  copy with a CUDA event; on CPU the sizes are on the host already (as plain sizes, what the copy's numpy
  arrays are on a GPU), so the stream, the event and the wait go;
- the router's CUDA device becomes the CPU;
- the TransformerEngine GEMM that megatron-core 0.16 leaves undefined without TransformerEngine is None,
  as 0.19 makes it itself;
- an expert's bias is added out of place (megatron-core's in-place add fails autograd's view check
  with EP = expert TP = 1 on the local layers; the sums are the same).
Checked against megatron-core 0.16.1 and 0.19.2; a source that no longer matches fails at install time.
"""

from __future__ import annotations

from ._rewrite import rewrite, rewrite_all
from .cpu_compat import CPU_REPLACEMENTS

MODULE = "megatron.core.transformer.moe.token_dispatcher"

UTILS = "megatron.core.transformer.moe.moe_utils"
TE_NAMES = ("te_general_gemm",)
"""megatron-core 0.16 imports these from TransformerEngine and leaves them undefined without it, then tests
them against None in the router's gating (a NameError on CPU); 0.19 sets them to None itself."""

ROUTER_TARGETS = {
    # the router moves its weight "to the GPU" at each forward; its expert-bias buffers start there
    "megatron.core.transformer.moe.router": ["Router.gating", "TopKRouter.__init__"],
}

INIT = [("MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()", "pass")]

DTOH = [
    ("on_side_stream = torch.cuda.current_stream() != self.cuda_dtoh_stream", "on_side_stream = False"),
    ("self.cuda_dtoh_stream.wait_stream(torch.cuda.current_stream())", "pass"),
    ("with torch.cuda.stream(self.cuda_dtoh_stream):", "if True:"),
    ("self.d2h_event = self.cuda_dtoh_stream.record_event()", "self.d2h_event = None"),
    ("self.d2h_event.synchronize()", "pass"),
]


def install() -> list[str]:
    """Rewrite the MoE layer's CUDA-only snippets (see the module docstring); returns what was patched."""
    import importlib

    importlib.import_module(MODULE)
    rewrite(MODULE, "MoEAlltoAllTokenDispatcher.__init__", INIT)
    rewrite(MODULE, "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", DTOH)
    # an expert's bias is added in place to its output, which with EP = expert TP = 1 is the tensor-parallel
    # reduce's input returned as-is: autograd forbids that in-place add (an out-of-place add, same sums)
    rewrite(
        "megatron.core.transformer.mlp",
        "MLP.forward",
        [
            (
                "output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)",
                "output = output + output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)",
            )
        ],
    )
    # the split sizes reach the all-to-all as plain sizes, as the host copy's numpy arrays do on a GPU
    rewrite(
        UTILS,
        "maybe_move_tensor_to_cpu",
        [("if torch.is_tensor(tensor) and tensor.is_cuda:", "if torch.is_tensor(tensor):")],
    )
    utils = importlib.import_module(UTILS)
    defined = [name for name in TE_NAMES if not hasattr(utils, name)]
    for name in defined:
        setattr(utils, name, None)
    dispatcher = [f"{MODULE}.MoEAlltoAllTokenDispatcher.{name}" for name in ("__init__", "_maybe_dtoh_and_synchronize")]
    patched = (
        dispatcher
        + ["megatron.core.transformer.mlp.MLP.forward", f"{UTILS}.maybe_move_tensor_to_cpu"]
        + rewrite_all(ROUTER_TARGETS, CPU_REPLACEMENTS)
    )
    return patched + [f"{UTILS}.{name}" for name in defined]
