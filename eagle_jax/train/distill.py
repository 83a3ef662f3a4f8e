"""Self-distillation data: the target answers the training prompts itself.

An EAGLE head is asked to predict the target's own continuations, so training on the target's
answers (rather than ShareGPT's GPT-3.5 answers) matches what it will see at inference.
`eagle-jax-distill --prompts prompts.jsonl --out data.npz` (`eagle_jax.cli.distill`) writes the same
arrays as `data.build_dataset` (input_ids, loss_mask on the generated tokens, lengths).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import tqdm

from eagle_jax.train import data as data_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.io import tokenization


def distill(engine: engine_lib.Engine, prompts: list[np.ndarray], max_new_tokens: int, sequence_length: int,
            pad_id: int, sampling: sampling_lib.Sampling = sampling_lib.Sampling(), chunk: int | None = None,
            progress: bool = True, desc: str = "distill", seed: int = 0) -> dict[str, np.ndarray]:
    """Generates an answer per prompt and packs prompt + answer rows, the loss on the answer.

    Prompts are processed shortest first so each batch pads little. `source` [rows] is the
    index of the prompt each row answers (rows whose answer fits nothing are dropped). Sampled
    answers depend on `seed`: another seed answers the same prompts anew.
    """
    order = np.argsort([len(p) for p in prompts], kind="stable")
    chunk = chunk or engine.config.batch_size * 8
    rows = len(prompts)
    input_ids = np.full((rows, sequence_length), pad_id, np.int32)
    loss_mask = np.zeros((rows, sequence_length), bool)
    lengths = np.zeros((rows,), np.int32)
    bar = tqdm.tqdm(total=rows, desc=desc, unit="prompt", disable=not progress)
    for first in range(0, rows, chunk):
        indices = order[first:first + chunk]
        began = time.perf_counter()
        # Seed 0 keeps the chunk offset as the chunk's seed (the parts of earlier runs); another seed is
        # mixed with it, so that no chunk of one seed samples like a chunk of another.
        chunk_seed = int(np.random.SeedSequence([seed, first]).generate_state(1)[0] >> 1) if seed else first
        results = engine.generate([prompts[i] for i in indices], max_new_tokens=max_new_tokens, sampling=sampling,
                                  seed=chunk_seed)
        for index, result in zip(indices, results):
            sequence = np.concatenate([prompts[index], np.asarray(result.token_ids, np.int32)])[:sequence_length]
            input_ids[index, :len(sequence)] = sequence
            loss_mask[index, len(prompts[index]):len(sequence)] = True
            lengths[index] = len(sequence)
        bar.update(len(indices))
        # Wall time of the whole chunk (several batches): a result's own `seconds` is its batch's.
        bar.set_postfix(tokens_per_second=f"{sum(r.num_tokens for r in results) / (time.perf_counter() - began):.0f}")
    bar.close()
    keep = loss_mask.any(axis=1)
    return {"input_ids": input_ids[keep], "loss_mask": loss_mask[keep], "lengths": lengths[keep],
            "source": np.flatnonzero(keep).astype(np.int32)}


def conversation_turns(tokenizer, messages: list[dict], max_turns: int) -> list[np.ndarray]:
    """Token ids that open each of a conversation's first `max_turns` user turns.

    Turn 0 is the chat-templated prompt of the first user message (default system prompt and
    generation prompt included). Turn u > 0 is what the template puts between the end-of-turn
    token closing answer u-1 and answer u (for ChatML "\\n<|im_start|>user\\n...<|im_end|>\\n
    <|im_start|>assistant\\n"). At distillation time the target's own answers go between them,
    so a later turn is answered in the context of what the target itself said, as it will be
    at inference. Text is split at special tokens, so the pieces tokenize as the whole does.
    """
    user_indices = [index for index, message in enumerate(messages) if message["role"] == "user"][:max_turns]
    turns = []
    for number, index in enumerate(user_indices):
        text = tokenizer.apply_chat_template(messages[:index + 1], tokenize=False, add_generation_prompt=True)
        if number:
            # The rendered conversation up to the end-of-turn token that closes the previous answer.
            before = tokenizer.apply_chat_template(messages[:index], tokenize=False).rstrip()
            if not text.startswith(before):
                raise ValueError("chat template does not render a turn as a prefix of the conversation")
            text = text[len(before):]
        turns.append(np.asarray(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], np.int32))
    return turns


def pack_turns(conversations: list[list[np.ndarray]], max_turns: int) -> dict[str, np.ndarray]:
    """Turn ids of many conversations as one flat array, `turn_lengths` [C, max_turns] (0 = no such turn)."""
    lengths = np.zeros((len(conversations), max_turns), np.int32)
    for row, turns in enumerate(conversations):
        lengths[row, :len(turns)] = [len(turn) for turn in turns]
    flat = [turn for turns in conversations for turn in turns]
    ids = np.concatenate(flat) if flat else np.zeros((0,), np.int32)
    # Stored compactly, like `data.save_dataset`: every vocabulary here fits in uint16.
    return {"turn_ids": ids.astype(np.uint16) if ids.size == 0 or ids.max() < 2**16 else ids, "turn_lengths": lengths}


def unpack_turns(packed: dict[str, np.ndarray]) -> list[list[np.ndarray]]:
    """Inverse of `pack_turns`."""
    ids, lengths = np.asarray(packed["turn_ids"], np.int32), packed["turn_lengths"]
    ends = np.cumsum(lengths.ravel())
    pieces = np.split(ids, ends[:-1]) if lengths.size else []
    return [[pieces[row * lengths.shape[1] + turn] for turn in range(lengths.shape[1]) if lengths[row, turn]]
            for row in range(lengths.shape[0])]


def follow_up_prompts(conversations: list[list[np.ndarray]], round_index: int, previous: dict[str, np.ndarray],
                      previous_conversation: np.ndarray, eos_id: int,
                      max_prompt_tokens: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Prompts of user turn `round_index`: the previous round's prompt + greedy answer + the next turn.

    Args:
        previous: the previous round's greedy `distill` output (its `source` indexes
            `previous_conversation`).
        previous_conversation: [prompts] the conversation each previous-round prompt came from.
        eos_id: closes an answer that stopped at its token budget instead of at end-of-turn.

    Returns:
        (prompts, conversation index of each), prompts longer than `max_prompt_tokens` left out.
    """
    prompts, owners = [], []
    for row, source in enumerate(previous["source"]):
        owner = int(previous_conversation[source])
        if round_index >= len(conversations[owner]):
            continue
        history = previous["input_ids"][row, :previous["lengths"][row]]
        if history[-1] != eos_id:
            history = np.append(history, np.int32(eos_id))
        prompt = np.concatenate([history, conversations[owner][round_index]]).astype(np.int32)
        if len(prompt) <= max_prompt_tokens:
            prompts.append(prompt)
            owners.append(owner)
    return prompts, np.asarray(owners, np.int32)


def distill_conversations(engine: engine_lib.Engine, conversations: list[list[np.ndarray]],
                          temperatures: list[float], num_rounds: int, max_prompt_tokens: int, max_new_tokens: int,
                          pad_id: int, eos_id: int, out_dir: Path, deadline: float = float("inf"),
                          progress: bool = True, seed: int = 0) -> list[Path]:
    """Distils every round (user turn) greedily, then again at each sampling temperature.

    Each (round, temperature) part is written to `out_dir/round{r}-t{T}.npz` as soon as it is
    done and reused when present, so an interrupted run resumes where it stopped; no new part
    starts after `deadline` (a `time.time()` value). Round r > 0 prompts are built from round
    r-1's greedy answers (`follow_up_prompts`). A sampled part with `seed` != 0 is named
    `round{r}-t{T}-s{seed}.npz`: fresh answers that sit beside those of other seeds (greedy parts
    do not depend on the seed). Returns the parts written or found.
    """
    if num_rounds > 1 and temperatures[0] != 0:
        raise ValueError("later rounds build on greedy answers: the first temperature must be 0")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sequence_length = max_prompt_tokens + max_new_tokens
    rounds = {0: ([turns[0] for turns in conversations], np.arange(len(conversations), dtype=np.int32))}
    parts = []
    for temperature in temperatures:
        for round_index in range(num_rounds):
            suffix = f"-s{seed}" if seed and temperature else ""
            path = out_dir / f"round{round_index}-t{temperature:g}{suffix}.npz"
            if round_index not in rounds:
                greedy_path = out_dir / f"round{round_index - 1}-t0.npz"
                if not greedy_path.is_file():  # the deadline came first
                    continue
                greedy = data_lib.load_dataset(greedy_path)
                rounds[round_index] = follow_up_prompts(conversations, round_index, greedy, rounds[round_index - 1][1],
                                                        eos_id, max_prompt_tokens)
            prompts = rounds[round_index][0]
            if path.is_file():
                parts.append(path)
                continue
            if time.time() > deadline or not prompts:
                continue
            arrays = distill(engine, prompts, max_new_tokens, sequence_length, pad_id,
                             sampling_lib.Sampling(temperature=temperature), progress=progress,
                             desc=f"round {round_index} T={temperature:g}", seed=seed)
            data_lib.save_dataset(arrays, path)
            parts.append(path)
            print(f"{path.name}: {len(arrays['input_ids'])} rows, {int(arrays['loss_mask'].sum())} generated tokens",
                  file=sys.stderr)
    return parts


def tokenize_prompts(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Chat-templated int32 ids of single-turn user prompts."""
    return [np.asarray(tokenization.encode(tokenizer, text, chat=True), np.int32) for text in texts]


if __name__ == "__main__":  # `python -m eagle_jax.train.distill`, the same as `eagle-jax-distill`
    from eagle_jax.cli import distill as distill_cli

    sys.exit(distill_cli.main())
