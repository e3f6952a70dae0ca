"""Pilot tests of managing chats in the app: resume, rename, export, delete, edit and regenerate,
copying one code block, and the draft tint of a reopened chat (tests/test_tui.py has the rest)."""

from __future__ import annotations

import random
import sqlite3

import pytest

from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import App

from edgespec.session import SESSION_FORMAT
from scripted_reply import ScriptedReply, use_script
from test_tui import SIZE, loaded, make_app, models, pilot_test, replies, send, user_dirs, wait_for  # noqa: F401
from tui.history import ChatStore, HistoryError, content_key
from tui.paste import PasteSafeParser
from tui.history_screens import ConfirmScreen, ExportScreen, HistoryScreen, RenameScreen
from tui.render import Block, BlockRenderer
from tui.reply import SEGMENT_LINES, BlockView, ReplyView
from tui.screens import SettingsScreen
from tui.widgets import Note, PromptInput, UserMessage

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
async def test_a_title_with_escape_sequences_is_drawn_in_the_history_and_renamed_plain(models):
    app = make_app(models)
    saved_chat(app.store, "EVIL\x1b]0;PWNED\x07\x1b[5;41mBLINK\x1b[0m end")  # stored by an older edgespec, say
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("ctrl+o")
        shown = str(app.screen.query_one("#chats").get_option_at_index(0).prompt)
        assert "\x1b" not in shown and "\x07" not in shown and "EVIL\u241b]0;PWNED\u2407" in shown
        await pilot.press("r")
        app.screen.query_one("#title").value = "\x1b[31mRED\x1b[0m title"
        await pilot.press("enter")
        assert app.store.list_chats()[0].title == "RED title"


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
async def test_deleting_the_open_chat_starts_a_new_one_and_it_stays_deleted(models):
    app = make_app(models)
    saved_chat(app.store, "delete me")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("f4")  # continue it
        await pilot.pause()
        assert app.chat.chat_id is not None and len(app.chat.session.messages) == 2
        await pilot.press("ctrl+o", "delete", "y", "escape")
        await pilot.pause()
        assert app.store.list_chats() == [] and app.chat.session.messages == [] and not replies(app)
        use_script(app.chat.engine, ScriptedReply("Sure."))
        await send(pilot, "One more")
        [chat] = app.store.list_chats()
        assert [m["content"] for m in app.store.load_chat(chat.id).session["messages"]] == ["One more", "Sure."]


@pilot_test
async def test_an_edit_too_long_for_the_context_changes_nothing(models):
    app = make_app(models, n_ctx=512)
    too_long = "word " * 4000
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        use_script(app.chat.engine, ScriptedReply("Sure."))
        await send(pilot, "First question")
        await send(pilot, "Second question")
        before = [dict(m) for m in app.chat.session.messages]
        stored_before = app.store.load_chat(app.chat.chat_id).session["messages"]
        await pilot.click(app.query(UserMessage).first())
        app.prompt_input.load_text(too_long)
        app.prompt_input.action_submit()
        await wait_for(pilot, lambda: app.generation is None and "context" in str(app.query(Note).last().render()))
        assert app.chat.session.messages == before and len(before) == 4
        assert [str(view.render()) for view in app.query(UserMessage)] == ["First question", "Second question"]
        assert app.store.load_chat(app.chat.chat_id).session["messages"] == stored_before
        assert app.prompt_input.text == too_long.strip(), "nothing typed is lost"
        assert app.editing == 0 and "editing message 1" in app.prompt_input.border_title  # Enter edits, not sends


@pilot_test
async def test_a_reopened_chat_titles_its_replies_as_they_were_written(models):
    # every reply of a reopened chat, or of one shown again after an error, was titled "reply"
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        use_script(app.chat.engine, ScriptedReply("Sure."))
        await send(pilot, "First question")
        written = str(replies(app)[0].border_title)
        assert written != "reply" and " · " in written
        chat_id, older = app.chat.chat_id, saved_chat(app.store)  # saved before labels were kept
        app.action_new_chat()
        app.open_chat(chat_id)
        await wait_for(pilot, lambda: replies(app))
        assert [str(reply.border_title) for reply in replies(app)] == [written]
        app.open_chat(older)
        await wait_for(pilot, lambda: replies(app) and replies(app)[0].reply.text == REPLY)
        assert [str(reply.border_title) for reply in replies(app)] == ["reply"]


