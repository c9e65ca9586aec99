"""Megatron-LM compatible accessors: ``get_args()`` and ``get_tokenizer()``.

Megatron-LM scripts call these from their providers; keeping them lets a
user's ``pretrain_gpt.py`` port unchanged. They are set once by ``pretrain``.
"""

from __future__ import annotations

_ARGS = None
_TOKENIZER = None


def set_global_variables(args, tokenizer) -> None:
    global _ARGS, _TOKENIZER
    _ARGS, _TOKENIZER = args, tokenizer


def get_args():
    """The parsed arguments of the running job."""
    if _ARGS is None:
        raise RuntimeError("get_args() called before pretrain() parsed the arguments")
    return _ARGS


def get_tokenizer():
    """The tokenizer of the running job."""
    if _TOKENIZER is None:
        raise RuntimeError("get_tokenizer() called before pretrain() built the tokenizer")
    return _TOKENIZER
