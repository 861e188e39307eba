# Two commands on a fresh machine:
#   make run    set up .venv, then the quick default of every system on data that ships with the packages:
#               `dvc repro adapt@mnist fedpad@quick fedpd@quick ppfcil@quick` (BPFedCTTA and PP-FCIL on MNIST digits,
#               FedPAD and FedPD++ on three digit domains)
#   make test   set up if needed, then lint (ruff, mypy) and run the whole test suite
#   make test-fast   the library and flow tests (tests/fedcore, tests/flows) without the slow end-to-end runs
# and, when there is time:
#   make private  (about 20 min on 2 cores) the private-TTA grid (6 methods x plain/clip/dp0/DP at 4 epsilons) and the canary audit
#   make stress   BPFedCTTA's stress protocol; make stress-private: DP-TTA's (lr x plain/clip/DP, 3 seeds);
#                 make stress-cifar: BPFedCTTA's on CIFAR-10-C (needs ../shared/data/cifar10-jpeg.zip)
# Sharing a run between clones or machines (docs/tracking.md):
#   make push   every output dvc.lock records -> the DVC remote (FEDCORE_DVC_REMOTE, default ../fedcore-dvc-remote)
#   make pull   on another clone: fetch, check every md5 against dvc.lock, restore; rebuilds nothing
#   STAGES="adapt@mnist fedpad@quick" limits either to those stages
# A real deployment on this machine's loopback (docs/deployment.md, section 5):
#   make services-up     PostgreSQL, MLflow and Prefect servers, a two-node Ray cluster, an SSH DVC remote and a
#                        Prefect worker running the nightly deployments; make services-down stops them
#   make deploy-check    every nightly run through that stack, then faults (run by CI after make test)
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export RAY_TMPDIR ?= /tmp/fedcore-ray
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export MLFLOW_ENABLE_TELEMETRY ?= false
export DO_NOT_TRACK ?= 1
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup browser lint run private stress stress-private stress-cifar fedpad fedpad-natural fedpd ppfcil push pull exp plots test test-fast params bench clean deploy-setup services-up services-down deploy-check

$(BIN)/.installed: pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch/torchvision are pinned in pyproject (2.14.1 / 0.29.1); constraints.txt pins the rest.
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e '.[platform,dev]'
	# Bytecode for every installed module, written once here (about 30 s on 2 cores): pip's own
	# compile step is skipped above, and where PYTHONDONTWRITEBYTECODE is set nothing writes it at
	# run time, so each process (every Ray worker and test) would compile torch, Prefect and MLflow
	# from source: `import flows.runs.federation` took 10.3 s without it, 5.3 s with it. Files for
	# newer Pythons (*312*.py) do not compile and are skipped.
	$(BIN)/python -m compileall -q -j 0 -x '312' $(VENV)/lib
	$(BIN)/python -m flows.reports.plot_page  # .dvc/plots/page.html: dvc plots show with Vega bundled, no CDN
	@mkdir -p $(RAY_TMPDIR)
	@touch $@

setup: $(BIN)/.installed

params: setup
	$(BIN)/python -m flows.config.params

# dvc exp show with the headline metrics and the settings a user changes; ARGS=--all for every column
exp: setup
	$(BIN)/python -m flows.reports.exp $(ARGS)

# dvc plots show, naming each plot without data here and the stage that writes its tables
plots: setup
	$(BIN)/python -m flows.reports.plots $(ARGS)

run: setup
	@git rev-parse --git-dir >/dev/null 2>&1 || (git init -q && echo "initialised a git repo for DVC")
	$(BIN)/dvc repro adapt@mnist fedpad@quick fedpd@quick ppfcil@quick
	@echo; echo "BPFedCTTA (results/table.md):"; cat results/table.md; echo
	@echo "FedPAD quick grid (results/fedpad/quick/table.md):"; cat results/fedpad/quick/table.md; echo
	@echo "FedPD++ quick grid (results/fedpd/quick/table.md):"; cat results/fedpd/quick/table.md; echo
	@echo "PP-FCIL quick grid (results/ppfcil/quick/table.md):"; cat results/ppfcil/quick/table.md; echo
	@echo "Browse the runs: $(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlruns.db --host 127.0.0.1 --port 5000"
	@echo "  then open http://127.0.0.1:5000/#/experiments?workflowType=machine_learning"

private: setup
	@git rev-parse --git-dir >/dev/null 2>&1 || (git init -q && echo "initialised a git repo for DVC")
	$(BIN)/dvc repro private audit
	@echo; cat results/private/table.md; echo; cat results/private/audit.md; echo

stress: setup
	@git rev-parse --git-dir >/dev/null 2>&1 || (git init -q && echo "initialised a git repo for DVC")
	$(BIN)/dvc repro stress_report
	@echo; cat results/stress_report.md; echo

