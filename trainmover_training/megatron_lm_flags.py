"""Megatron-LM's whole flag surface, and what ``pretrain_gpt.py`` does with each flag: implemented,
accepted without effect (named once in the log), or refused by name with the reason.

The surface is the generated list ``data/megatron_lm_flags.json`` (Megatron-LM's
``megatron/training/arguments.py`` at a pinned commit; ``scripts/gen_megatron_lm_flags.py``). A flag the
parser implements is its own; every other flag of the list is decided by :mod:`.megatron_lm_rules`. The
flags without effect are added to the parser from the list, with Megatron-LM's arity, so that its launch
scripts parse unchanged; refused ones reach :func:`refusal` through the parser's error. ``docs/flags.md``
renders the example-script table and the refusals from the parser itself."""

from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import os
from dataclasses import dataclass

from trainmover_training import megatron_lm_rules as rules

LISTING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "megatron_lm_flags.json")
NO_EFFECT_GROUP = "accepted for Megatron-LM launch scripts, without effect here (named once in the log when given)"
_NO_EFFECT_DEST = "megatron_lm_no_effect__"
"""Prefix of the parser destinations of the flags without effect (kept apart from the implemented ones)."""


@dataclass(frozen=True)
class MegatronFlag:
    """One option of Megatron-LM's parser: its option strings, arity (0: no value; 1; or argparse's
    '?', '*', '+') and argument group."""

    flags: tuple[str, ...]
    nargs: int | str
    group: str


@functools.lru_cache(maxsize=1)
def listing() -> dict:
    """The generated list (its header: source, ref, commit, generator; and ``flags``)."""
    with open(LISTING) as f:
        return json.load(f)


@functools.lru_cache(maxsize=1)
def megatron_flags() -> tuple[MegatronFlag, ...]:
    return tuple(MegatronFlag(tuple(r["flags"]), r["nargs"], r["group"]) for r in listing()["flags"])


def decide(flag: str, group: str) -> tuple[str, str] | None:
    """``(effect, why)`` for a Megatron-LM flag this layer does not implement, or None when no rule of
    :mod:`.megatron_lm_rules` covers it."""
    for pattern, effect, why in rules.FLAG_RULES:
        if fnmatch.fnmatchcase(flag, pattern):
            return effect, why
    return rules.GROUP_RULES.get(group)


def _no_effect_dest(mflag: MegatronFlag) -> str:
    return _NO_EFFECT_DEST + mflag.flags[0].removeprefix("--").replace("-", "_")


def _known(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}  # argparse has no public accessor


def add_no_effect_args(parser: argparse.ArgumentParser) -> None:
    """Add every flag of the list that ``parser`` does not implement and the rules accept without effect,
    with Megatron-LM's arity; call it after every implemented flag is added."""
    known = _known(parser)
    g = parser.add_argument_group(NO_EFFECT_GROUP)
    for mflag in megatron_flags():
        if any(f in known for f in mflag.flags):
            continue
        decision = decide(mflag.flags[0], mflag.group)
        if decision is None or decision[0] != rules.NO_EFFECT:
            continue
        kwargs: dict = {"dest": _no_effect_dest(mflag), "default": argparse.SUPPRESS, "help": decision[1] + "."}
        if mflag.nargs == 0:
            kwargs["action"] = "store_true"
        else:
            kwargs["metavar"] = "VALUE"
            if mflag.nargs != 1:
                kwargs["nargs"] = mflag.nargs
        g.add_argument(*mflag.flags, **kwargs)


def no_effect_given(args: argparse.Namespace) -> list[str]:
    """The flags without effect this run was given, as ``--flag (why)``, in the list's order."""
    given = []
    for mflag in megatron_flags():
        if hasattr(args, _no_effect_dest(mflag)):
            given.append(f"{mflag.flags[0]} ({decide(mflag.flags[0], mflag.group)[1]})")
    return given


def _is_no_effect(action: argparse.Action) -> bool:
    return action.dest.startswith(_NO_EFFECT_DEST)


