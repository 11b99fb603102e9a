"""The scheduler's text handling: stop strings held back until they cannot match."""

from __future__ import annotations

import pytest

from fermijit.server.scheduler import StopMatcher


def _run(stops, pieces):
    m = StopMatcher(tuple(stops))
    out = []
    for piece in pieces:
        text, is_stop = m.push(piece)
        out.append(text)
        if is_stop:
            return "".join(out), True, out
    out.append(m.flush())
    return "".join(out), False, out


@pytest.mark.parametrize("stops, pieces, want, is_stop", [
    (["END"], ["ab", "cE", "N", "D", "x"], "abc", True),       # across three pieces
    (["END"], ["ab", "cE", "N", "x"], "abcENx", False),         # a false start is released
    (["END"], ["abcENDxyz"], "abc", True),                      # inside one piece
    (["\n\n", "##"], ["a\n", "b#", "#c"], "a\nb", True),         # the first to complete
    (["aab"], ["a", "a", "a", "b"], "a", True),                 # overlapping prefixes
    ([], ["x", "y"], "xy", False),
])
def test_stop_strings(stops, pieces, want, is_stop):
    text, stopped, _ = _run(stops, pieces)
    assert (text, stopped) == (want, is_stop)


def test_text_that_cannot_start_a_stop_is_not_held():
    _, _, out = _run(["END"], ["abc", "dE", "f"])
    assert out[:3] == ["abc", "d", "Ef"]
