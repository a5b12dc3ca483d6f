# Two entry points for users: `make demo` and `make test`. Each creates .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-stamp
DEMO_OUT ?= demo-out

.PHONY: demo test venv bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test,oracle]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/stratatools demo $(DEMO_OUT) --force

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache
