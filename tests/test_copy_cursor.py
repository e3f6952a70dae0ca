"""The copy cursor: a copy goes on in its source after an edit, where the lookup alone would jump elsewhere."""

from edgespec.copy_cursor import MAX_INSERTED, RESYNC_WINDOW, CopyCursor
from edgespec.drafters import SOURCES, NgramDrafter, copy_signal_parts

# Two lines of a prompt, as token ids: "def f(a, b):" and "def g(c, d):" ("," is 5, ")" is 7, ":" is 8).
F_LINE = [100, 1, 2, 3, 5, 6, 7, 8]
G_LINE = [101, 9, 2, 10, 5, 11, 7, 8]
HINT = [50, 51]  # ": int", inserted by the edit


def followed(text, start, position):
    """A cursor at `position` that has followed text[start:]."""
    cursor = CopyCursor()
    cursor.move_to(position)
    for index in range(start, len(text)):
        cursor.follow(text, index)
    return cursor


def test_the_cursor_steps_along_a_copy_and_over_inserted_tokens():
    prompt = F_LINE + G_LINE
    assert followed(prompt + F_LINE[:4], len(prompt), 0).position == 4  # in step: the "," is next
    # ": int" is nowhere near the cursor: inserted; the "," after it is the source's next token
    cursor = followed(prompt + F_LINE[:4] + HINT, len(prompt), 0)
    assert cursor.position == 4
    assert followed(prompt + F_LINE[:4] + HINT + [5], len(prompt), 0).position == 5


def test_the_cursor_passes_over_source_tokens_the_edit_replaced():
    prompt = F_LINE + G_LINE
    # "def f(a)": ", b" dropped, so ")" is found two tokens on
    assert followed(prompt + F_LINE[:4] + [7], len(prompt), 0).position == 7
    # a token found only past the window is not the copy's
    far = list(range(200, 200 + RESYNC_WINDOW)) + [300]
    assert followed(far + [300], len(far), 0).position == 0


def test_a_copy_that_stays_out_of_step_is_over():
    prompt = F_LINE + G_LINE
    inserted = list(range(900, 900 + MAX_INSERTED))
    assert followed(prompt + F_LINE[:4] + inserted, len(prompt), 0).position == 4
    assert followed(prompt + F_LINE[:4] + inserted + [901], len(prompt), 0).position is None


def test_after_an_edit_the_drafter_goes_on_with_the_line_it_was_copying():
    # The reply copies "def f(a, b):" and inserts a type hint after "a".  Its tail is then ",", whose
    # most recent occurrence is in "def g(c, d):" (the lookup alone drafts " d):"); the copy was of f.
    prompt, reply = F_LINE + G_LINE, F_LINE[:4] + HINT + [5]
    drafter, context = NgramDrafter(), list(prompt)
    for token in reply:
        context.append(token)
        drafter.peek(context)  # the engine asks at every step
    assert drafter.propose(context, 3).tokens == [6, 7, 8]  # " b):"
    assert copy_signal_parts(drafter.peek(context).signal) == (SOURCES.index("prompt"), 1)
    lookup_alone = NgramDrafter()
    assert lookup_alone.propose(list(context), 3).tokens == [11, 7, 8]  # " d):"


def test_a_match_elsewhere_takes_over_from_a_copy_that_has_ended():
    # the reply leaves f's line for a copy of g's, too far on in the prompt for the cursor to follow
    prompt = F_LINE + list(range(700, 700 + RESYNC_WINDOW)) + G_LINE
    reply = F_LINE[:3] + G_LINE[:4]
    drafter, context = NgramDrafter(), list(prompt)
    for token in reply:
        context.append(token)
        drafter.peek(context)
    assert drafter.propose(context, 2).tokens == [5, 11]  # ", d" of g's line
    context += [5]
    assert drafter.propose(context, 2).tokens == [11, 7]  # and the copy of g's line goes on from there


def test_a_one_token_match_inside_an_edit_does_not_take_the_copy_away():
    # The edit inserts ": List" after "a", and " List" is also the import line's last token: the lookup
    # finds that one-token match, which a cursor that moved there would follow to the wrong line.  Here
    # the inserted "c" occurs in g's line (out of the cursor's reach), where the "," after the edit
    # would have taken the copy up.
    prompt = F_LINE + list(range(700, 700 + RESYNC_WINDOW)) + G_LINE
    reply = F_LINE[:4] + [50, 9] + [5]
    drafter, context = NgramDrafter(), list(prompt)
    for token in reply:
        context.append(token)
        drafter.peek(context)
    assert drafter.propose(context, 3).tokens == [6, 7, 8]  # " b):" of f's line, the line being copied
