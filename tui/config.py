"""The chat app's settings: built-in defaults < config.toml < command-line flags.

config.toml lives in platformdirs.user_config_dir("edgespec") (or in
$EDGESPEC_CONFIG_DIR).  Every key is optional:

    model = "smollm2-135m-instruct"   # catalog name or path to a .gguf
    draft = "auto"                    # path, catalog name, "ngram", "none" or "auto"
    draft_tokens = "auto"             # tokens drafted per step, or "auto"
    n_ctx = 4096
    gpu_layers = -1                   # these three default to the memory plan
    draft_gpu_layers = -1
    memory_budget = "6GiB"
    system_prompt = "You are a concise assistant."
    draft_tint = "#24513a"            # background of characters the draft guessed

    [sampling]
    temperature = 0.7
    top_p = 0.95
    top_k = 40
    min_p = 0.05
    max_tokens = 1024

    [keymap]                          # action = "key[,key...]", see KEY_ACTIONS
    regenerate = "ctrl+r"
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs
from rich.color import Color, ColorParseError
from textual.keys import REPLACED_KEYS, Keys, key_to_character

from edgespec.errors import EdgespecError
from edgespec.files import atomic_write
from edgespec.limits import RANGES, SettingError, checked_setting
from edgespec.units import InvalidSizeError, parse_size
from edgespec.sampling import SamplingParams

CONFIG_FILE = "config.toml"

# Action name -> (default keys, description).  The app binds each one with
# id "edgespec.<action>", so the keymap can rebind any of them.
KEY_ACTIONS: dict[str, tuple[str, str]] = {
    "cancel": ("escape", "Stop"),
    "regenerate": ("ctrl+r", "Regenerate"),
    "new_chat": ("ctrl+n", "New chat"),
    "copy_reply": ("ctrl+l", "Copy reply"),
    "cycle_mode": ("ctrl+g", "Drafting mode"),
    "toggle_marks": ("ctrl+t", "Draft marks"),
    "history": ("ctrl+o", "History"),
    "settings": ("ctrl+s", "Settings"),
    "model_info": ("f2", "Model info"),
    "help": ("f1", "Help"),
}


class ConfigError(EdgespecError):
    """config.toml cannot be read or holds a value the app cannot use."""


@dataclass(frozen=True)
class ChatConfig:
    model: str | None = None  # None: the catalog's default model
    draft: str = "auto"
    draft_tokens: int | str = "auto"
    n_ctx: int = 4096
    gpu_layers: int | None = None
    draft_gpu_layers: int | None = None
    memory_budget: str | None = None
    system_prompt: str = ""
    draft_tint: str = "#24513a"
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    max_tokens: int = 1024
    keymap: dict[str, str] = field(default_factory=dict)

    def with_overrides(self, **values) -> ChatConfig:
        """Replace the fields given a value other than None (as command-line flags do)."""
        return dataclasses.replace(self, **{k: v for k, v in values.items() if v is not None})

    def sampling(self) -> SamplingParams:
        try:
            return self._sampling_params()
        except ValueError as error:
            raise ConfigError(f"bad sampling setting in {config_path()} or the flags: {error}") from None

    def _sampling_params(self) -> SamplingParams:
        """The sampling settings; ValueError (from SamplingParams, which checks them) if one is bad."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, max_tokens=self.max_tokens)


_TOP_LEVEL = ("model", "draft", "draft_tokens", "n_ctx", "gpu_layers", "draft_gpu_layers", "memory_budget",
              "system_prompt", "draft_tint")
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "max_tokens")
_STRINGS = ("model", "draft", "memory_budget", "system_prompt", "draft_tint")
_INTEGERS = ("top_k", "max_tokens")  # n_ctx, the layer counts and draft_tokens: edgespec.limits.RANGES
_NUMBERS = ("temperature", "top_p", "min_p")


def config_dir() -> Path:
    return Path(os.environ.get("EDGESPEC_CONFIG_DIR") or platformdirs.user_config_dir("edgespec"))


def config_path() -> Path:
    return config_dir() / CONFIG_FILE


def load_config(path: Path | None = None) -> ChatConfig:
    """Read config.toml; a missing file means the defaults."""
    path = path or config_path()
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError:
        return ChatConfig()
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}; fix or delete the file") from None
    return _parse(data, path)


