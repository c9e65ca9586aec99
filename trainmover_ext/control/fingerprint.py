"""The job's model fingerprint: what a standby must share with the job before it may serve a rank.

Contract:
- What it covers: whatever makes a standby's model and optimizer state interchangeable with a
  rank's (:data:`FINGERPRINT_FIELDS`): the model's shape, vocabulary and tokenizer, precision, the
  parallel layout, the optimizer and its sharding, the batch geometry, the seed (initial weights
  and the data order a promoted standby reads on from) and the megatron-core version. A flag the
  parser does not have reads as the value the model is built with (``position_embedding_type``
  learned_absolute, ``normalization`` LayerNorm, ``optimizer`` adam, ...), so adding the flag
  later keeps old and new processes comparable. Learning rate, logging and paths are not compared.
- Who writes it: every worker under ``--trainmover``, once at start, before it registers
  (:func:`publish_fingerprint`). The first one writes ``fingerprint`` with put-if-absent; a later
  worker whose fingerprint differs fails with :class:`ConfigMismatch` naming every differing field.
- Who reads it: every standby, before it advertises any warm role, with recordings or without
  (``migration.standby``). It waits for the record at most ``--tm-fingerprint-timeout`` seconds
  (:func:`wait_job_fingerprint`, :class:`StoreTimeout` after that), and a difference refuses it
  (:func:`check_standby`): :class:`StandbyRefused` names each differing field with both values, the
  refusal goes to the job's timeline (:data:`REFUSAL_EVENT`), and the process exits with
  :data:`~trainmover_ext.errors.STANDBY_REFUSED_EXIT_CODE`, which its launcher does not restart.

The sandbox's recording fingerprint (``sandbox.fingerprint``) is this one plus what a replayed
shadow iteration also depends on.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import time
from typing import Any

from trainmover_ext.control.executor import event_put
from trainmover_ext.control.records import Event, FingerprintRecord
from trainmover_ext.errors import ConfigMismatch, MalformedValue, StandbyRefused, StoreTimeout
from trainmover_ext.kv.base import Put, wait_prefix
from trainmover_ext.kv.job import JobSpace

FINGERPRINT_KEY = "fingerprint"
"""The job's :class:`FingerprintRecord`, under the job's namespace."""
REFUSAL_EVENT = "standby_refused"
"""Timeline event of a refused standby: ``{"member": id, "fields": {name: [job value, standby value]}}``."""

FINGERPRINT_FIELDS: tuple[str, ...] = (
    # model shape, vocabulary and tokenizer
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "kv_channels",
    "num_query_groups",
    "seq_length",
    "max_position_embeddings",
    "vocab_size",
    "padded_vocab_size",
    "tokenizer_type",
    "position_embedding_type",
    "normalization",
    "swiglu",
    "disable_bias_linear",
    "norm_epsilon",
    "rotary_percent",
    "rotary_base",
    "untie_embeddings_and_output_weights",
    # precision
    "bf16",
    "fp16",
    "params_dtype",
    # parallel layout
    "world_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "data_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "sequence_parallel",
    "use_tp_pp_dp_mapping",
    # mixture of experts (all None for a dense model)
    "num_experts",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "moe_router_topk",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_token_dispatcher_type",
    "moe_ffn_hidden_size",
    # optimizer, batch geometry, seed
    "optimizer",
    "use_distributed_optimizer",
    "micro_batch_size",
    "global_batch_size",
    "seed",
    # library
    "megatron_core_version",
)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _params_dtype(args: Any) -> str:
    dtype = getattr(args, "params_dtype", None)
    if dtype is not None:
        return str(dtype).removeprefix("torch.")
    return "bfloat16" if getattr(args, "bf16", False) else ("float16" if getattr(args, "fp16", False) else "float32")


def model_fingerprint(args: Any) -> dict[str, Any]:
    """The fingerprint fields of ``args`` (a parsed, validated ``pretrain_gpt.py`` namespace, after
    the tokenizer set ``padded_vocab_size``): JSON scalars, the values the model is built with."""
    fields = {name: getattr(args, name, None) for name in FINGERPRINT_FIELDS}
    hidden, heads = args.hidden_size, args.num_attention_heads
    # Unset sizes as megatron derives them, so that spelling the default out changes nothing.
    fields["ffn_hidden_size"] = fields["ffn_hidden_size"] or 4 * hidden
    fields["kv_channels"] = fields["kv_channels"] or hidden // heads
    fields["num_query_groups"] = (
        fields["num_query_groups"] if getattr(args, "group_query_attention", False) else None
    ) or heads
    # Flags pretrain_gpt.py does not have: what it builds (see the module docstring).
    fields["position_embedding_type"] = fields["position_embedding_type"] or "learned_absolute"
    fields["normalization"] = fields["normalization"] or "LayerNorm"
    fields["optimizer"] = fields["optimizer"] or "adam"
    fields["norm_epsilon"] = fields["norm_epsilon"] or 1e-5
    rope = fields["position_embedding_type"] == "rope"
    fields["rotary_percent"] = (fields["rotary_percent"] or 1.0) if rope else None
    fields["rotary_base"] = (fields["rotary_base"] or 10000) if rope else None
    for flag in (
        "swiglu",
        "disable_bias_linear",
        "bf16",
        "fp16",
        "sequence_parallel",
        "use_distributed_optimizer",
        "untie_embeddings_and_output_weights",
    ):
        fields[flag] = bool(fields[flag])
    _moe_fields(fields, args)
    fields["params_dtype"] = _params_dtype(args)
    fields["megatron_core_version"] = _version("megatron-core")
    return fields


def _moe_fields(fields: dict[str, Any], args: Any) -> None:
    """The MoE fields as the model is built with them; all None for a dense model, so that processes
    without the MoE flags compare equal."""
    moe = ("num_experts",) + tuple(name for name in FINGERPRINT_FIELDS if name.startswith(("moe_", "expert_")))
    if not getattr(args, "num_experts", None):
        fields.update(dict.fromkeys(moe))
        return
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = fields[name]
        fields[name] = value[0] if isinstance(value, list) and len(value) == 1 else value
    fields["expert_tensor_parallel_size"] = fields["expert_tensor_parallel_size"] or args.tensor_model_parallel_size
    fields["moe_ffn_hidden_size"] = fields["moe_ffn_hidden_size"] or fields["ffn_hidden_size"]


def fingerprint_digest(fields: dict[str, Any]) -> str:
    """SHA-256 of ``fields`` in canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def fingerprint_record(args: Any, *, published_by: str, now: float | None = None) -> FingerprintRecord:
    """The record a worker publishes for ``args``."""
    fields = model_fingerprint(args)
    return FingerprintRecord(
        fields=fields,
        digest=fingerprint_digest(fields),
        published_by=published_by,
        published_at=time.time() if now is None else now,
    )


