"""What the host makes of one row's tokens as device calls bring them: stop strings, text,
logprobs in OpenAI's shape, and why the row finished.

The device ends a row at one of its stop ids (EOS unless ignored, the request's stop_token_ids;
the id is the row's last token) or at its budget. Stop strings need the text, so the host finds
them (`text.TextStream`, across token boundaries) and cuts the row there: its token ids end with
the one that completed the stop string, its text before the stop string; the host loop then
stops the row on the device too (`RowOutput.finished`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.serve import text as text_lib


class RowOutput:
    """One row's output on the host (one sample of one request).

    Args:
        sampling: the request's settings (stop strings, how many logprobs).
        stop_ids: the ids the device stops the row at (`Sampling.stop_ids`).
        tokenizer: decodes the text (stop strings need one); None: token ids only.
    """

    def __init__(self, sampling: sampling_lib.Sampling, stop_ids: Sequence[int] = (), tokenizer=None):
        self.sampling, self.stop_ids, self.tokenizer = sampling, tuple(stop_ids), tokenizer
        self.stream = None if tokenizer is None else text_lib.TextStream(tokenizer, stop=sampling.stop)
        self.token_ids: list[int] = []
        self.logprobs: list[dict] | None = None if sampling.logprobs is None else []
        self.pieces: list[str] = []
        self.shown = 0  # device tokens of this row taken so far
        self.finish_reason: str | None = None  # "stop" once a stop id or string ended it
        self.stop_reason: str | int | None = None  # the stop string or stop token id (vLLM's; None for EOS)

    @property
    def finished(self) -> bool:
        """Whether a stop id or a stop string ended the row (the budget is the device's to tell)."""
        return self.finish_reason is not None

    def take(self, output: np.ndarray, count: int, logprobs: sampling_lib.Logprobs | None = None) -> tuple[list, list]:
        """Takes the row's device tokens past those already taken, up to `count`.

        Args:
            output: the row's output buffer (host copy); count: its num_generated.
            logprobs: the row's logprobs buffers (host copies, [C] and [C, N]), or None.
        Returns:
            (the new token ids the request keeps, their logprob entries): the ids stop at a stop
            string; nothing once the row has finished. A stop string whose text waited for a
            character's last bytes may cut ids an earlier call returned: `token_ids` is the output.
        """
        if self.finished or count <= self.shown:
            return [], []
        ids = [int(i) for i in output[self.shown:count]]
        entries = [] if self.logprobs is None or logprobs is None else [
            self._entry(logprobs, position, token) for position, token in zip(range(self.shown, count), ids)]
        self.shown = count
        stop_at = next((index for index, token in enumerate(ids) if token in self.stop_ids), None)
        if self.stream is not None:
            self.pieces.append(self.stream.push(ids if stop_at is None else ids[:stop_at]))  # a stop id is no text
            if self.stream.stopped:  # a stop string: keep the ids up to the one that completed it
                # Usually in this chunk; an earlier one when the text waited on an incomplete
                # character (those ids were already returned: `token_ids` is what counts).
                keep = len(self.stream.ids)
                ids = ids[:max(0, keep - len(self.token_ids))]
                del self.token_ids[keep:]
                if self.logprobs is not None:
                    del self.logprobs[keep:]
                self.finish_reason, self.stop_reason = "stop", self.stream.matched
                stop_at = None
        if stop_at is not None:
            ids = ids[:stop_at + 1]
            self.finish_reason = "stop"
            self.stop_reason = ids[-1] if ids[-1] in self.sampling.stop_token_ids else None  # None: EOS, as vLLM
        entries = entries[:len(ids)]
        self.token_ids += ids
        if self.logprobs is not None:
            self.logprobs += entries
        return ids, entries

    def text(self) -> str | None:
        """The decoded output (cut before a stop string), once no more tokens come; None without a tokenizer."""
        if self.stream is None:
            return None
        self.pieces.append(self.stream.finish())
        return "".join(self.pieces)

    def _entry(self, logprobs: sampling_lib.Logprobs, position: int, token: int) -> dict:
        """OpenAI's per-token logprob entry (with token ids; with text and bytes given a tokenizer).

        Alternatives the processors removed (log-probability -inf) are left out: they could not be drawn.
        """
        entry = self._item(token, float(logprobs.token[position]))
        entry["rank"] = int(logprobs.rank[position])
        wanted = self.sampling.logprobs or 0
        entry["top_logprobs"] = [self._item(int(i), float(lp)) for i, lp in
                                 zip(logprobs.top_ids[position, :wanted], logprobs.top[position, :wanted])
                                 if math.isfinite(lp)]
        return entry

    def _item(self, token: int, logprob: float) -> dict:
        item = {"token_id": token, "logprob": logprob}
        if self.tokenizer is not None:
            text = self.tokenizer.decode([token])
            item.update(token=text, bytes=list(text.encode("utf-8")))
        return item


def row_logprobs(logprobs: sampling_lib.Logprobs | None, row: int) -> sampling_lib.Logprobs | None:
    """One row of host logprobs buffers ([B, C] and [B, C, N] arrays), or None."""
    if logprobs is None:
        return None
    return sampling_lib.Logprobs(token=logprobs.token[row], rank=logprobs.rank[row], top_ids=logprobs.top_ids[row],
                                 top=logprobs.top[row])
