"""Runtime patches onto megatron-core, installed in one audited place.

Installed as ``trainmover_ext.patches`` (see setup.py), never as a top-level
``patches`` module. :func:`install` is idempotent and is the only code in the
project that writes megatron-core's module state. Each patch checks the
megatron-core version it was written for and raises :class:`PatchError` on any
other, so an upgrade is noticed at start-up.
"""

from __future__ import annotations

import importlib.metadata
import logging

import torch

from trainmover_ext.errors import PatchError

logger = logging.getLogger(__name__)

# megatron-core versions whose source the CPU patches were checked against: 0.16 (the CPU stack,
# constraints.txt) and 0.19 (Python 3.12, constraints-compat.txt; `make test-compat`).
SUPPORTED_MCORE = ("0.16.", "0.19.")

_installed: list[str] | None = None


def megatron_core_version() -> str:
    """The installed megatron-core version string."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError as exc:
        raise PatchError(
            "megatron-core is not installed: run `make venv` or `pip install megatron-core==0.16.1`"
        ) from exc


def check_version(version: str | None = None) -> str:
    """Raise :class:`PatchError` unless megatron-core is a version the patches target."""
    version = version or megatron_core_version()
    if not version.startswith(SUPPORTED_MCORE):
        raise PatchError(
            f"megatron-core {version} is not supported by the CPU patches (written for "
            f"{', '.join(v + 'x' for v in SUPPORTED_MCORE)}). Install megatron-core==0.16.1 (0.19.2 on "
            "Python 3.12), or run on a GPU where the CPU patches are not needed."
        )
    return version


def install(force_cpu: bool | None = None) -> list[str]:
    """Install the patches this machine needs; returns the patched names.

    The CPU patches are installed only when CUDA is absent (or ``force_cpu``).
    On a GPU only what migration itself needs is rewritten
    (:mod:`.grad_norm_groups`, megatron-core 0.19 and later), so the NGC
    image's megatron-core otherwise runs untouched.
    """
    global _installed
    if _installed is not None:
        return _installed
    cpu = (not torch.cuda.is_available()) if force_cpu is None else force_cpu
    patched: list[str] = []
    if cpu:
        version = check_version()
        # Import every module first so that rebinding of `from x import f`
        # copies reaches them all.
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel.schedules  # noqa: F401
        import megatron.core.transformer.transformer_block  # noqa: F401

        from . import cpu_compat, moe_cpu, rng

        patched += cpu_compat.install(version)
        patched += moe_cpu.install()
        patched += rng.install()
    from . import grad_norm_groups

    patched += grad_norm_groups.install()
    logger.debug("trainmover patches installed: %s", patched)
    _installed = patched
    return patched
