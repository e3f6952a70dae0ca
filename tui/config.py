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
    kv_type = "f16"                   # KV cache: f16, q8_0 or q4_0 (keys only without flash attention)
    draft_kv_type = "f16"             # the draft's; default: kv_type
    flash_attn = "auto"               # on unless bit_exact; "on" (not with bit_exact) or "off"
    system_prompt = "You are a concise assistant."
    draft_tint = "#24513a"            # background of characters the draft guessed

    [sampling]
    temperature = 0.7
    top_p = 0.95
    top_k = 40
    min_p = 0.05
    max_tokens = 1024

    [keymap]                          # action = "key[,key...]", see KEY_ACTIONS (not one of APP_KEYS, nor a key that types)
    regenerate = "ctrl+r"
"""

from __future__ import annotations

import os
import tomllib
import unicodedata
from pathlib import Path

import platformdirs
from rich.color import Color, ColorParseError
from textual.keys import KEY_NAME_REPLACEMENTS, REPLACED_KEYS, Keys, key_to_character
from textual.widgets import TextArea

from edgespec.errors import EdgespecError
from edgespec.files import atomic_write, read_regular
from edgespec.limits import RANGES, SettingError, checked_flash_attn, checked_kv_type, checked_setting
from edgespec.units import InvalidSizeError, parse_size
from edgespec.sampling import SamplingParams
from tui.settings import KINDS, SAMPLING_SETTINGS, TOP_LEVEL_SETTINGS, ChatConfig

CONFIG_FILE = "config.toml"
# Far past any settings file a person writes; a larger one is refused, not read whole into memory.
MAX_CONFIG_BYTES = 1 << 20

# Action name -> (default keys, description).  The app binds each one with
# id "edgespec.<action>", so the keymap can rebind any of them.
KEY_ACTIONS: dict[str, tuple[str, str]] = {
    "cancel": ("escape", "Stop"),
    "regenerate": ("ctrl+r", "Regenerate"),
    "new_chat": ("ctrl+n", "New chat"),
    "continue_last": ("f4", "Last chat"),  # not ctrl+b: tmux takes that
    "edit_prompt": ("f3", "Edit prompt"),
    "copy_reply": ("ctrl+l", "Copy reply"),
    "cycle_mode": ("ctrl+g", "Drafting mode"),
    "toggle_marks": ("ctrl+t", "Draft marks"),
    "history": ("ctrl+o", "History"),
    "settings": ("ctrl+s", "Settings"),
    "model_info": ("f2", "Model info"),
    "help": ("f1", "Help"),
}


# Action name -> what the command palette says it does.
COMMAND_HELP = {
    "cancel": "Stop the reply being generated (keeps what has arrived)",
    "regenerate": "Sample the last reply again",
    "new_chat": "Start an empty chat",
    "continue_last": "Reopen the chat saved last",
    "edit_prompt": "Edit your last message and answer it again (click a message to edit an earlier one)",
    "copy_reply": "Copy the last reply to the clipboard (click a code block to copy just that)",
    "cycle_mode": "Switch drafting: draft model → n-gram → none",
    "toggle_marks": "Show or hide the tint on tokens the draft guessed",
    "history": "Reopen a saved chat",
    "settings": "System prompt, sampling (temperature, top-p, top-k, min-p, seed, stop strings), draft tokens, bit-exact",
    "model_info": "The memory plan and the GGUF metadata of the loaded models",
    "help": "Show or hide the key bindings",
}


class ConfigError(EdgespecError):
    """config.toml cannot be read or holds a value the app cannot use."""


def check_settings_go_together(config: ChatConfig) -> None:
    """ConfigError for settings no load can keep together, config.toml's and the flags' alike: the app only
    failed to load its model with them, and offered to load another file."""
    if config.flash_attn == "on" and config.bit_exact:
        raise ConfigError(f'flash_attn = "on" and bit_exact = true (in {config_path()}, or --flash-attn on and '
                          "--bit-exact) cannot go together: with flash attention a token's logits depend on how many "
                          "tokens share its pass; drop one")


def chat_sampling(config: ChatConfig) -> SamplingParams:
    """The config's sampling settings; ConfigError naming the file (or the flags) if one is bad."""
    try:
        return config.sampling_params()
    except ValueError as error:
        raise ConfigError(f"bad sampling setting in {config_path()} or the flags: {error}") from None


_STRINGS = tuple(name for name, kind in KINDS.items() if kind == "string")
_INTEGERS = tuple(name for name, kind in KINDS.items() if kind == "integer")  # "range" ones: edgespec.limits.RANGES
_NUMBERS = tuple(name for name, kind in KINDS.items() if kind == "number")
_BOOLEANS = tuple(name for name, kind in KINDS.items() if kind == "boolean")


