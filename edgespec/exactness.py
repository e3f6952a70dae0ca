"""What a load's settings give up of plain decoding's exact output, said before anything loads.

A quantised KV cache, flash attention and llamafile kernels each change a token's logits a little, so greedy
output may part from plain decoding's where two tokens nearly tie; a setting that cannot be kept is refused.
"""

from __future__ import annotations

from .backend import width_independent_kernels
from .errors import BadValueError, EdgespecError, Setting, Wording
from .limits import FLASH_ATTN_CHOICES, KV_TYPES, SettingError, checked_flash_attn, checked_kv_type, flash_attention_on


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
            raise BadValueError(Setting(name), f" must be one of {', '.join(KV_TYPES)}, not {value!r}") from None
    try:
        choice = checked_flash_attn(flash_attn)
    except SettingError:
        raise BadValueError(Setting("flash_attn"), f" must be one of {', '.join(FLASH_ATTN_CHOICES)}, "
                            f"not {flash_attn!r}") from None
    if choice == "on" and bit_exact:
        raise EdgespecError(Setting("flash_attn", "on"), " and ", Setting("bit_exact", True), " cannot go together: "
                            "with flash attention a token's logits depend on how many tokens share its pass (drop one "
                            "of the two)")
    quantised = {kv_type, draft_kv_type} != {"f16"}
    if flash_attention_on(choice, bit_exact) and quantised:
        return Wording("flash attention is on, so the KV cache types apply to keys and values")
    if quantised:
        kept_off_by = Setting("bit_exact", True) if choice == "auto" else Setting("flash_attn", "off")
        return Wording("the KV cache types apply to the keys only: llama.cpp quantises values only with flash "
                       "attention, which ", kept_off_by, " keeps off")
    return None
