# hyflow — the two set-up commands of the README.
#   make demo : venv + install + the CPU quickstart
#   make test : venv + install + the whole test suite (what CI runs)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=

.PHONY: venv test test-fast lint demo clean

venv: $(STAMP)

# torch goes in FIRST and pinned: a bare `torch` requirement would pull several GB of CUDA wheels.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$(TORCH_VERSION)') else 1)" 2>/dev/null \
		|| $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[test]"
	touch $(STAMP)

test: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check . || true

demo: venv
	@if [ -f examples/quickstart/run.py ]; then $(PY) examples/quickstart/run.py; \
	else echo "make demo: the quickstart arrives with the trainer (issue 4); the venv is ready in $(VENV)."; fi

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
