"""Learned priors: what a model's drafters were accepted at here before, kept between processes."""

import json
import subprocess
import sys
import time

import pytest

from edgespec.acceptance import LEARNED_WEIGHT_MAX
from edgespec.hindsight import COPY_BUCKETS
from edgespec.controller import controller_for
from edgespec.costs import CostModel
from edgespec.learned import (MIN_PRIOR_WEIGHT, SPREAD_KEEP, SPREAD_MIN_GENERATIONS, STORE_KEEP, STORE_MAX_TRIES,
                              LearnedAcceptance, add_generation, forget_all, prior_counts)

CURVE = CostModel([1.0, 1.58, 2.23, 2.67, 3.1, 3.54, 3.97, 4.4, 4.5, 4.6, 4.7, 4.8, 4.9, 5.0, 5.1, 5.2])


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def copying_counts(tries=40.0):
    """What a generation that copied all the time leaves: every copy of 4 or more tokens went on."""
    return {c: ([tries], [tries]) for c in range(COPY_BUCKETS.index(4), len(COPY_BUCKETS))}


def test_a_generation_fades_the_old_counts_and_caps_them():
    stored = add_generation({}, {1: ([10.0], [20.0])})
    stored = add_generation(stored, {1: ([5.0], [5.0]), 2: ([1.0], [2.0])})
    assert stored[1]["hits"] == pytest.approx([10.0 * STORE_KEEP + 5.0])
    assert stored[1]["tries"] == pytest.approx([20.0 * STORE_KEEP + 5.0])
    assert stored[2]["hits"] == [1.0] and stored[2]["tries"] == [2.0]
    big = add_generation({}, {1: ([1000.0], [2000.0])})
    assert big[1]["tries"] == [STORE_MAX_TRIES] and big[1]["hits"] == [STORE_MAX_TRIES / 2]


def test_the_spread_counts_the_generations_that_tried_a_position_enough():
    stored = add_generation({}, {1: ([3.0, 1.0], [4.0, 1.0])})  # position 2 tried once: says little
    assert stored[1]["generations"] == [1.0, 0.0]
    assert stored[1]["rates"] == [0.75, 0.0] and stored[1]["squares"] == [0.5625, 0.0]
    stored = add_generation(stored, {})  # a generation of another drafter or class fades it
    assert stored[1]["generations"] == pytest.approx([SPREAD_KEEP, 0.0])


def stored_after(rates, tries=40.0):
    """The store after one generation per rate, each trying the one position `tries` times."""
    stored = {}
    for rate in rates:
        stored = add_generation(stored, {7: ([rate * tries], [tries])})
    return stored


def weight_of(stored):
    return prior_counts(stored)[7][1][0]


def test_generations_that_agree_make_a_prior_worth_more_than_ones_that_disagree():
    agreeing = stored_after([0.9] * 10)
    disagreeing = stored_after([0.5, 1.0] * 5)
    assert weight_of(agreeing) == LEARNED_WEIGHT_MAX
    assert weight_of(disagreeing) == MIN_PRIOR_WEIGHT
    hits, tries = prior_counts(agreeing)[7]
    assert hits[0] / tries[0] == pytest.approx(0.9)  # the weight changes, not the rate


def test_a_spread_no_wider_than_chance_gives_the_most_weight_and_a_wider_one_less():
    # the same mean rate, 0.8: rates that part by what 40 tries give by chance, and rates that part by more
    chance = stored_after([0.75, 0.85] * 5)
    wider = stored_after([0.6, 1.0] * 5)
    assert weight_of(chance) == LEARNED_WEIGHT_MAX
    assert MIN_PRIOR_WEIGHT < weight_of(wider) < LEARNED_WEIGHT_MAX


def test_few_generations_make_a_prior_worth_the_minimum():
    generations = 0
    stored = {}
    while generations * SPREAD_KEEP + 1 < SPREAD_MIN_GENERATIONS:  # one generation short of trusting the spread
        stored = add_generation(stored, {7: ([36.0], [40.0])})
        generations = generations * SPREAD_KEEP + 1
    assert weight_of(stored) == MIN_PRIOR_WEIGHT
    assert weight_of(add_generation(stored, {7: ([36.0], [40.0])})) == LEARNED_WEIGHT_MAX


def test_a_new_controller_starts_from_what_the_model_learned(model_file, tmp_path):
    store = LearnedAcceptance(model_file, tmp_path / "learned.json")
    assert store.prior("ngram") is None
    cold = controller_for("ngram", CURVE, 15, learned=store.prior("ngram"))
    store.learn("ngram", copying_counts())
    warm = controller_for("ngram", CURVE, 15, learned=LearnedAcceptance(model_file, store.path).prior("ngram"))
    assert warm.acceptance(4)[0] > cold.acceptance(4)[0]
    assert warm.choose(4) > cold.choose(4) == 0
    assert warm.acceptance(3)[0] == pytest.approx(cold.acceptance(3)[0])  # shorter copies keep the neutral prior