EXAMPLE_FLAGS = (
    # model
    "--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --group-query-attention "
    "--num-query-groups --kv-channels --seq-length --max-position-embeddings --position-embedding-type "
    "--rotary-base --rotary-percent --attention-dropout --hidden-dropout --swiglu --init-method-std "
    "--attention-backend --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear "
    "--normalization --norm-epsilon --use-mcore-models "
    # training
    "--micro-batch-size --global-batch-size --rampup-batch-size --train-iters --train-samples "
    "--lr-decay-samples --lr-warmup-samples --lr-warmup-fraction --lr-warmup-iters --lr-decay-iters --lr "
    "--min-lr --decoupled-lr --decoupled-min-lr --lr-decay-style --clip-grad --weight-decay --adam-beta1 "
    "--adam-beta2 --fp16 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss "
    "--manual-gc --empty-unused-memory-level --exit-duration-in-mins --exit-signal-handler --exit-interval "
    # parallelism
    "--tensor-model-parallel-size --pipeline-model-parallel-size --context-parallel-size --sequence-parallel "
    "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --distributed-timeout-minutes "
    # data
    "--data-path --vocab-file --merge-file --split --tokenizer-type --tokenizer-model --vocab-size "
    "--mock-data --data-cache-path --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers "
    "--tiktoken-pattern "
    # evaluation, logging, checkpoints
    "--log-interval --save-interval --eval-interval --eval-iters --save --load --ckpt-format "
    "--tensorboard-dir --wandb-project --wandb-exp-name --wandb-save-dir --log-throughput --profile "
    "--log-params-norm --log-num-zeros-in-grad --log-timers-to-tensorboard "
    # memory
    "--recompute-activations --recompute-granularity --recompute-method --recompute-num-layers --use-flash-attn"
).split()
"""Every flag of ``examples/gpt3/train_gpt3_175b_distributed.sh`` and
``examples/llama/train_llama3_8b_h200_bf16.sh`` (and a few common neighbours)."""

REFUSED_PREFIXES = {"--moe-": rules.MOE}
"""Flag families refused by prefix though not in the list (a newer Megatron-LM's), with the reason."""


def refusal(flag: str) -> str | None:
    """Why ``flag`` (``--name`` or ``--name=value``) is refused, or None when it is simply unknown."""
    name = flag.split("=", 1)[0]
    for mflag in megatron_flags():
        if name in mflag.flags:
            decision = decide(name, mflag.group)
            return decision[1] if decision is not None and decision[0] == rules.REFUSED else None
    return next((why for prefix, why in REFUSED_PREFIXES.items() if name.startswith(prefix)), None)


def surface_gaps(parser: argparse.ArgumentParser) -> list[str]:
    """What ``parser`` gets wrong against the generated list, one line each (empty when none): a flag it
    neither implements nor accepts nor refuses by name, a flag no rule decides, a flag the rules accept
    that the parser lacks, a flag of :data:`rules.IMPLEMENTED` the parser lacks (or the reverse), or an
    implemented flag whose arity differs from Megatron-LM's (a script's
    ``--flag value`` would then misparse)."""
    known = _known(parser)
    gaps = []
    for mflag in megatron_flags():
        name = mflag.flags[0]
        action = next((known[f] for f in mflag.flags if f in known), None)
        implemented = action is not None and not _is_no_effect(action)
        if implemented != (name in rules.IMPLEMENTED):
            gaps.append(
                f"{name}: implemented here but not in megatron_lm_rules.IMPLEMENTED"
                if implemented
                else f"{name}: in megatron_lm_rules.IMPLEMENTED, but the parser lacks it"
            )
            continue
        if implemented:
            if (action.nargs == 0) != (mflag.nargs == 0):
                gaps.append(f"{name}: takes {'no value' if action.nargs == 0 else 'a value'} here, unlike Megatron-LM")
            continue
        decision = decide(name, mflag.group)
        if decision is None:
            gaps.append(f"{name}: no rule decides it (group {mflag.group!r}): add one to megatron_lm_rules")
        elif decision[0] == rules.NO_EFFECT and action is None:
            gaps.append(f"{name}: accepted without effect by the rules, but the parser lacks it")
        elif decision[0] == rules.REFUSED and refusal(name) is None:
            gaps.append(f"{name}: refused by the rules, but not by name")
    return gaps


def surface_counts(parser: argparse.ArgumentParser) -> dict[str, int]:
    """How many options of the list ``parser`` implements, accepts without effect, and refuses."""
    known = _known(parser)
    counts = {"implemented": 0, rules.NO_EFFECT: 0, rules.REFUSED: 0}
    for mflag in megatron_flags():
        action = next((known[f] for f in mflag.flags if f in known), None)
        if action is not None:
            counts[rules.NO_EFFECT if _is_no_effect(action) else "implemented"] += 1
        elif refusal(mflag.flags[0]) is not None:
            counts[rules.REFUSED] += 1
    return counts


def refused_flags() -> list[tuple[str, str]]:
    """``(flag, why)`` for every flag of the list the rules refuse (the parser may still implement some)."""
    out = []
    for mflag in megatron_flags():
        decision = decide(mflag.flags[0], mflag.group)
        if decision is not None and decision[0] == rules.REFUSED:
            out.append((mflag.flags[0], decision[1]))
    return out


def support_table(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """``(flag, status)`` for every flag of :data:`EXAMPLE_FLAGS`, from ``parser`` itself."""
    known = _known(parser)
    rows = []
    for flag in EXAMPLE_FLAGS:
        action = known.get(flag)
        if action is None:
            rows.append((flag, f"not supported: {refusal(flag) or 'refused as an unknown flag'}"))
        elif _is_no_effect(action):
            rows.append((flag, f"accepted, no effect here: {action.help.rstrip('.')}"))
        else:
            rows.append((flag, "supported"))
    return rows
