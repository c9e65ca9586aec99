"""Megatron-LM's own example launch scripts, scaled down, under ``--trainmover`` with one failure.

The GPT example (``examples/gpt3/train_gpt3_175b_distributed.sh``: GPT-2 BPE from a vocabulary and
a merges file, ``--split 949,50,1``, evaluation, TensorBoard, fp16, cosine decay with a warm-up
fraction) and the Llama 3 example (``examples/llama/train_llama3_8b_h200_bf16.sh``: a Hugging Face
tokenizer, RMSNorm, SwiGLU, RoPE, GQA, untied output, no biases, bf16, sample-counted schedule,
the distributed optimizer and the flags without effect on CPU), and the Mixtral example
(``examples/mixtral/train_mixtral_8x7b_distributed.sh``: Megatron-LM's Llama 2 SentencePiece tokenizer,
mixture-of-experts with top-2 routing, the all-to-all dispatcher, expert parallelism and the distributed
optimizer). The tokenizer files are written by
the test from the corpus text. Each run with a SIGKILLed rank completes without restart and is
bit-identical to the same flags without a fault: every training iteration and every evaluation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.jobs import REPO_ROOT
from helpers import fell_back, read_metrics, replaced, run_job, tiny_args, trajectory

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """GPT-2 BPE files (vocab.json, merges.txt) and a Hugging Face tokenizer directory, trained on the
    stdlib corpus, and datasets written with each: two halves of the corpus for a weighted blend."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
    from prepare_data import stdlib_documents
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tokenizers")
    docs = stdlib_documents(1500)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=500, min_frequency=2, special_tokens=["<|endoftext|>"])
    os.makedirs(root / "gpt2")
    bpe.save_model(str(root / "gpt2"))
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    hf.save_pretrained(str(root / "hf"))
    halves = {"a": docs[::2], "b": docs[1::2]}
    for name, part in halves.items():
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in part)
    import sentencepiece as spm

    with open(root / "sp.txt", "w") as f:
        f.writelines(d.replace("\n", " ")[:4000] + "\n" for d in docs)
    spm.SentencePieceTrainer.train(
        input=str(root / "sp.txt"), model_prefix=str(root / "sp"), vocab_size=300, minloglevel=2
    )
    files = {
        "vocab": str(root / "gpt2" / "vocab.json"),
        "merges": str(root / "gpt2" / "merges.txt"),
        "hf": str(root / "hf"),
        "sp": str(root / "sp.model"),
    }
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["vocab"], "--merge-file", files["merges"]]
    preps = {}  # all six at once: each is mostly one process's imports, on one core
    for name in halves:
        for tok, flags in (
            ("gpt2", gpt2),
            ("hf", ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", files["hf"]]),
            ("llama2", ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", files["sp"]]),
        ):
            prep = [sys.executable, "scripts/prepare_data.py", "--input", str(root / f"{name}.jsonl")]
            preps[f"{tok}_{name}"] = subprocess.Popen(
                prep + ["--output-prefix", str(root / f"{tok}_{name}"), *flags],
                cwd=REPO_ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
    try:
        for key, proc in preps.items():
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{key}: {err}"
            files[key] = str(root / f"{key}_text_document")
    finally:
        for proc in preps.values():
            if proc.poll() is None:
                proc.kill()
    return files


def _example(base: list[str], example: list[str], fault: str | None) -> list[str]:
    """``tiny_args``' model and batch with the example's flags, under --trainmover with one standby (at
    the default lease TTL and timeouts)."""
    drop = {"--data-path", "--train-iters"}
    kept, skip = [], False
    for arg in base:
        if skip:
            skip = False
            continue
        if arg in drop:
            skip = True
            continue
        kept.append(arg)
    tm = ["--trainmover", "--tm-standbys", "1", "--tm-standby-nice", "0", "--tm-no-sandbox"]
    return kept + example + tm + (["--tm-inject-fault", fault] if fault else [])


def _evaluations(job) -> dict[tuple[str, int], float]:
    """(split, iteration) -> loss; an evaluation run twice (again after a recovery) must agree."""
    out: dict[tuple[str, int], float] = {}
    for rec in read_metrics(job.metrics_path, "evaluation"):
        key = (rec["split"], rec["iteration"])
        assert out.setdefault(key, rec["loss"]) == rec["loss"], f"evaluation {key} re-ran differently"
    return out


_ROUTINE = {"member_joined", "leader_elected", "standby_started"}
"""Timeline events a failed comparison's message leaves out."""


def _what_happened(job) -> str:
    """The job's timeline (its routine joins left out), recoveries and checkpoints: what a failed
    comparison is read against."""
    lines = [f"  {e['what']}: {json.dumps(e['detail'])[:400]}" for e in job.events() if e["what"] not in _ROUTINE]
    lines += [f"  metrics: {json.dumps(r)[:300]}" for r in read_metrics(job.metrics_path, "recovered")]
    lines += [f"  metrics: {json.dumps(r)[:300]}" for r in read_metrics(job.metrics_path, "checkpoint")]
    return "what the faulty run did:\n" + "\n".join(lines)


def _assert_same_run(faulty, clean, iters: int) -> None:
    got, ref = trajectory(faulty.metrics_path), trajectory(clean.metrics_path)
    assert sorted(ref) == list(range(1, iters + 1)) and sorted(got) == sorted(ref)
    diffs = {it: (got[it], ref[it]) for it in ref if got[it] != ref[it]}
    assert not diffs, f"not bit-identical to the fault-free run: {diffs}\n{_what_happened(faulty)}"
    assert _evaluations(faulty) == _evaluations(clean)
    assert not fell_back(faulty), faulty.stderr()[-3000:]
    assert len(read_metrics(faulty.metrics_path, "startup")) == 1, "a rank restarted"
    moves = replaced(faulty, "failure")
    assert [r["rank"] for r in moves] == [5], f"not exactly one replacement, of the failed rank: {moves}"


def _tensorboard_scalars(directory: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for name in sorted(os.listdir(directory)):
        acc = EventAccumulator(os.path.join(directory, name))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for event in acc.Scalars(tag):
                out.setdefault(tag, {})[event.step] = event.value
    return out


def test_gpt_example_with_a_failure(tmp_path, tokenizer_files):
    """GPT-2 BPE, a 30/70 blend of two datasets, --split 949,50,1, an evaluation every 4 iterations
    (and the test split at the end), TensorBoard, fp16. Rank 5 dies in iteration 5's backward pass,
    after the evaluation at boundary 4, so the job resumes at boundary 4, where every rank evaluates
    again."""
    f = tokenizer_files
    gpt = [
        "--data-path", "0.3", f["gpt2_a"], "0.7", f["gpt2_b"],
        "--vocab-file", f["vocab"], "--merge-file", f["merges"], "--split", "949,50,1",
        "--train-iters", "12", "--eval-iters", "2", "--eval-interval", "4", "--log-interval", "1",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
        "--clip-grad", "1.0", "--fp16", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
        "--lr-warmup-fraction", ".1", "--attention-backend", "auto",
    ]  # fmt: skip
    base = tiny_args("unused", tp=2, pp=2)
    runs = {}
    for name, fault in (("clean", None), ("faulty", "5:5:backward")):
        tb = str(tmp_path / f"tb_{name}")
        runs[name] = run_job(
            tmp_path, 8, _example(base, gpt + ["--tensorboard-dir", tb], fault), name=f"gpt_{name}", timeout=400
        )
    _assert_same_run(runs["faulty"], runs["clean"], 12)
    evals = _evaluations(runs["clean"])
    assert sorted(evals) == [("test", 12), ("valid", 4), ("valid", 8), ("valid", 12)], evals
    reran = [r["iteration"] for r in read_metrics(runs["faulty"].metrics_path, "evaluation") if r["split"] == "valid"]
    assert reran.count(4) == 2, f"the evaluation at the resume boundary did not run again: {reran}"
    # TensorBoard got what the metrics log got (float32), across the logging rank's replacement too
    scalars = _tensorboard_scalars(str(tmp_path / "tb_faulty"))
    losses = trajectory(runs["clean"].metrics_path)
    assert sorted(scalars["lm loss"]) == list(range(1, 13))
    assert all(abs(scalars["lm loss"][it] - losses[it][0]) <= 1e-6 * abs(losses[it][0]) for it in losses)
    assert sorted(scalars["lm loss validation"]) == [4, 8, 12]
    assert "loss-scale" in scalars and "learning-rate" in scalars


def test_llama_example_with_a_failure(tmp_path, tokenizer_files):
    """A Hugging Face tokenizer, Llama's architecture (RMSNorm, SwiGLU, RoPE, GQA, untied output, no
    biases), bf16, a schedule in samples, the distributed optimizer, and flags that do nothing on CPU
    (named once in the log), and --save/--load with a checkpoint every 4 iterations. Rank 5 dies in the
    evaluation at boundary 6 (iteration 7's forward drill fires in the first forward pass after that
    boundary: the evaluation's). No replica holds rank 5's optimizer shard, but its holder's
    host-memory mirror does (``--tm-optimizer-mirror``, on by default): the standby takes the shard
    of boundary 6 from there, with no rollback to checkpoint 4, and the run goes on exactly, the
    evaluation at 6 included."""
    f = tokenizer_files
    llama = [
        "--use-mcore-models", "--data-path", f["hf_a"], f["hf_b"],
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", f["hf"], "--split", "99,1,0",
        "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--group-query-attention", "--num-query-groups", "2",
        "--kv-channels", "8", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--attention-backend", "fused", "--train-samples", "96", "--lr-decay-samples", "96",
        "--lr-warmup-samples", "16", "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--bf16",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--cross-entropy-loss-fusion", "--manual-gc", "--exit-duration-in-mins", "235",
        "--no-create-attention-mask-in-dataloader", "--num-workers", "1", "--data-cache-path", str(tmp_path),
        "--distributed-timeout-minutes", "60", "--log-throughput", "--eval-iters", "1", "--eval-interval", "6",
    ]  # fmt: skip
    base = tiny_args("unused", tp=2, pp=2)
    runs = {}
    for name, fault in (("clean", None), ("faulty", "5:7:forward")):
        ckpt = ["--save", str(tmp_path / f"ckpt_{name}"), "--load", str(tmp_path / f"ckpt_{name}")]
        args = _example(base, llama + ckpt + ["--save-interval", "4"], fault)
        runs[name] = run_job(tmp_path, 8, args, name=f"llama_{name}", timeout=400)
    clean, faulty = runs["clean"], runs["faulty"]
    _assert_same_run(faulty, clean, 12)
    assert sorted(_evaluations(clean)) == [("valid", 6), ("valid", 12)]
    resumed = [r["resumed_iteration"] for r in read_metrics(faulty.metrics_path, "recovered")]
    assert resumed == [6], f"the job did not resume where it failed: {resumed}"
    said = [line for line in clean.stdout().splitlines() if "accepted without effect here" in line]
    assert len(said) == 1 and "--attention-backend" in said[0] and "--manual-gc" in said[0], said


def test_mixtral_example_with_a_failure(tmp_path, tokenizer_files):
    """Megatron-LM's Mixtral 8x7B script with its sizes scaled down (4 experts for 8, PP 2 for 4, EP 2 for
    8, 4 layers, hidden 32) and every other flag as it is: Llama2Tokenizer, RMSNorm, SwiGLU, RoPE, GQA,
    top-2 routing with the auxiliary loss, the all-to-all dispatcher, --moe-grouped-gemm (the experts in
    turn without TransformerEngine), the distributed optimizer, --sequence-parallel at TP 1 (dropped, as
    Megatron-LM does), checkpoints every 4 iterations, evaluation, TensorBoard. Rank 5 (EP rank 1) dies
    in iteration 5's backward pass; its dense and expert optimizer shards come from its holder's mirror
    and the run is bit-identical to the one without a fault."""
    f = tokenizer_files
    mixtral = [
        # MODEL_ARGS
        "--use-mcore-models", "--disable-bias-linear", "--seq-length", "32", "--max-position-embeddings", "64",
        "--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
        "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
        "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
        "--no-masked-softmax-fusion", "--no-position-embedding", "--rotary-base", "1000000",
        # MOE_ARGS
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
        "--overlap-param-gather", "--overlap-grad-reduce",
        # DATA_ARGS
        "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", f["sp"], "--data-path", f["llama2_a"],
        "--split", "90,8,2",  # 99990,8,2 scaled to a corpus of 750 documents
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-4", "--train-iters", "12",
        "--lr-decay-iters", "10", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
        "--lr-warmup-iters", "2", "--clip-grad", "1.0", "--bf16",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--sequence-parallel",
        # LOGGING_ARGS
        "--log-interval", "1", "--save-interval", "4", "--eval-interval", "6", "--eval-iters", "1",
        "--no-load-optim", "--no-load-rng",
    ]  # fmt: skip
    base = tiny_args("unused", tp=1, pp=2)
    runs = {}
    for name, fault in (("clean", None), ("faulty", "5:5:backward")):
        ckpt = ["--save", str(tmp_path / f"ckpt_{name}"), "--load", str(tmp_path / f"ckpt_{name}")]
        tb = ["--tensorboard-dir", str(tmp_path / f"tb_{name}")]
        runs[name] = run_job(
            tmp_path, 8, _example(base, mixtral + ckpt + tb, fault), name=f"mixtral_{name}", timeout=400
        )
    clean, faulty = runs["clean"], runs["faulty"]
    _assert_same_run(faulty, clean, 12)
    assert sorted(_evaluations(clean)) == [("test", 12), ("valid", 6), ("valid", 12)], _evaluations(clean)
    said = [line for line in clean.stdout().splitlines() if "accepted without effect here" in line]
    assert len(said) == 1 and "--moe-grouped-gemm" in said[0] and "--no-position-embedding" in said[0], said
    assert "world 8 = TP1 x PP2 x DP4" in clean.stdout()
