"""TrainMover package.

``patches/`` is installed as ``trainmover_ext.patches`` so that no top-level
module named ``patches`` lands in site-packages. The training layer is
``trainmover_training`` (megatron-core 0.17 and later ship a ``megatron.training``
package of their own, so ours keeps out of the ``megatron`` namespace).
"""

import os
import re

from setuptools import find_namespace_packages, setup

_CONSTRAINTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "constraints.txt")


def pin(name: str) -> str:
    """``name==version`` from constraints.txt, the one file of pins (plain ``name`` if it has none)."""
    if os.path.exists(_CONSTRAINTS):
        for line in open(_CONSTRAINTS):
            m = re.fullmatch(rf"({re.escape(name)})==(\S+)", line.strip(), flags=re.IGNORECASE)
            if m:
                return line.strip()
    return name


setup(
    name="trainmover",
    version="0.1.0",
    description="Resilient runtime for Megatron-core training: warm standbys, delta communicators, live migration.",
    python_requires=">=3.11",
    packages=(
        find_namespace_packages(include=["trainmover_ext", "trainmover_ext.*", "nccl_delta", "nccl_delta.*"])
        + ["trainmover_ext.patches", "trainmover_training"]
    ),
    package_dir={"trainmover_ext.patches": "patches"},
    package_data={"trainmover_training": ["data/*.json"]},
    py_modules=["pretrain_gpt"],
    # What a site's environment keeps: its own torch build (never pinned here, so `pip install .` leaves
    # it alone), and a megatron-core the CPU patches target: 0.16.x (Python 3.11) or 0.19.x (3.12+).
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,!=0.17.*,!=0.18.*,<0.20",
        pin("etcd-sdk-python"),
        pin("cryptography"),  # the job CA of --tm-etcd-tls
        "protobuf",
        "prometheus_client",
        "numpy",
        "packaging",
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]", "nvidia-ml-py"],
        "test": [pin("pytest"), pin("pytest-timeout"), pin("hypothesis")],
        "plot": [pin("matplotlib")],
        "bench": [pin("nvidia-resiliency-ext")],
    },
    entry_points={"console_scripts": ["trainmover=trainmover_ext.cli:entry"]},
)
