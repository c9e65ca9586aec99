# TrainMover on an NGC PyTorch image (brings CUDA, NCCL, TransformerEngine and apex).
# Build:  docker build -t trainmover .
# Run:    docker run --gpus all --ipc=host --rm trainmover launch --nproc-per-node 8 pretrain_gpt.py ...
FROM nvcr.io/nvidia/pytorch:25.10-py3

ARG DEBIAN_FRONTEND=noninteractive
# etcd for the embedded membership store
RUN apt-get update \
    && apt-get install -y --no-install-recommends etcd-server \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/trainmover
COPY . /opt/trainmover
# Keep the image's torch: install the project and its GPU extra without touching it.
RUN pip install --no-cache-dir --no-deps -e . \
    && pip install --no-cache-dir "etcd-sdk-python==0.0.7" protobuf prometheus_client nvidia-ml-py

ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["trainmover"]
CMD ["--help"]
