"""Multi-turn self-distillation: turn pieces tokenize as the whole, follow-ups carry the target's answers."""

from __future__ import annotations

import numpy as np

from eagle_jax.train import data
from eagle_jax.train import distill
from eagle_jax.serve import config as engine_config
from eagle_jax.serve import engine

CONVERSATION = [
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello!"},
    {"role": "user", "content": "how are you?"},
    {"role": "assistant", "content": "fine"},
    {"role": "user", "content": "and tomorrow?"},
    {"role": "assistant", "content": "we'll see"},
]


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_turn_pieces_with_answers_between_tokenize_as_the_whole(chat_tokenizer):
    turns = distill.conversation_turns(chat_tokenizer, CONVERSATION, max_turns=3)
    assert len(turns) == 3
    eos = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    # What the target would generate: the answer's text, then its end-of-turn token.
    assembled = np.concatenate([turns[0], ids(chat_tokenizer, "hello!"), [eos], turns[1],
                                ids(chat_tokenizer, "fine"), [eos], turns[2]])
    whole = chat_tokenizer.apply_chat_template(CONVERSATION[:5], tokenize=False, add_generation_prompt=True)
    assert assembled.tolist() == ids(chat_tokenizer, whole)
    assert len(distill.conversation_turns(chat_tokenizer, CONVERSATION, max_turns=2)) == 2


def test_pack_unpack_round_trip():
    conversations = [[np.array([1, 2, 3]), np.array([4])], [np.array([5, 6])], [np.array([7]), np.array([8, 9]),
                                                                               np.array([10])]]
    packed = distill.pack_turns(conversations, max_turns=3)
    assert packed["turn_ids"].dtype == np.uint16
    unpacked = distill.unpack_turns(packed)
    assert [[turn.tolist() for turn in turns] for turns in unpacked] == \
        [[turn.tolist() for turn in turns] for turns in conversations]


def test_follow_up_prompts_close_unfinished_answers_and_drop_long_ones():
    eos = 2
    conversations = [[np.array([10, 11]), np.array([20])], [np.array([30]), np.array([40, 41, 42, 43, 44])],
                     [np.array([50])]]
    # Previous round: prompts 0, 1, 2 belong to conversations 0, 1, 2; rows answer prompts 0, 1, 2.
    previous = {"input_ids": np.array([[10, 11, 7, 2, 0], [30, 8, 8, 8, 0], [50, 9, 2, 0, 0]], np.int32),
                "lengths": np.array([4, 4, 3], np.int32), "source": np.array([0, 1, 2], np.int32)}
    prompts, owners = distill.follow_up_prompts(conversations, 1, previous, np.array([0, 1, 2]), eos,
                                                max_prompt_tokens=8)
    # Conversation 0: answer ended on eos, so nothing is added; conversation 1 would need 4 + 1 + 5 = 10 > 8
    # tokens; conversation 2 has no second turn.
    assert owners.tolist() == [0]
    assert prompts[0].tolist() == [10, 11, 7, 2, 20]
    prompts, owners = distill.follow_up_prompts(conversations, 1, previous, np.array([0, 1, 2]), eos,
                                                max_prompt_tokens=10)
    assert owners.tolist() == [0, 1]
    assert prompts[1].tolist() == [30, 8, 8, 8, eos, 40, 41, 42, 43, 44]  # the budget-cut answer is closed


def test_distill_conversations_builds_rounds_and_resumes(random_target, tmp_path):
    target = random_target(seed=3, vocab_size=61, eos_token_id=None)
    rng = np.random.default_rng(0)
    conversations = [[rng.integers(3, 61, size=rng.integers(2, 6)).astype(np.int32)
                      for _ in range(rng.integers(1, 3))] for _ in range(10)]
    generator = engine.Engine(target, config=engine_config.EngineConfig(batch_size=4, max_length=64,
                                                                        fixed_shapes=True))
    eos = 2
    kwargs = dict(num_rounds=2, max_prompt_tokens=24, max_new_tokens=6, pad_id=0, eos_id=eos, progress=False)
    parts = distill.distill_conversations(generator, conversations, [0.0, 1.0], out_dir=tmp_path, **kwargs)
    assert [part.name for part in parts] == ["round0-t0.npz", "round1-t0.npz", "round0-t1.npz", "round1-t1.npz"]
    first, second = data.load_dataset(parts[0]), data.load_dataset(parts[1])
    # Every round-1 row starts with its conversation's round-0 greedy row, closed by eos, then turn 1.
    with_second_turn = [c for c, turns in enumerate(conversations) if len(turns) > 1]
    assert len(second["input_ids"]) == len(with_second_turn)
    for row, owner in zip(second["input_ids"], with_second_turn):
        history = first["input_ids"][owner, :first["lengths"][owner]]
        expected = np.concatenate([history, [eos], conversations[owner][1]])
        np.testing.assert_array_equal(row[:len(expected)], expected)
    # Sampled answers differ from greedy ones somewhere; the prompts are the same.
    sampled = data.load_dataset(parts[2])
    assert not np.array_equal(sampled["input_ids"], first["input_ids"])
    # A rerun past its deadline finds every part and generates nothing.
    before = {part: part.stat().st_mtime_ns for part in parts}
    again = distill.distill_conversations(generator, conversations, [0.0, 1.0], out_dir=tmp_path, deadline=0, **kwargs)
    assert again == parts and all(part.stat().st_mtime_ns == before[part] for part in parts)
    assert len(data.load_dataset(tmp_path)["input_ids"]) == sum(len(data.load_dataset(p)["input_ids"]) for p in parts)


def test_another_seed_samples_fresh_answers_beside_the_first(random_target, tmp_path):
    target = random_target(seed=3, vocab_size=61, eos_token_id=None)
    rng = np.random.default_rng(1)
    conversations = [[rng.integers(3, 61, size=rng.integers(2, 6)).astype(np.int32)] for _ in range(6)]
    generator = engine.Engine(target, config=engine_config.EngineConfig(batch_size=4, max_length=64,
                                                                        fixed_shapes=True))
    kwargs = dict(num_rounds=1, max_prompt_tokens=24, max_new_tokens=6, pad_id=0, eos_id=2, progress=False)
    first = distill.distill_conversations(generator, conversations, [0.0, 1.0], out_dir=tmp_path, **kwargs)
    second = distill.distill_conversations(generator, conversations, [0.0, 1.0], out_dir=tmp_path, seed=5, **kwargs)
    # The greedy part does not depend on the seed and is reused; the sampled one is new, beside the first.
    assert [part.name for part in first] == ["round0-t0.npz", "round0-t1.npz"]
    assert [part.name for part in second] == ["round0-t0.npz", "round0-t1-s5.npz"]
    one, other = data.load_dataset(first[1]), data.load_dataset(second[1])
    np.testing.assert_array_equal(one["source"], other["source"])  # the same prompts, answered anew
    assert not np.array_equal(one["input_ids"], other["input_ids"])
