"""Modal screens: settings, model info, and loading another model (the history's: tui/history_screens.py)."""

from __future__ import annotations

import dataclasses
import re

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Static, TextArea

from edgespec.gguf_info import read_gguf_info
from edgespec.limits import SettingError, checked_setting
from edgespec.plan_table import format_plan_table
from tui import stats as stats_text
from edgespec.control_chars import visible_controls
from tui.settings import KINDS, LABELS, SCREEN_SETTINGS, ChatSettings


class SettingsScreen(ModalScreen[tuple[ChatSettings, bool] | None]):
    """System prompt and sampling settings; returns (settings, save as defaults) or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close")]
    # the first field, not the scrolling dialog (Textual's first focusable), which took what was typed
    AUTO_FOCUS = "#system-prompt"

    def __init__(self, settings: ChatSettings):
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog", id="settings") as dialog:  # scrolls in a short terminal
            dialog.border_title = "Chat settings (Esc cancels)"
            yield Label("System prompt")
            yield TextArea(self.settings.system_prompt, id="system-prompt", soft_wrap=True)
            with Horizontal(classes="fields"):
                for name in SCREEN_SETTINGS:
                    yield from _field(LABELS[name], _field_id(name), self.settings.value(name))
            sampling = self.settings.sampling
            with Horizontal(classes="fields"):
                yield from _field("Seed (empty: random)", "seed", "" if sampling.seed is None else sampling.seed)
                with Vertical(classes="field wide"):
                    yield Label("Stop strings (one per line; \\n is a newline)")
                    yield TextArea("\n".join(_escaped(stop) for stop in sampling.stop), id="stop", soft_wrap=False)
            yield Checkbox("Bit-exact: greedy output is plain decoding's, token for token",
                           self.settings.bit_exact, id="bit-exact")
            yield Static("", id="settings-error")
            with Horizontal(classes="buttons"):
                yield Button("Apply", id="apply", variant="primary")
                yield Button("Apply and save as defaults", id="save")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
            return
        try:
            settings = self._read()
        except ValueError as error:
            self.query_one("#settings-error", Static).update(Text(str(error)))  # it quotes what was typed: not markup
            return
        self.dismiss((settings, event.button.id == "save"))

    def _read(self) -> ChatSettings:
        values = {name: self._value(name) for name in SCREEN_SETTINGS}
        draft_tokens = values.pop("draft_tokens")
        seed = self.query_one("#seed", Input).value.strip()
        values["seed"] = self._number("seed", seed, int) if seed else None
        values["stop"] = tuple(_unescaped(line) for line in self.query_one("#stop", TextArea).text.splitlines() if line)
        # SamplingParams refuses what it cannot sample with (NaN, inf, out of range), naming the field.
        sampling = dataclasses.replace(self.settings.sampling, **values)
        system_prompt = self.query_one("#system-prompt", TextArea).text.strip()
        return ChatSettings(system_prompt, sampling, draft_tokens, self.query_one("#bit-exact", Checkbox).value)

    def _value(self, name: str):
        """The value typed for setting `name`; ValueError naming it if it is not one."""
        field_id = _field_id(name)
        text = self.query_one(f"#{field_id}", Input).value.strip()
        kind = KINDS[name]
        if kind == "range":  # draft tokens: a whole number in its range, or "auto"
            try:
                return checked_setting(name, text if text == "auto" else self._number(field_id, text, int))
            except SettingError as error:
                raise ValueError(str(error)) from None
        return self._number(field_id, text, int if kind == "integer" else float)

    @staticmethod
    def _number(field_id: str, text: str, kind):
        try:
            return kind(text)
        except ValueError:
            wanted = "a whole number" if kind is int else "a number"
            raise ValueError(f"{field_id.replace('-', ' ')} must be {wanted}, not {text!r}") from None


_ESCAPES = {"\n": "\\n", "\t": "\\t", "\\": "\\\\"}


def _escaped(stop: str) -> str:
    """A stop string as one line of the stop-strings field."""
    return "".join(_ESCAPES.get(char, char) for char in stop)


def _unescaped(line: str) -> str:
    """A line of the stop-strings field as the stop string it stands for: \\n, \\t and \\\\ decoded."""
    return re.sub(r"\\([nt\\])", lambda match: {"n": "\n", "t": "\t", "\\": "\\"}[match.group(1)], line)


def _field_id(name: str) -> str:
    return name.replace("_", "-")


def _field(label: str, field_id: str, value) -> ComposeResult:
    with Vertical(classes="field"):
        yield Label(label)
        yield Input(str(value), id=field_id)


class ModelInfoScreen(ModalScreen[None]):
    """The memory plan and the GGUF metadata of the loaded models."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close")]

    def __init__(self, renderables: list):
        super().__init__()
        self.renderables = renderables

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog", id="model-info") as dialog:
            dialog.border_title = "Model info (Esc closes)"
            for renderable in self.renderables:
                yield Static(renderable)


