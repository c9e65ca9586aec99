"""Building a rank's training parts exactly as ``pretrain`` does, once groups exist.

Shared by the shadow iterations and by the sandbox's test/benchmark job
ranks, so a shadow iteration and the job iteration it replays run the same
construction (``trainmover_training.training.build_session``: seeds,
``get_model``, ``setup_optimizer``, config wiring, dataset) and the same
``train_step``.
"""

from __future__ import annotations

import hashlib

import torch


def build_parts(args, layout, program, *, consumed_samples: int, iteration: int = 0):
    """This rank's training ``Session`` for ``layout``, as ``pretrain`` builds it (megatron's groups must exist).

    Sets ``args.iteration`` / ``args.consumed_train_samples`` to the given
    position and points the data iterators there.
    """
    from trainmover_training.training import MetricsLog, build_session

    from .compile import chunk_preparer

    session = build_session(
        args,
        layout,
        program.model_provider,
        program.dataset_provider,
        program.forward_step_func,
        MetricsLog(None, False),
        chunk_preparer(args),
    )
    args.iteration, args.consumed_train_samples = iteration, consumed_samples
    session.reset_data()
    for chunk in session.model:
        chunk.train()
    return session


def state_digest(model: list) -> dict[str, str]:
    """SHA-256 of every parameter and every gradient (``main_grad``), in parameter order.

    Bit-identity checks compare these between a job rank and the standby that
    replayed it.
    """
    grads, params = hashlib.sha256(), hashlib.sha256()
    for chunk in model:
        for name, param in chunk.named_parameters():
            params.update(name.encode())
            params.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            grad: torch.Tensor | None = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is not None:
                grads.update(name.encode())
                grads.update(grad.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return {"grad": grads.hexdigest(), "param": params.hexdigest()}
