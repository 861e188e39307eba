# Two commands on a fresh machine:
#   make run    set up .venv, then `dvc repro adapt`: the default experiment on the bundled MNIST digits
#   make test   set up if needed, then run the test suite
# and, when there is time (about 20 min on 2 cores):
#   make private  the private-TTA grid (6 methods x plain/clip/DP at 4 epsilons) and the canary audit
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export RAY_TMPDIR ?= /tmp/fedcore-ray
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export MLFLOW_ENABLE_TELEMETRY ?= false
export DO_NOT_TRACK ?= 1
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup run private test test-fast params bench clean

$(BIN)/.installed: pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch/torchvision are pinned in pyproject (2.14.1 / 0.29.1); constraints.txt pins the rest.
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e '.[platform,dev]'
	@mkdir -p $(RAY_TMPDIR)
	@touch $@

setup: $(BIN)/.installed

params: setup
	$(BIN)/python -m flows.params

run: setup
	@git rev-parse --git-dir >/dev/null 2>&1 || (git init -q && echo "initialised a git repo for DVC")
	$(BIN)/dvc repro adapt
	@echo; cat results/table.md; echo
	@echo "Browse the runs: $(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlruns.db --host 127.0.0.1 --port 5000"

private: setup
	@git rev-parse --git-dir >/dev/null 2>&1 || (git init -q && echo "initialised a git repo for DVC")
	$(BIN)/dvc repro private audit
	@echo; cat results/private/table.md; echo; cat results/private/audit.md; echo

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/dp_step.py

clean:
	rm -rf data/prepared data/partitions models models_group results checkpoints mlruns mlruns.db
