"""The chat app's settings: ChatConfig (config.toml and the flags) and ChatSettings (what a chat keeps).

ChatConfig's fields are the one list of the chat's settings: each one's
metadata says where it lives in config.toml (top level or [sampling]), what
kind of value it takes, whether an `edgespec chat` flag overrides it, and the
label it has on the settings screen if that screen edits it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from edgespec.limits import SettingError, checked_setting
from edgespec.sampling import SamplingParams


def _setting(default, kind: str, *, section: str = "", flag: bool = False, label: str | None = None):
    """A ChatConfig field; kind is "string", "integer", "number", "boolean" or "range" (see edgespec.limits.RANGES)."""
    return field(default=default, metadata={"kind": kind, "section": section, "flag": flag, "label": label})


@dataclass(frozen=True)
class ChatConfig:
    model: str | None = _setting(None, "string", flag=True)  # None: the catalog's default model
    draft: str = _setting("auto", "string", flag=True)
    draft_tokens: int | str = _setting("auto", "range", flag=True, label="Draft tokens")
    n_ctx: int = _setting(4096, "range", flag=True)
    gpu_layers: int | None = _setting(None, "range", flag=True)
    draft_gpu_layers: int | None = _setting(None, "range", flag=True)
    memory_budget: str | None = _setting(None, "string", flag=True)
    bit_exact: bool = _setting(False, "boolean", flag=True)  # --bit-exact: greedy output bit for bit plain decoding's
    prompt_cache: bool = _setting(True, "boolean", flag=True)  # --no-prompt-cache: reopened chats prefill their history
    prompt_cache_size: str | None = _setting(None, "string", flag=True)  # None: EDGESPEC_PROMPT_CACHE_SIZE, else 2GiB
    # the KV caches (--kv-type, --draft-kv-type, --flash-attn): they size the contexts, so like n_ctx
    # they take effect when models are loaded, not from the settings screen
    kv_type: str = _setting("f16", "string", flag=True)
    draft_kv_type: str | None = _setting(None, "string", flag=True)  # None: the kv_type
    flash_attn: str = _setting("auto", "string", flag=True)  # auto, on or off (edgespec.limits.FLASH_ATTN_CHOICES)
    system_prompt: str = _setting("", "string")
    draft_tint: str = _setting("#24513a", "string")
    temperature: float = _setting(0.7, "number", section="sampling", flag=True, label="Temperature")
    top_p: float = _setting(0.95, "number", section="sampling", flag=True, label="Top-p")
    top_k: int = _setting(40, "integer", section="sampling", flag=True, label="Top-k")
    min_p: float = _setting(0.05, "number", section="sampling", flag=True, label="Min-p")
    max_tokens: int = _setting(1024, "integer", section="sampling", flag=True, label="Max tokens")
    keymap: dict[str, str] = field(default_factory=dict, metadata={"section": "keymap"})

    def with_overrides(self, **values) -> ChatConfig:
        """Replace the fields given a value other than None (as command-line flags do)."""
        return dataclasses.replace(self, **{k: v for k, v in values.items() if v is not None})

    def sampling_params(self) -> SamplingParams:
        """The sampling settings; ValueError (from SamplingParams, which checks them) if one is bad."""
        return SamplingParams(**{name: getattr(self, name) for name in SAMPLING_SETTINGS})


def _names(**wanted) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(ChatConfig)
                 if all(f.metadata.get(key) == value for key, value in wanted.items()))


TOP_LEVEL_SETTINGS = _names(section="")  # config.toml's top-level keys
SAMPLING_SETTINGS = _names(section="sampling")  # config.toml's [sampling] keys
FLAG_SETTINGS = _names(flag=True)  # what `edgespec chat`'s flags override
# what the settings screen edits: the sampling settings first, then drafting
SCREEN_SETTINGS = tuple(f.name for f in sorted(
    (f for f in dataclasses.fields(ChatConfig) if f.metadata.get("label")), key=lambda f: f.metadata["section"] != "sampling"))
LABELS = {f.name: f.metadata["label"] for f in dataclasses.fields(ChatConfig) if f.metadata.get("label")}
KINDS = {f.name: f.metadata["kind"] for f in dataclasses.fields(ChatConfig) if "kind" in f.metadata}


@dataclass(frozen=True)
class ChatSettings:
    """What the settings screen edits; kept per chat in the history."""

    system_prompt: str
    sampling: SamplingParams  # with the chat's seed and stop strings
    draft_tokens: int | str  # or "auto"
    bit_exact: bool = False  # Engine.configure(bit_exact=...)

    def as_dict(self) -> dict:
        sampling = dataclasses.asdict(self.sampling)
        sampling["stop"] = list(sampling["stop"])
        return {"sampling": sampling, "draft_tokens": self.draft_tokens, "bit_exact": self.bit_exact}

    @classmethod
    def from_dict(cls, data: dict, system_prompt: str, fallback: ChatSettings) -> ChatSettings:
        """Settings saved with a chat; anything missing or invalid keeps the fallback's value."""
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        try:  # a hand edit's "stop": 5 or "sampling": [] keeps the fallback's sampling, as any invalid value does
            sampling = dict(data.get("sampling", {}))
            if "stop" in sampling:
                sampling["stop"] = tuple(sampling["stop"])
            params = dataclasses.replace(fallback.sampling, **{k: v for k, v in sampling.items() if k in known})
        except (TypeError, ValueError):
            params = fallback.sampling
        try:
            draft_tokens = checked_setting("draft_tokens", data.get("draft_tokens", fallback.draft_tokens))
        except SettingError:
            draft_tokens = fallback.draft_tokens
        bit_exact = data.get("bit_exact", fallback.bit_exact)
        return cls(system_prompt, params, draft_tokens, bit_exact if isinstance(bit_exact, bool) else fallback.bit_exact)

    def value(self, name: str):
        """The value of the ChatConfig setting `name` that these settings hold."""
        return self.draft_tokens if name == "draft_tokens" else getattr(self.sampling, name)

    def config_values(self) -> dict:
        """These settings as ChatConfig fields, to save them as the defaults (seed and stop strings stay per chat)."""
        return {"system_prompt": self.system_prompt, "bit_exact": self.bit_exact,
                **{name: self.value(name) for name in SCREEN_SETTINGS}}
