# Two entry points: `make demo` and `make test`. Both build .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Some machines carry a CPU-only torch wheel in PIP_FIND_LINKS that torchvision's
# extension will not load against; install the matching pair from the index instead.
PIP := env -u PIP_FIND_LINKS $(BIN)/pip

.PHONY: demo test bench-tests lint venv clean

# The suite mostly waits (node processes, round timeouts), so it runs on two
# pytest-xdist workers per core (4 on 2 cores, at most 8); tests in one
# xdist_group (the timing-sensitive ones, and a file that shares one finished
# federation) stay on one worker, one after the other (docs/testing.md).
# `make test XDIST_ARGS=` runs serially; `XDIST_ARGS="-n 3 --dist loadgroup"` sets the count.
XDIST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); w=$$((2 * n)); [ $$w -gt 8 ] && w=8; echo $$w)
XDIST_ARGS ?= -n $(XDIST_WORKERS) --dist loadgroup
# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set: else every
# worker, benchmark subprocess and phase 2 compiles the sources and rewrites the
# tests' asserts again (about 10 CPU-seconds per pytest process).
PYTEST := PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -p no:cacheprovider
# Phase 2 collects only the files that mark a test `exclusive` (collecting the
# whole suite again cost it 7 s of its 77): the files that spell
# `pytest.mark.exclusive`, which tests/conftest.py checks every exclusive test's
# file does. With PYTEST_ARGS, phase 2 collects what they name, as phase 1 does.
EXCLUSIVE_FILES := $(shell grep -l 'pytest.mark.exclusive' tests/test_*.py)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev,ray]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: $(STAMP)
	sh scripts/ensure-chromium.sh
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@# Phase 1, in parallel: everything but the load tests. Phase 2, alone on an
	@# otherwise idle machine: the tests marked `exclusive`, whose bounds are
	@# absolute latencies (a flooded node's /healthz p99 < 100 ms) that other
	@# workers' load would make flaky. Both run; exit 5 = nothing selected.
	status=0; \
	$(PYTEST) -m "not bench and not exclusive" $(XDIST_ARGS) --durations=25 $(PYTEST_ARGS) || status=$$?; \
	$(PYTEST) -m "exclusive and not bench" --durations=5 $(if $(PYTEST_ARGS),$(PYTEST_ARGS),$(EXCLUSIVE_FILES)) || { rc=$$?; [ $$rc -eq 5 ] || status=$$rc; }; \
	exit $$status

# The long load tests (120-round soak, 30 s flood), one at a time: run them
# before a release and after any change to the transport, spool or journal.
bench-tests: $(STAMP)
	$(PYTEST) -m bench --durations=0 $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/python -m bench.demo

clean:
	rm -rf $(VENV) build *.egg-info
