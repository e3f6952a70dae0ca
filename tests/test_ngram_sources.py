"""Draft sources beyond the context: the cross-request pool and a predicted output."""

import pytest

from edgespec.drafters import MAX_COPY_LENGTH, NgramDrafter, Proposal, copy_signal_parts, ngram_signal
from edgespec.ngram_pool import NgramPool, TokenIndex


def test_the_pool_offers_what_followed_an_n_gram_in_another_text():
    pool = NgramPool()
    pool.add([10, 11, 12, 13, 14, 15, 16])
    n, tokens = pool.lookup([99, 98, 11, 12, 13], k=3)
    assert n == 3 and tokens == [14, 15, 16]
    assert pool.lookup([1, 2, 3], k=3) is None
    assert pool.lookup([12, 13], k=3) is None  # shorter than the shortest indexed length


def test_the_pool_prefers_the_longest_match_and_the_latest_text():
    pool = NgramPool(lengths=(5, 3))
    pool.add([1, 2, 3, 4, 5, 6, 7])
    pool.add([0, 3, 4, 5, 8, 9])
    assert pool.lookup([9, 3, 4, 5], k=2) == (3, [8, 9])  # the later text
    assert pool.lookup([1, 2, 3, 4, 5], k=2) == (5, [6, 7])  # the longer match


def test_the_pool_stays_within_its_bound_and_forgets_the_oldest():
    pool = NgramPool(max_tokens=100, lengths=(3,))
    for start in range(0, 2000, 50):
        pool.add(list(range(start, start + 50)))
    assert pool.tokens <= 100
    assert pool.lookup([0, 1, 2], k=2) is None  # long dropped
    assert pool.lookup([1950, 1951, 1952], k=2) == (3, [1953, 1954])
    # the index is rebuilt as dropped texts fill it, so it stays proportional to what is kept
    assert pool.indexed_ngrams <= 2 * len(pool.lengths) * pool.tokens


def test_a_token_index_finds_the_longest_match_with_a_continuation():
    index = TokenIndex([5, 6, 7, 8, 5, 6, 9])
    assert index.lookup([1, 5, 6]) == (2, 6)  # the latest occurrence of [5, 6] is followed by 9
    assert index.lookup([7, 8]) == (2, 4)
    assert index.lookup([6, 9]) is None  # nothing follows it


def test_the_drafter_takes_the_prediction_only_for_a_longer_match_than_the_contexts():
    drafter = NgramDrafter()
    context = [1, 2, 3, 50, 1, 2]
    assert drafter.propose(context, 3).tokens == [3, 50, 1]
    # the prompt already holds what the client predicts: on a tie the prompt's own match is drafted
    drafter.use_sources(prediction=TokenIndex([7, 1, 2, 40, 41, 42]))
    assert drafter.propose(context, 3).source == "prompt"
    assert drafter.peek(context).signal == ngram_signal("prompt", 2)
    # a longer match in the prediction wins
    drafter.use_sources(prediction=TokenIndex([3, 50, 1, 2, 40, 41, 42]))
    proposal = drafter.propose(context, 3)
    assert proposal.tokens == [40, 41, 42] and proposal.source == "prediction"
    assert drafter.peek(context).signal == ngram_signal("prediction", 4)
    drafter.use_sources()
    assert drafter.propose(context, 3).source == "prompt"


def test_a_match_in_the_prompt_and_one_in_the_generations_own_text_are_told_apart():
    drafter = NgramDrafter()
    context = [1, 2, 3, 50, 1, 2]  # a list the drafter has not seen: a generation's prompt
    assert drafter.peek(context).signal == ngram_signal("prompt", 2)
    context += [3, 60, 61, 3]  # the generation wrote these: "3" was last followed by 60 in its own text
    assert drafter.propose(context, 2) == Proposal([60, 61], None, "context")
    assert drafter.peek(context).signal == ngram_signal("context", 1)
    # the next generation's prompt holds the earlier reply: a match there is the prompt's
    turn = [*context, 60]
    assert drafter.propose(turn, 1) == Proposal([61], None, "prompt")