def config_dir() -> Path:
    return Path(os.environ.get("EDGESPEC_CONFIG_DIR") or platformdirs.user_config_dir("edgespec"))


def config_path() -> Path:
    return config_dir() / CONFIG_FILE


def load_config(path: Path | None = None) -> ChatConfig:
    """Read config.toml; a missing file means the defaults."""
    path = path or config_path()
    try:
        # not a FIFO or /dev/zero; utf-8-sig, as Windows editors start UTF-8 with a byte-order mark
        data = tomllib.loads(read_regular(path, MAX_CONFIG_BYTES).decode("utf-8-sig"))
    except FileNotFoundError:
        return ChatConfig()
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}; fix or delete the file") from None
    except RecursionError:  # tomllib parses nested arrays and tables by recursion
        raise ConfigError(f"cannot read {path}: its values are nested too deeply; fix or delete the file") from None
    except UnicodeDecodeError as error:  # TOML is UTF-8; tomllib lets the decoding error through
        raise ConfigError(f"cannot read {path}: it is not UTF-8 text (byte 0x{error.object[error.start]:02x} at "
                          f"offset {error.start}); fix or delete the file") from None
    return _parse(data, path)


def _parse(data: dict, path: Path) -> ChatConfig:
    values: dict = {}
    for key, value in data.items():
        if key in ("sampling", "keymap") and not isinstance(value, dict):
            raise ConfigError(f"{path}: {key} must be a table: a [{key}] section")
        if key == "sampling":
            for name, sampling_value in value.items():
                _check_key(name, SAMPLING_SETTINGS, path, "[sampling] ")
                values[name] = sampling_value
        elif key == "keymap":
            for action, keys in value.items():
                _check_key(action, tuple(KEY_ACTIONS), path, "[keymap] ")
                _check_keys(action, keys, path)
            _check_keys_are_distinct(value, path)
            values["keymap"] = dict(value)
        else:
            _check_key(key, TOP_LEVEL_SETTINGS, path, "")
            values[key] = value
    for name, value in values.items():
        if name != "keymap":
            values[name] = _checked(name, value, path)
    config = ChatConfig(**values)
    try:
        config.sampling_params()
    except ValueError as error:
        raise ConfigError(f"{path}: [sampling] {error}") from None
    return config


def _checked(name: str, value, path: Path):
    if name in RANGES:
        try:
            return checked_setting(name, value)
        except SettingError as error:
            raise ConfigError(f"{path}: {error}") from None
    if name == "flash_attn" and isinstance(value, bool):  # before "auto", it was on or off
        return checked_flash_attn(value)
    if name in _STRINGS and isinstance(value, str):
        _check_string(name, value, path)
        return value
    if name in _INTEGERS and isinstance(value, int) and not isinstance(value, bool):
        return value
    if name in _NUMBERS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if name in _BOOLEANS and isinstance(value, bool):
        return value
    kind = ("a string" if name in _STRINGS else "a whole number" if name in _INTEGERS else
            "true or false" if name in _BOOLEANS else "a number")
    raise ConfigError(f"{path}: {name} must be {kind}, not {value!r}")


def _check_string(name: str, value: str, path: Path) -> None:
    # the app shows these strings (the settings' text areas, notes, the loading panel), and a terminal obeys an
    # escape sequence in them; a system prompt may have lines and tabs
    allowed = "\n\t" if name == "system_prompt" else ""
    control = next((char for char in value if (ord(char) < 0x20 or 0x7F <= ord(char) <= 0x9F) and char not in allowed), None)
    if control is not None:
        raise ConfigError(f"{path}: {name} holds a control character (U+{ord(control):04X}); remove it")
    if name in ("model", "draft") and not value:  # as a path, "" is "."
        raise ConfigError(f'{path}: {name} cannot be empty; give a GGUF path or a catalog name, or leave {name} out')
    if name == "draft_tint":
        try:
            Color.parse(value)
        except ColorParseError:
            raise ConfigError(f'{path}: draft_tint must be a colour like "#24513a" or "dark_green", '
                              f"not {value!r}") from None
    elif name in ("kv_type", "draft_kv_type", "flash_attn"):
        check = checked_flash_attn if name == "flash_attn" else checked_kv_type
        try:
            check(value)
        except SettingError as error:
            raise ConfigError(f"{path}: {name}: {error}") from None
    elif name in ("memory_budget", "prompt_cache_size"):
        try:
            parse_size(value)
        except InvalidSizeError as error:
            raise ConfigError(f"{path}: {name}: {error}") from None


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


