# diprl: every target works on a fresh 2-core CPU machine with only the package registries.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-cpu

# Offline, loopback-only defaults for everything run through make (tests, benchmarks, the arena).
export HF_HUB_OFFLINE := 1
export WANDB_MODE := offline
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1
export VLLM_ENABLE_V1_MULTIPROCESSING := 0
export VLLM_CPU_KVCACHE_SPACE := 1
export DS_BUILD_OPS := 0
export DS_ACCELERATOR := cpu
export DIPRL_CACHE_DIR ?= $(CURDIR)/.cache
export TMPDIR := $(DIPRL_CACHE_DIR)/tmp
export TORCH_EXTENSIONS_DIR := $(DIPRL_CACHE_DIR)/torch_extensions
export TORCHINDUCTOR_CACHE_DIR := $(DIPRL_CACHE_DIR)/inductor
# Ray workers import this checkout (not whichever one the venv was installed from).
export PYTHONPATH := $(CURDIR)

ARENA_ARGS ?= --hero dumbbot --opponents random --games 70 --max-year 1935

.PHONY: install system-packages run train arena ladder test lint format bench docs clean

install: system-packages $(STAMP)

# Debian packages some tests need: strace, iproute2 and util-linux for the loopback-only network audit
# (diprl.netaudit); chromium and chromium-driver for the web app's browser tests (tests/web); openssh-server
# and rsync for `ray up` over real SSH (tests/test_ray_up.py); prometheus for the cluster's metrics
# (tests/test_prometheus.py); libtcmalloc-minimal4, the allocator the CPU engine core is started with
# (inference.preload_tcmalloc, docs/benchmarks.md). Installed when missing and this is root with apt-get;
# otherwise named.
SYSTEM_TOOLS := strace ip unshare chromium chromedriver sshd ssh-keygen rsync prometheus
SYSTEM_PACKAGES := strace iproute2 util-linux chromium chromium-driver openssh-server openssh-client rsync prometheus libtcmalloc-minimal4
system-packages:
	@mkdir -p $(TMPDIR)  # exported above: package scripts (openssh-server's postinst) mktemp in it
	@missing=""; for tool in $(SYSTEM_TOOLS); do command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; done; \
	ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || missing="$$missing libtcmalloc"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES); \
	  else echo "note: the tests need$$missing: install the Debian packages $(SYSTEM_PACKAGES) as root" >&2; fi; \
	fi

# The CPU stack in one venv. torch is pinned to the +cpu build (a free resolver pulls GBs of CUDA
# wheels); torchvision & co. are removed because the PyPI builds need CUDA and break `import vllm`.
$(STAMP): requirements/cpu.txt requirements/dev.txt requirements/constraints-cpu.txt pyproject.toml
	@mkdir -p $(TMPDIR)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c requirements/constraints-cpu.txt -r requirements/cpu.txt
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(BIN)/pip install -q --no-deps -e .
	touch $@

run: install train

# The main job: league RL of the tiny Qwen3 on a local Ray cluster (about 10 minutes here).
TRAIN_ARGS ?= +experiment=pfsp
PYTEST_ARGS ?= -q
# The suite runs on two pytest-xdist workers, a test file to a worker (tests/conftest.py groups them); the
# whole-system runs start first. TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
train: install
	@mkdir -p $(TMPDIR)
	$(BIN)/python -m diprl.train $(TRAIN_ARGS)

arena: install
	@mkdir -p $(TMPDIR)
	$(BIN)/python -m diprl.arena $(ARENA_ARGS)

ladder: install
	@mkdir -p $(TMPDIR)
	$(BIN)/python -m diprl.eval.ladder --games 70

test: install
	@mkdir -p $(TMPDIR)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check diprl tests
	$(BIN)/ruff format --check diprl tests
	$(BIN)/mypy

format: install
	$(BIN)/ruff check --fix diprl tests
	$(BIN)/ruff format diprl tests

bench: install
	@mkdir -p $(TMPDIR)
	$(BIN)/python -m diprl.bench engine

# The docs site (mkdocs.yml, docs/) on loopback only, rebuilt as pages change; tests/test_docs.py builds it --strict.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve -a 127.0.0.1:8001

clean:
	rm -rf $(VENV) $(DIPRL_CACHE_DIR) .pytest_cache .mypy_cache .ruff_cache