class LoadModelScreen(ModalScreen[tuple[str, str] | None]):
    """Ask for a target model and a drafter, to load instead of the current ones."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close")]

    def __init__(self, model: str, draft: str):
        super().__init__()
        self.model, self.draft = model, draft

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="load-model") as dialog:
            dialog.border_title = "Load model (Esc cancels)"
            yield Label("Target model (catalog name or .gguf path)")
            yield Input(self.model, id="model")
            yield Label('Draft (catalog name, .gguf path, "ngram", "none" or "auto")')
            yield Input(self.draft, id="draft")
            with Horizontal(classes="buttons"):
                yield Button("Load", id="load", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_input_submitted(self) -> None:
        self._load()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "load":
            self._load()
        else:
            self.dismiss(None)

    def _load(self) -> None:
        model = self.query_one("#model", Input).value.strip()
        if model:
            self.dismiss((model, self.query_one("#draft", Input).value.strip() or "auto"))


def model_info(engine, plain: tuple[float, str] | None, plain_min_steps: int) -> list:
    """What the model-info screen shows: drafting, paths, plain speed, the memory plan, the GGUF metadata."""
    if engine is None:
        return ["No model is loaded."]
    plain_line = (f"Plain decoding: {plain[0]:.1f} tok/s ({plain[1]})" if plain else
                  f"Plain decoding: n/a (it takes {plain_min_steps} steps without drafting: "
                  "switch drafting to none and send a prompt)")
    lines = [
        f"Drafting now: {stats_text.engine_mode_label(engine)}; draft tokens per step: "
        f"{engine.draft_tokens}; context: {engine.n_ctx:,} tokens",
        ("Verification: bit-exact (greedy output is plain decoding's, token for token; passes up to "
         f"{engine.max_draft_tokens + 1} tokens)" if engine.bit_exact else
         "Verification: wide (exact in distribution up to llama.cpp's rounding; passes up to "
         f"{engine.max_draft_tokens + 1} tokens, logit drift up to {engine.drift_bound() / 2:.2g})"),
        f"Target: {stats_text.display_path(engine.target_path)}",
        *([f"Draft: {stats_text.display_path(engine.draft_path)}"] if engine.draft_path else []),
        plain_line,
    ]
    renderables: list = [Text("\n".join(lines))]  # it names files as given: paths, not markup
    if engine.plan is not None:
        renderables.append(format_plan_table(engine.plan))
    renderables.append(gguf_table("Target model", read_gguf_info(engine.target_path)))
    if engine.draft_path is not None:
        renderables.append(gguf_table("Draft model", read_gguf_info(engine.draft_path)))
    return renderables


def gguf_table(title: str, info) -> Table:
    """Key facts of a GGUF header (edgespec.gguf_info.GGUFInfo)."""
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2, 0, 0))
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("file", f"{info.path.name}  ({info.file_size / 2**20:,.1f} MiB)"),
        ("name", info.name or "—"),
        ("architecture", info.architecture),
        ("parameters", f"{info.parameter_count / 1e6:,.1f} M"),
        ("quantization", info.quantization),
        ("layers", str(info.n_layer)),
        ("embedding", str(info.n_embd)),
        ("heads / kv heads", f"{info.n_head} / {info.n_head_kv}  (head dim {info.head_dim})"),
        ("trained context", f"{info.context_length:,}"),
        ("vocabulary", f"{info.vocab_size:,}  ({info.tokenizer_model or 'unknown'} tokenizer)"),
        ("chat template", f"{len(info.chat_template):,} characters" if info.chat_template else "none"),
    ]
    for key, value in rows:  # a header's text is the file's: not markup, and no escape reaches the terminal
        table.add_row(key, Text(visible_controls(value)))
    return table
