# Both entry points build what they need on a fresh machine: the virtualenv,
# the packages (llama-cpp-python compiles llama.cpp: ~10 minutes the first
# time, then pip's wheel cache makes it quick) and the models.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: chat test models

chat: $(INSTALLED)
	$(BIN)/edgespec models pull qwen2.5-coder-1.5b-instruct
	$(BIN)/edgespec chat

test: $(INSTALLED)
	$(BIN)/edgespec models pull smollm2-135m-instruct --quiet
	$(BIN)/python -m pytest -q

$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $@
