# TrainMover developer entry points. `make demo` and `make test` set up .venv on first use.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv etcd promtool lint test test-fast demo data bench clean help

help:
	@echo "make demo      - train the demo GPT (8 CPU ranks, TP2xPP2xDP2) on the bundled corpus"
	@echo "make test      - install everything needed and run the whole test suite"
	@echo "make test-fast - the suite without tests marked slow"
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

demo: venv etcd data
	$(VPY) scripts/demo.py

clean:
	rm -rf $(VENV) data runs bench_out
