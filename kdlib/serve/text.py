"""Token ids to text, one step at a time: incremental detokenisation and stop strings.

    ts = TextStream(tokenizer, stops=("\\n\\n",))
    used = ts.push(step_tokens)          # None, or how many of them it took to complete a stop string
    delta = ts.take()                    # text that can go to the client now
    delta += ts.take(final=True)         # at the end: everything left

Decoding re-reads a short window of ids rather than the whole output: the new text is
`decode(ids[p:])` minus the window's text so far (`decode(ids[p:r])`, kept from the last call),
so one push costs one decode. The window's start p moves up to PREFIX ids before r once it spans
WINDOW ids (one extra decode then): a few ids of context keep decoders that treat a leading
token specially right. A window whose text ends in U+FFFD (an incomplete UTF-8 character of a
byte-level BPE) waits for the next id. Text that may be the start of a stop string is held back
until it is known not to be one, so a stop string split across tokens (or steps) never reaches the
client.
"""

from __future__ import annotations

import codecs

REPLACEMENT = "\ufffd"
WINDOW, PREFIX = 16, 4  # ids a decode window may span before it restarts, and the context it keeps


class TextStream:
    """The text of one generated sequence; see the module docstring.

    tokenizer: anything with decode(ids) -> str. stops: the stop strings (non-empty). Attributes:
    text (all text so far, cut at a stop string), stopped (the stop string found, or None),
    sent (characters already handed out by `take`).
    """

    def __init__(self, tokenizer, stops=()):
        self._tok = tokenizer
        self.stops = tuple(stops)
        if any(not s for s in self.stops):
            raise ValueError("stop strings must be non-empty")
        self._ids: list[int] = []
        self._p = self._r = 0  # ids[:r] are all in `text`; the window ids[p:r] decodes to `_window`
        self._window = ""
        self.text = ""
        self.sent = 0
        self._searched = 0  # text[:searched] holds no stop string
        self.stopped: str | None = None

    def push(self, ids, check_from: int = 0) -> int | None:
        """Add ids; when the text of ids[j] completes a stop string (j >= check_from: earlier ids may
        not stop, e.g. before min_tokens), return j + 1 and ignore the rest (`text` ends before the
        stop string). Otherwise None. Without stop strings the ids are decoded in one window."""
        if self.stopped is not None:
            raise RuntimeError("the sequence already hit a stop string")
        if not self.stops:
            self._ids.extend(int(t) for t in ids)
            self._decode()
            return None
        for j, t in enumerate(ids):
            self._ids.append(int(t))
            if self._decode():
                if j >= check_from and self._find_stop():
                    return j + 1
                self._searched = len(self.text)
        return None

    def _decode(self, final: bool = False) -> bool:
        """Turn the waiting ids into text; False while they end inside a character (unless final)."""
        if self._r == len(self._ids):
            return False
        window = self._tok.decode(self._ids[self._p:])
        if window.endswith(REPLACEMENT) and not final:
            return False  # an incomplete character: wait for the next id
        self.text += window[len(self._window):]
        self._r, self._window = len(self._ids), window
        if self._r - self._p > WINDOW:
            self._p = self._r - PREFIX
            self._window = self._tok.decode(self._ids[self._p:self._r])
        return True

    def flush(self) -> None:
        """Decode ids still waiting for the rest of a character (end of the sequence)."""
        if self.stopped is None and self._decode(final=True):
            self._find_stop()

    def _find_stop(self) -> bool:
        """A stop string ending after `_searched` (the text before it holds none that counts)."""
        hits = [(i, s) for s in self.stops
                if (i := self.text.find(s, max(0, self._searched - len(s) + 1))) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        self.text, self.stopped = self.text[:i], s
        return True

    def _held(self) -> int:
        """Characters at the end of `text` that could begin a stop string."""
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text) - self.sent), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held

    def take(self, final: bool = False) -> str:
        """The text not handed out yet that is safe to send (all of it when `final` or stopped)."""
        if final:
            self.flush()
        end = len(self.text) if final or self.stopped is not None else len(self.text) - self._held()
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out


class TokenOffsets:
    """OpenAI's `text_offset`: where each token's text starts in its sequence's text, in characters from
    `start`, as tokens are pushed in order. A token adds the characters its bytes complete (the tokenizer's
    `token_bytes`, through an incremental UTF-8 decoder; without it, the text a `TextStream` has let out):
    none where the text hides it (`shown` False: the end of text) or where it holds a character's first
    bytes (it starts where that character does)."""

    def __init__(self, tokenizer, start: int = 0):
        self._bytes = getattr(tokenizer, "token_bytes", None)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0
        self._text = None if self._bytes else TextStream(tokenizer)
        self.start = start

    def push(self, token: int, shown: bool = True) -> int:
        at = self.start + (self._chars if self._text is None else len(self._text.text))
        if shown:
            if self._text is None:
                self._chars += len(self._utf8.decode(self._bytes(token)))
            else:
                self._text.push([token])
        return at
