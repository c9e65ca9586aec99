"""Tokenizers named by ``--tokenizer-type``, as in Megatron-LM.

- ``ByteLevelTokenizer`` (the default): UTF-8 bytes are ids 0..255 and 256 ends
  a document, so any text is tokenized with no vocabulary file.
- ``NullTokenizer``: ids are given directly; ``--vocab-size`` sets the size.
- ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``--vocab-file``
  (``vocab.json``) and ``--merge-file`` (``merges.txt``), the files Megatron-LM's
  GPT examples pass. It is built from those files with the ``tokenizers``
  package: megatron-core's own route to it asks the model hub for ``gpt2``'s
  configuration, which a cluster without internet access cannot reach.
- ``HuggingFaceTokenizer``: ``--tokenizer-model`` is a local directory made by
  ``save_pretrained`` (or a model name already in the local Hugging Face
  cache); loaded through ``megatron.core.tokenizers``.
- ``SentencePieceTokenizer``: ``--tokenizer-model`` is a SentencePiece
  ``.model`` file; loaded through ``megatron.core.tokenizers``.
- ``Llama2Tokenizer``: a SentencePiece ``.model`` file read as Megatron-LM's
  Llama 2 tokenizer does (its Mixtral example's): each text starts with the
  model's BOS id, and its EOS id ends a document.

Every tokenizer has ``vocab_size``, ``eod``, ``tokenize(text)`` and
``detokenize(ids)``. :func:`build_tokenizer` also pads the vocabulary
(``args.padded_vocab_size``). ``scripts/prepare_data.py`` takes the same flags,
so a dataset and the job that trains on it use one tokenizer.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Protocol

from trainmover_training.errors import ConfigError

TOKENIZER_TYPES = (
    "ByteLevelTokenizer",
    "NullTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "Llama2Tokenizer",
)
GPT2_EOD = "<|endoftext|>"


class Tokenizer(Protocol):
    """What the training layer and the data tools need of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids) -> str: ...


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


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE (GPT-2's pre-tokenizing pattern, no prefix space) from a vocabulary
    and a merges file; ``<|endoftext|>`` ends a document and must be in the vocabulary."""

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import ByteLevelBPETokenizer

        try:
            self._bpe = ByteLevelBPETokenizer.from_file(vocab_file, merge_file)
        except Exception as exc:  # the tokenizers package raises bare Exceptions on malformed files
            raise ConfigError(
                f"cannot read GPT-2 BPE files --vocab-file {vocab_file} / --merge-file {merge_file}: {exc}. "
                "Give a GPT-2 vocab.json and merges.txt."
            ) from exc
        eod = self._bpe.token_to_id(GPT2_EOD)
        if eod is None:
            raise ConfigError(
                f"--vocab-file {vocab_file} has no {GPT2_EOD} token, which GPT2BPETokenizer ends documents with"
            )
        self._eod = int(eod)

    @property
    def vocab_size(self) -> int:
        return int(self._bpe.get_vocab_size())

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return list(self._bpe.encode(text).ids)

    def detokenize(self, ids) -> str:
        return str(self._bpe.decode([int(i) for i in ids]))


class CoreTokenizer:
    """A ``megatron.core.tokenizers`` tokenizer (Hugging Face or SentencePiece library)."""

    def __init__(self, library: str, path: str):
        from megatron.core.tokenizers import MegatronTokenizer

        try:
            self._tok: Any = MegatronTokenizer.from_pretrained(
                tokenizer_path=path, metadata_path={"library": library, "model_type": "gpt"}
            )
        except (ImportError, ModuleNotFoundError) as exc:
            raise ConfigError(f"the {library} tokenizer needs a package that is not installed: {exc}") from exc
        except Exception as exc:  # the libraries raise ValueError, OSError, RuntimeError ... for a bad model
            raise ConfigError(f"cannot load the {library} tokenizer from --tokenizer-model {path}: {exc}") from exc
        eod = self._tok.eod
        if eod is None or int(eod) < 0:
            raise ConfigError(
                f"the tokenizer at --tokenizer-model {path} has no end-of-sequence token to end documents with"
            )
        self._eod = int(eod)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.vocab_size)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return [int(i) for i in self._tok.tokenize(text)]

    def detokenize(self, ids) -> str:
        return str(self._tok.detokenize([int(i) for i in ids]))


class Llama2Tokenizer:
    """A SentencePiece model as Megatron-LM's ``Llama2Tokenizer``: every text starts with BOS (text
    completion), EOS ends a document."""

    def __init__(self, path: str):
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except Exception as exc:  # sentencepiece raises OSError or RuntimeError for a bad file
            raise ConfigError(f"cannot load the SentencePiece model --tokenizer-model {path}: {exc}") from exc
        self._bos, self._eos = int(self._sp.bos_id()), int(self._sp.eos_id())
        if self._bos < 0 or self._eos < 0:
            raise ConfigError(f"the SentencePiece model {path} lacks a BOS or EOS piece, which Llama2Tokenizer uses")

    @property
    def vocab_size(self) -> int:
        return int(self._sp.vocab_size())

    @property
    def eod(self) -> int:
        return self._eos

    def tokenize(self, text: str) -> list[int]:
        return [self._bos, *(int(i) for i in self._sp.encode(text))]

    def detokenize(self, ids) -> str:
        return str(self._sp.decode([int(i) for i in ids]))


def add_tokenizer_args(g: argparse._ArgumentGroup) -> None:
    """The tokenizer flags (shared by ``pretrain_gpt.py`` and ``scripts/prepare_data.py``)."""
    g.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help="Tokenizer (default: GPT2BPETokenizer when --vocab-file and --merge-file are given, as in Megatron-LM's "
        "GPT examples, else ByteLevelTokenizer). ByteLevelTokenizer works offline with no files (257 tokens); "
        "NullTokenizer needs "
        "--vocab-size; GPT2BPETokenizer needs --vocab-file and --merge-file; HuggingFaceTokenizer, "
        "SentencePieceTokenizer and Llama2Tokenizer (a SentencePiece model, BOS before each text) need "
        "--tokenizer-model.",
    )
    g.add_argument("--vocab-size", type=int, default=None, help="Vocabulary size for NullTokenizer and --mock-data.")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: the GPT-2 vocabulary (vocab.json).")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: the GPT-2 BPE merges (merges.txt).")
    g.add_argument(
        "--tokenizer-model",
        default=None,
        help="HuggingFaceTokenizer: a directory written by save_pretrained (or a model name in the local Hugging "
        "Face cache); SentencePieceTokenizer and Llama2Tokenizer: the .model file.",
    )


def validate_tokenizer_args(args: argparse.Namespace) -> None:
    """Resolve the default ``--tokenizer-type``; raise :class:`ConfigError` naming a missing or wrong flag."""
    if args.tokenizer_type is None:
        gpt2 = args.vocab_file and args.merge_file
        args.tokenizer_type = "GPT2BPETokenizer" if gpt2 else "ByteLevelTokenizer"
    kind = args.tokenizer_type
    if kind == "NullTokenizer" and not args.vocab_size:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
    if kind == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            if not path:
                raise ConfigError(f"--tokenizer-type GPT2BPETokenizer needs {flag}")
            if not os.path.isfile(path):
                raise ConfigError(f"{flag} {path} does not exist")
    if kind in ("HuggingFaceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer"):
        if not args.tokenizer_model:
            raise ConfigError(f"--tokenizer-type {kind} needs --tokenizer-model")
        if kind != "HuggingFaceTokenizer" and not os.path.isfile(args.tokenizer_model):
            raise ConfigError(f"--tokenizer-model {args.tokenizer_model} does not exist (a SentencePiece .model file)")


def make_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer named by ``--tokenizer-type`` (flags validated by :func:`validate_tokenizer_args`)."""
    validate_tokenizer_args(args)
    kind = args.tokenizer_type
    if kind == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if kind == "NullTokenizer":
        return NullTokenizer(args.vocab_size)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(args.vocab_file, args.merge_file)
    if kind == "HuggingFaceTokenizer":
        return CoreTokenizer("huggingface", args.tokenizer_model)
    if kind == "Llama2Tokenizer":
        return Llama2Tokenizer(args.tokenizer_model)
    return CoreTokenizer("sentencepiece", args.tokenizer_model)


def build_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer named by ``--tokenizer-type``; sets ``args.padded_vocab_size``.

    The vocabulary is padded to a multiple of ``--make-vocab-size-divisible-by``
    alone (not times TP, as Megatron-LM does) so the padded size, and therefore
    the loss, does not depend on the parallel layout.
    """
    tokenizer = make_tokenizer(args)
    multiple = args.make_vocab_size_divisible_by
    args.padded_vocab_size = ((tokenizer.vocab_size + multiple - 1) // multiple) * multiple
    return tokenizer