def test_a_learned_prior_counts_for_little_against_the_text_at_hand(model_file, tmp_path):
    store = LearnedAcceptance(model_file, tmp_path / "learned.json")
    for _ in range(20):
        store.learn("ngram", copying_counts())
    controller = controller_for("ngram", CURVE, 15, learned=store.prior("ngram"))
    context = list(range(100))
    for step in range(8):  # the drafter's guesses for this text are always wrong
        controller.watch(context, 4, lambda: [-1] * 15)
        context.append(step)
    assert controller.choose(4) == 0


def test_drafters_and_models_are_kept_apart(model_file, tmp_path):
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(10))
    path = tmp_path / "learned.json"
    LearnedAcceptance(model_file, path).learn("ngram", copying_counts())
    assert LearnedAcceptance(model_file, path).prior("draft-model") is None
    assert LearnedAcceptance(other, path).prior("ngram") is None
    assert LearnedAcceptance(model_file, path).forget() is True
    assert LearnedAcceptance(model_file, path).prior("ngram") is None
    assert LearnedAcceptance(model_file, path).forget() is False


def test_a_read_only_store_is_never_written(model_file, tmp_path):
    store = LearnedAcceptance(model_file, tmp_path / "learned.json", writable=False)
    store.learn("ngram", copying_counts())
    assert not store.path.exists()


@pytest.mark.parametrize("content, why", [("not json", "it is not JSON"),
                                          ("[]", "it is not a learned-priors file"),
                                          (json.dumps({"format": "4", "models": {}}), "it is not a learned-priors file")])
def test_a_file_that_is_not_a_store_is_said_once_and_moved_aside_before_a_new_one_begins(model_file, tmp_path,
                                                                                         content, why):
    path = tmp_path / "learned.json"
    path.write_text(content)
    said = []
    store = LearnedAcceptance(model_file, path, notice=said.append)
    assert store.prior("ngram") is None
    assert said == [f"the learned priors in {path} are not read: {why}; moved it to learned.json.unreadable "
                    "and began a new one"]
    assert (tmp_path / "learned.json.unreadable").read_text() == content  # whatever was edited there is kept
    store.learn("ngram", copying_counts())
    assert store.prior("ngram") is not None and len(said) == 1


def test_a_second_damaged_store_is_moved_aside_beside_the_first_not_over_it(model_file, tmp_path):
    # the second hand edit's rename replaced learned.json.unreadable: the first edit was lost
    path = tmp_path / "learned.json"
    for edit in ("HAND EDIT ONE", "HAND EDIT TWO", "HAND EDIT THREE"):
        path.write_text(edit)
        LearnedAcceptance(model_file, path, notice=lambda text: None).prior("ngram")
    kept = [(tmp_path / name).read_text() for name in
            ("learned.json.unreadable", "learned.json.unreadable.1", "learned.json.unreadable.2")]
    assert kept == ["HAND EDIT ONE", "HAND EDIT TWO", "HAND EDIT THREE"]


def test_a_read_only_store_says_a_file_it_cannot_read_and_leaves_it_where_it_is(model_file, tmp_path):
    path = tmp_path / "learned.json"
    path.write_text("not json")
    said = []
    store = LearnedAcceptance(model_file, path, writable=False, notice=said.append)
    assert store.prior("ngram") is None and store.prior("ngram") is None
    assert said == [f"the learned priors in {path} are not read: it is not JSON"]
    assert path.read_text() == "not json" and not (tmp_path / "learned.json.unreadable").exists()


def test_a_newer_edgespec_s_file_is_neither_read_nor_written_over(model_file, tmp_path):
    path = tmp_path / "learned.json"
    newer = json.dumps({"format": 99, "models": {"x": {"ngram": {"a": 1}}}})
    path.write_text(newer)
    said = []
    store = LearnedAcceptance(model_file, path, notice=said.append)
    assert store.prior("ngram") is None
    store.learn("ngram", copying_counts())
    assert store.forget() is False
    assert path.read_text() == newer
    assert len(said) == 1 and "a newer edgespec wrote it (format 99)" in said[0]


def test_an_older_format_s_counts_are_replaced_without_a_word(model_file, tmp_path):
    path = tmp_path / "learned.json"
    path.write_text(json.dumps({"format": 1, "models": {"x": {"ngram": {"a": 1}}}}))
    said = []
    store = LearnedAcceptance(model_file, path, notice=said.append)
    assert store.prior("ngram") is None
    store.learn("ngram", copying_counts())
    assert store.prior("ngram") is not None and said == []
    assert not (tmp_path / "learned.json.unreadable").exists()


