"""What a load's settings give up of plain decoding's exact output, said before anything loads.

A quantised KV cache, flash attention and llamafile kernels each change a token's logits a little, so greedy
output may part from plain decoding's where two tokens nearly tie; a setting that cannot be kept is refused.
"""

from __future__ import annotations

from .backend import width_independent_kernels
from .errors import EdgespecError, Setting, Wording
from .limits import KV_TYPES, SettingError, checked_kv_type


def exactness_notices(kv_type: str, draft_kv_type: str | None, flash_attn: bool, bit_exact: bool) -> list[str]:
    """What the KV cache choice and this llama.cpp build give up of plain decoding's exact output, a line
    each; EdgespecError for a choice that cannot be kept."""
    notices = [kv_cache_notice(kv_type, kv_type if draft_kv_type is None else draft_kv_type, flash_attn, bit_exact)]
    if not width_independent_kernels():
        notices.append("this llama.cpp build has llamafile kernels, so greedy output may differ from plain decoding "
                       "where two tokens nearly tie; rebuild llama-cpp-python with CMAKE_ARGS=-DGGML_LLAMAFILE=OFF "
                       "(make does)")
    return [line for line in notices if line]


def kv_cache_notice(kv_type: str, draft_kv_type: str, flash_attn: bool, bit_exact: bool) -> str | None:
    """What the KV cache choice trades away, in one line (None for the default f16 cache);
    EdgespecError for a choice that cannot be kept."""
    for name, value in (("kv_type", kv_type), ("draft_kv_type", draft_kv_type)):
        try:
            checked_kv_type(value)
        except SettingError:
            raise EdgespecError(Setting(name), f" must be one of {', '.join(KV_TYPES)}, not {value!r}") from None
    if flash_attn and bit_exact:
        raise EdgespecError(Setting("flash_attn", True), " and ", Setting("bit_exact", True), " cannot go together: "
                            "with flash attention a token's logits depend on how many tokens share its pass (drop one "
                            "of the two)")
    if flash_attn:
        return Wording("flash attention on: the KV cache types apply to keys and values, and verification is exact "
                       "in distribution but no longer bit for bit plain decoding's (", Setting("bit_exact", True),
                       " needs it off)")
    if {kv_type, draft_kv_type} != {"f16"}:
        return Wording("the KV cache types apply to the keys only: llama.cpp quantises values only with flash "
                       "attention, which stays off so verification can be bit-exact; ", Setting("flash_attn", True),
                       " quantises both, without ", Setting("bit_exact", True))
    return None
