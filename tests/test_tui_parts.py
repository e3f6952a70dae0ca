"""The chat app's pure parts: Markdown blocks with draft tint, stats texts, config, pasted and exported text."""

from dataclasses import replace

import pytest
from rich.style import Style
from rich.text import Text

from textual import events
from textual._xterm_parser import XTermParser

from edgespec import Notice
from edgespec.errors import EdgespecError, Setting, Wording
from tui.chat import ChatController, ReplyStream
from tui.config import ChatConfig, ConfigError, load_config, save_defaults
from edgespec.control_chars import plain_text, terminal_text, visible_controls
from tui.engine_host import SMALL_MACHINE_CORES, default_chat_threads
from tui.export import chat_markdown, default_export_path
from tui.history import ChatStore, StoredChat, content_key
from tui.paste import PasteSafeParser
from tui.render import DEFAULT_DRAFT_TINT, BlockRenderer, split_blocks
from edgespec.stats import Stats
from tui.stats import MIN_PLAIN_STEPS, PlainSpeedEstimate, reply_footer, stats_line, step_acceptance

REPLY = (
    "# Title\n\nSome **bold** and `code`.\n- one\n- two\n\n"
    "```python\ndef f(x):\n    return x + 1\n```\nAfter.\n\n```js\nlet a"
)


def test_blocks_split_prose_and_fences_and_keep_an_open_fence_open():
    blocks = split_blocks(REPLY)
    assert [b.kind for b in blocks] == ["prose", "prose", "code", "prose", "code"]
    python = blocks[2]
    assert python.language == "python"
    assert REPLY[python.body_start:python.body_end] == "def f(x):\n    return x + 1\n"
    assert REPLY[blocks[4].body_start:blocks[4].body_end] == "let a"


def test_splitting_from_the_last_block_start_matches_splitting_everything():
    """What lets the view re-render only the last block while streaming."""
    for cut in range(1, len(REPLY) + 1):
        text = REPLY[:cut]
        blocks = split_blocks(text)
        if len(blocks) > 1:
            assert split_blocks(text, blocks[-1].start) == blocks[-1:]


def _tinted(text, tint=DEFAULT_DRAFT_TINT):
    style = Style(bgcolor=tint)
    return "".join(text.plain[span.start:span.end] for span in text.spans if span.style == style)


def test_draft_tint_follows_source_characters_through_markup_and_highlighting():
    renderer = BlockRenderer()
    blocks = split_blocks(REPLY)
    mask = bytearray(len(REPLY))
    bold = REPLY.index("bold")
    mask[bold - 2:bold + 6] = b"\x01" * 8  # "**bold**": the markers are not shown
    body = REPLY.index("return")
    mask[body:body + 6] = b"\x01" * 6

    prose = renderer.render(blocks[1], REPLY, bytes(mask), True)
    assert prose.plain.startswith("Some bold and code.\n• one")
    assert _tinted(prose) == "bold"
    code = renderer.render(blocks[2], REPLY, bytes(mask), True)
    assert code.plain == "def f(x):\n    return x + 1"
    assert _tinted(code) == "return"
    assert any(span.style != Style(bgcolor=DEFAULT_DRAFT_TINT) for span in code.spans)  # highlighted
    assert _tinted(renderer.render(blocks[2], REPLY, bytes(mask), False)) == ""


def test_step_acceptance_is_per_step_not_cumulative():
    assert step_acceptance(4, 4) == 1.0
    assert step_acceptance(4, 1) == 0.25
    assert step_acceptance(0, 0) is None


STATS = Stats(
    mode="draft-model", tokens_generated=120, decode_tokens_per_second=40.0,
    draft_tokens_proposed=100, draft_tokens_accepted=75, acceptance_rate=0.75,
    target_passes_per_token=0.4, mean_draft_tokens=3.5, finish_reason="stop",
    prompt_tokens=30,
)


def test_reply_footer_gives_speedup_only_once_plain_speed_is_known():
    assert "speedup n/a" in reply_footer(STATS, None)
    footer = reply_footer(STATS, (16.0, "measured"))
    assert "120 tokens" in footer and "40.0 tok/s" in footer and "accepted 75% (75/100)" in footer
    assert "2.50× vs plain 16.0 tok/s (measured)" in footer
    assert reply_footer(replace(STATS, finish_reason="cancelled"), (16.0, "measured")).startswith("stopped")
    assert reply_footer(replace(STATS, finish_reason="length"), (16.0, "measured")).startswith("cut at max tokens")
    assert not reply_footer(replace(STATS, finish_reason="stop"), (16.0, "measured")).startswith("cut")
    plain = replace(STATS, mode="none", draft_tokens_proposed=0)
    assert "baseline" in reply_footer(plain, (16.0, "measured"))


