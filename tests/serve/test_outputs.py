"""serve/outputs.py: a row's tokens on the host: stop ids and stop strings, finish and stop reasons,
text, and logprob entries in OpenAI's shape."""

from __future__ import annotations

import numpy as np

from eagle_jax.decode import sampling
from eagle_jax.serve import outputs as outputs_lib

EOS, STOP_ID = 7, 9


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def take_in_chunks(row: outputs_lib.RowOutput, ids: list[int], cuts: list[int], logprobs=None):
    """Feeds `ids` as device calls would (the output buffer grows to each cut); returns what each call kept."""
    buffer = np.asarray(ids + [0] * 4, np.int32)
    return [row.take(buffer, cut, logprobs)[0] for cut in cuts]


def test_stop_ids_end_the_row_and_say_why():
    stopped = outputs_lib.RowOutput(sampling.Sampling(stop_token_ids=(STOP_ID,)), (EOS, STOP_ID))
    assert take_in_chunks(stopped, [1, 2, STOP_ID, 4], [2, 4]) == [[1, 2], [STOP_ID]]  # the id is kept, last
    assert (stopped.finish_reason, stopped.stop_reason, stopped.token_ids) == ("stop", STOP_ID, [1, 2, STOP_ID])
    at_eos = outputs_lib.RowOutput(sampling.Sampling(), (EOS,))
    take_in_chunks(at_eos, [1, EOS], [2])
    assert (at_eos.finish_reason, at_eos.stop_reason) == ("stop", None)  # vLLM's: no stop_reason for EOS
    running = outputs_lib.RowOutput(sampling.Sampling(), (EOS,))
    take_in_chunks(running, [1, 2, 3], [1, 3])
    assert not running.finished and running.token_ids == [1, 2, 3] and running.text() is None


def test_a_stop_string_cuts_text_and_tokens(chat_tokenizer):
    """chat_tokenizer has one token per byte: "é" is two tokens."""
    ids = ids_of(chat_tokenizer, "one, two; three")
    row = outputs_lib.RowOutput(sampling.Sampling(stop=("; ", "x")), (EOS,), chat_tokenizer)
    kept = take_in_chunks(row, ids, [3, 8, 12, len(ids)])
    assert row.text() == "one, two" and (row.finish_reason, row.stop_reason) == ("stop", "; ")
    assert row.token_ids == ids[:10] and sum(kept, []) == ids[:10]  # up to the id that completed "; "
    assert kept[-1] == []  # nothing after the stop


def test_a_stop_string_found_late_cuts_ids_already_taken(chat_tokenizer):
    """The chunk ends inside "é": its text waits for the next chunk, so the stop string "b" before it
    is found one call late; `token_ids` still ends with the id that completed it."""
    ids = ids_of(chat_tokenizer, "abéc")
    assert len(ids) == 5
    row = outputs_lib.RowOutput(sampling.Sampling(stop="b"), (EOS,), chat_tokenizer)
    kept = take_in_chunks(row, ids, [3, 5])
    assert kept == [ids[:3], []] and row.token_ids == ids[:2] and row.text() == "a"


def test_logprob_entries_are_openai_shaped(chat_tokenizer):
    ids = ids_of(chat_tokenizer, "hi")
    width = 3
    logprobs = sampling.Logprobs(token=np.array([-0.1, -0.5, 0, 0]), rank=np.array([1, 2, 0, 0]),
                                 top_ids=np.array([[ids[0], 5, 6], [4, ids[1], 6], [0] * 3, [0] * 3]),
                                 top=np.array([[-0.1, -2.5, -np.inf], [-0.3, -0.5, -3.0], [0] * 3, [0] * 3]))
    assert logprobs.top_ids.shape[1] == width
    row = outputs_lib.RowOutput(sampling.Sampling(logprobs=3), (EOS,), chat_tokenizer)
    take_in_chunks(row, ids, [2], logprobs)
    first, second = row.logprobs
    assert first == {"token_id": ids[0], "logprob": -0.1, "token": "h", "bytes": [104], "rank": 1,
                     "top_logprobs": [{"token_id": ids[0], "logprob": -0.1, "token": "h", "bytes": [104]},
                                      {"token_id": 5, "logprob": -2.5, "token": chat_tokenizer.decode([5]),
                                       "bytes": list(chat_tokenizer.decode([5]).encode())}]}  # -inf: left out
    assert second["rank"] == 2 and [t["token_id"] for t in second["top_logprobs"]] == [4, ids[1], 6]
    fewer = outputs_lib.RowOutput(sampling.Sampling(logprobs=1), (EOS,))  # asked for 1 of the 3 computed
    take_in_chunks(fewer, ids, [2], logprobs)
    assert [len(e["top_logprobs"]) for e in fewer.logprobs] == [1, 1] and "token" not in fewer.logprobs[0]
