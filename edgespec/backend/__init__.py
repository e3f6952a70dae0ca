"""The only package that talks to llama-cpp-python.

runtime.py starts llama.cpp and reads its build; model.py is a loaded model
(KV cache, forward passes, logits) over the low-level C API; kvcache.py edits
a KV cache in place (the context shift); state.py is a KV cache as bytes and back
(the prompt cache's snapshots); tokenizer.py is text <-> token ids.
"""

from .kvcache import common_prefix_length, dropped_span
from .model import LlamaModel
from .state import load_state, state_buffer, state_bytes
from .runtime import RUNTIME, default_threads, supports_gpu_offload, width_independent_kernels

__all__ = [
    "LlamaModel", "RUNTIME", "common_prefix_length", "dropped_span", "load_state", "state_buffer", "state_bytes",
    "default_threads", "supports_gpu_offload", "width_independent_kernels",
]
