"""Stop strings: matched across pieces, never shown in part, released when they cannot match."""

from __future__ import annotations

from workers.engine.stop_strings import StopStrings


def test_a_stop_string_split_over_pieces_is_never_shown_and_ends_the_text_before_it():
    stops = StopStrings(["</end>", "STOP"])
    shown = []
    for piece in ["Hello", " wor", "ld</e", "nd> after"]:
        text, stopped = stops.feed(piece)
        shown.append(text)
        if stopped:
            break
    assert "".join(shown) == "Hello world" and stopped
    assert all("<" not in piece for piece in shown)


def test_held_back_text_is_released_once_it_cannot_start_a_stop_string_or_at_the_end():
    stops = StopStrings(["abc"])
    assert stops.feed("xxab") == ("xx", False)  # "ab" may start "abc"
    assert stops.feed("d") == ("a", False)  # "abd" cannot, but "bd" is kept as long as two characters are
    assert stops.flush() == "bd"


def test_without_stop_strings_text_passes_at_once():
    assert StopStrings([]).feed("anything") == ("anything", False)


def test_a_stop_string_may_end_the_text_instead():
    stops = StopStrings(["END", "ENDING"], include=True)
    assert stops.feed("the EN") == ("t", False)  # "he EN" may start "ENDING"
    assert stops.feed("DING here") == ("he ENDING", True)  # the first to start; of those, the longest