def test_every_step_of_one_copy_hints_the_same_copy_and_another_copy_another():
    drafter = NgramDrafter()
    sentence = [10, 11, 12, 13, 14, 15]
    context = [*sentence, 90, *sentence[:2]]  # the text repeats its sentence, 7 tokens later
    hints = []
    for token in sentence[2:]:
        hints.append(drafter.peek(context))
        context.append(token)
    assert [hint.copy for hint in hints] == [7, 7, 7, 7]  # the copy's source stands 7 back all along
    assert [copy_signal_parts(hint.signal)[1] for hint in hints] == [2, 3, 4, 5]  # however long it has run
    context += [91, 92, 10, 11]  # the sentence again: a copy of the repeat, which stands 8 back
    assert drafter.peek(context).copy == 8
    drafter.use_sources(prediction=TokenIndex([92, 10, 11, 12, 13]))
    hint = drafter.peek(context)  # a longer match in the prediction, "92 10 11", whose next token is its 4th
    assert copy_signal_parts(hint.signal) == (1, 3) and hint.copy == len(context) - 3
    pool = NgramPool(lengths=(3,))
    pool.add([20, 21, 22, 23, 24])
    drafter.use_sources(pool=pool)
    assert drafter.peek([9, 20, 21, 22]).copy is None  # the pool does not say where its match stands


def test_the_drafter_asks_the_pool_only_without_a_usable_context_match():
    pool = NgramPool(lengths=(3,))
    pool.add([20, 21, 22, 23, 24])
    drafter = NgramDrafter()
    drafter.use_sources(pool=pool)
    proposal = drafter.propose([9, 20, 21, 22], 2)
    assert proposal.tokens == [23, 24] and proposal.source == "pool"
    assert drafter.peek([9, 20, 21, 22]).signal == ngram_signal("pool", 3)
    # a context match as long as the pool's shortest length wins (here in the prompt)
    context = [20, 21, 22, 30, 20, 21, 22]
    assert drafter.propose(context, 2).source == "prompt"


def test_signal_classes_separate_sources_and_lengths():
    signals = {ngram_signal(source, n) for source in ("context", "prediction", "pool", "prompt") for n in (1, 2, 4, 8, 16, 40)}
    assert len(signals) == 24 and 0 not in signals
    assert ngram_signal("pool", 0) == 0
    assert ngram_signal("context", MAX_COPY_LENGTH) == ngram_signal("context", 500)  # lengths are counted so far
    assert copy_signal_parts(ngram_signal("pool", 40)) == (2, 40)
    with pytest.raises(ValueError):
        ngram_signal("elsewhere", 3)


END = 2  # an end-of-generation token, such as the end of the prompt's turn in a chat template


def test_a_copy_is_drafted_up_to_an_end_token_and_no_further():
    # the prompt's turn ends after "30 31", then the template opens the reply (40 41); the reply quotes "30 31"
    context = [5, 30, 31, END, 40, 41, 9, 30, 31]
    drafter = NgramDrafter(end_tokens=frozenset({END}))
    assert drafter.peek(context).available == 1
    assert drafter.propose(context, 6).tokens == [END]
    unaware = NgramDrafter()
    assert unaware.propose(context, 6).tokens == [END, 40, 41, 9, 30, 31]
    assert unaware.peek(context).available is None  # the copy repeats past the context's end


def test_every_source_is_cut_at_an_end_token_and_says_how_much_it_offers():
    drafter = NgramDrafter(end_tokens=frozenset({END}))
    drafter.use_sources(prediction=TokenIndex([7, 8, 60, 61, END, 62]))
    assert drafter.propose([1, 7, 8], 5).tokens == [60, 61, END]
    assert drafter.peek([1, 7, 8]).available == 3
    pool = NgramPool(lengths=(3,))
    pool.add([20, 21, 22, 23, END, 24, 25])
    drafter.use_sources(pool=pool)
    assert drafter.propose([9, 20, 21, 22], 4).tokens == [23, END]
    drafter.use_sources(prediction=TokenIndex([7, 8, 60, 61]))
    assert drafter.peek([1, 7, 8]).available == 2  # the prediction ends there


def test_a_drafter_for_another_sequence_keeps_the_end_tokens_and_nothing_else():
    drafter = NgramDrafter(end_tokens=frozenset({END}))
    drafter.propose([11, 12, 13, 11, 12], 2)
    other = drafter.for_sequence(1)
    assert other.end_tokens == drafter.end_tokens
    assert other.propose([7, 8, 7], 2).tokens == [8, 7]
