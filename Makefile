# Three entry points, each idempotent and fast on a second call:
#   make run    set up .venv and train mnist1d-cnn with 8 Hogwild processes
#   make check  set up .venv, lint (ruff) and run the fast tier: every test that starts
#               no process and opens no socket (tests/tiers.py); run it after each edit
#   make test   set up .venv, lint (ruff) and run the whole test suite (what CI runs)
# On a machine without an NVIDIA GPU the CPU build of torch is installed
# (a plain `pip install torch` would pull a multi-GB CUDA build).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.asyncsgd-installed
TORCH_CPU ?= torch==2.13.0

.PHONY: setup run lint check test bench clean

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q "$(TORCH_CPU)"; fi
	$(BIN)/python -m pip install -q -e '.[dev,ray,loggers]'
# What a first command would otherwise pay in its start-up (experiments/README.md,
# "Start-up and exit"): the project's bytecode (pip compiles no editable install's, and
# PYTHONDONTWRITEBYTECODE keeps a run from saving it) and MNIST-1D (1.2 s to generate).
	$(BIN)/python -m compileall -q asyncsgd workers servers
	$(BIN)/python -c "from asyncsgd.core.data import mnist1d; mnist1d()"
	touch $(STAMP)

run: setup
	$(BIN)/asyncsgd hogwild --task mnist1d-cnn --procs 8 --epochs 60

lint: setup
	$(BIN)/ruff check .

check: lint
	$(BIN)/python -m pytest -q -m "not processes"

# Two test files at a time (pytest-xdist; a file's tests stay in order on one worker, so its
# module fixtures run once): most tests wait on process start-up and the clock. Tests marked
# solo time themselves or load the machine on purpose: they run alone, after the others. On
# 2 cores: 15.5 min two at a time plus 4.5 min solo, against 28 min all one at a time.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not solo"; first=$$?; \
	$(BIN)/python -m pytest -q -m solo; test $$first -eq 0 -a $$? -eq 0

bench: setup
	$(BIN)/python experiments/hogwild_scaling.py

clean:  # runs/ itself stays: Slurm's jobs write their output into it (runs/.gitignore)
	rm -rf $(VENV) .pytest_cache
	find runs -mindepth 1 -maxdepth 1 ! -name .gitignore -exec rm -rf {} +
