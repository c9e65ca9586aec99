"""TrainMover's training layer on pip megatron-core: Megatron-LM's ``megatron.training`` in shape,
under a name of its own (megatron-core 0.17 and later ship a ``megatron.training`` of their own).

Megatron-LM compatible entry points: :func:`pretrain`, :func:`get_args`,
:func:`get_tokenizer`.
"""

import warnings

# megatron-core warns at import that it falls back from TransformerEngine/Apex
# kernels; on CPU that is the expected path, and each of 8 ranks repeating it
# buries the training log.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|TransformerEngine).*", category=UserWarning)

from trainmover_training.global_vars import get_args, get_tokenizer  # noqa: E402,F401


def pretrain(*args, **kwargs):
    """See :func:`trainmover_training.training.pretrain` (imported lazily: it pulls in torch)."""
    from trainmover_training.training import pretrain as _pretrain

    return _pretrain(*args, **kwargs)