def test_reply_footer_gives_the_end_to_end_speedup_beside_the_decode_one():
    # 120 tokens in 3 s after a 1.5 s prefill; plain decoding at 16 tok/s would have taken 7.5 s to decode
    timed = replace(STATS, prefill_seconds=1.5, decode_seconds=3.0)
    footer = reply_footer(timed, (16.0, "measured"))
    assert "2.50× vs plain 16.0 tok/s (measured) · 2.00× end to end" in footer
    assert "end to end" not in reply_footer(timed, (0.3, "measured"))  # no speedup, no end-to-end one


def test_reply_footer_compares_a_reply_with_its_own_plain_pace_as_its_stats_json_does():
    # the reply's one-token steps took 50 ms (20 tok/s); the chat's plain steps of an earlier hour, 16 tok/s
    paced = replace(STATS, prefill_seconds=1.5, decode_seconds=3.0, plain_step_seconds=0.05,
                    decode_speedup=2.0, end_to_end_speedup=(1.5 + 6.0) / (1.5 + 3.0))
    footer = reply_footer(paced, (16.0, "measured"))
    assert "2.00× vs plain 20.0 tok/s (its own pace) · 1.67× end to end" in footer
    assert "2.00× vs plain 20.0 tok/s (its own pace)" in reply_footer(paced, None)
    assert "baseline" in reply_footer(replace(paced, mode="none"), (16.0, "measured"))


def test_reply_footer_shows_no_speedup_the_evidence_cannot_support():
    # 0.4 target passes per token: a step costs at least one pass, so at most 2.5x (plus slack)
    contended = reply_footer(STATS, (0.3, "measured"))  # a plain speed taken on a busy machine
    assert "×" not in contended and "speedup n/a" in contended and "does not fit this reply" in contended
    assert "3.00× vs plain" in reply_footer(STATS, (40.0 / 3, "measured"))
    short = replace(STATS, tokens_generated=10)
    assert "×" not in reply_footer(short, (16.0, "measured")) and "too few tokens" in reply_footer(short, (16.0, "measured"))


def plain_steps(estimate, seconds_per_step, steps):
    """Feed `steps` plain steps of one reply, as the generation thread does from each Step."""
    for _ in range(steps):
        estimate.observe(0, seconds_per_step)


def test_plain_speed_needs_many_steps_and_ignores_a_contended_cancelled_reply():
    estimate = PlainSpeedEstimate()
    plain_steps(estimate, 3.47, 10)  # 10 tokens in 34.7 s, then cancelled
    assert estimate.steps == 10 and estimate.tokens_per_second() is None, "ten steps are no evidence"
    plain_steps(estimate, 0.01, MIN_PLAIN_STEPS)  # a normal plain reply
    assert estimate.tokens_per_second() == pytest.approx(100.0)
    plain_steps(estimate, 3.47, 10)  # the busy spell again
    assert estimate.tokens_per_second() == pytest.approx(100.0)


def test_plain_speed_counts_only_steps_that_drafted_nothing():
    estimate = PlainSpeedEstimate(min_steps=1)
    estimate.observe(4, 0.02)  # a step that drafted 4 tokens
    assert estimate.steps == 0
    estimate.observe(0, 0.0)  # no time measured: no figure
    assert estimate.steps == 0
    estimate.observe(0, 0.01)
    assert estimate.tokens_per_second() == pytest.approx(100.0)


def test_stats_line_shows_mode_models_numbers_and_context():
    line = stats_line(mode="draft-model", target="qwen", draft="qwen-small", stats=STATS,
                      draft_tokens=4, context_used=150, n_ctx=4096).plain
    for part in ("draft model", "qwen ← qwen-small", "ctx 150/4,096", "40.0 tok/s", "accept 75%",
                 "0.40 target passes/tok", "draft 4 (avg 3.5/step)"):
        assert part in line
    measuring = stats_line(mode="ngram", target="qwen", draft=None, stats=None, draft_tokens=4,
                           context_used=0, n_ctx=4096, status="measuring speed…").plain
    assert "measuring speed…" in measuring.splitlines()[0]


def test_config_file_overrides_defaults_and_flags_override_the_file(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('model = "m.gguf"\ndraft_tokens = 6\n[sampling]\ntemperature = 0\n'
                    '[keymap]\nregenerate = "f5"\n')
    config = load_config(path)
    assert (config.model, config.draft_tokens, config.temperature) == ("m.gguf", 6, 0.0)
    assert config.keymap == {"regenerate": "f5"}
    flagged = config.with_overrides(draft_tokens=2, model=None)
    assert (flagged.model, flagged.draft_tokens) == ("m.gguf", 2)
    assert load_config(tmp_path / "missing.toml") == ChatConfig()


def test_the_kv_cache_settings_come_from_the_file_and_the_chat_flags(tmp_path):
    from edgespec.commands import build_parser
    from tui.settings import FLAG_SETTINGS

    path = tmp_path / "config.toml"
    path.write_text('kv_type = "q8_0"\nflash_attn = true\n')
    config = load_config(path)
    assert (config.kv_type, config.draft_kv_type, config.flash_attn) == ("q8_0", None, "on")  # as before "auto"
    args = build_parser().parse_args(["chat", "--kv-type", "q4_0", "--draft-kv-type", "f16"])
    flagged = config.with_overrides(**{name: getattr(args, name) for name in FLAG_SETTINGS})
    assert (flagged.kv_type, flagged.draft_kv_type, flagged.flash_attn) == ("q4_0", "f16", "on")
    assert load_config(save_defaults(flagged, tmp_path / "saved.toml")) == flagged
    args = build_parser().parse_args(["chat", "--flash-attn", "off"])
    assert config.with_overrides(**{name: getattr(args, name) for name in FLAG_SETTINGS}).flash_attn == "off"
    assert ChatConfig().flash_attn == "auto"
    path.write_text('flash_attn = "sometimes"\n')
    with pytest.raises(ConfigError, match="flash_attn: flash attention must be one of auto, on, off"):
        load_config(path)


@pytest.mark.parametrize("config_text, flags", [
    ('flash_attn = "on"\nbit_exact = true\n', {}),
    ('bit_exact = true\n', {"flash_attn": "on"}),
])
def test_settings_no_load_can_keep_are_refused_before_the_app_starts(tmp_path, monkeypatch, config_text, flags):
    # the app failed to load its model with them, named flags that were not given, and offered another file
    from tui.run import run_chat

    monkeypatch.setenv("EDGESPEC_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("EDGESPEC_DATA_DIR", str(tmp_path))
    (tmp_path / "config.toml").write_text(config_text)
    monkeypatch.setattr("tui.run.ChatApp.run", lambda app: pytest.fail("the app started"))
    with pytest.raises(ConfigError, match='flash_attn = "on" and bit_exact = true .*config.toml.* drop one'):
        run_chat(**flags)
    assert not (tmp_path / "history.sqlite3").exists()  # refused before the history was opened


@pytest.mark.parametrize("text, problem", [
    ("colour = 1\n", "unknown setting colour"),
    # "unknown setting temperature" for a known setting in the wrong place
    ("temperature = 0.5\n", "temperature is a sampling setting; put it under the \\[sampling\\] section"),
    ("[keymap]\nfly = \"x\"\n", "unknown setting \\[keymap\\] fly"),
    ("draft_tokens = \"four\"\n", "draft_tokens must be"),
    ("model = [\n", "cannot read"),
    # an escape in a setting the app shows (a text area, a note) acted on the terminal: retitled it here
    ('system_prompt = "be brief\\u001b]2;pwned\\u0007"\n', "system_prompt holds a control character \\(U\\+001B\\)"),
    ('model = "m\\u009b2J.gguf"\n', "model holds a control character \\(U\\+009B\\)"),
    # one key for two actions left one of them out of reach without a word
    ('[keymap]\nregenerate = "ctrl+n"\n', "\\[keymap\\] regenerate: ctrl\\+n is new_chat's key too"),
    ('[keymap]\nhistory = "f5"\nsettings = "f8, f5"\n', "\\[keymap\\] settings: f5 is history's key too"),
    ('[keymap]\nhelp = "ctrl+q"\n', "\\[keymap\\] help: ctrl\\+q is the app's own key \\(quit\\); give help another"),
    ('[keymap]\nregenerate = "f5, enter"\n', "\\[keymap\\] regenerate: enter is the app's own key \\(send\\)"),
    # the prompt took these while typing, so the action ran only with the focus elsewhere
    ('[keymap]\nregenerate = "r"\n', "regenerate: the prompt takes r while you type.*an F key or a ctrl or alt key"),
    ('[keymap]\nregenerate = "minus"\n', "regenerate: the prompt takes minus while you type"),
    ('[keymap]\nregenerate = "slash"\n', "regenerate: the prompt takes slash while you type"),
    ('[keymap]\nhistory = "f5,shift+h"\n', "history: the prompt takes shift\\+h while you type"),
    ('[keymap]\nsettings = "space"\n', "settings: the prompt takes space while you type"),
    ('[keymap]\nhelp = "ctrl+w"\n', "help: the prompt takes ctrl\\+w while you type"),
])
def test_bad_config_names_the_problem(tmp_path, text, problem):
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem):
        load_config(path)


def test_saved_defaults_read_back(tmp_path):
    config = ChatConfig(model="x", system_prompt='say "hi"\nthen stop', temperature=0.2,
                        keymap={"regenerate": "f5"})
    assert load_config(save_defaults(config, tmp_path / "config.toml")) == config


def test_defaults_the_next_start_would_refuse_are_not_saved(tmp_path):
    # a 1 MB system prompt was saved, and the next start refused config.toml, with every setting in it
    path = tmp_path / "config.toml"
    save_defaults(ChatConfig(temperature=0.2), path)
    with pytest.raises(EdgespecError, match="shorten the system prompt"):
        save_defaults(ChatConfig(system_prompt="line\n" * 200_000), path)
    assert load_config(path).temperature == 0.2  # the file as it was


def test_reply_footer_names_the_drafters_whose_tokens_were_kept_and_the_tokens_per_drafting_step():
    combined = replace(STATS, mode="combined", steps=40, k0_steps=10, accepted_by_drafter={"ngram": 30, "draft-model": 45})
    footer = reply_footer(combined, (16.0, "measured"))
    assert "from n-gram 30, draft model 45" in footer and "2.5 accepted/step" in footer  # 75 over 30 drafting steps
    one_drafter = reply_footer(replace(combined, mode="ngram", accepted_by_drafter={"ngram": 75}), None)
    assert "from" not in one_drafter and "2.5 accepted/step" in one_drafter


def test_the_stats_line_drops_its_least_important_figures_to_fit_a_width():
    kwargs = dict(mode="draft-model", target="qwen", draft="qwen-small", stats=STATS, draft_tokens=4,
                  context_used=150, n_ctx=4096)
    full = stats_line(**kwargs).plain.splitlines()
    assert all(len(line) > 40 for line in full)
    narrow = stats_line(**kwargs, width=40).plain.splitlines()
    assert all(len(line) <= 40 for line in narrow)
    assert "draft model  qwen" in narrow[0] and "ctx 150/4,096" in narrow[0] and "qwen-small" not in narrow[0]
    assert "40.0 tok/s" in narrow[1] and "accept 75%" in narrow[1] and "target passes" not in narrow[1]


@pytest.mark.parametrize("text, plain", [
    ("CCC\x1b[31mDDD", "CCCDDD"),  # a colour: the whole sequence goes, not just the ESC
    ("a\x1b]0;window title\x07b", "ab"),  # OSC ended by BEL (which rings, or was Ctrl+G)
    ("a\x1b]8;;https://x.example\x1b\\link\x1b]8;;\x1b\\b", "alinkb"),  # a hyperlink, ST-terminated
    ("\x1bPq#0;2;0;0;0\x1b\\ok", "ok"),  # DCS (sixel)
    ("a\x9b2Jb\x85c", "abc"),  # C1: CSI as one character, NEL
    ("x\x00y\x08z\x7f", "xyz"),  # C0 and DEL
    ("one\r\ntwo\rthree\n\tfour", "one\ntwo\nthree\n\tfour"),  # line breaks kept as \n, tabs kept
    ("cut \x1b]0;no end\nnext line", "cut \nnext line"),  # an unterminated string costs its line only
    ("café 日本 😀 ~[31m", "café 日本 😀 ~[31m"),  # text that only looks like a sequence stays
    ("if x\u202e } \u2066{\u2069", "if x } {"),  # bidi overrides and isolates, which reorder what is drawn
    ("עברית \u200f. العربية", "עברית \u200f. العربية"),  # right-to-left text and its marks stay
])
def test_plain_text_drops_escape_sequences_and_control_characters(text, plain):
    assert plain_text(text) == plain


def test_bidi_overrides_are_drawn_one_for_one_not_obeyed():
    # a reply or title holding U+202E was drawn reversed by a terminal that honours it
    assert visible_controls("ab\u202ecd\u2067e") == "ab\ufffdcd\ufffde"
    assert terminal_text("x\u202dy") == "x\ufffdy"


def parsed(parser, reads: list[str]) -> list[tuple[str, str]]:
    events_out = [event for read in reads for event in parser.feed(read)]
    return [("paste", e.text) if isinstance(e, events.Paste) else ("key", e.key) for e in events_out]


def test_a_bracketed_paste_with_escape_bytes_arrives_whole_and_presses_no_key():
    raw = "x\x1b[200~CCC\x1b[31mDDD \x1b]0;t\x07E\x1b[201~y"
    # Textual's own parser replays what follows the ESC as key presses (a BEL: Ctrl+G) before the paste
    assert ("key", "ctrl+g") in parsed(XTermParser(), [raw])
    expected = [("key", "x"), ("paste", "CCCDDD E"), ("key", "y")]
    assert parsed(PasteSafeParser(), [raw]) == expected
    assert parsed(PasteSafeParser(), list(raw)) == expected, "markers and pastes split between reads"
    assert parsed(PasteSafeParser(), ["\x1b"]) == [] and parsed(PasteSafeParser(), ["a"]) == [("key", "a")]


def test_an_exported_chat_holds_no_escape_sequences():
    reply = "Done: \x1b[2J\x1b]0;pwned\x07all clear"
    session = {"system_prompt": "be \x1b[1mbold", "messages": [
        {"role": "user", "content": "paste: \x1b[31mred\x1b[0m"}, {"role": "assistant", "content": reply}]}
    chat = StoredChat(id=1, title="t\x1b[5mitle", target="m.gguf", settings={}, session=session,
                      extras={"drafted": {content_key(reply): [[0, 4]]}})
    for marked in (True, False):
        text = chat_markdown(chat, marked)
        assert not any(ord(char) < 32 and char not in "\n\t" or 0x7f <= ord(char) <= 0x9f for char in text)
        assert "# title" in text and "**System prompt:** be bold" in text and "paste: red" in text
        assert ("<mark>Done</mark>: all clear" if marked else "Done: all clear") in text


def test_an_exported_reply_that_may_be_unfinished_says_how_it_ended():
    # every reply was a plain "## Assistant" section: a stopped one ended mid-sentence with no mark
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "whole"},
                {"role": "user", "content": "b"}, {"role": "assistant", "content": "The ocean is", "cancelled": True},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "cut"},
                {"role": "user", "content": "d"}, {"role": "assistant", "content": "full"}]
    turns = [{"message_index": 1, "finish_reason": "stop"}, {"message_index": 3, "finish_reason": "cancelled"},
             {"message_index": 5, "finish_reason": "length"}, {"message_index": 7, "finish_reason": "context"}]
    chat = StoredChat(id=1, title="t", target="m.gguf", settings={}, session={"messages": messages, "turn_stats": turns},
                      extras={})
    text = chat_markdown(chat, mark_drafts=False)
    assert "whole\n\n## You" in text
    assert "The ocean is\n\n*(stopped)*" in text and "cut\n\n*(cut at max tokens)*" in text
    assert "full\n\n*(cut where the context was full)*" in text


def test_the_chat_leaves_a_core_to_the_app_on_small_machines():
    assert [default_chat_threads(cores) for cores in (1, 2, 3, 4)] == [1, 1, 2, 3]
    assert default_chat_threads(SMALL_MACHINE_CORES + 1) is None  # the engine's own default


def test_the_chat_actions_use_only_what_they_declare_of_the_app():
    """ChatActions (a mixin of ChatApp) declares the app state and methods it uses: nothing else of the app."""
    import ast
    import inspect

    from textual.app import App

    import tui.actions
    from tui.actions import ChatActions

    tree = ast.parse(inspect.getsource(tui.actions))
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"}
    declared = set(ChatActions.__annotations__) | set(vars(ChatActions))
    assert used - declared - set(dir(App)) == set()


def test_a_turn_s_notice_names_the_chat_s_flag_not_the_library_parameter(tmp_path):
    chat = ChatController(ChatConfig(), ChatStore(tmp_path / "history.db"))
    stream = ReplyStream()
    shifted = Notice(Wording("left the oldest 2 message(s) out (", Setting("bit_exact", True), " recomputes)"))
    chat.stream_reply(stream, lambda: iter([shifted]))
    assert stream.take()[2] == ["left the oldest 2 message(s) out (--bit-exact recomputes)"]


@pytest.mark.parametrize("data", [b'model = "caf\xe9"\n', b"\xff\xfetemperature = 0\n"])
def test_a_config_file_that_is_not_utf8_names_the_problem(tmp_path, data):
    # tomllib raised UnicodeDecodeError, which reached the user of `edgespec chat` as a traceback
    path = tmp_path / "config.toml"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match="cannot read .*not UTF-8 text.*fix or delete the file"):
        load_config(path)


def test_a_config_file_saved_with_a_byte_order_mark_is_read(tmp_path):
    # Notepad starts UTF-8 with one, and tomllib called it an invalid statement
    path = tmp_path / "config.toml"
    path.write_bytes(b"\xef\xbb\xbfdraft_tokens = 5\n")
    assert load_config(path).draft_tokens == 5


CONTROLS = "\x1b]2;PWNED\x07 \x1b[5;41mred\x9b2J\x00\x7f"


def _holds_controls(text: str) -> bool:
    return any(ord(char) < 32 and char not in "\n\t" or 0x7f <= ord(char) <= 0x9f for char in text)


@pytest.mark.parametrize("reply", [f"Say {CONTROLS} now", f"```sh\necho {CONTROLS}\n```\n",
                                   f"```py\x1b[31m\nx\n```\n", f"- **{CONTROLS}**"])
def test_a_reply_with_escape_sequences_shows_them_as_symbols_and_keeps_its_tint(reply):
    # a model may write ESC: on the screen it set the terminal's title and made text blink (an export made it plain)
    drafted = bytes([1] * len(reply))
    for block in split_blocks(reply):
        rendered = BlockRenderer().render(block, reply, drafted, True)
        assert not _holds_controls(rendered.plain), repr(rendered.plain)
        assert "␛" in rendered.plain or block.kind == "code" and "\x1b" not in reply[block.body_start:block.body_end]
        tinted = "".join(rendered.plain[span.start:span.end] for span in rendered.spans
                         if span.style == Style(bgcolor=DEFAULT_DRAFT_TINT))
        assert tinted.replace("\n", "") == rendered.plain.replace("\n", "").removeprefix("• "), "one symbol a character"


def test_a_user_message_with_escape_sequences_shows_them_as_symbols():
    from tui.widgets import UserMessage

    shown = UserMessage(f"from an old chat: {CONTROLS}", 0).content
    assert not _holds_controls(str(shown)) and "␛]2;PWNED" in str(shown)


@pytest.mark.parametrize("name", ["a" * 300 + ".md", "~no-such-user-here/chat.md", "nul\x00.md", "x" * 300 + "/chat.md"])
def test_an_export_path_the_system_refuses_is_an_export_error_not_a_crash(name, tmp_path):
    # the dialog shows an ExportError and stays open; an OSError, ValueError or RuntimeError ended the app
    from tui.export import ExportError, write_new_file

    path = tmp_path / name if not name.startswith("~") else __import__("pathlib").Path(name)
    with pytest.raises(ExportError) as refused:
        write_new_file(path, "text")
    assert "\n" not in str(refused.value)
    assert not list(tmp_path.iterdir())


