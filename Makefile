# minipar: make test | make demo | make bench | make figures | make lint | make lessons | make portability | make multinode | make course-selftest | make mutants | make kill-campaign | make trace-viewer
# Every target builds .venv first if needed, and reinstalls only when pyproject.toml changed.

SHELL := /bin/bash
VENV := .venv
PYTHON := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
INSTALLED := $(VENV)/.installed-from-pyproject
RANKS := 2 4 8
# mpiexec kills a whole launch that runs past this many seconds, so a hang cannot stall CI.
export MPIEXEC_TIMEOUT ?= 400
# One BLAS thread per process: every rank stands for one device, and ranks sharing a few cores with
# their own thread pools would only fight over them (about 3x slower steps on 2 cores).
export OPENBLAS_NUM_THREADS ?= 1
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
# Python may cache compiled modules (and pytest its rewritten test modules) in __pycache__: where the
# environment forbids it, every process of every launch compiles minipar and the 84 test files again
# (8 ranks collecting the tests: 64 s of wall time without the cache, 16 s with it, on 2 loaded cores).
unexport PYTHONDONTWRITEBYTECODE
# A rank waiting in MPI sleeps between polls instead of yielding in a loop: with 8 ranks on 2 cores the
# spinning ranks took the processor from the working ones (MPICH's CVAR; half the system time, and the
# multi-rank tests about 20% faster, measured on tests/parallel/test_zero.py at 4 and 8 ranks).
export MPIR_CVAR_ENABLE_HEAVY_YIELD ?= 1
START := $(shell date +%s)
say = echo "[make] $(1): $$(( $$(date +%s) - $(2) )) s"

.PHONY: test demo bench figures lint lessons portability setup multinode course-selftest mutants kill-campaign trace-viewer

setup: $(INSTALLED)

$(PYTHON):
	python3 -m venv $(VENV)

$(INSTALLED): pyproject.toml | $(PYTHON)
	$(PYTHON) -m pip install -e ".[mpich,dev,viz]"
	touch $@

# The serial tests in SERIAL_WORKERS pytest-xdist workers, a test file to a worker (its module
# fixtures built once): most serial tests keep one core busy, so on 2 cores two workers took the phase
# from 269 s to 164 s. The lessons stay in one process: their blocks launch multi-rank jobs that fill
# both cores already (two workers: 146 s and 155 s), and a lesson's blocks share one namespace.
SERIAL_WORKERS ?= 2

# lint first: a broken layer rule or type error fails in seconds, before minutes of tests.
test: lint
	@t=$$(date +%s); $(PYTHON) -m pytest -m "not mpi" -q -n $(SERIAL_WORKERS) --dist loadfile; s=$$?; \
	  $(call say,serial tests,$$t); exit $$s
	@$(MAKE) --no-print-directory lessons
	@for k in $(RANKS); do \
	  t=$$(date +%s); $(MPIEXEC) -n $$k $(PYTHON) -m pytest -m mpi -q; s=$$?; \
	  $(call say,multi-rank tests on $$k ranks,$$t); [ $$s -eq 0 ] || exit $$s; \
	done
	@$(call say,make test in all,$(START))

# The lessons alone: every python block of lessons/*.md runs, and the output it prints is checked.
lessons: $(INSTALLED)
	@t=$$(date +%s); $(PYTHON) -m pytest -q lessons/; s=$$?; \
	  $(call say,lessons,$$t); exit $$s

# The lessons and the serial tests again under every OpenBLAS matrix kernel this CPU can run and with
# NumPy's SIMD levels turned off one by one (tests/portability.py): a figure a lesson checks must not
# depend on the CPU. Not part of make test (5 configurations on an AVX2 machine, about 20 minutes).
portability: $(INSTALLED)
	@t=$$(date +%s); $(PYTHON) tests/portability.py $(if $(PHASES),--phases $(PHASES)); s=$$?; \
	  $(call say,portability,$$t); exit $$s

