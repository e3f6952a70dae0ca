"""`edgespec heads train|show` on a tiny model: a heads file in the cache dir, its summary, and one-line refusals."""

from __future__ import annotations

import fcntl
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
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.txt", "cache", "notes.txt"]  # no lock file beside


def test_a_run_that_saves_no_heads_leaves_the_heads_kept_before_as_they_are(tiny_models, tmp_path, monkeypatch,
                                                                            capsys):
    # the copy of the heads to be replaced was made at the start: a run that then failed wrote it over the
    # .previous file an earlier run had kept, and the README tells how to take those back
    import edgespec.heads.job
    from edgespec.errors import EdgespecError

    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a.txt").write_text("the cat sat on the mat and the cat sat on the mat. " * 20)
    train = ["heads", "train", str(tmp_path / "a.txt"), "--model", str(tiny_models["target"]), "--minutes", "1",
             "--threads", "1", "--vocab", "64", "--max-tokens", "300"]
    assert main(train) == 0 and main([*train, "--n-heads", "2"]) == 0  # heads of their own, to be told apart
    heads_file = default_heads_path(tiny_models["target"])
    kept = heads_file.with_name(heads_file.stem + ".previous.npz")
    kept_before, current = kept.read_bytes(), heads_file.read_bytes()
    assert kept_before != current
    capsys.readouterr()

    def fails(*args, **kwargs):  # as the time running out, a full disk or Ctrl-C end a run
        raise EdgespecError("the time ran out")

    monkeypatch.setattr(edgespec.heads.job, "train_heads", fails)
    assert main(train) == 1
    assert kept.read_bytes() == kept_before and heads_file.read_bytes() == current
    lock = heads_file.name + ".training.lock"  # kept, as lock files are: the lock goes with the process
    assert sorted(path.name for path in heads_file.parent.iterdir()) == sorted([heads_file.name, kept.name, lock])


def test_a_heads_file_that_cannot_be_written_is_refused_before_the_training(tiny_models, tmp_path, monkeypatch,
                                                                           capsys):
    # found out after the whole budget, with the work lost: a directory in its place, or a folder not writable
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    default_heads_path(tiny_models["target"]).mkdir(parents=True)
    train = ["heads", "train", "--model", str(tiny_models["target"]), "--minutes", "1", "--threads", "1"]
    assert main(train) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a directory, where the heads file goes" in err
    assert main([*train, "--output", os.path.join(os.devnull, "heads.npz")]) == 1  # a folder that cannot be
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a file stands where a folder of that path goes" in err


def test_more_max_tokens_than_ram_can_hold_is_refused_before_the_model_loads(tiny_models, tmp_path, monkeypatch,
                                                                             capsys):
    # any number was taken: the positions' hidden states grew until the process was killed for memory
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["heads", "train", "--model", str(tiny_models["target"]), "--max-tokens", str(10**15),
                 "--minutes", "1", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--max-tokens {10**15} keeps " in err and "give --max-tokens " in err
    assert not default_heads_path(tiny_models["target"]).exists()


def test_a_second_training_of_the_same_heads_is_refused_while_the_first_runs(tiny_models, tmp_path, monkeypatch,
                                                                             capsys):
    # two at once took turns overwriting the heads and the resume file; the last to save won
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a.txt").write_text("the cat sat on the mat. " * 40)
    heads_path = default_heads_path(tiny_models["target"])
    heads_path.parent.mkdir(parents=True)
    train = ["heads", "train", str(tmp_path / "a.txt"), "--model", str(tiny_models["target"]), "--minutes", "1",
             "--threads", "1", "--vocab", "64", "--max-tokens", "300"]
    other = os.open(heads_path.with_name(heads_path.name + ".training.lock"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the first training, as another process holds it
        assert main(train) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"another `edgespec heads train` is writing {heads_path}" in err
        assert not heads_path.exists()
    finally:
        os.close(other)
    assert main(train) == 0 and heads_path.exists()  # once it has ended
    assert main(train) == 0, "a training that ended let go of its lock"


def test_a_path_that_is_neither_a_file_nor_a_folder_is_named_as_such(tiny_models, tmp_path, monkeypatch, capsys):
    # a FIFO or /dev/zero gave "no training text ... (give more --minutes)", which no minutes could mend
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert main(["heads", "train", str(fifo), "--model", str(tiny_models["target"]), "--minutes", "1",
                 "--threads", "1", "--no-builtin"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a file or a folder" in err


def test_plan_with_heads_says_heads_and_whether_any_are_trained(tiny_models, tmp_path, monkeypatch, capsys):
    # the plan said "ngram ... n-gram drafting as asked", and "fits" with no heads trained, where run refuses;
    # then "the heads trained for this model as asked" above "no heads are trained"
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    plan = ["plan", "--model", str(tiny_models["target"]), "--draft", "heads"]
    assert main(plan) == 0
    out = " ".join(capsys.readouterr().out.split())  # the caption wraps at the table's width
    assert "edgespec plan: heads on" in out and "drafting heads as asked" in out and "heads trained" not in out
    assert "no heads are trained for" in out and "edgespec heads train --model" in out

    (tmp_path / "a.txt").write_text("the cat sat on the mat and the cat sat on the mat. " * 20)
    assert main(["heads", "train", str(tmp_path / "a.txt"), "--model", str(tiny_models["target"]), "--minutes", "1",
                 "--threads", "1", "--vocab", "64", "--max-tokens", "300"]) == 0
    capsys.readouterr()
    assert main(plan) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "edgespec plan: heads on" in out and "drafting heads as asked" in out and "no heads are trained" not in out


def test_sigterm_stops_a_training_as_ctrl_c_does_keeping_the_work(tiny_models, tmp_path, monkeypatch, capsys):
    # kill, timeout and docker stop ended a training at once, the work since the last resume file lost
    import signal

    import edgespec.commands.heads as heads_command

    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a.txt").write_text("the cat sat on the mat and the cat sat on the mat. " * 20)
    reached_the_default = []  # stands in for SIGTERM's default action, which would end this test process
    previous = signal.signal(signal.SIGTERM, lambda *_: reached_the_default.append(True))
    shown = heads_command.ProgressLine.__call__

    def terminated_while_training(self, phase, *rest):
        shown(self, phase, *rest)
        if phase == "training":
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(heads_command.ProgressLine, "__call__", terminated_while_training)
    try:
        code = main(["heads", "train", str(tmp_path / "a.txt"), "--model", str(tiny_models["target"]), "--minutes", "1",
                     "--threads", "1", "--vocab", "64", "--max-tokens", "300"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    heads_file = default_heads_path(tiny_models["target"])
    assert not reached_the_default and code == 130
    assert heads_file.with_name(heads_file.stem + ".resume.npz").exists() and not heads_file.exists()
    assert "what was done is kept in" in capsys.readouterr().err
