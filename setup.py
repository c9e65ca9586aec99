"""TrainMover package.

``patches/`` is installed as ``trainmover_ext.patches`` so that no top-level
module named ``patches`` lands in site-packages; ``megatron/training`` joins
megatron-core's ``megatron`` namespace package.
"""

from setuptools import find_namespace_packages, setup

setup(
    name="trainmover",
    version="0.1.0",
    description="Resilient runtime for Megatron-core training: warm standbys, delta communicators, live migration.",
    python_requires=">=3.11",
    packages=(
        find_namespace_packages(include=["trainmover_ext", "trainmover_ext.*", "nccl_delta", "nccl_delta.*"])
        + ["trainmover_ext.patches", "megatron.training"]
    ),
    package_dir={"trainmover_ext.patches": "patches"},
    py_modules=["pretrain_gpt"],
    install_requires=[
        "torch>=2.5",
        "megatron-core>=0.16.1",
        "etcd-sdk-python==0.0.7",
        "protobuf",
        "prometheus_client",
        "numpy",
        "packaging",
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]", "nvidia-ml-py"],
        "test": ["pytest", "pytest-timeout"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["trainmover=trainmover_ext.cli:main"]},
)