# Keys that stay the app's own: Textual's quit, Ctrl+C (stop a reply, or copy) and command palette, the prompt's
# keys (tui.widgets.PromptInput: send, new line, earlier and later prompts) and moving between fields.  An action
# given one took it from them (help on Ctrl+Q left only the palette to quit) or never ran (regenerate on Enter).
APP_KEYS = {"ctrl+q": "quit", "ctrl+c": "stop or copy", "ctrl+p": "the command palette", "enter": "send",
            "shift+enter": "new line", "ctrl+j": "new line", "up": "earlier prompt", "down": "later prompt",
            "tab": "next field", "shift+tab": "previous field"}


# The prompt's editing keys (TextArea's: ctrl+a, ctrl+w, home, ...), which it takes before the app's bindings.
PROMPT_EDITING_KEYS = {key.strip() for binding in TextArea.BINDINGS for key in binding.key.split(",")}


_UNICODE_NAMES = {short: unicode for unicode, short in KEY_NAME_REPLACEMENTS.items()}  # "minus": "hyphen_minus"


def _typed_character(name: str) -> str | None:
    """The character a key's name stands for, if any: Textual names a character's key by its Unicode name
    ("comma", "full_stop"), some of them shortened ("minus", "slash")."""
    if len(name) == 1:
        return name
    unicode_name = _UNICODE_NAMES.get(name, name).upper()
    for spelled in (unicode_name.replace("_", " "), unicode_name.replace("_", "-")):
        try:
            return unicodedata.lookup(spelled)
        except KeyError:
            pass
    return key_to_character(name)


def _typed_into_the_prompt(key: str) -> bool:
    """True for a key the prompt takes while it has the focus, so that an action bound to it would not run
    while you type: a character (shifted too) or one of PROMPT_EDITING_KEYS."""
    *modifiers, name = key.split("+")
    character = _typed_character(name)
    return bool(character and character.isprintable() and set(modifiers) <= {"shift"}) or key in PROMPT_EDITING_KEYS


def _check_keys_are_distinct(keymap: dict[str, str], path: Path) -> None:
    """ConfigError when the keymap gives one key to two actions, or one of APP_KEYS or a key the prompt types
    with to an action: only one of them would run.  The actions left at their default keys claim them first, so
    the error names the action the file rebound."""
    for action, keys in keymap.items():
        for key in (key.strip() for key in keys.split(",")):
            if key in APP_KEYS:
                raise ConfigError(f"{path}: [keymap] {action}: {key} is the app's own key ({APP_KEYS[key]}); "
                                  f"give {action} another key")
            if _typed_into_the_prompt(key):
                raise ConfigError(f"{path}: [keymap] {action}: the prompt takes {key} while you type, so {action} "
                                  "would not run; give it an F key or a ctrl or alt key the prompt does not edit with")
    owners: dict[str, str] = {}
    unchanged = [action for action in KEY_ACTIONS if action not in keymap]
    for action in unchanged + [action for action in KEY_ACTIONS if action in keymap]:
        for key in (key.strip() for key in keymap.get(action, KEY_ACTIONS[action][0]).split(",")):
            if owners.setdefault(key, action) != action:
                raise ConfigError(f"{path}: [keymap] {action}: {key} is {owners[key]}'s key too; give one of "
                                  "them another key")


def _check_key(key: str, known: tuple[str, ...], path: Path, section: str) -> None:
    if key in known:
        return
    if not section and key in SAMPLING_SETTINGS:  # temperature = 0.5 above every section
        raise ConfigError(f"{path}: {key} is a sampling setting; put it under the [sampling] section")
    raise ConfigError(f"{path}: unknown setting {section}{key}; known ones are {', '.join(known)}")


def save_defaults(config: ChatConfig, path: Path | None = None) -> Path:
    """Write config as config.toml, so the next start uses these settings."""
    path = path or config_path()
    lines = []
    for name in TOP_LEVEL_SETTINGS:
        value = getattr(config, name)
        if value is not None:
            lines.append(f"{name} = {_toml_value(value)}")
    lines += ["", "[sampling]"]
    lines += [f"{name} = {_toml_value(getattr(config, name))}" for name in SAMPLING_SETTINGS]
    if config.keymap:
        lines += ["", "[keymap]"]
        lines += [f"{action} = {_toml_value(keys)}" for action, keys in sorted(config.keymap.items())]
    text = "\n".join(lines) + "\n"
    if len(text.encode("utf-8")) > MAX_CONFIG_BYTES:  # the next start would refuse the file, all its settings too
        raise EdgespecError(f"these settings take {len(text.encode('utf-8')):,} bytes as config.toml, more than it "
                            f"may hold ({MAX_CONFIG_BYTES:,}); shorten the system prompt")
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, text)


def _toml_value(value) -> str:
    if isinstance(value, str):
        escaped = "".join(
            f"\\u{ord(char):04x}" if ord(char) < 0x20 or ord(char) == 0x7F or char in '"\\' else char
            for char in value
        )
        return f'"{escaped}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
