"""Stop strings, found wherever they fall: across token boundaries, inside one token's text."""

from __future__ import annotations


class StopStrings:
    """Where to cut a growing text at the first stop string, and how much to hold back.

    Text that might be the start of a stop string is held back (len(longest) - 1 characters)
    until decided, so a client never sees text that is then cut away. With
    include_stop_str_in_output nothing needs holding back: the text is cut after the stop
    string, and everything before it is sent anyway.
    """

    def __init__(self, stops: list[str], include_in_output: bool) -> None:
        self.stops = [stop for stop in stops if stop]
        self.include_in_output = include_in_output
        longest = max((len(stop) for stop in self.stops), default=0)
        self.hold_back = 0 if include_in_output or not longest else longest - 1
        self.matched: str | None = None  # the stop string the last cut found

    def find_cut(self, text: str, new_from: int) -> int | None:
        """Where to cut `text` if a stop string ends in `text[new_from:]` (the part just added).

        Of several, the one ending first wins (what a character-by-character stream would see);
        at the same end, the longer one.
        """
        best: tuple[int, int, str] | None = None  # (end, -start, stop)
        for stop in self.stops:
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start != -1:
                candidate = (start + len(stop), -start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is None:
            return None
        end, negative_start, self.matched = best
        return end if self.include_in_output else -negative_start
