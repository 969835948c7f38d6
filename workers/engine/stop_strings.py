"""Stop strings: generation ends at the first one, and the client sees none of it (or all of it, when asked).

Text that could still be the start of a stop string is held back (at most the
longest stop string less one character), so that a stream never shows part
of a stop string that the next token completes. Held-back text is released
when it can no longer start one, or when generation ends otherwise.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str], include: bool = False) -> None:
        """`include`: the text shown ends with the stop string rather than before it (vLLM's
        include_stop_str_in_output)."""
        self._stops = stops
        self._include = include
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that may be shown now, and whether a stop string was reached (the text stops before it)."""
        if not self._stops:
            return text, False
        self._pending += text
        found = [(i, -len(s)) for i, s in ((self._pending.find(s), s) for s in self._stops) if i >= 0]
        if found:
            start, minus_length = min(found)  # the first to start; of those, the longest
            shown, self._pending = self._pending[: start - minus_length if self._include else start], ""
            return shown, True
        cut = len(self._pending) - self._hold
        if cut <= 0:
            return "", False
        shown, self._pending = self._pending[:cut], self._pending[cut:]
        return shown, False

    def flush(self) -> str:
        """What is held back, when generation ends for another reason."""
        shown, self._pending = self._pending, ""
        return shown