stress-private: setup
	@git rev-parse --git-dir >/dev/null 2>&1 || (git init -q && echo "initialised a git repo for DVC")
	$(BIN)/dvc repro stress_private_report
	@echo; cat results/stress_private_report.md; echo

stress-cifar: setup
	@git rev-parse --git-dir >/dev/null 2>&1 || (git init -q && echo "initialised a git repo for DVC")
	$(BIN)/dvc repro stress_cifar_report
	@echo; cat results/stress_cifar_report.md; echo

fedpad: setup
	@git rev-parse --git-dir >/dev/null 2>&1 || (git init -q && echo "initialised a git repo for DVC")
	$(BIN)/dvc repro fedpad@digits fedpad@digits_gamma fedpad@pacs fedpad@digits_6211 fedpad@digits_part20 \
		fedpad@digits_part50 fedpad@digits_double
	@for g in digits digits_gamma pacs digits_6211 digits_part20 digits_part50 digits_double; do echo; cat results/fedpad/$$g/table.md; cat results/fedpad/$$g/stats.md; done

fedpad-natural: setup
	@git rev-parse --git-dir >/dev/null 2>&1 || (git init -q && echo "initialised a git repo for DVC")
	$(BIN)/dvc repro fedpad@pacs_natural fedpad@pacs_equal_shards fedpad@pacs_natural_part20 \
		fedpad@pacs_natural_part50 fedpad@pacs_natural_6211 fedpad@digits_natural
	@for g in pacs_natural pacs_equal_shards pacs_natural_part20 pacs_natural_part50 pacs_natural_6211 \
		digits_natural; do echo; cat results/fedpad/$$g/table.md; cat results/fedpad/$$g/stats.md; done

fedpd: setup
	@git rev-parse --git-dir >/dev/null 2>&1 || (git init -q && echo "initialised a git repo for DVC")
	$(BIN)/dvc repro fedpd@digits
	@cat results/fedpd/digits/table.md; cat results/fedpd/digits/stats.md

ppfcil: setup
	@git rev-parse --git-dir >/dev/null 2>&1 || (git init -q && echo "initialised a git repo for DVC")
	$(BIN)/dvc repro ppfcil@mnist ppfcil@mnist-t10 ppfcil@cifar10 ppfcil@cifar10-t10 ppfcil@privacy ppfcil@privacy-eps ppfcil@privacy-nbafl \
		ppfcil_privacy
	@for g in mnist mnist-t10 cifar10 cifar10-t10 privacy privacy-eps privacy-nbafl; do \
		echo; cat results/ppfcil/$$g/table.md; cat results/ppfcil/$$g/stats.md; done
	@cat results/ppfcil/privacy/privacy.md

push: setup
	$(BIN)/python -m flows.services.remote push $(STAGES)

pull: setup
	$(BIN)/python -m flows.services.remote pull $(STAGES)

# The browser check of the MLflow and Prefect UIs (tests/e2e/test_ui.py) needs Chromium, from the system's
# packages: installed here when we are root with apt-get; otherwise that one test is skipped, with the reason.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium (apt) for the browser check"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
	      >/dev/null) || echo "could not install chromium: tests/e2e/test_ui.py will be skipped"; \
	  else echo "no chromium, and not root: tests/e2e/test_ui.py will be skipped (apt-get install chromium)"; fi; }

# A real deployment on this machine's loopback (docs/deployment.md): PostgreSQL, MLflow and Prefect servers, a
# two-node Ray cluster, an SSH DVC remote and a Prefect worker running the nightly deployments.
$(BIN)/.deploy-installed: $(BIN)/.installed infra/deploy-setup.sh
	infra/deploy-setup.sh
	@touch $@

deploy-setup: $(BIN)/.deploy-installed

services-up: setup deploy-setup
	$(BIN)/python infra/stack.py up

services-down:
	$(BIN)/python infra/stack.py down

# The end-to-end check of that deployment: every nightly run through the worker, then the faults (about 40 minutes).
deploy-check: setup deploy-setup
	$(BIN)/python -m pytest -q tests/deploy

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two pytest workers (pytest-xdist), one per core here; work stealing evens out the long end-to-end runs.
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test: setup browser lint
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "not slow" tests/fedcore tests/flows

bench: setup
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/dp_step.py
	$(BIN)/python benchmarks/rounds.py
	$(BIN)/python benchmarks/fedpd_align.py
	$(BIN)/python benchmarks/ppfcil.py
	$(BIN)/python benchmarks/scale.py

clean:
	rm -rf data/prepared data/partitions data/domains models models_group results checkpoints mlruns mlruns.db mlruns.db-wal mlruns.db-shm
