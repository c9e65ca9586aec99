"""TrainMover's training layer on pip megatron-core (joins the ``megatron`` namespace).

Megatron-LM compatible entry points: :func:`pretrain`, :func:`get_args`,
:func:`get_tokenizer`.
"""

import warnings

# megatron-core warns at import that it falls back from TransformerEngine/Apex
# kernels; on CPU that is the expected path, and each of 8 ranks repeating it
# buries the training log.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|TransformerEngine).*", category=UserWarning)

from megatron.training.global_vars import get_args, get_tokenizer  # noqa: E402,F401


def pretrain(*args, **kwargs):
    """See :func:`megatron.training.training.pretrain` (imported lazily: it pulls in torch)."""
    from megatron.training.training import pretrain as _pretrain

    return _pretrain(*args, **kwargs)
