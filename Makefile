# rlkube developer entry points. `make demo` and `make test` are the two a newcomer needs.
SHELL := /bin/bash
export PYTHONSAFEPATH := 1
VENV := .venv
PY := $(VENV)/bin/python
PYTEST := $(VENV)/bin/pytest
DEVCLUSTER := $(VENV)/bin/rlkube-devcluster
NODES ?= 4
GPUS_PER_NODE ?= 8

.PHONY: help venv cluster-build cluster-up cluster-down crds lint typecheck test test-fast test-realpods demo \
        bench-operator bench-weights bench-gpu clean

help:
	@echo "make demo           run the main job locally (control plane + operator + trainer, no GPU)"
	@echo "make test           build/reuse everything and run every test (what CI runs)"
	@echo "make test-realpods  only the tests that run real containers on the real node (-m realpods)"
	@echo "make lint           ruff + mypy + helm lint"
	@echo "make cluster-up     start the local control plane (.devcluster/kubeconfig)"
	@echo "make cluster-down   stop it and remove its state"
	@echo "make crds           regenerate crds/, the chart's CRD and admission policy from the Python sources"
	@echo "make bench-operator / bench-weights / bench-gpu   benchmarks (JSON in bench/results/)"

$(PY): pyproject.toml .ci/python-env.sh
	bash .ci/python-env.sh
	@touch $(PY)

venv: $(PY)

cluster-build:
	bash devcluster/tools/build.sh
	nice -n 10 bash devcluster/tools/build.sh node

cluster-up: venv cluster-build
	$(DEVCLUSTER) up --nodes $(NODES) --gpus-per-node $(GPUS_PER_NODE)

cluster-down: venv
	$(DEVCLUSTER) down

crds: venv
	$(PY) -m rlkube.api.crd --write
	$(PY) -m rlkube.operator.policy --write

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy api runtime operator devcluster bench

test: venv cluster-build lint
	PYTEST=$(PYTEST) bash tests/run.sh

test-realpods: venv cluster-build
	$(PYTEST) -p no:cacheprovider -m realpods tests

demo: venv cluster-build
	$(PY) -m rlkube.devcluster.demo

bench-operator: venv cluster-build
	$(PY) bench/operator_bench.py

bench-weights: venv
	$(PY) bench/weights_bench.py

bench-gpu:
	@echo "bench-gpu runs on the GPU machine through the device tool: see docs/benchmarks.md"
	bash bench/gpu/run.sh

clean:
	rm -rf .devcluster build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
