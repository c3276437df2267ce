"""Stop strings over streamed text: what may be sent now, what must wait, where the text ends."""

from __future__ import annotations


class StopMatcher:
    """Feed text pieces as tokens produce them; get back the text that is safe to send.

    Text that could be the start of a stop string is held back until it is known not to be one;
    when a stop string appears, the text ends just before it (:attr:`hit` says which). As
    llama-server does, the stop string itself is never sent.
    """

    def __init__(self, stops: tuple[str, ...] | list[str] = ()):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.hit: str | None = None

    def push(self, text: str) -> str:
        """The text that can be sent after ``text`` was generated ('' once a stop string was hit)."""
        if self.hit is not None:
            return ""
        self.buf += text
        if not self.stops:
            out, self.buf = self.buf, ""
            return out
        found = [(i, s) for s in self.stops if (i := self.buf.find(s)) >= 0]
        if found:
            i, self.hit = min(found)
            out, self.buf = self.buf[:i], ""
            return out
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), keep, -1):
                if self.buf.endswith(s[:k]):
                    keep = k
                    break
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def flush(self) -> str:
        """What is still held back (generation ended without the stop string completing)."""
        out, self.buf = ("" if self.hit is not None else self.buf), ""
        return out
