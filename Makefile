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
#
# The GPU backend is chosen by itself: CUDA when a CUDA toolkit is found (nvcc
# on PATH, or $(CUDA_HOME)/bin/nvcc, CUDA_HOME defaulting to /usr/local/cuda)
# and `nvidia-smi -L` lists a GPU (a toolkit in a build image without a GPU
# would cost a long CUDA compile for nothing), Metal on macOS (llama.cpp's
# default there), else the CPU.
# EDGESPEC_GPU=cpu|cuda|metal forces the choice; `make print-cmake-args`
# shows the flags and the wheelhouse they select without building anything.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
LLAMA_CPP_VERSION := 0.3.36
NO_AMX := $(if $(filter x86_64 amd64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
CUDA_HOME ?= /usr/local/cuda
NVCC := $(or $(shell command -v nvcc 2>/dev/null),$(wildcard $(CUDA_HOME)/bin/nvcc))
IS_MACOS := $(filter Darwin,$(shell uname -s))
HAS_NVIDIA_GPU = $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)
ifndef EDGESPEC_GPU
EDGESPEC_GPU := $(if $(and $(NVCC),$(HAS_NVIDIA_GPU)),cuda,$(if $(IS_MACOS),metal,cpu))
endif
ifeq ($(filter $(EDGESPEC_GPU),cpu cuda metal),)
$(error EDGESPEC_GPU must be cpu, cuda or metal, not '$(EDGESPEC_GPU)')
endif
ifeq ($(EDGESPEC_GPU),cuda)
ifeq ($(NVCC),)
$(error EDGESPEC_GPU=cuda but no nvcc was found: put the CUDA toolkit's bin folder on PATH or set CUDA_HOME)
endif
GPU_CMAKE_ARGS := -DGGML_CUDA=on -DCMAKE_CUDA_COMPILER=$(NVCC)
endif
ifeq ($(EDGESPEC_GPU),metal)
ifeq ($(IS_MACOS),)
$(error EDGESPEC_GPU=metal needs macOS; use cpu or cuda here)
endif
endif
# Metal is on by default on macOS, so only the CPU choice needs a flag there.
ifeq ($(EDGESPEC_GPU)$(IS_MACOS),cpuDarwin)
GPU_CMAKE_ARGS := -DGGML_METAL=off
endif

LLAMA_CMAKE_ARGS := -DGGML_LLAMAFILE=OFF $(if $(NO_AMX),"-DCMAKE_C_FLAGS=$(NO_AMX)" "-DCMAKE_CXX_FLAGS=$(NO_AMX)") $(CMAKE_ARGS)
# appended, not inserted: a CPU build keeps the flags, and so the wheelhouse, it always had
ifneq ($(GPU_CMAKE_ARGS),)
LLAMA_CMAKE_ARGS += $(GPU_CMAKE_ARGS)
endif
WHEELHOUSE := $(HOME)/.cache/edgespec/wheels/$(shell echo "$(LLAMA_CPP_VERSION) $(LLAMA_CMAKE_ARGS)" | md5sum | cut -c1-12)

.PHONY: chat test print-cmake-args

print-cmake-args:
	@echo 'EDGESPEC_GPU=$(EDGESPEC_GPU)'
	@echo 'CMAKE_ARGS=$(LLAMA_CMAKE_ARGS)'
	@echo 'WHEELHOUSE=$(WHEELHOUSE)'

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
