# asyncinfer image: a worker (`asyncinfer worker --device npu:0`) or Flower, per docker-compose.yml.
#
# Ascend NPU (default): Ascend's CANN image supplies the runtime; torch and torch_npu must be the
# same release (torch_npu 2.7.1 ↔ torch 2.7.1). The host's driver is mounted in at run time.
# CUDA: --build-arg BASE_IMAGE=python:3.11-slim --build-arg EXTRAS=""
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg TORCH_SPEC=torch==2.7.1
ARG BASE_IMAGE=quay.io/ascend/cann:8.3.rc2-910b-ubuntu22.04-py3.11
FROM ${BASE_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC="torch==2.7.1 torch-npu==2.7.1"
ARG EXTRAS=npu

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /app

# torch first, from the index that matches the accelerator (an unpinned torch pulls a CUDA build).
RUN pip install --extra-index-url "${TORCH_INDEX}" ${TORCH_SPEC}

COPY pyproject.toml README.md ./
COPY asyncinfer ./asyncinfer
RUN pip install ".${EXTRAS:+[${EXTRAS}]}" "flower>=2.0,<3"

CMD ["asyncinfer", "worker", "--device", "auto"]
