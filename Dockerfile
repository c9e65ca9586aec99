# TrainMover on an NGC PyTorch image, which brings CUDA, NCCL, torch, TransformerEngine and apex.
# Build:  docker build -t trainmover .
# Run:    docker run --gpus all --ipc=host --network=host --rm trainmover launch --nproc-per-node 8 pretrain_gpt.py ...
# Slurm (pyxis/enroot) and more: docs/container.md.
#
# tests/deploy/test_container.py lints this file with hadolint and replays its COPY and
# `pip install` steps in a fresh venv, so keep installs as plain `pip install` commands.
FROM nvcr.io/nvidia/pytorch:25.10-py3

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEBIAN_FRONTEND=noninteractive

# etcd for the embedded membership store (the launcher and trainmover.sbatch start it).
# The distribution's etcd-server follows the base image's Ubuntu release, so it is not pinned here.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends etcd-server \
    && rm -rf /var/lib/apt/lists/* \
    && etcd --version

WORKDIR /opt/trainmover

# Dependencies first, from the pins alone: this layer is rebuilt only when a pin changes, not on
# every source edit. The image's torch and TransformerEngine stay: the NGC image pins them (and
# grpcio, protobuf, numpy) through PIP_CONSTRAINT, and constraints.txt leaves those unpinned.
COPY constraints.txt requirements-image.txt ./
RUN pip install --no-cache-dir -r requirements-image.txt \
    && python -c "import megatron.core, pyetcd, prometheus_client, matplotlib"

# Then the source, installed as a regular package (not editable) and without dependencies.
COPY setup.py pretrain_gpt.py ./
COPY trainmover_training ./trainmover_training
COPY patches ./patches
COPY trainmover_ext ./trainmover_ext
COPY nccl_delta ./nccl_delta
COPY scripts ./scripts
RUN pip install --no-cache-dir --no-deps . \
    && trainmover --help > /dev/null

ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["trainmover"]
CMD ["--help"]
