"""Per-process records of a benchmark run: what every rank and standby logged, and a hash of its final state.

Contract: :func:`install_from_env` runs first thing in every process of a benchmarked job (from
``benchmarks/harness/recorded_pretrain.py``, the script the benchmarks give the launcher in place of
``pretrain_gpt.py``, and from the nvrx baseline's worker), and does nothing unless
``TM_BENCH_RECORDS`` names a directory. It then appends JSON lines to ``<dir>/<pid>.jsonl``:

- ``process``: the pid, its start on the wall clock and its member id (a standby's), at install;
- every record but ``iteration`` the process's ``MetricsLog`` writes, on **every** rank (the job's own
  metrics file has the logging rank's only), with ``pid``, ``rank`` (once the process knows it) and ``t_written``: a
  stayer's ``recovered``, a joiner's ``promoted``, a restarted rank's ``startup`` give each rank's
  resume time;
- ``state_hash``: once training reached ``--train-iters``, sha256 over the rank's model parameters and
  over its optimizer's state (every master parameter, every state tensor, every hyper-parameter), in
  a fixed order (:func:`state_digest`). Equal hashes of a faulted run and its fault-free twin, rank for
  rank, mean the state is bit-identical, not only the loss trajectory.

It reaches the training layer through three names (``MetricsLog.write``, ``initialize_distributed``,
``train_loop`` of ``trainmover_training.training``) and raises ``RuntimeError`` at install when one is
gone, so that a benchmark never runs without its records. A benchmark drill lives here too: with
``TM_BENCH_STANDBYS=N`` and ``TM_BENCH_REFILL_DELAY_S=D``, every standby started after the first ``N``
(a refill) sleeps ``D`` seconds before it starts, so that it neither imports nor warms during the
post-promotion window (the A/B that measures what refills cost the job there).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

RECORDS_ENV = "TM_BENCH_RECORDS"
REFILL_DELAY_ENV = "TM_BENCH_REFILL_DELAY_S"
INITIAL_STANDBYS_ENV = "TM_BENCH_STANDBYS"
MEMBER_ENV = "TRAINMOVER_MEMBER_ID"


class _Recorder:
    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{os.getpid()}.jsonl")
        self.rank: int | None = None
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(dict(record, pid=os.getpid(), rank=record.get("rank", self.rank), t_written=time.time()))
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")


_RECORDER: _Recorder | None = None


def install_from_env() -> bool:
    """Install the records when ``TM_BENCH_RECORDS`` is set (see the module doc); returns whether it did.
    Idempotent."""
    global _RECORDER
    directory = os.environ.get(RECORDS_ENV)
    if not directory:
        return False
    if _RECORDER is not None:
        return True
    import trainmover_training.training as training

    missing = [n for n in ("MetricsLog", "initialize_distributed", "train_loop") if not hasattr(training, n)]
    if missing:
        raise RuntimeError(
            f"benchmarks/harness/recorder.py reaches trainmover_training.training.{missing[0]}, which is gone: "
            "update the recorder to the training layer's new names"
        )
    rec = _RECORDER = _Recorder(directory)
    rec.write(
        {"event": "process", "process_start": training.process_start_time(), "member": os.environ.get(MEMBER_ENV)}
    )
    original_write = training.MetricsLog.write
    original_init = training.initialize_distributed
    original_loop = training.train_loop

    def write(self, **record):
        original_write(self, **record)
        if record.get("event") != "iteration":  # the logging rank's metrics file has those already
            rec.write(record)

    def initialize_distributed(*args, **kwargs):
        layout = original_init(*args, **kwargs)
        rec.rank = layout.rank
        return layout

    def train_loop(session, runtime):
        rec.rank = session.layout.rank
        summary = original_loop(session, runtime)
        args = session.args
        if args.iteration >= args.train_iters:
            rec.write(
                {"event": "state_hash", "iteration": args.iteration, **state_digest(session.model, session.optimizer)}
            )
        return summary

    training.MetricsLog.write = write
    training.initialize_distributed = initialize_distributed
    training.train_loop = train_loop
    return True


def defer_refill(argv: list[str]) -> None:
    """The deferred-refill drill (see the module doc): a refill standby sleeps ``TM_BENCH_REFILL_DELAY_S``
    seconds before it starts (and warms), or exits when its agent is gone meanwhile."""
    delay, keep = os.environ.get(REFILL_DELAY_ENV), os.environ.get(INITIAL_STANDBYS_ENV)
    member = os.environ.get(MEMBER_ENV, "")
    if delay is None or keep is None or "--tm-role" not in argv or not member.startswith("standby-"):
        return
    try:
        index = int(member.split("-")[2])
    except (IndexError, ValueError):
        return
    if index < int(keep):
        return
    print(f"[bench] refills deferred: standby {member} starts in {float(delay):.1f}s", flush=True)
    parent, until = os.getppid(), time.time() + float(delay)
    while time.time() < until:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.2)


# ---------------------------------------------------------------------------- state hash


def _feed_tensor(h: Any, tensor) -> None:
    import torch

    t = tensor.detach().cpu().contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def _feed_value(h: Any, value: Any) -> None:
    """Tensors by dtype, shape and bytes; containers in a fixed order; anything else by ``repr``."""
    import torch

    if isinstance(value, torch.Tensor):
        _feed_tensor(h, value)
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            h.update(repr(key).encode())
            _feed_value(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"[{len(value)}".encode())
        for item in value:
            _feed_value(h, item)
    else:
        h.update(repr(value).encode())


def _torch_optimizers(optimizer) -> Iterable[Any]:
    """The torch optimizers under megatron's wrappers (chained, mixed precision, distributed)."""
    import torch

    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        yield opt, (inner if isinstance(inner, torch.optim.Optimizer) else opt)


def state_digest(model, optimizer) -> dict[str, str]:
    """``{"params": sha256, "optimizer": sha256}`` of model chunks ``model`` (a module or a list) and
    ``optimizer`` (megatron's or torch's). Collective-free: every rank hashes what it holds."""
    params = hashlib.sha256()
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for name, p in chunk.named_parameters():
            params.update(name.encode())
            _feed_tensor(params, p)
    opt_hash = hashlib.sha256()
    for wrapper, torch_opt in _torch_optimizers(optimizer):
        for group in torch_opt.param_groups:
            _feed_value(opt_hash, {k: v for k, v in group.items() if k != "params"})
            for p in group["params"]:
                _feed_tensor(opt_hash, p)  # the master copy the optimizer steps
                _feed_value(opt_hash, dict(torch_opt.state.get(p, {})))
        scaler = getattr(wrapper, "grad_scaler", None)
        if scaler is not None and hasattr(scaler, "state_dict"):
            _feed_value(opt_hash, scaler.state_dict())
    return {"params": params.hexdigest(), "optimizer": opt_hash.hexdigest()}