@pytest.mark.parametrize("entry", [
    {"1": [[1.0], [2.0]]},  # format 3's (hits, tries) pair
    {"1": {"hits": [1.0], "tries": [2.0], "generations": [1.0], "rates": [0.5], "squares": [0.25]}},  # a field missing
    {"1": {"hits": [1.0], "tries": [2.0, 3.0], "generations": [1.0], "rates": [0.5], "squares": [0.25],
           "inverse_tries": [0.5]}},  # fields of different lengths
    {"1": {"hits": [1.0], "tries": [2.0], "generations": [1.0], "rates": [2.0], "squares": [0.25],
           "inverse_tries": [0.5]}},  # more rates than generations
    {"1": {"hits": [1.0], "tries": [2.0], "generations": [1.0], "rates": [0.5], "squares": [0.25],
           "inverse_tries": [float("nan")]}},
])
def test_a_damaged_entry_is_ignored_and_replaced(model_file, tmp_path, entry):
    from edgespec.learned import FORMAT, model_identity

    path = tmp_path / "learned.json"
    path.write_text(json.dumps({"format": FORMAT, "models": {model_identity(model_file): {"ngram": entry}}}))
    store = LearnedAcceptance(model_file, path)
    assert store.prior("ngram") is None
    store.learn("ngram", copying_counts())
    assert store.prior("ngram") is not None


def test_forget_all_deletes_the_file(tmp_path, model_file):
    path = tmp_path / "learned.json"
    LearnedAcceptance(model_file, path).learn("ngram", copying_counts())
    assert forget_all(path) == path and not path.exists()
    forget_all(path)  # nothing to delete is fine


# -- through the engine and the command line --------------------------------------------------


def test_a_finished_generation_teaches_the_next_engine(tiny_models):
    from edgespec import SamplingParams
    from edgespec.loading import load_engine, use_learning

    curve = tuple(CURVE.forward_seconds[:5])
    engine = load_engine(tiny_models["target"], "ngram", n_ctx=512, cost_curve=curve)
    use_learning(engine)
    try:
        engine.generate("hello world, hello world, hello", SamplingParams(temperature=0.0, max_tokens=40), raw=True)
    finally:
        engine.close()
    store = LearnedAcceptance(tiny_models["target"])
    learned = store.prior("ngram")
    assert learned and any(sum(tries) > 0 for _, tries in learned.values())

    cold = load_engine(tiny_models["target"], "ngram", n_ctx=512, cost_curve=curve)
    use_learning(cold, "read")
    try:
        cold.generate("the cat", SamplingParams(temperature=0.0, max_tokens=4), raw=True)
    finally:
        cold.close()
    assert store.prior("ngram") == learned  # a read-only engine adds nothing


def test_forget_learning_from_the_command_line(tiny_models, capsys):
    from edgespec.commands import main

    store = LearnedAcceptance(tiny_models["target"])
    store.learn("ngram", copying_counts())
    assert main(["models", "forget-learning", str(tiny_models["target"])]) == 0
    assert store.prior("ngram") is None and "forgot" in capsys.readouterr().out
    assert main(["models", "forget-learning", str(tiny_models["target"])]) == 0
    assert "nothing learned" in capsys.readouterr().out
    store.learn("ngram", copying_counts())
    assert main(["models", "forget-learning"]) == 0
    assert not store.path.exists()


@pytest.mark.parametrize("entry", [[1, 2], {"ngram": {"1": {"hits": "lots"}}}])
def test_a_model_s_entry_that_is_not_counts_is_said_once_as_it_is_begun_anew(model_file, tmp_path, entry):
    path = tmp_path / "learned.json"
    said = []
    store = LearnedAcceptance(model_file, path, notice=said.append)
    path.write_text(json.dumps({"format": 4, "models": {store.model: entry}}))
    store.learn("ngram", copying_counts())
    store.learn("ngram", copying_counts())
    assert store.prior("ngram") is not None
    assert said == [f"the learned priors of this model in {path} are not counts (a hand edit?); began its counts "
                    "for ngram drafts anew"]


LEARN_IN_A_PROCESS = """
import sys
from pathlib import Path
from edgespec.hindsight import COPY_BUCKETS
from edgespec.learned import LearnedAcceptance
store = LearnedAcceptance(Path(sys.argv[1]), Path(sys.argv[2]))
counts = {c: ([40.0], [40.0]) for c in range(COPY_BUCKETS.index(4), len(COPY_BUCKETS))}
Path(sys.argv[3]).touch()
while not Path(sys.argv[4]).exists():  # both processes start learning together
    pass
for _ in range(int(sys.argv[5])):
    store.learn("ngram", counts)
"""


def test_two_processes_learning_at_once_keep_every_generation(model_file, tmp_path):
    # each read the store, added its generation and wrote it back, so one wrote over the other's
    path, go, rounds = tmp_path / "learned.json", tmp_path / "go", 30
    processes = [subprocess.Popen([sys.executable, "-c", LEARN_IN_A_PROCESS, str(model_file), str(path),
                                   str(tmp_path / f"ready{i}"), str(go), str(rounds)]) for i in range(2)]
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        time.sleep(0.01)
    go.touch()
    assert [process.wait(timeout=120) for process in processes] == [0, 0]
    alone = LearnedAcceptance(model_file, tmp_path / "alone.json")
    for _ in range(2 * rounds):
        alone.learn("ngram", copying_counts())
    assert json.loads(path.read_text()) == json.loads(alone.path.read_text())