def _parse(data: dict, path: Path) -> ChatConfig:
    values: dict = {}
    for key, value in data.items():
        if key in ("sampling", "keymap") and not isinstance(value, dict):
            raise ConfigError(f"{path}: {key} must be a table: a [{key}] section")
        if key == "sampling":
            for name, sampling_value in value.items():
                _check_key(name, _SAMPLING, path, "[sampling] ")
                values[name] = sampling_value
        elif key == "keymap":
            for action, keys in value.items():
                _check_key(action, tuple(KEY_ACTIONS), path, "[keymap] ")
                _check_keys(action, keys, path)
            values["keymap"] = dict(value)
        else:
            _check_key(key, _TOP_LEVEL, path, "")
            values[key] = value
    for name, value in values.items():
        if name != "keymap":
            values[name] = _checked(name, value, path)
    config = ChatConfig(**values)
    try:
        config._sampling_params()
    except ValueError as error:
        raise ConfigError(f"{path}: [sampling] {error}") from None
    return config


def _checked(name: str, value, path: Path):
    if name in RANGES:
        try:
            return checked_setting(name, value)
        except SettingError as error:
            raise ConfigError(f"{path}: {error}") from None
    if name in _STRINGS and isinstance(value, str):
        _check_string(name, value, path)
        return value
    if name in _INTEGERS and isinstance(value, int) and not isinstance(value, bool):
        return value
    if name in _NUMBERS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    kind = "a string" if name in _STRINGS else "a whole number" if name in _INTEGERS else "a number"
    raise ConfigError(f"{path}: {name} must be {kind}, not {value!r}")


def _check_string(name: str, value: str, path: Path) -> None:
    if name == "draft_tint":
        try:
            Color.parse(value)
        except ColorParseError:
            raise ConfigError(f'{path}: draft_tint must be a colour like "#24513a" or "dark_green", '
                              f"not {value!r}") from None
    elif name == "memory_budget":
        try:
            parse_size(value)
        except InvalidSizeError as error:
            raise ConfigError(f"{path}: memory_budget: {error}") from None


# Key names Textual binds besides single characters and character names ("comma").
_KEY_NAMES = {key.value for key in Keys if "+" not in key.value and not key.value.startswith("<")} | set(REPLACED_KEYS)
_MODIFIERS = {"ctrl", "shift", "alt", "meta", "super", "hyper"}


def _check_keys(action: str, keys, path: Path) -> None:
    """keys is "key[,key...]" in Textual's names; else a ConfigError naming the action and the key."""
    if not isinstance(keys, str) or not keys.strip():
        raise ConfigError(f'{path}: [keymap] {action} must be a string like "ctrl+r", not {keys!r}')
    for key in keys.split(","):
        *modifiers, name = key.strip().split("+")
        known_name = name in _KEY_NAMES or (len(name) == 1 and name.isprintable()) or key_to_character(name)
        if not (known_name and all(modifier in _MODIFIERS for modifier in modifiers)):
            raise ConfigError(
                f'{path}: [keymap] {action}: {key.strip()!r} is not a key; write keys like "ctrl+r", "f5", '
                f'"escape" or "ctrl+comma", several separated by commas')


def _check_key(key: str, known: tuple[str, ...], path: Path, section: str) -> None:
    if key not in known:
        raise ConfigError(f"{path}: unknown setting {section}{key}; known ones are {', '.join(known)}")


def save_defaults(config: ChatConfig, path: Path | None = None) -> Path:
    """Write config as config.toml, so the next start uses these settings."""
    path = path or config_path()
    lines = []
    for name in _TOP_LEVEL:
        value = getattr(config, name)
        if value is not None:
            lines.append(f"{name} = {_toml_value(value)}")
    lines += ["", "[sampling]"]
    lines += [f"{name} = {_toml_value(getattr(config, name))}" for name in _SAMPLING]
    if config.keymap:
        lines += ["", "[keymap]"]
        lines += [f"{action} = {_toml_value(keys)}" for action, keys in sorted(config.keymap.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, "\n".join(lines) + "\n")


def _toml_value(value) -> str:
    if isinstance(value, str):
        escaped = "".join(
            f"\\u{ord(char):04x}" if ord(char) < 0x20 or ord(char) == 0x7F or char in '"\\' else char
            for char in value
        )
        return f'"{escaped}"'
    return repr(value)
