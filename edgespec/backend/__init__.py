"""The only package that talks to llama-cpp-python, split by llama.cpp's own objects.

runtime.py starts llama.cpp and reads its build; weights.py is a model's
weights and metadata (llama_model); vocabulary.py is text <-> token ids
(llama_vocab); context.py is a context over the weights: its sequences' KV
caches (rewind, share, shift, save and load as bytes), forward passes and
logits (llama_context); batch.py is the llama_batch it fills.  model.py's
LlamaModel loads the three together; probing.py measures its passes;
kvcache.py is the token arithmetic of reusing a cache.
"""

# runtime first: it loads llama.cpp's libraries, which must come before numpy's (see commands._run_command)
from .runtime import RUNTIME, default_threads, supports_gpu_offload, width_independent_kernels  # isort: skip
from .kvcache import common_prefix_length, dropped_span
from .model import LlamaModel
from .probing import plain_logits, probe_pass_widths, probe_tokens, time_forward, time_sequence_passes
from .state import state_buffer

__all__ = [
    "LlamaModel", "RUNTIME", "plain_logits", "probe_tokens", "common_prefix_length", "dropped_span", "probe_pass_widths", "time_forward",
    "time_sequence_passes",
    "state_buffer",
    "default_threads", "supports_gpu_offload", "width_independent_kernels",
]
