"""Renames a text makes while it copies: the n-gram drafter learns them and drafts across them."""

from edgespec.drafters import NgramDrafter
from edgespec.ngram_pool import TokenIndex
from edgespec.renames import RenameTable

NAME, NEW_NAME, SEPARATOR = 7, 70, 99
# a source that uses one name four times, each time between other tokens
SOURCE = [10, 11, NAME, 12, 13, 14, NAME, 15, 16, 17, NAME, 18, 19, 20, NAME, 21, 22, 23, 24]


def drive(text: list[int], start: int, k: int = 4, prediction: list[int] | None = None) -> list[tuple[int, list[int]]]:
    """Decode text[start:] as the engine would, token by token; each position with the drafter's proposal."""
    drafter, context, proposals = NgramDrafter(), list(text[:start]), []
    if prediction is not None:
        drafter.use_sources(prediction=TokenIndex(prediction))
    for position in range(start, len(text)):
        drafter.peek(context)
        proposals.append((position, drafter.propose(context, k).tokens))
        context.append(text[position])
    return proposals


def test_a_name_replaced_at_two_places_is_drafted_as_its_new_name_and_the_copy_goes_on_across_it():
    copy = [NEW_NAME if token == NAME else token for token in SOURCE]
    text = SOURCE + [SEPARATOR] + copy
    proposals = dict(drive(text, len(SOURCE) + 1))
    at = {i: len(SOURCE) + 1 + i for i in range(len(copy))}  # the copy's token i is decoded at position at[i]
    # the second replacement (copy[6]) and the two tokens after it make the rename
    assert proposals[at[9]] == [17, NEW_NAME, 18, 19], "the new name is drafted where the source has the old"
    assert proposals[at[11]] == [18, 19, 20, NEW_NAME], "the copy is found again right after the new name"
    assert proposals[at[15]] == [21, 22, 23, 24]
    # before that, the drafter drafted the old name, as any copy would
    assert proposals[at[1]][:2] == [11, NAME]


def test_a_predicted_output_is_drafted_with_the_renames_the_text_made():
    # an editor sends the file before the edit as the prediction; the prompt does not hold it
    copy = [NEW_NAME if token == NAME else token for token in SOURCE]
    text = [SEPARATOR, SEPARATOR + 1] + copy
    proposals = dict(drive(text, 2, prediction=SOURCE))
    at = {i: 2 + i for i in range(len(copy))}
    assert proposals[at[9]] == [17, NEW_NAME, 18, 19]
    assert proposals[at[11]] == [18, 19, 20, NEW_NAME]


def test_a_token_replaced_once_is_not_a_rename():
    # a template copied with one slot varied: the other occurrences keep the old token
    copy = list(SOURCE)
    copy[SOURCE.index(NAME)] = NEW_NAME
    text = SOURCE + [SEPARATOR] + copy
    proposals = dict(drive(text, len(SOURCE) + 1))
    later = [len(SOURCE) + 1 + i for i, token in enumerate(copy) if token == NAME]
    assert len(later) == 3 and all(proposals[position][0] == NAME for position in later)


def feed(table: RenameTable, text: list[int], canonical: list[int], source_start: int, tokens: list[int]) -> None:
    """The text copies its own tokens from source_start on, as these tokens; the table watches the copy at
    every token, as the drafter's lookups do."""
    for offset, token in enumerate(tokens):
        table.watch(len(text), canonical, source_start + offset)
        text.append(token)
        canonical.append(table.canonical(token))
        table.settle(canonical, text)


def test_a_rename_is_forgotten_where_the_text_keeps_the_old_name_until_seen_twice_more():
    table = RenameTable()
    text, canonical = SOURCE + [SEPARATOR], SOURCE + [SEPARATOR]
    renamed = [NEW_NAME if token == NAME else token for token in SOURCE]
    feed(table, text, canonical, 0, renamed[:9])  # two replaced occurrences, and what follows the second
    assert table.written(NAME) == NEW_NAME and table.canonical(NEW_NAME) == NAME
    feed(table, text, canonical, 9, SOURCE[9:14])  # the copy goes on, and this time keeps the old name
    assert table.written(NAME) == NAME and table.canonical(NEW_NAME) == NEW_NAME
    # taken again only when seen twice more: once is not enough
    feed(table, text, canonical, 0, renamed[:5])
    assert table.written(NAME) == NAME
    feed(table, text, canonical, 5, renamed[5:9])
    assert table.written(NAME) == NEW_NAME
