"""Token ids to text as they arrive, and stop strings found across token boundaries.

The device emits token ids a device call at a time; a user wants text, streamed, cut before the
first stop string. Both are host work on one request's ids:

* Decoding a whole sequence again for every chunk costs O(length) a chunk. `TextStream` decodes
  a short window instead (vLLM's prefix/read offsets): the ids from `prefix_offset` on, against
  the same window without the new ids, so that tokenizers which drop or add a leading space at
  the start of a decode (sentencepiece) produce the same prefix both times and the difference
  is exactly the new text. A chunk that ends inside a multi-byte character decodes to U+FFFD;
  its text is held back until the next chunk completes the character.
* A stop string can span chunks, so the longest tail of the text that is a proper prefix of
  some stop string is held back too, until the next chunk says whether the stop string follows.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

REPLACEMENT = "\ufffd"  # what a decode of an incomplete UTF-8 sequence ends with


@dataclasses.dataclass
class TextStream:
    """One request's text, built from its token ids chunk by chunk.

    Args:
        tokenizer: anything with `decode(ids, skip_special_tokens=...)` (a transformers tokenizer).
        stop: strings that end the output; the output is cut before the first one found.
        stop_token_ids: token ids that end the output; the id itself is not part of it.
    """

    tokenizer: object
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    skip_special_tokens: bool = True
    ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""  # everything decoded so far, held-back tail included
    emitted: int = 0  # characters of `text` already returned
    stopped: bool = False  # a stop string or stop token ended the output
    matched: str | None = None  # the stop string that ended it (the longest of those starting there)
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self):
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")

    def push(self, new_ids: Sequence[int]) -> str:
        """Adds a chunk of ids; returns the text that is now final (possibly empty).

        After a stop string or stop token, `stopped` is True and later chunks add nothing.
        """
        if self.stopped:
            return ""
        new_ids = [int(i) for i in new_ids]
        for position, token in enumerate(new_ids):
            if token in self.stop_token_ids:
                new_ids, self.stopped = new_ids[:position], True
                break
        self.ids += new_ids
        self.text += self._decode_new()
        found = self._find_stop()
        if found is not None:
            self.matched = max((s for s in self.stop if self.text.startswith(s, found)), key=len)
            self._trim_ids(len(self.text) - found)
            self.text, self.stopped = self.text[:found], True
        final = len(self.text) if self.stopped else len(self.text) - self._held_back()
        delta = self.text[self.emitted:final]
        self.emitted = max(self.emitted, final)
        return delta

    def finish(self) -> str:
        """The text still held back once no more ids will come (the request ended)."""
        if not self.stopped:
            tail = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
            window = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset],
                                           skip_special_tokens=self.skip_special_tokens)
            self.text += tail[len(window):]  # an incomplete character at the very end stays U+FFFD
            self.read_offset = len(self.ids)
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta

    def _decode_new(self) -> str:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        window = decode(self.ids[self.prefix_offset:self.read_offset])
        extended = decode(self.ids[self.prefix_offset:])
        if len(extended) <= len(window) or extended.endswith(REPLACEMENT):
            return ""  # nothing new yet, or the chunk ends inside a character: wait for more ids
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return extended[len(window):]

    def _trim_ids(self, stop_and_after: int) -> None:
        """Drops the ids past the one that completed the stop string (usage counts up to it).

        `stop_and_after` characters at the end of `text` are the stop string and what followed
        it; the fewest trailing ids whose removal still keeps the stop string's last character
        are found by decoding shorter prefixes (once per request, so a few decodes cost nothing).
        """
        keep_chars = len(self.text) - stop_and_after + self._stop_length()
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        low, high = 0, len(self.ids)  # the answer is the least n with len(decode(ids[:n])) >= keep_chars
        while low < high:
            middle = (low + high) // 2
            if len(decode(self.ids[:middle]).rstrip(REPLACEMENT)) >= keep_chars:
                high = middle
            else:
                low = middle + 1
        self.ids = self.ids[:high]

    def _stop_length(self) -> int:
        at = self._find_stop()
        return max(len(s) for s in self.stop if self.text.startswith(s, at))

    def _find_stop(self) -> int | None:
        """Where the first stop string starts in `text`, looking only where a new one can be."""
        if not self.stop:
            return None
        longest = max(map(len, self.stop))
        start = max(0, self.emitted - longest + 1)
        hits = [at for at in (self.text.find(s, start) for s in self.stop) if at >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that a stop string could still complete."""
        for size in range(min(max(map(len, self.stop), default=1) - 1, len(self.text) - self.emitted), 0, -1):
            tail = self.text[-size:]
            if any(s.startswith(tail) for s in self.stop):
                return size
        return 0
