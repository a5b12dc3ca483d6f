# Two entry points for users: `make demo` and `make test`. Each creates .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-stamp
DEMO_OUT ?= demo-out

.PHONY: demo test venv bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test,oracle]' \
	  || $(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test,oracle]'  # one retry: registries hiccup
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/stratatools demo $(DEMO_OUT) --force

test: $(STAMP)
	$(BIN)/python -m pytest

# Benchmarks print ratios against a baseline measured in the same run; the big ones generate GB-sized
# inputs in a temp folder (see each script's --help). GPU benchmarks need CuPy and a GPU.
bench: $(STAMP)
	$(BIN)/python bench/bench_alloc.py
	$(BIN)/python bench/bench_cachesim.py
	$(BIN)/python bench/bench_tune.py
	$(BIN)/python bench/bench_trace.py
	$(BIN)/python bench/bench_pack.py
	$(BIN)/python bench/bench_runtime.py

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache
