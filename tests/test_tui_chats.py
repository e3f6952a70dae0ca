"""Pilot tests of managing chats in the app: resume, rename, export, delete, edit and regenerate,
copying one code block, and the draft tint of a reopened chat (tests/test_tui.py has the rest)."""

from __future__ import annotations

import random

import pytest
from rich.style import Style
from textual.app import App

from edgespec.engine import Done, GenerationResult, Step, Token
from edgespec.session import SESSION_FORMAT
from edgespec.stats import Stats
from test_tui import SIZE, loaded, make_app, models, pilot_test, replies, send, user_dirs, wait_for  # noqa: F401
from tui.history import ChatStore, content_key
from tui.history_screens import ConfirmScreen, ExportScreen, HistoryScreen, RenameScreen
from tui.render import BlockRenderer
from tui.reply import SEGMENT_LINES, BlockView, ReplyView
from tui.widgets import Note, UserMessage

CODE = "".join(f"    total += {i}\n" for i in range(20))
REPLY = f"Here is the **sum**:\n\n```python\ndef total():\n{CODE}```\n\nIt adds the numbers."
CODE_START = REPLY.index("def total")
# drafted: part of the prose, and two runs inside the code block
DRAFTED = [[0, 4], [CODE_START + 4, CODE_START + 9], [CODE_START + 30, CODE_START + 60]]


def saved_chat(store: ChatStore, title: str = "Sum the numbers", reply: str = REPLY) -> int:
    """A chat in the history as the app saves one, with draft marks in its code block."""
    session = {"format": SESSION_FORMAT, "system_prompt": None, "context_policy": "drop-oldest",
               "messages": [{"role": "user", "content": "Sum some numbers"}, {"role": "assistant", "content": reply}],
               "first_visible": 0, "turn_stats": [], "params": None, "mode": "combined"}
    return store.save_chat(None, title, "/models/elsewhere.gguf", {}, session,
                           {"drafted": {content_key(reply): DRAFTED}, "pending_prompt": None})


def tinted(view: BlockView, tint: str) -> str:
    rendered = view.rendered
    return "".join(rendered.plain[s.start:s.end] for s in rendered.spans if s.style == Style(bgcolor=tint))


@pilot_test
async def test_the_last_chat_is_offered_and_resumes_with_its_code_tint_and_one_key(models):
    app = make_app(models)
    saved_chat(app.store)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        offer = [str(note.render()) for note in app.query(Note) if note.has_class("last-chat")]
        assert len(offer) == 1 and "“Sum the numbers” (2 messages)" in offer[0] and "f4 continues it" in offer[0]
        await pilot.press("f4")
        await pilot.pause()
        assert [m["role"] for m in app.chat.session.messages] == ["user", "assistant"]
        [reply] = replies(app)
        assert reply.reply.text == REPLY and reply.reply.drafted_ranges() == DRAFTED
        code = [view for view in reply.query(BlockView) if view.block.kind == "code"][0]
        assert tinted(code, app.config.draft_tint) == REPLY[CODE_START + 4:CODE_START + 9] + REPLY[CODE_START + 30:CODE_START + 60]
        prose = reply.query(BlockView).first()
        assert tinted(prose, app.config.draft_tint) == "Here"

        await pilot.click(code)  # one code block, not the whole reply
        assert app.clipboard == f"def total():\n{CODE}".rstrip("\n")
        await pilot.press("ctrl+l")
        assert app.clipboard == REPLY

        await pilot.press("ctrl+n")  # one key starts a new chat
        await pilot.pause()
        assert app.chat.session.messages == [] and not replies(app)


