"""Bad values and damaged files get one clear line (or, in the app, a notice), never a traceback or a hang.

Issue 12, section 4: out-of-range threads, NaN/inf sampling values, bad seeds
and contexts, invalid UTF-8 prompts, malformed models.json, bad config.toml
values and keys, and a chat history with overwritten pages.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import random
import sqlite3
import subprocess
import sys

import pytest

from edgespec.catalog import CatalogError, load_catalog, USER_CATALOG_NAME
from edgespec.backend import LlamaModel
from edgespec.limits import SettingError, usable_cores
from edgespec.sampling import SamplingParams
from tui.app import ChatApp
from tui.config import ChatConfig, ConfigError, load_config
from tui.history import ChatStore, HistoryError
from tui.screens import SettingsScreen
from tui.widgets import Note

EDGESPEC = [sys.executable, "-m", "edgespec"]
PAGE = 4096  # SQLite's default page size


def run_cli(*args, stdin=None, timeout=120):
    return subprocess.run([*EDGESPEC, *args], input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL,
                          capture_output=True, timeout=timeout)


def one_error_line(done) -> str:
    """The one line a refused command printed; fails on a traceback or more lines."""
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode != 0, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def tiny_run(tiny_models, *flags):
    return ["run", "hello", "--raw", "--model", str(tiny_models["target"]), "--draft", "none",
            "--n-ctx", "512", "--max-tokens", "4", "--threads", "1", *flags]


# ---------------------------------------------------------------- the command line


def test_threads_beyond_the_cores_are_refused_at_once(tiny_models):
    line = one_error_line(run_cli(*tiny_run(tiny_models), "--threads", "1000", timeout=60))
    assert "--threads" in line and f"from 1 to {usable_cores()}" in line and "1000" in line


def test_the_engine_api_refuses_threads_beyond_the_cores_too(tiny_models):
    with pytest.raises(SettingError, match=f"from 1 to {usable_cores()}"):
        LlamaModel(tiny_models["target"], n_ctx=256, n_threads=usable_cores() + 1)


@pytest.mark.parametrize("flag, value, named", [
    ("--temperature", "nan", "temperature"),
    ("--temperature", "inf", "temperature"),
    ("--top-p", "nan", "top_p"),
    ("--min-p", "nan", "min_p"),
    ("--min-p", "inf", "min_p"),
    ("--seed", "-1", "seed"),
])
def test_non_finite_sampling_values_and_negative_seeds_get_one_line(tiny_models, flag, value, named):
    done = run_cli(*tiny_run(tiny_models), flag, value)
    line = one_error_line(done)
    assert done.returncode == 2, "a usage error, like every other bad flag (issue 25)"
    assert line.startswith(f"edgespec run: argument {flag}") and named in line and value in line


def test_a_stop_string_that_is_not_utf8_is_refused_as_the_prompt_is(tiny_models):
    # it was taken, and as no reply can hold its byte, it never matched
    done = subprocess.run([*map(os.fsencode, EDGESPEC), *map(os.fsencode, tiny_run(tiny_models)), b"--stop", b"a\xe9"],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    line = one_error_line(done)
    assert done.returncode == 2 and "argument --stop: byte 0xe9 at offset 1 is not UTF-8" in line


@pytest.mark.parametrize("flag, value, valid", [
    ("--n-ctx", "0", "from 256"),
    ("--n-ctx", "100", "from 256"),
    ("--gpu-layers", "-5", "from -1"),
    ("--draft-gpu-layers", "-2", "from -1"),
    ("--n-ctx", str(2**32), "to 2147483647"),  # llama.cpp's uint32 would wrap it to 0: the trained context
])
def test_contexts_and_layer_counts_llama_cpp_would_change_are_refused(tiny_models, flag, value, valid):
    line = one_error_line(run_cli(*tiny_run(tiny_models), flag, value))
    assert flag in line and valid in line and value in line


def test_a_context_no_ram_could_hold_is_refused_before_anything_loads(tiny_models):
    # llama.cpp took a minute or more of allocating to fail at n_ctx=10**9 (Qwen 1.5B; its warning came first)
    import edgespec
    from edgespec.limits import MAX_N_CTX
    from edgespec.memory import ram_budget

    if ram_budget().total_bytes > 2**40:  # the tiny model's KV cache at the largest context is 1 TiB
        pytest.skip("this machine's RAM could hold the tiny model's largest context")
    line = one_error_line(run_cli(*tiny_run(tiny_models), "--n-ctx", str(MAX_N_CTX), timeout=60))
    assert line.startswith("edgespec: a context of 2,147,483,647 tokens needs") and line.endswith("lower --n-ctx")
    with pytest.raises(ValueError, match="of RAM: lower n_ctx"):
        edgespec.load(str(tiny_models["target"]), draft="none", n_threads=1, n_ctx=MAX_N_CTX)
    with pytest.raises(ValueError, match="in each of parallel's 2 sequences"):
        edgespec.load(str(tiny_models["target"]), draft="none", n_threads=1, n_ctx=MAX_N_CTX // 2, parallel=2)


@pytest.mark.parametrize("flag", ["--kv-type", "--draft-kv-type"])
def test_an_unknown_kv_cache_type_is_one_line_listing_the_choices(tiny_models, flag):
    line = one_error_line(run_cli(*tiny_run(tiny_models), flag, "q5"))
    assert flag in line and "'q5'" in line and "f16, q8_0, q4_0" in line


def test_flash_attention_with_bit_exact_is_one_line_naming_both(tiny_models):
    line = one_error_line(run_cli(*tiny_run(tiny_models), "--flash-attn", "--bit-exact"))
    assert "--flash-attn" in line and "--bit-exact" in line


def test_argparse_errors_are_one_line_too():
    line = one_error_line(run_cli("run"))
    assert line.startswith("edgespec run:") and "prompt" in line and "--help" in line


def test_invalid_utf8_on_stdin_names_the_byte_offset(tiny_models):
    done = run_cli(*["-" if arg == "hello" else arg for arg in tiny_run(tiny_models)], stdin=b"\xff\xfe\x00abc")
    line = one_error_line(done)
    assert "stdin is not UTF-8" in line and "offset 0" in line and "0xff" in line


def test_invalid_utf8_in_the_prompt_argument_names_the_byte_offset(tiny_models):
    args = tiny_run(tiny_models)
    args[1] = b"ab\xffc"  # the shell passes bytes; Python keeps the bad one as a lone surrogate
    line = one_error_line(run_cli(*args))
    assert "the prompt is not UTF-8" in line and "offset 2" in line


def test_a_read_error_on_stdin_is_one_line(tiny_models, tmp_path):
    args = ["-" if arg == "hello" else arg for arg in tiny_run(tiny_models)]
    with open(tmp_path / "write-only", "wb") as write_only:  # reading it fails with EBADF
        done = subprocess.run([*EDGESPEC, *args], stdin=write_only, capture_output=True, timeout=120)
    assert "cannot read the prompt from stdin" in one_error_line(done)


def test_a_nul_byte_in_valid_utf8_is_just_text(tiny_models):
    args = ["-" if arg == "hello" else arg for arg in tiny_run(tiny_models, "--json", "--temperature", "0")]
    done = run_cli(*args, stdin="a\x00bc".encode())
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) == 4


# ---------------------------------------------------------------- SamplingParams, the one place


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.5), ("temperature", 1e-320),
    ("top_p", math.nan), ("top_p", -0.1), ("top_p", math.inf), ("min_p", math.nan), ("min_p", -math.inf),
    ("top_k", -1), ("top_k", 2.5), ("max_tokens", 0), ("max_tokens", True),
    ("seed", -1), ("seed", 2**64), ("seed", 1.5), ("temperature", "0.7"), ("stop", 7),
])
def test_sampling_params_refuse_bad_values_naming_the_field_and_range(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be .*(from|in|or) .*, not "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("load_options, named", [
    ({"n_ctx": -5}, "n_ctx"), ({"kv_type": "q3"}, "kv_type"), ({"flash_attn": "maybe"}, "flash_attn"),
])
def test_a_bad_load_option_is_a_value_error_as_the_readme_says(tiny_models, load_options, named):
    # they were EdgespecErrors only, which a caller's `except ValueError` let through
    import edgespec

    with pytest.raises(ValueError, match=named):
        edgespec.load(str(tiny_models["target"]), draft="none", n_threads=1, **load_options)


@pytest.mark.parametrize("prompt", [[], ["a"], [10**9]])
def test_a_bad_prompt_of_token_ids_is_a_value_error(tiny_models, prompt):
    import edgespec

    with edgespec.load(str(tiny_models["target"]), draft="none", n_threads=1, n_ctx=512) as engine:
        with pytest.raises(ValueError, match="prompt"):
            next(engine.stream_tokens(prompt, SamplingParams(max_tokens=2)))


def test_stop_strings_past_the_most_accepted_are_refused():
    from edgespec.sampling import MAX_STOPS

    assert len(SamplingParams(stop=[f"s{i}" for i in range(MAX_STOPS)]).stop) == MAX_STOPS
    with pytest.raises(ValueError, match=f"stop holds {MAX_STOPS + 1} strings; at most {MAX_STOPS}"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOPS + 1)])


def test_an_empty_stop_string_is_refused_not_dropped(tiny_models):
    # the stop check skips an empty string, so accepted it would stop nothing without a word
    with pytest.raises(ValueError, match="stop string may not be empty"):
        SamplingParams(stop=["END", ""])
    done = run_cli(*tiny_run(tiny_models), "--stop", "")
    assert done.returncode == 2 and "stop string may not be empty" in one_error_line(done)


def test_sampling_params_take_the_whole_valid_range():
    params = SamplingParams(temperature=0, top_k=0, top_p=1, min_p=0, max_tokens=1, seed=2**64 - 1, stop="x")
    assert params.greedy and params.seed == 2**64 - 1 and params.stop == ("x",)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)


# ---------------------------------------------------------------- models.json


@pytest.mark.parametrize("content", [
    "[1, 2, 3]",
    '"models"',
    '{"models": 5}',
    '{"models": [1]}',
    '{"models": [{"name": "x", "sources": "nowhere"}]}',
    '{"models": [{"name": "x", "sources": ["nowhere"]}]}',
    '{"models": [{"name": "x", "sources": [{"kind": "path", "path": 5}]}]}',
    '{"models": [{"name": "x", "size": "big", "sources": [{"kind": "path", "path": "/x.gguf"}]}]}',
])
def test_a_malformed_models_json_is_one_line(tmp_path, monkeypatch, content):
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path))
    (tmp_path / USER_CATALOG_NAME).write_text(content)
    with pytest.raises(CatalogError, match="models.json"):
        load_catalog()
    line = one_error_line(run_cli("run", "hi", "--model", "x"))
    assert "models.json" in line


# ---------------------------------------------------------------- config.toml


@pytest.mark.parametrize("toml, named", [
    ('draft_tint = "notacolor"', "draft_tint"),
    ("[sampling]\ntemperature = nan", "temperature"),
    ("[sampling]\ntemperature = inf", "temperature"),
    ("[sampling]\ntop_p = nan", "top_p"),
    ("[sampling]\nmin_p = inf", "min_p"),
    ("n_ctx = 0", "n_ctx"),
    ("n_ctx = 100", "n_ctx"),
    ("gpu_layers = -7", "gpu_layers"),
    ('memory_budget = "lots"', "memory_budget"),
    ('prompt_cache_size = "lots"', "prompt_cache_size"),  # loaded the model, then failed inside the app
    ('prompt_cache_size = "0"', "prompt_cache_size"),
    ('kv_type = "q5"', "kv_type"),
    ('draft_kv_type = "f32"', "draft_kv_type"),
    ('flash_attn = "yes"', "flash_attn"),
    ('[keymap]\nregenerate = "notakey"', "'notakey'"),
    ('[keymap]\nhistory = "ctrl+o,,f5"', "history"),
    ('[keymap]\nsettings = "hyperctrl+s"', "'hyperctrl+s'"),
    ("sampling = 3", "[sampling]"),
])
def test_config_values_the_app_cannot_use_are_refused_by_the_loader(tmp_path, toml, named):
    path = tmp_path / "config.toml"
    path.write_text(toml + "\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    message = str(refused.value)
    assert message.startswith(str(path)) and named in message and "\n" not in message


def test_config_keys_textual_knows_are_accepted(tmp_path):
    path = tmp_path / "config.toml"
    # escape is cancel's by default: moved, so that no key is two actions' (test_tui_parts)
    path.write_text('draft_tint = "dark_green"\n[keymap]\nregenerate = "ctrl+comma,f5,escape,ctrl+shift+up,alt+plus,alt+a"\n'
                    'cancel = "f9"\n')
    assert load_config(path).keymap == {"regenerate": "ctrl+comma,f5,escape,ctrl+shift+up,alt+plus,alt+a", "cancel": "f9"}


# ---------------------------------------------------------------- the chat history


def write_history(path, chats: int = 60) -> None:
    store = ChatStore(path)
    for i in range(chats):
        store.save_chat(None, f"chat {i}", "/m.gguf", {}, {"messages": [{"role": "user", "content": "x" * 3000}]}, {})
        store.add_prompt(f"prompt {i} " + "y" * 500)
    store.close()


def overwrite_pages(path, count: int, seed: int, first: int = 1) -> None:
    rng = random.Random(seed)
    pages = path.stat().st_size // PAGE
    with open(path, "r+b") as file:
        for page in rng.sample(range(first, pages), count):
            file.seek(page * PAGE)
            file.write(rng.randbytes(PAGE))


def assert_moved_aside_and_fresh(store: ChatStore, path, damaged: bytes) -> None:
    [notice] = store.notices
    [backup] = path.parent.glob(f"{path.name}.corrupt-*[0-9]")
    assert str(backup) in notice and "damaged" in notice
    assert backup.read_bytes() == damaged
    assert store.list_chats() == [] and store.recent_prompts() == []
    chat = store.save_chat(None, "after", "/m.gguf", {}, {"messages": []}, {})
    assert [c.title for c in store.list_chats()] == ["after"] and store.load_chat(chat).title == "after"
    assert store.notices == [notice], "said once"


@pytest.mark.parametrize("seed", range(4))
def test_a_history_with_overwritten_pages_is_moved_aside_at_start(tmp_path, seed):
    path = tmp_path / "history.sqlite3"
    write_history(path)
    overwrite_pages(path, 3, seed)
    damaged = path.read_bytes()
    store = ChatStore(path)
    store.list_chats()
    store.recent_prompts()
    assert_moved_aside_and_fresh(store, path, damaged)


def test_a_history_whose_header_page_is_overwritten_is_moved_aside(tmp_path):
    path = tmp_path / "history.sqlite3"
    write_history(path, chats=5)
    overwrite_pages(path, 1, seed=0, first=0)
    with open(path, "r+b") as file:
        file.write(b"\x00" * 100)  # the header: not a database any more
    damaged = path.read_bytes()
    assert_moved_aside_and_fresh(ChatStore(path), path, damaged)


def test_damage_found_by_a_later_query_is_moved_aside_with_its_wal(tmp_path):
    path = tmp_path / "history.sqlite3"
    write_history(path)
    store = ChatStore(path)
    said = []
    store.on_notice = said.append
    old_chat = store.list_chats()[-1].id
    # Another writer commits (so the store's cached pages are stale), then pages go bad under both.
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("INSERT INTO prompts (text, created_at) VALUES ('from another window', 0)")
    overwrite_pages(path, 10, seed=1)
    assert store.list_chats() == []
    assert len(said) == 1 and said == store.notices
    backups = sorted(p.name for p in tmp_path.glob("history.sqlite3.corrupt-*"))
    assert [name.rsplit("-", 1)[-1] for name in backups[1:]] == ["shm", "wal"]
    # The chat the app had open is saved again in the fresh history, under a new id.
    again = store.save_chat(old_chat, "still here", "/m.gguf", {}, {"messages": []}, {})
    assert [c.title for c in store.list_chats()] == ["still here"] and store.load_chat(again).title == "still here"
    other.close()


def test_a_locked_history_is_said_once_and_is_not_moved_aside(tmp_path):
    path = tmp_path / "history.sqlite3"
    write_history(path, chats=2)
    store = ChatStore(path, lock_wait_seconds=0.0)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    store.add_prompt("blocked")
    assert store.save_chat(7, "t", "/m.gguf", {}, {"messages": []}, {}) == 7  # the app goes on with its id
    assert len(store.notices) == 1 and "locked" in store.notices[0]
    holder.execute("ROLLBACK")
    store.add_prompt("free")
    assert not list(tmp_path.glob("*.corrupt-*")) and "can be written again" in store.notices[-1]
    assert len(store.list_chats()) == 2


def test_a_stored_chat_with_damaged_json_is_a_history_error(tmp_path):
    store = ChatStore(tmp_path / "h.sqlite3")
    chat = store.save_chat(None, "t", "/m.gguf", {}, {"messages": []}, {})
    outside = sqlite3.connect(tmp_path / "h.sqlite3")  # damaged from outside, as a disk or another program would
    with outside:
        outside.execute("UPDATE chats SET session = '{not json' WHERE id = ?", (chat,))
    outside.close()
    with pytest.raises(HistoryError, match=f"chat {chat} .* is damaged"):
        store.load_chat(chat)


# ---------------------------------------------------------------- the chat app


def pilot_test(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))

    return run


async def wait_for(pilot, condition, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "timed out waiting for the app"
        await asyncio.sleep(0.02)
    await pilot.pause()


def tiny_app(tiny_models) -> ChatApp:
    config = ChatConfig(model=str(tiny_models["target"]), draft="ngram", temperature=0.0, max_tokens=8, n_ctx=512)
    return ChatApp(config, ChatStore(), n_threads=1)


@pilot_test
async def test_the_app_starts_on_a_damaged_history_and_says_so_once(tiny_models, tmp_path):
    from tui.history import data_dir

    path = data_dir() / "history.sqlite3"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_history(path)
    overwrite_pages(path, 3, seed=2)
    app = tiny_app(tiny_models)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.chat.session is not None)
        notes = [str(note.render()) for note in app.query(Note)]
        assert sum("chat history was damaged" in note for note in notes) == 1, notes
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert type(app.screen).__name__ == "HistoryScreen"


@pilot_test
async def test_the_settings_screen_refuses_nan(tiny_models):
    app = tiny_app(tiny_models)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.chat.session is not None)
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#temperature").value = "nan"
        await pilot.click("#apply")
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen), "a NaN temperature keeps the dialog open"
        error = str(app.screen.query_one("#settings-error").render())
        assert "temperature" in error and "nan" in error
        app.screen.query_one("#temperature").value = "0.5"
        app.screen.query_one("#draft-tokens").value = "40"
        app.screen.query_one("#apply").press()  # a second click this soon would count as a double click
        error = app.screen.query_one("#settings-error")
        await wait_for(pilot, lambda: "draft_tokens" in str(error.render()))
        assert isinstance(app.screen, SettingsScreen)
        await pilot.press("escape")
        assert math.isclose(app.chat.settings.sampling.temperature, 0.0)
