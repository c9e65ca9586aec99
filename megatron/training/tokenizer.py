"""Tokenizers that work offline.

``ByteLevelTokenizer`` maps UTF-8 bytes to ids 0..255 and uses 256 as the
end-of-document token, so any text can be tokenized without a vocabulary
download. ``NullTokenizer`` is Megatron's: ids are given directly, vocabulary
size comes from ``--vocab-size``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class ByteLevelTokenizer:
    """UTF-8 bytes as tokens, plus one end-of-document token."""

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod(self) -> int:
        return 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class NullTokenizer:
    """Token ids are given directly; ``vocab_size - 1`` is end-of-document."""

    size: int

    @property
    def vocab_size(self) -> int:
        return self.size

    @property
    def eod(self) -> int:
        return self.size - 1

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(args: argparse.Namespace) -> ByteLevelTokenizer | NullTokenizer:
    """The tokenizer named by ``--tokenizer-type``; sets ``args.padded_vocab_size``.

    The vocabulary is padded to a multiple of ``--make-vocab-size-divisible-by``
    alone (not times TP, as Megatron-LM does) so the padded size, and therefore
    the loss, does not depend on the parallel layout.
    """
    if args.tokenizer_type == "ByteLevelTokenizer":
        tokenizer = ByteLevelTokenizer()
    else:
        tokenizer = NullTokenizer(args.vocab_size)
    multiple = args.make_vocab_size_divisible_by
    args.padded_vocab_size = ((tokenizer.vocab_size + multiple - 1) // multiple) * multiple
    return tokenizer
