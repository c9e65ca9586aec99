"""Megatron-LM's flags: tokenizers, --split, weighted blends, sample-counted schedules, evaluation
and logging flags, and the flags accepted without effect (pure logic and small real files)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from helpers import tiny_args
from trainmover_training.arguments import parse_args
from trainmover_training.data import BlendedDataset, IndexedGPTDataset, MockGPTDataset, build_dataset, split_bounds
from trainmover_training.errors import ConfigError
from trainmover_training.megatron_lm_flags import no_effect_given
from trainmover_training.tokenizer import build_tokenizer, make_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n" * 40


def _args(*extra: str, corpus: str | None = None, world: int = 1) -> argparse.Namespace:
    return parse_args(argv=tiny_args(corpus, extra=list(extra)), world_size=world)


def _tok_args(**kw) -> argparse.Namespace:
    base = {"tokenizer_type": None, "vocab_size": None, "vocab_file": None, "merge_file": None}
    return argparse.Namespace(**{**base, "tokenizer_model": None, **kw})


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("bpe")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT], vocab_size=300, min_frequency=2, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(root))
    return str(root / "vocab.json"), str(root / "merges.txt"), bpe


def test_gpt2_bpe_from_vocab_and_merges(bpe_files):
    vocab, merges, bpe = bpe_files
    # no --tokenizer-type: the vocab and merges files mean GPT-2 BPE, as in Megatron-LM's GPT examples
    args = _tok_args(vocab_file=vocab, merge_file=merges, make_vocab_size_divisible_by=128)
    tok = build_tokenizer(args)
    assert args.tokenizer_type == "GPT2BPETokenizer"
    ids = tok.tokenize("the lazy dog jumps")
    assert ids == bpe.encode("the lazy dog jumps").ids and len(ids) < len("the lazy dog jumps")
    assert tok.detokenize(ids) == "the lazy dog jumps"
    assert tok.eod == bpe.token_to_id("<|endoftext|>") and args.padded_vocab_size == 384


def test_gpt2_bpe_bad_files_say_what_to_do(bpe_files, tmp_path):
    vocab, merges, _ = bpe_files
    with pytest.raises(ConfigError, match="needs --merge-file"):
        make_tokenizer(_tok_args(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab))
    no_eod = {k: v for k, v in json.load(open(vocab)).items() if k != "<|endoftext|>"}
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(no_eod))
    with pytest.raises(ConfigError, match="has no <|endoftext|> token"):
        make_tokenizer(_tok_args(vocab_file=str(path), merge_file=merges))
    path.write_text("not json")
    with pytest.raises(ConfigError, match="cannot read GPT-2 BPE files"):
        make_tokenizer(_tok_args(vocab_file=str(path), merge_file=merges))


def test_hugging_face_tokenizer_through_megatron_core(bpe_files, tmp_path):
    from transformers import PreTrainedTokenizerFast

    _, _, bpe = bpe_files
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>").save_pretrained(str(tmp_path))
    tok = make_tokenizer(_tok_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path)))
    assert tok.tokenize("the lazy dog") == bpe.encode("the lazy dog").ids
    assert tok.vocab_size == bpe.get_vocab_size() and tok.eod == bpe.token_to_id("<|endoftext|>")
    with pytest.raises(ConfigError, match="cannot load the huggingface tokenizer"):
        make_tokenizer(_tok_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "none")))


def test_sentencepiece_tokenizer_through_megatron_core(tmp_path):
    import sentencepiece as spm

    (tmp_path / "text.txt").write_text(TEXT)
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=40, minloglevel=2
    )
    model = str(tmp_path / "sp.model")
    tok = make_tokenizer(_tok_args(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model))
    ids = tok.tokenize("the lazy dog")
    assert ids and tok.detokenize(ids) == "the lazy dog" and tok.vocab_size == 40
    assert tok.eod == spm.SentencePieceProcessor(model_file=model).eos_id()
    with pytest.raises(ConfigError, match="does not exist"):
        make_tokenizer(_tok_args(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model + ".gone"))
    # Megatron-LM's Llama2Tokenizer (its Mixtral example's): the same model, BOS before each text
    sp = spm.SentencePieceProcessor(model_file=model)
    llama = make_tokenizer(_tok_args(tokenizer_type="Llama2Tokenizer", tokenizer_model=model))
    assert llama.tokenize("the lazy dog") == [sp.bos_id(), *sp.encode("the lazy dog")] != ids
    assert llama.eod == sp.eos_id() and llama.vocab_size == 40
    assert llama.detokenize(llama.tokenize("the lazy dog")) == "the lazy dog"
    with pytest.raises(ConfigError, match="cannot load the SentencePiece model"):
        make_tokenizer(_tok_args(tokenizer_type="Llama2Tokenizer", tokenizer_model=str(tmp_path / "text.txt")))


def test_split_gives_disjoint_parts_of_the_stream(corpus):
    prefix = corpus + "_text_document"
    whole = IndexedGPTDataset([prefix], 32, seed=1)
    shares = (0.9, 0.08, 0.02)
    parts = [IndexedGPTDataset([prefix], 32, 1, split_bounds(shares, s), s) for s in range(3)]
    assert sum(len(p.tokens) for p in parts) == len(whole.tokens)
    assert np.array_equal(np.concatenate([np.asarray(p.tokens) for p in parts]), np.asarray(whole.tokens))
    # the training part of "100,0,0" is the whole stream in the same order as before --split existed
    assert np.array_equal(IndexedGPTDataset([prefix], 32, 1, (0.0, 1.0), 0)[3], whole[3])


def test_split_flag_builds_each_part_or_none(corpus):
    args = _args("--split", "949,50,1", corpus=corpus)
    assert args.split_shares == pytest.approx((0.949, 0.05, 0.001))
    train, valid, test = (build_dataset(args, None, s) for s in range(3))
    assert valid.windows > 0 and test.windows >= 1 and train.windows > 10 * valid.windows
    assert build_dataset(_args(corpus=corpus), None, 1) is None  # the default split has no validation share
    for bad in ("a,b", "0,1,0", "1,2,3,4", "-1,2"):
        with pytest.raises(ConfigError, match="--split"):
            _args(f"--split={bad}", corpus=corpus)


def test_blend_follows_the_weights_and_the_index_alone():
    a, b = MockGPTDataset(50, 4, seed=1), MockGPTDataset(50, 4, seed=2)
    blend = BlendedDataset([a, b], [0.3, 0.7])
    blend[999]  # assigns samples 0..999 (at least)
    picks = [int(blend._source[i]) for i in range(1000)]
    assert abs(picks.count(0) - 300) <= 1 and abs(picks.count(1) - 700) <= 1
    # sample i is the next unread sample of its dataset, whichever order samples are asked in
    again = BlendedDataset([a, b], [3, 7])
    assert np.array_equal(again[700], blend[700]) and np.array_equal(again[5], blend[5])
    counts = [picks[:6].count(0), picks[:6].count(1)]
    assert np.array_equal(blend[6], [a, b][picks[6]][counts[picks[6]]])


def test_weighted_data_path_flag(corpus):
    prefix = corpus + "_text_document"
    args = parse_args(
        argv=tiny_args(None, extra=[])[:-1] + ["--data-path", "1", prefix, "3", prefix], world_size=1
    )  # tiny_args(None) ends with --mock-data
    assert args.data_weighted and [w for w, _ in args.data_blend] == [1.0, 3.0]
    assert isinstance(build_dataset(args, None, 0), BlendedDataset)
    with pytest.raises(ConfigError, match="pairs"):
        parse_args(argv=tiny_args(None)[:-1] + ["--data-path", "1", prefix, "3"], world_size=1)


def test_sample_counted_schedule():
    argv = tiny_args(None, gbs=8)  # it gives --train-iters: swap it for samples
    i = argv.index("--train-iters")
    argv[i : i + 2] = ["--train-samples", "100", "--lr-decay-samples", "80", "--lr-warmup-samples", "16"]
    args = parse_args(argv=argv, world_size=1)
    assert (args.train_iters, args.lr_decay_iters, args.lr_warmup_iters) == (12, 10, 2)
    with pytest.raises(ConfigError, match="exactly one of --train-iters and --train-samples"):
        parse_args(argv=tiny_args(None) + ["--train-samples", "100"], world_size=1)
    args = _args("--lr-warmup-fraction", "0.25")
    assert args.lr_warmup_iters == 2  # a quarter of --lr-decay-iters (= --train-iters 10)


def test_flags_without_effect_are_named():
    args = _args("--attention-backend", "fused", "--manual-gc", "--num-workers", "2")
    named = no_effect_given(args)
    assert [n.split(" ")[0] for n in named] == ["--attention-backend", "--manual-gc", "--num-workers"]
    assert no_effect_given(_args()) == []


def test_logging_flags_check_their_packages():
    import importlib.util

    assert importlib.util.find_spec("wandb") is None, "this check needs wandb to be absent"
    with pytest.raises(ConfigError, match="pip install wandb"):
        _args("--wandb-project", "p")
    with pytest.raises(ConfigError, match="--eval-interval"):
        _args("--eval-interval", "0")
