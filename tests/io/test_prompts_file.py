"""Reading prompts files: what is accepted, and an error naming the file and line for the rest."""

import json

import pytest

from eagle_jax.io import prompts_file


def write(path, *lines, prefix=b""):
    path.write_bytes(prefix + "\n".join(lines).encode("utf-8"))
    return path


def test_prompt_fields_and_mt_bench_turns_in_file_order(tmp_path):
    path = write(tmp_path / "p.jsonl",
                 json.dumps({"question_id": 81, "category": "writing", "turns": ["first turn", "second"]}),
                 "", "   ",
                 json.dumps({"prompt": "a prompt", "turns": ["ignored"]}),
                 json.dumps({"turns": "one turn as a string"}) + "\r")  # CRLF line ends too
    assert prompts_file.read(path) == ["first turn", "a prompt", "one turn as a string"]


def test_a_string_of_turns_is_one_turn_not_its_first_character(tmp_path):
    path = write(tmp_path / "q.jsonl", json.dumps({"question_id": 1, "category": "writing", "turns": "Hello there"}))
    assert prompts_file.read(path) == ["Hello there"]
    assert prompts_file.questions(path)[0]["turns"] == ["Hello there"]


def test_a_byte_order_mark_is_skipped(tmp_path):
    path = write(tmp_path / "p.jsonl", json.dumps({"prompt": "héllo"}, ensure_ascii=False),
                 json.dumps({"prompt": "b"}), prefix=prompts_file.BOM)
    assert prompts_file.read(path) == ["héllo", "b"]
    # Plain text is not a prompts file, BOM or not: the same error, at the same column.
    for prefix in (b"", prompts_file.BOM):
        with pytest.raises(prompts_file.PromptsFileError, match=r":1: expected JSON .* at column 1\)$"):
            prompts_file.read(write(tmp_path / "p.txt", "Write a poem.", prefix=prefix))


def test_lines_split_at_newlines_only(tmp_path):
    # U+2028 and U+0085 are legal unescaped inside JSON strings; str.splitlines would cut the line there.
    text = "one\u2028two\x85three"
    path = write(tmp_path / "p.jsonl", json.dumps({"prompt": text}, ensure_ascii=False))
    assert prompts_file.read(path) == [text]


@pytest.mark.parametrize("content, message", [
    (b"", "{path}: no prompts in the file"),
    (b"\n  \n\n", "{path}: no prompts in the file"),
    (prompts_file.BOM, "{path}: no prompts in the file"),
    (b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n', "{path}:2: not UTF-8 text (byte 0xe9 at column 16)"),
    (b'{"prompt": "fine"}\n{not json\n', "{path}:2: expected JSON with 'prompt' or 'turns' (Expecting property name "
                                          "enclosed in double quotes at column 2)"),
    (b'["a", "b"]\n', "{path}:1: expected JSON with 'prompt' or 'turns', got a JSON array"),
    (b'"just a string"\n', "{path}:1: expected JSON with 'prompt' or 'turns', got a JSON string"),
    (b'null\n', "{path}:1: expected JSON with 'prompt' or 'turns', got a JSON null"),
    (b'{"text": "x", "id": 3}\n', "{path}:1: expected JSON with 'prompt' or 'turns', got the keys 'text', 'id'"),
    (b'{}\n', "{path}:1: expected JSON with 'prompt' or 'turns', got the keys none"),
    (b'{"prompt": 5}\n', "{path}:1: 'prompt' must be a string, got 5"),
    (b'{"prompt": null}\n', "{path}:1: 'prompt' must be a string, got null"),
    (b'{"turns": []}\n', "{path}:1: 'turns' must be a string or a non-empty list of strings, got []"),
    (b'{"turns": [1, 2]}\n', "{path}:1: 'turns' must be a string or a non-empty list of strings, got [1, 2]"),
    (b'{"prompt": "a \\udcff b"}\n', "{path}:1: the prompt holds a lone surrogate U+DCFF, not a character"),
])
def test_bad_files_name_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(prompts_file.PromptsFileError) as error:
        prompts_file.read(path)
    assert str(error.value) == message.format(path=path)


def test_a_directory_or_a_missing_file_is_named(tmp_path):
    with pytest.raises(prompts_file.PromptsFileError, match="is a directory, not a prompts file"):
        prompts_file.read(tmp_path)
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(prompts_file.PromptsFileError) as error:
        prompts_file.read(missing)
    assert str(error.value) == f"{missing}: cannot be read (No such file or directory)"


def test_questions_need_their_fields(tmp_path):
    path = write(tmp_path / "q.jsonl", json.dumps({"question_id": 1, "category": "c", "turns": ["a"]}),
                 json.dumps({"question_id": 2, "turns": ["b"]}))
    with pytest.raises(prompts_file.PromptsFileError, match=r":2: question without \['category'\]"):
        prompts_file.questions(path)
    path = write(tmp_path / "q.jsonl", json.dumps({"question_id": 1, "category": "c", "turns": None}))
    with pytest.raises(prompts_file.PromptsFileError, match=":1: 'turns' must be a string or a non-empty list"):
        prompts_file.questions(path)
