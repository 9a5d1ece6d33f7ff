# minipar: make test | make demo | make bench | make lint
# Every target builds .venv first if needed, and reinstalls only when pyproject.toml changed.

SHELL := /bin/bash
VENV := .venv
PYTHON := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
INSTALLED := $(VENV)/.installed-from-pyproject
RANKS := 2 4 8
# mpiexec kills a whole launch that runs past this many seconds, so a hang cannot stall CI.
export MPIEXEC_TIMEOUT ?= 400
START := $(shell date +%s)
say = echo "[make] $(1): $$(( $$(date +%s) - $(2) )) s"

.PHONY: test demo bench lint setup

setup: $(INSTALLED)

$(PYTHON):
	python3 -m venv $(VENV)

$(INSTALLED): pyproject.toml | $(PYTHON)
	$(PYTHON) -m pip install -e ".[mpich,dev]"
	touch $@

test: $(INSTALLED)
	@t=$$(date +%s); $(PYTHON) -m pytest -m "not mpi" -q; s=$$?; $(call say,serial tests,$$t); exit $$s
	@# exit 5 is pytest's "no tests collected": no lesson has a code block yet
	@t=$$(date +%s); $(PYTHON) -m pytest --markdown-docs -m markdown-docs -q lessons/; s=$$?; \
	  $(call say,lessons,$$t); [ $$s -eq 0 ] || [ $$s -eq 5 ]
	@for k in $(RANKS); do \
	  t=$$(date +%s); $(MPIEXEC) -n $$k $(PYTHON) -m pytest -m mpi -q; s=$$?; \
	  $(call say,multi-rank tests on $$k ranks,$$t); [ $$s -eq 0 ] || exit $$s; \
	done
	@$(call say,make test in all,$(START))

demo: $(INSTALLED)
	$(MPIEXEC) -n 2 $(PYTHON) -m minipar train

bench: $(INSTALLED)
	$(PYTHON) -m minipar bench all

lint: $(INSTALLED)
	$(VENV)/bin/ruff check minipar tests
