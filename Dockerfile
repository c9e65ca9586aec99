# TrainMover on an NGC PyTorch image, which brings CUDA, NCCL, torch, TransformerEngine and apex, and
# megatron-core 0.19.2 (the compat stack's pin; it needs the image's Python 3.12).
# Build:  docker build -t trainmover .
# Run:    docker run --gpus all --ipc=host --network=host --rm trainmover launch --nproc-per-node 8 pretrain_gpt.py ...
# GPU checks:  docker run --gpus all --entrypoint bash trainmover scripts/gpu_check.sh
# Slurm (pyxis/enroot) and more: docs/container.md.
#
# tests/deploy/test_container.py lints this file with hadolint and (in `make test-compat`) replays its
# COPY and `pip install` steps in a fresh Python 3.12 venv, so keep installs as plain `pip install` commands.
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
# every source edit. The versions are the compat stack's (constraints-compat.txt: megatron-core 0.19.2).
# The image's torch and TransformerEngine stay: the NGC image pins them (and grpcio, protobuf, numpy)
# through PIP_CONSTRAINT, and constraints-compat.txt pins none of those (the compat venv's torch pin
# is in constraints-compat-base.txt, which is not copied here).
# pytest and its plugins (the compat pins) let scripts/gpu_check.sh run the GPU tests inside the image.
COPY constraints-compat.txt requirements-image.txt ./
RUN pip install --no-cache-dir -r requirements-image.txt \
    && pip install --no-cache-dir -c constraints-compat.txt pytest pytest-timeout hypothesis \
    && python -c "import megatron.core, pyetcd, prometheus_client, matplotlib, pytest"

# Then the source, installed as a regular package (not editable) and without dependencies.
COPY setup.py pretrain_gpt.py ./
COPY trainmover_training ./trainmover_training
COPY patches ./patches
COPY trainmover_ext ./trainmover_ext
COPY nccl_delta ./nccl_delta
COPY scripts ./scripts
RUN pip install --no-cache-dir --no-deps . \
    && trainmover --version

# What scripts/gpu_check.sh runs on a GPU (`docker run --gpus all --entrypoint bash trainmover
# scripts/gpu_check.sh`): the tests, their helpers and the benchmarks they share. Not installed.
COPY pytest.ini ./
COPY tests ./tests
COPY benchmarks ./benchmarks

ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["trainmover"]
CMD ["--help"]
