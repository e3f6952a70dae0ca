# Both entry points build what they need on a fresh machine: the virtualenv,
# the packages and the models.
#
# llama-cpp-python is compiled from source with llamafile's tinyBLAS kernels
# off: with them, a token's logits depend on how many tokens share its forward
# pass, and speculative decoding would no longer reproduce plain decoding bit
# for bit.  The wheel is kept in a per-user wheelhouse keyed by the CMake flags,
# so the ~10-minute compile happens once per machine, not once per clone.
# On x86 the AMX kernels are compiled out: they segfault on some Xeons, and
# without them llama.cpp's other repacked CPU kernels can stay on.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
LLAMA_CPP_VERSION := 0.3.36
NO_AMX := $(if $(filter x86_64 amd64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
LLAMA_CMAKE_ARGS := -DGGML_LLAMAFILE=OFF $(if $(NO_AMX),"-DCMAKE_C_FLAGS=$(NO_AMX)" "-DCMAKE_CXX_FLAGS=$(NO_AMX)") $(CMAKE_ARGS)
WHEELHOUSE := $(HOME)/.cache/edgespec/wheels/$(shell echo "$(LLAMA_CPP_VERSION) $(LLAMA_CMAKE_ARGS)" | md5sum | cut -c1-12)

.PHONY: chat test

chat: $(INSTALLED)
	$(BIN)/edgespec models pull qwen2.5-coder-1.5b-instruct
	$(BIN)/edgespec chat

test: $(INSTALLED)
	$(BIN)/edgespec models pull smollm2-135m-instruct --quiet
	$(BIN)/python -m pytest -q

$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	ls $(WHEELHOUSE)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS='$(LLAMA_CMAKE_ARGS)' $(BIN)/python -m pip wheel --no-cache-dir --no-deps \
		llama-cpp-python==$(LLAMA_CPP_VERSION) --wheel-dir $(WHEELHOUSE)
	$(BIN)/python -m pip install --quiet --force-reinstall --no-deps $(WHEELHOUSE)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $@
