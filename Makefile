# TrainMover developer entry points. `make demo` and `make test` set up .venv on first use.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The compat stack (`make test-compat`): the NGC images' Python 3.12, PyPI's torch and the newest
# megatron-core 0.19.x. constraints-compat.txt pins what the container image shares with it;
# constraints-compat-base.txt pins torch, numpy, grpcio and protobuf, which the image brings itself.
# Its venv (GBs: torch's CUDA build) lives outside the clone, keyed by the two files' hash, so CI runs
# on one machine reuse it.
COMPAT_PY ?= $(or $(lastword $(sort $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12))),python3.12)
COMPAT_PINS := constraints-compat-base.txt constraints-compat.txt
COMPAT_KEY := $(shell cat $(COMPAT_PINS) 2>/dev/null | sha256sum | cut -c1-12)
COMPAT_HOME ?= $(HOME)/.cache/trainmover
COMPAT_VENV ?= $(COMPAT_HOME)/venv-compat-py312-$(COMPAT_KEY)
COMPAT_VPY := $(COMPAT_VENV)/bin/python
# The foundation (pure units, the kv contract on real etcd, the layering) and one of each kind of
# move, each bit-identical to the fault-free run: an unexpected failure and a planned migration. And
# the container image's install steps, replayed on this stack's Python and megatron-core. And MoE
# (the CPU patches of its dispatchers, router and experts on 0.19).
COMPAT_TESTS := tests/training/test_units.py tests/training/test_grad_sync.py tests/nccl_delta/test_units.py tests/control/test_decide.py tests/control/test_plan_inbox.py \
	tests/training/test_moe_flags.py tests/training/test_moe_training.py \
	tests/control/test_kv.py tests/control/test_fingerprint.py tests/migration/test_transfer_format.py \
	tests/sandbox/test_units.py tests/test_layering.py tests/test_deadline.py tests/test_fsutil.py \
	"tests/migration/test_failover.py::test_sigkill_is_replaced_bit_identically[last-stage-tp1-backward]" \
	"tests/migration/test_planned.py::test_planned_migration_is_bit_identical[first-stage-tp1]" \
	tests/deploy/test_container.py::test_dockerfile_install_steps_work_in_a_fresh_venv

.PHONY: venv venv-compat etcd promtool lint test test-fast test-compat demo data clean help

help:
	@echo "make demo      - train the demo GPT (8 CPU ranks, TP2xPP2xDP2) on the bundled corpus"
	@echo "make test      - install everything needed and run the whole test suite"
	@echo "make test-fast - the suite without tests marked slow"
	@echo "make test-compat - foundation tests and two bit-identical moves on Python 3.12, PyPI's torch, megatron-core 0.19"
	@echo "make lint      - ruff check, ruff format --check and mypy (strict on nccl_delta, kv, control, migration, runtime)"

$(STAMP): constraints.txt requirements.txt setup.py pyproject.toml
	@command -v $(PY) >/dev/null || { echo "$(PY) not found: install Python 3.11"; exit 1; }
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first and alone: nothing after it may pull a CUDA build
	$(VPY) -m pip install -q -c constraints.txt torch
	$(VPY) -m pip install -q -r requirements.txt
	$(VPY) -m pip install -q --no-deps -e .
	@$(VPY) -c "import torch,sys; v=torch.__version__; sys.exit(0 if v.startswith('2.13.0') else 'torch was replaced by '+v)"
	touch $(STAMP)

venv: $(STAMP)

# Built from nothing on a fresh machine; pip's own cache (not disabled here) keeps a rebuild after a
# pin change short. No file prerequisite: the path holds the pins' hash (a fresh clone's newer mtime
# must not rebuild it). The clone is installed editable; .clone records which clone it points at.
$(COMPAT_VENV)/.installed:
	@$(COMPAT_PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null \
	  || { echo "$(COMPAT_PY) is not Python 3.12: install it (pyenv install 3.12) or pass COMPAT_PY=/path/to/python3.12"; exit 1; }
	@echo "[compat 1/3 $$(date +%T)] creating $(COMPAT_VENV) with $$($(COMPAT_PY) --version)"
	rm -rf $(COMPAT_VENV) && mkdir -p $(COMPAT_HOME)
	$(COMPAT_PY) -m venv $(COMPAT_VENV)
	$(COMPAT_VPY) -m pip install --upgrade pip
	@echo "[compat 2/3 $$(date +%T)] installing $(COMPAT_PINS) (torch's CUDA wheels are GBs on a cold cache)"
	$(COMPAT_VPY) -m pip install $(addprefix -r ,$(COMPAT_PINS))
	@echo "[compat 3/3 $$(date +%T)] done"
	@# stale venvs of earlier pins
	@find $(COMPAT_HOME) -maxdepth 1 -name 'venv-compat-py312-*' ! -path $(COMPAT_VENV) -exec rm -rf {} +
	touch $@

venv-compat: $(COMPAT_VENV)/.installed
	@test "$$(cat $(COMPAT_VENV)/.clone 2>/dev/null)" = "$(CURDIR)" || { \
	  $(COMPAT_VPY) -m pip install -q --no-deps -e . && echo "$(CURDIR)" > $(COMPAT_VENV)/.clone; }

etcd:
	@command -v etcd >/dev/null || { echo "installing Debian's etcd-server"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server) >/dev/null \
	  || { echo "could not install etcd-server: run 'apt-get install etcd-server' as root"; exit 1; }; }

promtool:
	@command -v promtool >/dev/null || { echo "installing Debian's prometheus (its promtool checks the alert rules)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) >/dev/null \
	  || { echo "could not install prometheus: run 'apt-get install prometheus' as root"; exit 1; }; }

data: venv
	@test -f data/corpus_text_document.bin || $(VPY) scripts/prepare_data.py --stdlib-corpus --output-prefix data/corpus

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: venv etcd promtool
	$(VPY) -m pytest -q --timeout 900

test-fast: venv etcd promtool
	$(VPY) -m pytest -q --timeout 600 -m "not slow"

# The check proves the venv runs this clone's code (its editable install points at the clone).
test-compat: venv-compat etcd
	@$(COMPAT_VPY) -W ignore -c 'import sys, torch, megatron.core, trainmover_training as t; \
	  print("compat stack: Python", sys.version.split()[0], "torch", torch.__version__, "megatron-core", megatron.core.__version__); \
	  sys.exit(None if t.__file__.startswith("$(CURDIR)/") else "trainmover_training is " + t.__file__)'
	$(COMPAT_VPY) -m pytest -q --timeout 600 $(COMPAT_TESTS)

demo: venv etcd data
	$(VPY) scripts/demo.py

clean:
	rm -rf $(VENV) data runs bench_out