@pilot_test
async def test_an_edit_stopped_before_its_reply_began_is_undone(models):
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        use_script(app.chat.engine, ScriptedReply("Sure."))
        await send(pilot, "First question")
        before = [dict(m) for m in app.chat.session.messages]
        app.begin_editing(0)
        app.on_prompt_input_submitted(PromptInput.Submitted("First question, edited"))
        app.action_cancel()  # this coroutine has not yielded since: the worker thread has not begun the reply
        await wait_for(pilot, lambda: app.generation is None)
        assert app.chat.session.messages == before
        assert app.store.load_chat(app.chat.chat_id).session["messages"] == before
        assert app.editing == 0 and app.prompt_input.text == "First question, edited"
        assert "the edit is undone" in str(app.query(Note).last().render())


@pilot_test
async def test_the_message_being_written_waits_aside_while_an_earlier_one_is_edited(models):
    # F3 put the earlier message in the input, and Esc left it empty: what was being written was gone
    app = make_app(models, n_ctx=512)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        use_script(app.chat.engine, ScriptedReply("Sure."))
        await send(pilot, "First question")
        app.prompt_input.load_text("my half-written question")
        await pilot.press("f3")
        assert app.editing == 0 and app.prompt_input.text == "First question"
        await pilot.press("escape")
        assert app.editing is None and app.prompt_input.text == "my half-written question"

        await pilot.press("f3")
        app.prompt_input.load_text("First question, edited")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.generation is None and app.chat.session.messages[0]["content"].endswith("edited"))
        assert app.prompt_input.text == "my half-written question", "back once the edit is sent"

        await pilot.press("f3")  # an edit the context cannot hold: the edit comes back, the draft waits again
        app.prompt_input.load_text("word " * 4000)
        app.prompt_input.action_submit()
        await wait_for(pilot, lambda: app.generation is None and app.query(Note)
                       and "context" in str(app.query(Note).last().render()))
        assert app.editing == 0 and app.prompt_input.text == ("word " * 4000).strip()
        await pilot.press("escape")
        assert app.prompt_input.text == "my half-written question"


@pilot_test
async def test_editing_an_earlier_message_answers_it_again_and_drops_what_followed(models):
    app = make_app(models, bit_exact=True)  # at T = 0 every reply is then plain decoding's: the same for the same chat
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
async def test_blocks_that_arrive_whole_in_one_update_are_all_shown():
    """A reply whose blocks all arrive before they are mounted (a fast model, one frame) shows each of them:
    a block complete before its on_mount once stayed empty (Textual counts it mounted only after on_mount)."""
    app = _Replies()
    async with app.run_test(size=(100, 60)) as pilot:
        app.streamed.append([(REPLY, False)])
        app.streamed.finish()
        await pilot.pause()
        views = list(app.streamed.query(BlockView))
        assert [view.block.kind for view in views] == ["prose", "code", "prose"]
        shown = ["\n".join(str(segment.render()) for segment in view.children) for view in views]
        assert shown == [view.rendered.plain for view in views] and all(shown)


@pilot_test
async def test_a_code_blocks_language_is_shown_as_text_not_markup():
    app = _Replies()
    async with app.run_test(size=(100, 20)) as pilot:
        app.whole.set_text("```[red]x\nprint(1)\n```", [])
        await pilot.pause()
        [view] = app.whole.query(BlockView)
        assert view.border_title == "\\[red]x"  # escaped markup: it shows as typed


