"""The generate command's checks on prompts and seed (before anything is loaded)."""

import json

import pytest

from eagle_jax.cli import user_input
from eagle_jax.serve import config as config_lib


def test_prompts_from_flags_then_the_file_else_the_default(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "from the file"}) + "\n")
    assert user_input.prompts(["a", "b"], str(path)) == ["a", "b", "from the file"]
    assert user_input.prompts([], None) == [user_input.DEFAULT_PROMPT]


@pytest.mark.parametrize("given, message", [
    (["fine", b"\xff\xfe".decode("utf-8", "surrogateescape")],
     "--prompt number 2 is not UTF-8 text (byte 0xff at byte 1)"),
    (["caf" + b"\xe9 au lait".decode("utf-8", "surrogateescape")],
     "--prompt number 1 is not UTF-8 text (byte 0xe9 at byte 4)"),
    (["é" + b"\xc3".decode("utf-8", "surrogateescape")],  # a cut multi-byte character
     "--prompt number 1 is not UTF-8 text (byte 0xc3 at byte 3)"),
    (["a\ud800"], "--prompt number 1 is not UTF-8 text (a lone surrogate U+D800 at character 2)"),
])
def test_prompts_that_are_not_utf8_are_refused(given, message):
    with pytest.raises(config_lib.InputError) as error:
        user_input.prompts(given, None)
    assert str(error.value) == message


@pytest.mark.parametrize("seed", [2**63, 2**64, -2**63 - 1, 10**30])
def test_seeds_outside_int64_are_refused(seed):
    with pytest.raises(config_lib.InputError) as error:
        user_input.check_seed(seed)
    assert str(error.value) == f"--seed must be an integer from -2^63 to 2^63 - 1, got {seed}"


def test_per_prompt_seeds_wrap_inside_int64():
    for seed in (0, -1, 2**63 - 1, -2**63):
        user_input.check_seed(seed)
    assert [user_input.prompt_seed(5, index) for index in range(3)] == [5, 6, 7]
    assert user_input.prompt_seed(2**63 - 1, 1) == -2**63
    assert user_input.prompt_seed(-1, 1) == 0