@pilot_test
async def test_history_renames_and_the_name_survives_later_saves(models):
    app = make_app(models)
    chat_id = saved_chat(app.store)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, HistoryScreen)
        await pilot.press("r")
        assert isinstance(app.screen, RenameScreen)
        app.screen.query_one("#title").value = ""
        await pilot.press("enter")
        assert isinstance(app.screen, RenameScreen), "an empty title is refused in place"
        assert "cannot be empty" in str(app.screen.query_one(".dialog-error").render())
        app.screen.query_one("#title").value = "Adding [bold]numbers[/]"  # markup stays text
        await pilot.press("enter")
        assert isinstance(app.screen, HistoryScreen)
        assert "Adding [bold]numbers[/]" in str(app.screen.query_one("#chats").get_option_at_index(0).prompt)
        await pilot.press("enter")  # open it and go on: the new save keeps the name
        await pilot.pause()
        await send(pilot, "more")
        assert app.store.list_chats()[0].id == chat_id and app.store.list_chats()[0].title == "Adding [bold]numbers[/]"


@pilot_test
async def test_history_exports_markdown_with_marks_outside_code_and_never_overwrites(models, tmp_path):
    app = make_app(models)
    saved_chat(app.store)
    target = tmp_path / "exported.md"
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("ctrl+o", "e")
        assert isinstance(app.screen, ExportScreen)
        app.screen.query_one("#path").value = str(target)
        await pilot.click("#export-button")
        await pilot.pause()
        assert isinstance(app.screen, HistoryScreen)
        text = target.read_text()
        assert text.startswith("# Sum the numbers\n")
        assert "## You\n\nSum some numbers\n" in text
        assert "<mark>Here</mark> is the **sum**:" in text
        assert f"```python\ndef total():\n{CODE}```" in text, "code is exported as written, without marks"

        target.write_text("someone else's file")
        await pilot.press("e")
        app.screen.query_one("#path").value = str(target)
        app.screen.query_one("#mark-drafts").value = False
        await pilot.click("#export-button")
        await pilot.pause()
        assert isinstance(app.screen, ExportScreen), "the dialog stays open with the problem"
        assert "already exists" in str(app.screen.query_one(".dialog-error").render())
        assert target.read_text() == "someone else's file"
        app.screen.query_one("#path").value = str(tmp_path / "plain.md")
        app.screen.query_one("#path").focus()
        await pilot.press("enter")  # Enter in the file name exports too
        await pilot.pause()
        plain = (tmp_path / "plain.md").read_text()
        assert "<mark>" not in plain and REPLY in plain
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".md")) == ["exported.md", "plain.md"]
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


@pilot_test
async def test_deleting_a_chat_asks_first(models):
    app = make_app(models)
    keep, gone = saved_chat(app.store, "keep me"), saved_chat(app.store, "delete me")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("ctrl+o", "delete")  # the newest, "delete me", is highlighted
        assert isinstance(app.screen, ConfirmScreen) and "delete me" in str(app.screen.query_one("Static").render())
        await pilot.press("n")
        assert isinstance(app.screen, HistoryScreen) and len(app.store.list_chats()) == 2
        await pilot.press("delete", "y")
        await pilot.pause()
        assert isinstance(app.screen, HistoryScreen)
        assert [chat.id for chat in app.store.list_chats()] == [keep] and gone != keep
        assert app.screen.query_one("#chats").option_count == 1


@pilot_test
async def test_editing_an_earlier_message_answers_it_again_and_drops_what_followed(models):
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "Hello world")
        first_reply = app.chat.session.messages[1]["content"]
        await send(pilot, "and the cat")
        assert len(app.chat.session.messages) == 4
        await pilot.click(app.query(UserMessage).first())
        assert app.editing == 0 and app.prompt_input.text == "Hello world"
        assert "drops the 3 after it" in app.prompt_input.border_title
        await pilot.press("escape")  # cancels the edit
        assert app.editing is None and app.prompt_input.text == ""

        await pilot.click(app.query(UserMessage).first())
        app.prompt_input.load_text("Hello there")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.generation is None and len(app.chat.session.messages) == 2)
        assert [m["content"] for m in app.chat.session.messages[:1]] == ["Hello there"]
        assert [str(view.render()) for view in app.query(UserMessage)] == ["Hello there"]
        assert len(replies(app)) == 1 and replies(app)[0].reply.text == app.chat.session.messages[1]["content"]
        assert app.prompt_input.border_title is None
        stored = app.store.load_chat(app.chat.chat_id)
        assert [m["content"] for m in stored.session["messages"]][0] == "Hello there"

        await pilot.press("f3")  # the last message, by key
        assert app.editing == 0 and app.prompt_input.text == "Hello there"
        app.prompt_input.load_text("Hello world")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.generation is None and len(app.chat.session.messages) == 2)
        assert app.chat.session.messages[1]["content"] == first_reply  # T = 0: the same answer as at first