def fingerprint_diff(job: dict[str, Any], mine: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``field -> (job value, other value)`` for every field that differs (a field one side lacks reads None)."""
    return {k: (job.get(k), mine.get(k)) for k in sorted(set(job) | set(mine)) if job.get(k) != mine.get(k)}


def describe_diff(diff: dict[str, tuple[Any, Any]], *, other: str = "standby") -> str:
    """``"field: job 1, standby 2; ..."``: every differing field with both values."""
    return "; ".join(f"{name}: job {a!r}, {other} {b!r}" for name, (a, b) in diff.items())


def check_standby(job: dict[str, Any], mine: dict[str, Any], *, member: str) -> None:
    """Pure: raise :class:`StandbyRefused` when standby ``member``'s fingerprint ``mine`` differs from
    the job's; return None when every field is equal."""
    diff = fingerprint_diff(job, mine)
    if diff:
        raise StandbyRefused(
            f"standby {member} refused by the job: its model fingerprint differs from the job's "
            f"({describe_diff(diff)}). "
            "It never advertises a warm role and is not restarted; start standbys with the job's exact model, "
            "precision, parallel, optimizer and batch flags and the same megatron-core.",
            diff,
        )


# --- the one key, and the refusal in the timeline ---------------------------------------


def publish_fingerprint(space: JobSpace, record: FingerprintRecord) -> FingerprintRecord:
    """Worker: write the job's fingerprint unless one exists; returns the job's. Raises
    :class:`ConfigMismatch` when the job's differs from ``record``."""
    key = space.key(FINGERPRINT_KEY)
    while True:
        if space.put_if_absent(key, record.to_bytes()):
            return record
        entry = space.kv.get(key)
        if entry is not None:  # None: deleted in between; write it ourselves
            break
    job = FingerprintRecord.from_bytes(entry.value, key=key)
    diff = fingerprint_diff(job.fields, record.fields)
    if diff:
        raise ConfigMismatch(
            f"this worker's model fingerprint differs from the one job {space.job!r} published "
            f"({describe_diff(diff, other='this worker')}; written by {job.published_by or 'another worker'}): every "
            f"worker of a job runs with the same flags. If an earlier run under this --tm-job left it in an external "
            f"etcd, pick a new --tm-job or delete {key}."
        )
    return job


def wait_job_fingerprint(space: JobSpace, timeout_s: float) -> FingerprintRecord:
    """Standby: the job's fingerprint, waiting for its first worker to publish it; :class:`StoreTimeout`
    after ``timeout_s``."""
    key = space.key(FINGERPRINT_KEY)
    values = wait_prefix(space.kv, key, lambda v: key in v, timeout_s)
    if values is None:
        raise StoreTimeout(
            f"job {space.job!r} published no model fingerprint ({key}) within {timeout_s:.0f}s: its workers write it "
            "once their model is built. Start the standby against a running job (same --tm-job and etcd) or raise "
            "--tm-fingerprint-timeout."
        )
    return FingerprintRecord.from_bytes(values[key], key=key)


def refusal_event(space: JobSpace, member: str, diff: dict[str, tuple[Any, Any]], now: float | None = None) -> Put:
    """The timeline event (:data:`REFUSAL_EVENT`) of standby ``member`` refused for ``diff``."""
    detail = {"member": member, "fields": {k: list(v) for k, v in diff.items()}}
    return event_put(space, REFUSAL_EVENT, detail, time.time() if now is None else now)


def read_refusal(space: JobSpace, member: str) -> dict[str, tuple[Any, Any]] | None:
    """The differing fields of standby ``member``'s refusal, from the job's timeline; None if it has none."""
    prefix = space.events_prefix
    found: dict[str, tuple[Any, Any]] | None = None
    for entry in space.kv.get_prefix(prefix).entries:
        try:
            event = Event.from_bytes(entry.value, key=entry.key)
        except MalformedValue:  # not ours to judge here; the timeline's readers report it
            continue
        if event.what == REFUSAL_EVENT and event.detail.get("member") == member:
            found = {k: tuple(v) for k, v in event.detail.get("fields", {}).items()}
    return found


def why_refused(space: JobSpace, member: str) -> str:
    """Why the job refused standby ``member``, in words, from the job's timeline (the standby wrote it);
    never raises (etcd trouble: the standby's own log has the fields)."""
    try:
        fields = read_refusal(space, member)
    except Exception as exc:  # noqa: BLE001 - said instead: the caller only logs it
        return f"its model fingerprint differs from the job's (could not read which fields: {exc})"
    if not fields:
        return "its model fingerprint differs from the job's (see its log for the fields)"
    return describe_diff(fields)