@pilot_test
async def test_the_code_tint_of_a_streamed_reply_is_the_same_after_a_restart(models):
    app = make_app(models, max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        use_script(app.chat.engine, ScriptedReply(REPLY, DRAFTED))  # a code block a tiny model would not write
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


@pilot_test
async def test_a_history_that_cannot_be_written_is_said_once_and_the_chat_is_saved_whole_later(models):
    """Another program holding the history (as a full disk or a read-only folder would) ended the app with a
    traceback, and lost the message being sent and the reply."""
    app = make_app(models, store=ChatStore(lock_wait_seconds=0.0))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        holder = sqlite3.connect(app.store.path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        use_script(app.chat.engine, ScriptedReply("First."))
        await send(pilot, "Hello")
        said = [str(note.render()) for note in app.query(Note) if "locked" in str(note.render())]
        assert len(said) == 1 and app.chat.session.messages[-1]["content"] == "First."
        holder.execute("ROLLBACK")
        holder.close()
        use_script(app.chat.engine, ScriptedReply("Second."))
        await send(pilot, "Again")
        stored = app.store.load_chat(app.chat.chat_id)
        assert [m["content"] for m in stored.session["messages"]] == ["Hello", "First.", "Again", "Second."]
        assert any("can be written again" in str(note.render()) for note in app.query(Note))


@pilot_test
async def test_a_refused_message_is_saved_neither_as_a_chat_nor_as_a_pending_prompt(models):
    """20,000 characters are more than the context holds: the message is refused, goes back to the input,
    and the saved chats stay as they were (F4 once offered the refused message as "the last chat")."""
    app = make_app(models, n_ctx=512)
    earlier = saved_chat(app.store, "an earlier chat")
    too_long = "word " * 4000
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        app.prompt_input.load_text(too_long)
        app.prompt_input.action_submit()
        await wait_for(pilot, lambda: app.generation is None and "context" in str(app.query(Note).last().render()))
        assert app.prompt_input.text == too_long.strip(), "nothing typed is lost"
        assert [chat.id for chat in app.store.list_chats()] == [earlier] and app.chat.chat_id is None
        app.prompt_input.load_text("")
        await pilot.press("f4")  # continues the earlier chat, with no prompt said to be unanswered
        await pilot.pause()
        assert app.chat.chat_id == earlier and app.prompt_input.text == ""
        assert not any("no reply" in str(note.render()) for note in app.query(Note))

        use_script(app.chat.engine, ScriptedReply("Sure."))
        await send(pilot, "One more")
        app.prompt_input.load_text(too_long)  # refused in a chat that has messages: saved without it
        app.prompt_input.action_submit()
        await wait_for(pilot, lambda: app.generation is None and "context" in str(app.query(Note).last().render()))
        stored = app.store.load_chat(earlier)
        assert stored.extras["pending_prompt"] is None
        assert [m["content"] for m in stored.session["messages"]][-2:] == ["One more", "Sure."]


@pilot_test
async def test_a_paste_is_plain_text_and_its_escape_bytes_drive_nothing(models):
    """A bracketed paste from the terminal, through the parser the app runs with (tui.paste), to the prompt."""
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        mode = app.chat.engine.mode
        raw = "\x1b[200~CCC\x1b[31mDDD\r\ntitle: \x1b]0;evil\x07set\x00 \x9b2J\tdone\x1b[201~"
        for event in PasteSafeParser().feed(raw):  # what the terminal driver would post, in order
            app.post_message(event)
        await pilot.pause()
        assert app.prompt_input.text == "CCCDDD\ntitle: set \tdone"
        assert app.chat.engine.mode == mode, "the BEL in the OSC string was no Ctrl+G"
        app.prompt_input.load_text("")
        app.post_message(events.Paste("a\x1b[1mb\x07c"))  # a Paste event from any driver is cleaned too
        await pilot.pause()
        assert app.prompt_input.text == "abc" and app.chat.engine.mode == mode


@pilot_test
async def test_a_settings_value_that_looks_like_markup_is_refused_as_typed(models):
    # the error quoting it was read as markup: "[/]" ended the app with a MarkupError, "[bold]x" lost its brackets
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        for value in ("[/]", "[bold]x", "[link=x]y"):
            await pilot.press("ctrl+s")
            app.screen.query_one("#temperature").value = value
            app.screen.query_one("#apply").press()
            await pilot.pause()
            assert isinstance(app.screen, SettingsScreen), f"temperature = {value} keeps the dialog open"
            assert repr(value) in str(app.screen.query_one("#settings-error").render())
            await pilot.press("escape")


@pilot_test
async def test_a_model_path_that_looks_like_markup_loads_with_its_name_shown_as_is(models, tmp_path):
    # the loading panel and the model info read the path as markup: a folder "a[" holding "]b.gguf" is
    # "a[/]b.gguf", a MarkupError that ended the app
    import shutil

    folder = tmp_path / "a["
    folder.mkdir()
    path = shutil.copy(models["target"], folder / "]b.gguf")
    app = make_app(models, model=str(path))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert app.chat.session is not None and not [note for note in app.query(Note) if note.has_class("error")]
        await pilot.press("f2")  # the model info names it too
        await pilot.pause()
        assert "a[/]b.gguf" in "".join(str(static.render()) for static in app.screen.query("Static"))


@pilot_test
async def test_a_chat_whose_unanswered_prompt_is_not_text_is_named_damaged_and_the_open_chat_stays(models):
    # extras hold what the app put there, but another program may have written any JSON: a number there ended
    # the app on opening the chat, after its session had already been switched
    app = make_app(models)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "Hello")
        before = (app.chat.chat_id, list(app.chat.session.messages))
        for pending in (5, ["a list"]):
            damaged = app.store.save_chat(None, "t", "/models/elsewhere.gguf", {}, {"messages": []},
                                          {"pending_prompt": pending})
            with pytest.raises(HistoryError, match=f"chat {damaged} .* is damaged"):
                app.chat.open(damaged)
            assert (app.chat.chat_id, app.chat.session.messages) == before


@pilot_test
async def test_a_bit_exact_chat_reopened_under_flash_attention_loads_the_models_again_without_it(models):
    app = make_app(models)  # flash_attn "auto": on, as bit-exact is off
    session = {"format": SESSION_FORMAT, "system_prompt": None, "context_policy": "drop-oldest",
               "messages": [{"role": "user", "content": "Sum some numbers"}, {"role": "assistant", "content": REPLY}],
               "first_visible": 0, "turn_stats": [], "params": None, "mode": "ngram"}
    app.store.save_chat(None, "Exact sums", "/models/elsewhere.gguf", {"bit_exact": True}, session,
                        {"drafted": {}, "pending_prompt": None})
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        flash_attention_engine = app.chat.engine
        assert flash_attention_engine.flash_attn and not flash_attention_engine.bit_exact
        await pilot.press("f4")
        await wait_for(pilot, lambda: app.chat.engine is not flash_attention_engine)
        assert app.chat.engine.bit_exact and not app.chat.engine.flash_attn and app.chat.settings.bit_exact
        assert [m["content"] for m in app.chat.session.messages] == ["Sum some numbers", REPLY]
        await send(pilot, "and the cat")
        assert len(app.chat.session.messages) == 4


@pilot_test
async def test_bit_exact_switched_on_during_a_reply_loads_the_models_again_once_it_ends(models):
    app = make_app(models, max_tokens=3000, n_ctx=4096)  # flash_attn "auto": on, as bit-exact is off
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        flash_attention_engine = app.chat.engine
        use_script(flash_attention_engine, ScriptedReply(REPLY, endless=True, pause_s=0.002))  # until Esc
        app.prompt_input.load_text("Tell me everything")
        app.prompt_input.action_submit()  # not pilot.press: a press waits for idle, which a streaming reply never is
        await wait_for(pilot, lambda: app.generation is not None and app.generation.view.reply.text)
        app.action_settings()
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        app.screen.query_one("#bit-exact").value = True
        app.screen.query_one("#apply").press()
        await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        assert app.generation is not None and app.loading is None  # the reply goes on in its context
        assert app.chat.engine is flash_attention_engine and app.chat.settings.bit_exact
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.chat.engine is not flash_attention_engine)
        assert app.chat.engine.bit_exact and not app.chat.engine.flash_attn and app.chat.settings.bit_exact
        last = app.chat.session.messages[-1]
        assert last["role"] == "assistant" and last.get("cancelled") and last["content"]  # what arrived is kept
        await send(pilot, "Go on")
        assert app.chat.shown_stats.bit_exact and len(app.chat.session.messages) == 4


def test_a_block_taken_off_the_screen_before_its_mount_shows_nothing_and_raises_nothing():
    # Quitting mid-reply can remove a block view after its Mount event was queued: mounting segments
    # under a detached widget raised MountError in the Mount handler, as a traceback on the way out.
    text = "one line of prose\n"
    view = BlockView(Block("prose", 0, len(text)))
    view.show(view.block, text, Text(text))
    view.on_mount()
    assert not view.is_attached
    assert list(view.children) == []
    assert view.rendered.plain == text