class _Replies(App):
    def compose(self):
        self.streamed = ReplyView(BlockRenderer(), True)
        self.whole = ReplyView(BlockRenderer(), True)
        yield self.streamed
        yield self.whole


@pilot_test
async def test_a_streamed_reply_settles_lines_once_and_ends_as_the_whole_reply_renders():
    rng = random.Random(3)
    pieces, position = [], 0
    while position < len(REPLY):
        size = rng.randint(1, 5)
        piece = REPLY[position:position + size]
        pieces.append((piece, any(start <= position < end for start, end in DRAFTED)))
        position += size
    app = _Replies()
    async with app.run_test(size=(100, 80)) as pilot:
        first_segment = None
        for piece in pieces:
            app.streamed.append([piece])
            await pilot.pause()
            views = list(app.streamed.query(BlockView))
            code = [view for view in views if view.block.kind == "code"]
            app.whole.set_text(app.streamed.text, app.streamed.drafted_ranges())
            await pilot.pause()
            assert [v.rendered.plain for v in views] == [v.rendered.plain for v in app.whole.query(BlockView)]
            if code and views[-1] is code[0] and len(code[0].children) > 1:  # the open block has settled lines
                segment = code[0].children[0]
                first_segment = first_segment or (segment, str(segment.render()))
                assert first_segment == (segment, str(segment.render())), "a settled segment is not redrawn"
        assert first_segment is not None and SEGMENT_LINES < CODE.count("\n")
        app.streamed.finish()
        await pilot.pause()
        streamed = [(v.block, v.rendered) for v in app.streamed.query(BlockView)]
        assert streamed == [(v.block, v.rendered) for v in app.whole.query(BlockView)]
        assert all(len(view.children) == 1 for view in app.streamed.query(BlockView))


@pilot_test
async def test_a_code_blocks_language_is_shown_as_text_not_markup():
    app = _Replies()
    async with app.run_test(size=(100, 20)) as pilot:
        app.whole.set_text("```[red]x\nprint(1)\n```", [])
        await pilot.pause()
        [view] = app.whole.query(BlockView)
        assert view.border_title == "\\[red]x"  # escaped markup: it shows as typed


def scripted_reply(text: str, drafted: list):
    """An Engine.stream_tokens stand-in that streams `text` (a code block a tiny model would not write)
    in steps of a few tokens, marking the characters of `drafted` as accepted n-gram tokens."""
    def stream_tokens(prompt_ids, params, cancel=None):
        pieces, position, rng = [], 0, random.Random(5)
        while position < len(text):
            end = min(len(text), position + rng.randint(1, 4))
            pieces.append(Token(0, text[position:end], "ngram" if any(a <= position < b for a, b in drafted) else None))
            position = end
        stats = Stats(mode="ngram", tokens_generated=len(pieces), finish_reason="stop", steps=len(pieces) // 3)
        for start in range(0, len(pieces), 3):
            yield Step(pieces[start:start + 3], stats)
        yield Done(GenerationResult(text, [0] * len(pieces), "stop", stats))
    return stream_tokens


@pilot_test
async def test_the_code_tint_of_a_streamed_reply_is_the_same_after_a_restart(models):
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        app.chat.engine.stream_tokens = scripted_reply(REPLY, DRAFTED)
        await send(pilot, "Sum some numbers")
        [reply] = replies(app)
        assert reply.reply.text == REPLY
        live = [(view.block.kind, tinted(view, app.config.draft_tint)) for view in reply.query(BlockView)]
        assert live[1][0] == "code" and live[1][1]
    app.close_engine()

    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("f4")
        await pilot.pause()
        [reply] = replies(app)
        assert [(view.block.kind, tinted(view, app.config.draft_tint)) for view in reply.query(BlockView)] == live
