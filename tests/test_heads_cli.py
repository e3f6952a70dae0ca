"""`edgespec heads train|show` on a tiny model: a heads file in the cache dir, its summary, and one-line refusals."""

from __future__ import annotations

import os

from edgespec.commands import main
from edgespec.heads.store import default_heads_path


def test_train_then_show_then_refuse_a_damaged_file(tiny_models, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("the cat sat on the mat and the cat sat on the mat. " * 20)
    (notes / "binary.bin").write_bytes(b"\0\1\2" * 100)  # skipped: not text
    model = str(tiny_models["target"])
    assert main(["heads", "train", str(notes), "--model", model, "--minutes", "1", "--threads", "1",
                 "--vocab", "64", "--max-tokens", "300"]) == 0
    out, err = capsys.readouterr()
    heads_file = default_heads_path(tiny_models["target"])
    assert heads_file.is_file() and str(heads_file) in out and "held-out accuracy" in out
    assert "heads:" in err  # the progress line goes to stderr

    assert main(["heads", "show", "--model", model]) == 0
    assert "hydra heads trained on" in capsys.readouterr().out

    heads_file.write_bytes(heads_file.read_bytes()[:100])
    assert main(["heads", "show", "--model", model]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "damaged" in err
    assert main(["run", "hello", "--model", model, "--draft", "heads", "--max-tokens", "4", "--threads", "1"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("edgespec: heads file") and "damaged" in err


def test_training_again_keeps_the_heads_it_replaces_and_refuses_to_write_over_other_files(tiny_models, tmp_path,
                                                                                          monkeypatch, capsys):
    # the old code wrote over both without a word: a better heads file, and a notes file named by --output
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a.txt").write_text("the cat sat on the mat and the cat sat on the mat. " * 20)
    train = ["heads", "train", str(tmp_path / "a.txt"), "--model", str(tiny_models["target"]), "--minutes", "1",
             "--threads", "1", "--vocab", "64", "--max-tokens", "300"]
    assert main(train) == 0
    heads_file = default_heads_path(tiny_models["target"])
    first = heads_file.read_bytes()
    capsys.readouterr()

    assert main(train) == 0
    kept = heads_file.with_name(heads_file.stem + ".previous.npz")
    assert kept.read_bytes() == first and f"the heads this run replaced are kept at {kept}" in capsys.readouterr().err

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert main([*train, "--output", str(notes)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a heads file" in err and notes.read_text() == "my notes\n"


def test_a_path_that_is_neither_a_file_nor_a_folder_is_named_as_such(tiny_models, tmp_path, monkeypatch, capsys):
    # a FIFO or /dev/zero gave "no training text ... (give more --minutes)", which no minutes could mend
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert main(["heads", "train", str(fifo), "--model", str(tiny_models["target"]), "--minutes", "1",
                 "--threads", "1", "--no-builtin"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a file or a folder" in err