# The main job: the default GPT on 8 ranks, 2 data-parallel replicas of a 2-stage pipeline whose
# stages are split over 2 tensor-parallel ranks, ZeRO-1 on top; checked against one process.
demo: $(INSTALLED)
	$(MPIEXEC) -n 8 $(PYTHON) -m minipar train --dp 2 --pp 2 --tp 2 --zero 1 --microbatches 4 --steps 100 --precision fp64 \
	  --check-reference

# The 3D job on 2 simulated nodes (network namespaces, root only), TCP between them: the link split, the
# kernel's byte counters against the ledger, tp across nodes, a fault on node 2 (tests/multinode/).
multinode: $(INSTALLED)
	cd tests/multinode && NODES=$(or $(NODES),2) ../../$(PYTHON) cluster.py

# Every exercise of the coursework (lessons/course.md): in a fresh workspace its checks fail on the stub
# and pass once the reference's files are copied back, and every known-wrong solution of the bank
# (minipar_lab/course/bank.py) is graded FAIL at its check (minipar_lab/course/selftest.py; most of an hour).
course-selftest: $(INSTALLED)
	@t=$$(date +%s); $(PYTHON) -m minipar_lab.course.selftest; s=$$?; $(call say,course selftest,$$t); exit $$s

# How many plausible bugs the tests catch: each mutant of tests/mutant_catalogue.py applied in a scratch
# copy (the tree is never patched), the touched package's tests run with a timeout (tests/mutants.py).
# Not part of make test. ONLY=text runs the mutants whose name contains it.
mutants: $(INSTALLED)
	@t=$$(date +%s); $(PYTHON) tests/mutants.py $(if $(ONLY),--only $(ONLY)); s=$$?; \
	  $(call say,mutants,$$t); exit $$s

# SIGKILL a rank of a --save-every 1 --save-async job at random times; each kill's newest manifest must
# validate and resume to the uninterrupted run bit for bit (tests/kill_campaign.py). Not part of make
# test (10-20 minutes on 2 loaded cores). KILLS=n for fewer.
kill-campaign: $(INSTALLED)
	@t=$$(date +%s); $(PYTHON) tests/kill_campaign.py $(if $(KILLS),--kills $(KILLS)); s=$$?; \
	  $(call say,kill campaign,$$t); exit $$s

# A trace of make demo's layout (2 steps, 8 ranks) opened in a real viewer, offline: speedscope (npm; its
# package ships the built web app) in Debian's headless Chromium must import it without a warning about
# nesting; the screenshot is lesson 07's lessons/figures/07_trace_speedscope.png (tests/trace_viewer.py).
# Installs both on first use (speedscope into build/viewer, chromium by apt-get as root); never make test.
VIEWER_DIR := build/viewer
SPEEDSCOPE := speedscope@1.25.0
trace-viewer: $(INSTALLED)
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y chromium; } || \
	  { echo "make trace-viewer: needs Debian's chromium: apt-get install -y chromium (as root)"; exit 2; }
	@[ -f $(VIEWER_DIR)/node_modules/speedscope/package.json ] || \
	  npm install --no-audit --no-fund --prefix $(VIEWER_DIR) $(SPEEDSCOPE)
	@t=$$(date +%s); $(PYTHON) tests/trace_viewer.py; s=$$?; $(call say,trace viewer,$$t); exit $$s

bench: $(INSTALLED)
	$(PYTHON) -m minipar bench all

# Every picture the lessons embed, redrawn from short fresh runs (minipar_lab/plot; under a minute), but
# lesson 07's screenshot of a trace in a viewer: make trace-viewer takes it.
figures: $(INSTALLED)
	@t=$$(date +%s); $(PYTHON) -m minipar plot all --out lessons/figures; s=$$?; \
	  $(call say,figures,$$t); exit $$s

# ruff (style), lint-imports (imports point down the layers, no cycles inside one: [tool.importlinter]) and
# mypy (core, speed, distributed, parallel: [tool.mypy]). All three run even when one fails, so one pass shows everything.
lint: $(INSTALLED)
	@t=$$(date +%s); s=0; \
	  $(VENV)/bin/ruff check minipar tests lessons || s=1; \
	  $(VENV)/bin/lint-imports --no-logo || s=1; \
	  $(VENV)/bin/mypy || s=1; \
	  $(call say,lint,$$t); exit $$s
