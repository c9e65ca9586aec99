"""Training data: deterministic sample order addressed by consumed samples.

A dataset maps a global sample index to ``seq_length + 1`` tokens. The order of
samples depends only on ``--seed`` and the sample index, never on the parallel
layout or on how often the job restarted. A data iterator is therefore fully
described by ``consumed_samples``: this is what checkpoints and migrations carry
to resume exactly.

Batch layout follows Megatron's pretraining sampler: within an iteration, micro
batch ``m`` of data-parallel rank ``d`` holds global samples
``consumed + m * (mbs * dp) + d * mbs + [0, mbs)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from trainmover_training.errors import DataError

SPLITS = ("train", "valid", "test")


class MockGPTDataset:
    """Synthetic tokens: sample ``i`` is a seeded random sequence (independent of layout); ``split``
    (0 train, 1 valid, 2 test) draws from its own stream."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, num_samples: int = 1 << 30, split: int = 0):
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = num_samples
        self.split = split

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, idx] if self.split == 0 else [self.seed, idx, self.split])
        return rng.integers(0, self.vocab_size - 1, size=self.seq_length + 1, dtype=np.int64)


class IndexedGPTDataset:
    """Fixed-length windows over a Megatron indexed dataset (``PREFIX.bin/.idx``).

    The ``.bin`` file is the concatenation of every document's tokens (the
    builder appends end-of-document tokens), so sample ``j`` of an epoch is the
    window ``[j * seq, j * seq + seq + 1)`` of that stream. Epochs visit windows
    in a seeded permutation.

    ``share`` keeps the part ``[start, end)`` of the stream (fractions of its tokens): the
    ``--split`` of train, validation and test. ``split`` (0 train, 1 valid, 2 test) seeds the
    permutation of each part apart.
    """

    def __init__(
        self,
        prefixes: list[str],
        seq_length: int,
        seed: int,
        share: tuple[float, float] = (0.0, 1.0),
        split: int = 0,
    ):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        streams = []
        for prefix in prefixes:
            try:
                index = IndexedDataset(prefix, mmap=True)
            except (OSError, ValueError, AssertionError) as exc:
                raise DataError(
                    f"cannot read indexed dataset {prefix}(.bin/.idx): {exc}; rebuild it with scripts/prepare_data.py"
                ) from exc
            streams.append(np.memmap(prefix + ".bin", dtype=index.index.dtype, mode="r"))
        tokens = streams[0] if len(streams) == 1 else np.concatenate([np.asarray(s) for s in streams])
        lo, hi = (round(f * len(tokens)) for f in share)
        self.tokens = tokens[lo:hi]
        self.seq_length = seq_length
        self.seed = seed
        self.split = split
        self.windows = (len(self.tokens) - 1) // seq_length
        if self.windows < 1:
            raise DataError(
                f"the {SPLITS[split]} split of dataset {prefixes} has {len(self.tokens)} tokens, fewer than one "
                f"sample of --seq-length {seq_length} + 1; use more text, a shorter --seq-length or a larger "
                "share in --split"
            )
        self._epoch_perm: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return 1 << 62  # epochs repeat with a fresh permutation

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._epoch_perm.get(epoch)
        if perm is None:
            key = [self.seed, epoch] if self.split == 0 else [self.seed, epoch, self.split]
            perm = np.random.default_rng(key).permutation(self.windows)
            self._epoch_perm = {epoch: perm}  # keep one epoch: memory stays bounded
        return perm

    def __getitem__(self, idx: int) -> np.ndarray:
        epoch, pos = divmod(idx, self.windows)
        start = int(self._permutation(epoch)[pos]) * self.seq_length
        return np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64)


@dataclass(kw_only=True)
class BatchPlan:
    """Which samples a data-parallel rank reads."""

    micro_batch_size: int
    """Samples per micro-batch."""
    data_parallel_size: int
    """DP world size."""
    data_parallel_rank: int
    """This rank's DP index."""


