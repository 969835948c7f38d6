"""Stop strings: generation ends at the first one, and the client never sees any of it.

Text that could still be the start of a stop string is held back (at most the
longest stop string less one character), so that a stream never shows part
of a stop string that the next token completes. Held-back text is released
when it can no longer start one, or when generation ends otherwise.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that may be shown now, and whether a stop string was reached (the text stops before it)."""
        if not self._stops:
            return text, False
        self._pending += text
        found = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        if found:
            shown, self._pending = self._pending[: min(found)], ""
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
