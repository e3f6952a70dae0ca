"""The only package that talks to llama-cpp-python.

runtime.py starts llama.cpp and reads its build; model.py is a loaded model
(KV cache, forward passes, logits) over the low-level C API; tokenizer.py is
text <-> token ids; peer.py is llama-cpp-python's own prompt lookup, for the
benchmark.
"""

from .model import LlamaModel, common_prefix_length
from .peer import PEER_WORKAROUND, PeerResult, PromptLookupPeer
from .runtime import RUNTIME, default_threads, supports_gpu_offload, width_independent_kernels

__all__ = [
    "LlamaModel", "PEER_WORKAROUND", "PeerResult", "PromptLookupPeer", "RUNTIME", "common_prefix_length",
    "default_threads", "supports_gpu_offload", "width_independent_kernels",
]
