#!/usr/bin/env python3
"""Turn text into a Megatron indexed dataset (``PREFIX_text_document.bin/.idx``).

Uses megatron-core's ``IndexedDatasetBuilder`` and the tokenizer flags of
``pretrain_gpt.py`` (``--tokenizer-type``, ``--vocab-file``, ``--merge-file``,
``--tokenizer-model``; default: the offline byte-level tokenizer), so a job
reads its data with the tokenizer that wrote it. Inputs:

- ``--input FILE ...``: plain text (documents separated by blank lines) or
  JSON lines with a ``text`` field (``.jsonl``);
- ``--stdlib-corpus``: a small real English corpus made from the docstrings of
  the Python standard library installed on this machine (no download; the
  corpus the tests and ``make demo`` use).

Example::

    python scripts/prepare_data.py --stdlib-corpus --output-prefix data/corpus
    # -> data/corpus_text_document.bin / .idx ; train with --data-path data/corpus_text_document
    python scripts/prepare_data.py --input docs.jsonl --output-prefix data/gpt2 \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainmover_training.errors import ConfigError  # noqa: E402
from trainmover_training.tokenizer import ByteLevelTokenizer, Tokenizer, add_tokenizer_args, make_tokenizer  # noqa: E402

# Pure-Python stdlib modules that import quickly and without side effects.
STDLIB_MODULES = (
    "abc argparse ast base64 bisect calendar collections contextlib copy csv dataclasses datetime decimal "
    "difflib enum fractions functools getopt gettext glob heapq hmac html inspect io ipaddress itertools json "
    "logging mimetypes numbers operator optparse os pathlib pickle pprint queue random re sched secrets "
    "selectors shlex shutil smtplib socket statistics string struct subprocess tarfile tempfile textwrap "
    "threading timeit tokenize traceback types typing unittest urllib uuid warnings weakref zipfile"
).split()


def stdlib_documents(max_docs: int | None = None) -> list[str]:
    """Docstrings of stdlib modules, classes and functions, one document each, in a fixed order."""
    docs: list[str] = []
    seen: set[int] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in STDLIB_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            objects = [module] + [getattr(module, a) for a in sorted(dir(module)) if not a.startswith("_")]
            for obj in objects:
                doc = getattr(obj, "__doc__", None)
                if isinstance(doc, str) and len(doc) > 80 and id(doc) not in seen:
                    seen.add(id(doc))
                    docs.append(doc.strip())
                if max_docs and len(docs) >= max_docs:
                    return docs
    return docs


def file_documents(paths: list[str]) -> list[str]:
    """Documents from text files (blank-line separated) or JSON lines (``text`` field)."""
    docs: list[str] = []
    for path in paths:
        if not os.path.isfile(path):
            raise SystemExit(f"prepare_data.py: error: input file {path} does not exist")
        with open(path, encoding="utf-8", errors="replace") as f:
            if path.endswith((".jsonl", ".json")):
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            docs.append(json.loads(line)["text"])
                        except (ValueError, KeyError) as exc:
                            raise SystemExit(
                                f"prepare_data.py: error: {path}:{n} is not JSON with a 'text' field"
                            ) from exc
            else:
                docs.extend(p.strip() for p in f.read().split("\n\n") if p.strip())
    return docs


def write_indexed_dataset(docs: list[str], output_prefix: str, tokenizer: Tokenizer | None = None) -> tuple[str, int]:
    """Tokenize ``docs`` (EOD appended to each) and write ``OUTPUT_PREFIX_text_document`` (uint16 ids
    when the vocabulary fits, else int32)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tokenizer = tokenizer or ByteLevelTokenizer()
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    prefix = f"{output_prefix}_text_document"
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin.tmp", dtype=dtype)
    total = 0
    for doc in docs:
        ids = tokenizer.tokenize(doc) + [tokenizer.eod]
        builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
        total += len(ids)
    builder.finalize(prefix + ".idx.tmp")
    # publish both files only when complete, so a crash never leaves a half dataset
    os.replace(prefix + ".bin.tmp", prefix + ".bin")
    os.replace(prefix + ".idx.tmp", prefix + ".idx")
    return prefix, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", help="Text files (blank-line separated documents) or .jsonl files.")
    src.add_argument(
        "--stdlib-corpus",
        action="store_true",
        help="Use docstrings of the Python standard library as a small real corpus (offline).",
    )
    parser.add_argument("--output-prefix", required=True, help="Output prefix; writes PREFIX_text_document.bin/.idx.")
    parser.add_argument("--max-docs", type=int, default=None, help="Keep at most this many documents.")
    add_tokenizer_args(parser.add_argument_group("tokenizer (the flags pretrain_gpt.py takes)"))
    args = parser.parse_args(argv)
    try:
        tokenizer = make_tokenizer(args)
    except ConfigError as exc:
        parser.error(str(exc))
    docs = stdlib_documents(args.max_docs) if args.stdlib_corpus else file_documents(args.input)[: args.max_docs]
    if not docs:
        parser.error("no documents found in the input")
    prefix, total = write_indexed_dataset(docs, args.output_prefix, tokenizer)
    print(
        f"wrote {prefix}.bin/.idx: {len(docs)} documents, {total} tokens ({args.tokenizer_type}, "
        f"{tokenizer.vocab_size} ids, EOD={tokenizer.eod})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