def test_a_config_system_prompt_keeps_its_lines_and_tabs(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('system_prompt = "one\\n\\ttwo"\n')
    assert load_config(path).system_prompt == "one\n\ttwo"


def test_a_note_shows_control_characters_as_symbols():
    from tui.widgets import Note

    assert not _holds_controls(str(Note(f"system prompt: {CONTROLS}", "note").content))


def test_a_keymap_may_swap_two_actions_keys(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[keymap]\nregenerate = "ctrl+n"\nnew_chat = "ctrl+r"\n')
    assert load_config(path).keymap == {"regenerate": "ctrl+n", "new_chat": "ctrl+r"}


class _WorkersRunAtOnce:
    """What EngineHost needs of the app: workers (run at once, on this thread) and messages (kept)."""

    def __init__(self):
        self.messages = []

    def run_worker(self, work, **_):
        work()

    def post_message(self, message):
        self.messages.append(message)


def test_the_chat_learns_as_run_batch_and_serve_do(smollm2_path):
    from edgespec.learned import LearnedAcceptance
    from tui.engine_host import EngineHost

    app = _WorkersRunAtOnce()
    EngineHost(app, ChatConfig(), cost_curve=(1.0, 1.2)).load(str(smollm2_path), "none", draft_tokens="auto",
                                                             bit_exact=False)
    loaded = [m for m in app.messages if isinstance(m, EngineHost.Loaded)]
    assert len(loaded) == 1, app.messages
    engine = loaded[0].engine
    try:  # its replies start from what this model's drafts did before and add to it; other chats' text is a source
        assert isinstance(engine.planner.learned, LearnedAcceptance) and engine.planner.learned.writable
        assert engine.decoder.pool is not None
    finally:
        engine.close()


def test_a_shutdown_that_hangs_after_a_stop_signal_s_save_ends_the_process_with_its_code(monkeypatch):
    import threading
    from types import SimpleNamespace

    import tui.run

    ended, exits = threading.Event(), []
    monkeypatch.setattr(tui.run, "HUNG_SHUTDOWN_SECONDS", 0.0)
    monkeypatch.setattr(tui.run.os, "_exit", lambda code: (exits.append(code), ended.set()))
    quitting = SimpleNamespace(stop_signal=None, kept_at=0.0)  # Ctrl+Q: its shutdown is waited for
    guard = threading.Thread(target=tui.run._end_a_hung_shutdown, args=(quitting, ended))
    guard.start()
    guard.join(timeout=0.5)
    assert guard.is_alive() and exits == []
    quitting.stop_signal = 15  # SIGTERM, its save done: a shutdown that does not end is ended
    guard.join(timeout=30)
    assert exits == [143]


def test_the_keys_a_keymap_may_not_take_cover_the_prompt_s_own():
    from tui.config import APP_KEYS
    from tui.widgets import PromptInput

    prompt_keys = {key.strip() for binding in PromptInput.BINDINGS for key in binding.key.split(",")}
    assert prompt_keys <= set(APP_KEYS)


@pytest.mark.parametrize("saved", [{"sampling": {"stop": 5}}, {"sampling": [1, 2]}])
def test_a_chat_s_saved_sampling_that_is_not_settings_keeps_the_fallback_s(saved):
    # A hand edit's "stop": 5 refused the whole chat ("'int' object is not iterable") instead of keeping the default.
    from tui.config import chat_sampling
    from tui.settings import ChatSettings

    config = ChatConfig()
    fallback = ChatSettings(config.system_prompt, chat_sampling(config), config.draft_tokens, config.bit_exact)
    restored = ChatSettings.from_dict({**saved, "draft_tokens": 6}, "be brief", fallback)
    assert restored.sampling == fallback.sampling and restored.draft_tokens == 6


@pytest.mark.parametrize("data, rows", [
    ((0.99,) * 10, ["█" * 10, "█" * 10]),  # near-full acceptance is near-full bars, not a flat bottom line
    ((0.5,), ["▁", "█"]),  # one step at half is half a bar, not a full one
    ((0.0, 1.0) * 20, ["▁" * 10, "█" * 10]),  # 40 steps in 10 columns: each the mean of its 4, half
])
def test_acceptance_bars_keep_a_fixed_0_to_100_scale(data, rows):
    import asyncio

    from textual.app import App

    from tui.widgets import AcceptanceBars

    class Bars(App):
        CSS = "AcceptanceBars { width: 10; height: 2; }"

        def compose(self):
            yield AcceptanceBars()

    async def rendered():
        app = Bars()
        async with app.run_test(size=(20, 4)) as pilot:
            bars = app.query_one(AcceptanceBars)
            bars.data = data
            await pilot.pause()
            return bars.render().plain.split("\n")

    assert asyncio.run(rendered()) == rows


def test_an_export_is_offered_a_name_no_file_has_yet(tmp_path):
    # a second export of a chat was offered the first's name, which the export refuses to write over
    first = default_export_path(tmp_path, "Sum: the numbers!")
    assert first == tmp_path / "sum-the-numbers.md"
    first.write_text("exported")
    assert default_export_path(tmp_path, "Sum: the numbers!") == tmp_path / "sum-the-numbers-2.md"
    assert default_export_path(tmp_path, "/../") == tmp_path / "chat.md"


HOSTILE_FILE_STEM = "m[b]BOLD[@click=app.quit]QUIT\x1b]2;PWNED\x07\u202e"


def test_a_models_file_name_is_shown_as_text_with_its_controls_drawn_not_obeyed():
    from tui import stats as stats_text
    from tui.widgets import AssistantMessage, LoadingPanel

    name = stats_text.model_name(f"/models/{HOSTILE_FILE_STEM}.gguf")
    assert name == visible_controls(HOSTILE_FILE_STEM) and "\x1b" not in name and "\u202e" not in name
    assert "\x1b" not in stats_text.display_path(f"/models/{HOSTILE_FILE_STEM}.gguf")
    # a reply's title: a str title would be markup, and a click on "QUIT" ran app.quit
    title = AssistantMessage(BlockRenderer(), False, f"{name} · n-gram").border_title
    assert Text.from_markup(title).plain == f"{name} · n-gram"
    assert "\x1b" not in LoadingPanel(f"Loading /models/{HOSTILE_FILE_STEM}.gguf").description


def test_the_plan_table_and_a_notice_show_a_models_file_name_as_it_is(tmp_path, capsys):
    from rich.console import Console

    from edgespec.gguf_info import read_gguf_info
    from edgespec.memory import MemoryBudget
    from edgespec.notices import print_notice
    from edgespec.plan_table import format_plan_table
    from edgespec.planner import plan
    from tinygguf import write_tiny_model

    path = write_tiny_model(tmp_path / f"{HOSTILE_FILE_STEM}.gguf", seed=1)
    memory_plan = plan(read_gguf_info(path), None, n_ctx=256, budget=MemoryBudget("cpu", 2**34, 2**34, "test"),
                       gpu_offload=False)
    console = Console(width=300, record=True, color_system=None)
    console.print(format_plan_table(memory_plan))
    shown = console.export_text()
    assert "\x1b" not in shown and "\u202e" not in shown and "m[b]BOLD[@click=app.quit]QUIT" in shown
    print_notice(f"not loading draft {HOSTILE_FILE_STEM}.gguf")
    assert "\x1b" not in capsys.readouterr().err


def test_a_link_is_drawn_as_one_only_up_to_a_links_length():
    # the link pattern is bounded so that a long line of "[a](" draws in linear time (it took 21 s at 160,000
    # characters); a link longer than the bound is left as the text it is
    from tui.render import MAX_LINK_TARGET, MAX_LINK_TEXT, STYLES

    def linked(text: str) -> str:
        [block] = split_blocks(text)
        rendered = BlockRenderer().render(block, text, bytes(len(text)), False)
        return "".join(rendered.plain[s.start:s.end] for s in rendered.spans if s.style == STYLES["link"])

    assert linked("see [the docs](https://example.org/a) now") == "the docs"
    assert linked(f"see [{'a' * MAX_LINK_TEXT}](x)") == "a" * MAX_LINK_TEXT
    assert linked(f"see [{'a' * (MAX_LINK_TEXT + 1)}](x)") == ""
    assert linked(f"see [a]({'x' * (MAX_LINK_TARGET + 1)})") == ""


def test_combined_drafting_with_heads_and_no_draft_model_is_called_so():
    # the stats bar, the reply's title and its footer said "n-gram + draft model" with no draft model loaded
    from tui.stats import mode_label

    assert mode_label("combined", draft_model=False) == "n-gram + heads"
    assert mode_label("combined", draft_model=True) == "n-gram + draft model"
    bar = stats_line(mode="combined", target="smol", draft=None, stats=None, draft_tokens=4, context_used=0,
                     n_ctx=4096).plain
    assert bar.startswith("n-gram + heads  smol")
    with_heads = replace(STATS, mode="combined", steps=40, k0_steps=10, accepted_by_drafter={"ngram": 30, "heads": 45})
    footer = reply_footer(with_heads, None)
    assert "n-gram + heads accepted" in footer and "from n-gram 30, heads 45" in footer and "draft model" not in footer
    only_ngrams = reply_footer(replace(with_heads, accepted_by_drafter={"ngram": 30}), None)  # the heads drafted none
    assert "n-gram accepted" in only_ngrams and "draft model" not in only_ngrams