def micro_batch_indices(plan: BatchPlan, consumed_samples: int) -> list[int]:
    """Global sample indices of the micro-batch that starts at ``consumed_samples``."""
    start = consumed_samples + plan.data_parallel_rank * plan.micro_batch_size
    return list(range(start, start + plan.micro_batch_size))


class GPTBatchIterator:
    """Yields micro-batches ``{tokens, labels, loss_mask, position_ids}`` for one DP rank.

    ``consumed_samples`` counts samples of the whole job (all DP ranks) and is
    advanced by ``mbs * dp`` per micro-batch, as in Megatron's sampler.
    """

    def __init__(self, dataset, plan: BatchPlan, consumed_samples: int = 0):
        self.dataset = dataset
        self.plan = plan
        self.consumed_samples = consumed_samples

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        idx = micro_batch_indices(self.plan, self.consumed_samples)
        self.consumed_samples += self.plan.micro_batch_size * self.plan.data_parallel_size
        data = torch.from_numpy(np.stack([self.dataset[i] for i in idx]))
        tokens = data[:, :-1].contiguous()
        labels = data[:, 1:].contiguous()
        seq = tokens.shape[1]
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": torch.ones_like(tokens, dtype=torch.float),
            "position_ids": torch.arange(seq, dtype=torch.long).unsqueeze(0).expand_as(tokens).contiguous(),
            "sample_indices": idx,
        }


class BlendedDataset:
    """Samples drawn from several datasets in proportion to their weights, as Megatron-LM's blend:
    sample ``i`` comes from the dataset whose share so far lags its weight the most (ties: the
    first), so the order depends on the weights and the index alone (any layout, any restart)."""

    def __init__(self, datasets: list, weights: list[float]):
        total = float(sum(weights))
        self.datasets = datasets
        self.weights = np.asarray([w / total for w in weights], dtype=np.float64)
        self._source = np.zeros(0, dtype=np.int32)
        self._position = np.zeros(0, dtype=np.int64)
        self._counts = np.zeros(len(datasets), dtype=np.int64)

    def __len__(self) -> int:
        return 1 << 62

    def _extend(self, upto: int) -> None:
        """Assign samples ``len(self._source) .. upto`` (amortised: the table at least doubles)."""
        start = len(self._source)
        end = max(upto + 1, 2 * start, 1024)
        source = np.empty(end - start, dtype=np.int32)
        position = np.empty(end - start, dtype=np.int64)
        counts = self._counts
        for k, i in enumerate(range(start, end)):
            d = int(np.argmax(self.weights * (i + 1) - counts))
            source[k], position[k] = d, counts[d]
            counts[d] += 1
        self._source = np.concatenate([self._source, source])
        self._position = np.concatenate([self._position, position])

    def __getitem__(self, idx: int) -> np.ndarray:
        if idx >= len(self._source):
            self._extend(idx)
        return self.datasets[int(self._source[idx])][int(self._position[idx])]


def split_bounds(shares: tuple[float, float, float], split: int) -> tuple[float, float]:
    """The ``[start, end)`` fraction of a dataset's tokens that ``split`` (0 train, 1 valid, 2 test) reads."""
    start = sum(shares[:split])
    return start, start + shares[split]


def build_dataset(args, tokenizer, split: int = 0):
    """The dataset of ``split`` (0 train, 1 valid, 2 test) named by ``--mock-data`` / ``--data-path``
    and ``--split``; None when ``--split`` gives that split no share."""
    shares = getattr(args, "split_shares", (1.0, 0.0, 0.0))
    if shares[split] <= 0:
        return None
    if args.mock_data and not args.data_path:
        vocab = args.vocab_size or tokenizer.vocab_size
        return MockGPTDataset(vocab, args.seq_length, args.seed, split=split)
    bounds = split_bounds(shares, split)
    if not getattr(args, "data_weighted", False):
        return IndexedGPTDataset(list(args.data_path), args.seq_length, args.seed, bounds, split)
    blend = args.data_blend
    parts = [IndexedGPTDataset([prefix], args.seq_length, args.seed, bounds, split) for _, prefix in blend]
    return BlendedDataset(parts, [w for w, _ in blend])
