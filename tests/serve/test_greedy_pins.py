"""The default model's greedy tokens, pinned: the library and the CLI reproduce them exactly.

`tests/data/greedy_pins_default_model.json` holds SmolLM2-135M-Instruct's float32 greedy ids on
a CPU for three chat prompts x 32 new tokens: plain decoding, the shipped EAGLE-3 head as a
chain of 3 drafts, and as a tree of topk 2, 3 steps, 4 draft tokens (made at the commit the
file names). Speculation is lossless, so all three are the same ids.
"""

import json
from pathlib import Path

import pytest

from eagle_jax import heads
from eagle_jax.cli import generate
from eagle_jax.decode import tree as tree_lib
from eagle_jax.io import models
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib

PINS = json.loads((Path(__file__).parents[1] / "data" / "greedy_pins_default_model.json").read_text())
SETTINGS = {"plain": {}, "eagle3_k3": dict(num_speculative_tokens=3),
            "eagle3_tree_2_3_4": dict(tree=tree_lib.TreeOptions(topk=2, num_steps=3, num_draft_tokens=4))}


@pytest.mark.slow
def test_the_library_and_the_cli_reproduce_the_pinned_greedy_ids(capsys):
    target, _ = models.load_target(None, PINS["dtype"])
    head = models.load_head(heads.shipped_head("eagle3"), target, PINS["dtype"])
    for name, drafting in SETTINGS.items():
        engine = engine_lib.Engine(target, head if drafting else None, config_lib.EngineConfig(batch_size=1, **drafting))
        results = engine.generate(PINS["prompt_ids"], max_new_tokens=PINS["max_new_tokens"])
        assert [r.token_ids for r in results] == PINS[name], name
    argv = ["--json", "--max-new-tokens", str(PINS["max_new_tokens"]), "--draft", "none", "--no-compile-cache"]
    for prompt in PINS["prompts"]:
        argv += ["--prompt", prompt]
    assert generate.main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [record["token_ids"] for record in records] == PINS["plain"]
