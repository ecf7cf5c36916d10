# Two commands do all set-up on a fresh machine:
#   make demo   a short hybrid-parallel run with telemetry: embedded collector and dashboard, URL printed
#   make test   the whole test suite
# Both create .venv when it is missing. torch is pinned to 2.13.0 first: on this kind of
# machine that resolves to a local CPU wheel; an unpinned torch would pull a CUDA build.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
RUN_DIR ?= runs/demo

.PHONY: venv system-deps demo test test-quick test-browser lint screenshots bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev,hf,lightning]'
	touch $(STAMP)

# dp2 x pp2 x tp2 on 8 CPU ranks would crawl on 2 cores: the demo uses dp2 x tp2 (4 ranks)
# on 2 simulated nodes, with a data spike and a straggler it can show being detected and healed. The
# straggler is 8x: on 2 nodes the policy's cost model takes a node out only when the other doing both
# halves of every step beats waiting for it, and moves micro-batches off its replica in place (rebalance) when
# that is cheaper still: which one follows the costs measured on the host
demo: venv
	rm -rf $(RUN_DIR)
	$(VENV)/bin/trainer --telemetry --keep-collector --run-id demo --run-dir $(RUN_DIR) \
	  --dp 2 --tp 2 --nodes 2 --layers 4 --d-model 128 --heads 4 --seq-len 128 \
	  --micro-batch-size 4 --micro-batches 2 --steps 120 --precision bf16 --eval-every 20 \
	  --ckpt-dir $(RUN_DIR)/ckpt --ckpt-every 10 --metrics-jsonl $(RUN_DIR)/metrics.jsonl \
	  --inject spike@step=70 --inject straggler@rank=3,from=40,factor=8

# Debian's prometheus, prometheus-alertmanager, docker-compose, chromium and chromium-driver, when missing and this
# user may install them (root or passwordless sudo); otherwise their tests skip, saying why
system-deps:
	@.ci/system-deps

# Two passes. The quick tests (pure logic, a collector on loopback: nothing that measures
# time on a loaded host) run on $(JOBS) workers at once; the slow ones (real multi-rank runs,
# whose detection reads step times) one at a time, as a shared CI machine allows.
# --durations: the slowest tests, in every CI log (the suite's time is a budget: README)
# PYTEST: pytest with bytecode writes on, whatever the shell says (PYTHONDONTWRITEBYTECODE=1 in some
# sandboxes): it caches its assertion-rewritten test modules as .pyc, or every pytest process
# (each worker, each pass) rewrites and compiles them all again (~5 s of collection's 14 s)
JOBS ?= 2
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest

# the test suite's own extras beyond the venv's: pyspark (450 MB, for the fleet queries on Spark; not for the demo)
FLEET_STAMP := $(VENV)/.installed-fleet
$(FLEET_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,hf,lightning,fleet]'
	touch $(FLEET_STAMP)

test: venv $(FLEET_STAMP) system-deps
	$(PYTEST) -q -m "not slow" -n $(JOBS) --dist loadfile --durations=10
	$(PYTEST) -q -m slow --durations=25

test-quick: venv
	$(PYTEST) -q -m "not slow" -n $(JOBS) --dist loadfile

# The gates alone (make test runs them too, in tests/unit/test_gates.py): ruff, and DESIGN.md's import direction
lint: venv
	$(VENV)/bin/ruff check .
	$(PY) -m tests.import_rules

# The dashboard in headless Chromium (Debian's chromium and chromium-driver: .ci/run installs
# them; without them these tests skip, or fail in CI). Also part of `make test`.
test-browser: venv system-deps
	$(PYTEST) -q -m browser tests/browser

# docs/screenshots/<page>.png of the demo run (after `make demo`, once its collector stopped)
screenshots: venv
	$(PY) -m tests.browser.screenshots --db $(RUN_DIR)/telemetry.duckdb --run demo --out docs/screenshots

bench: venv
	$(PY) -m pip install -q -e '.[dev,hf,lightning,bench,fleet]'
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
