"""benchmarks/replay_acceptance.py: the offline replay counts what the engine counts, and its
draft-vocabulary numbers are what the accept rules give on a case worked by hand.

The engine case decodes with real speculation (`engine.Engine`, EAGLE-3 and EAGLE-1 heads that
accept some drafts but not all, built as test_speculative.py's are), then replays the same
outputs: every row's drafts and accepted drafts at each depth must be the engine's own, including
the last step, which EOS or the budget cuts.
"""

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from eagle_jax.train import data
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import result as result_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.io import models

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))
import replay_acceptance  # noqa: E402

MAX_NEW = 12  # with k <= 4 every prompt fits a 32-slot cache: one prefill and one step program per engine
PROMPT_LENGTHS = (4, 9, 14)
DRAFT_VOCAB = 64  # of the target's 101 tokens: its drafts miss tokens the target emits


@pytest.fixture(scope="module")
def prompts(random_prompts):
    return random_prompts(PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def plain(speculation_target, prompts):
    """Plain greedy outputs (no EOS): the tokens the heads are built around and the EOS is chosen from."""
    engine = engine_lib.Engine(speculation_target, config=config_lib.EngineConfig(max_length=64))
    results = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def heads(speculation_target, plain, agreeing_head, biased_eagle3_head):
    cfg = speculation_target.config
    frequent = np.argsort(-np.bincount(np.concatenate(plain), minlength=cfg.vocab_size))[:2]
    # Two layers: each layer's diagonal (a draft step's own earlier keys) in the unrolled steps. The
    # seed is one whose drafts the target accepts two at a time now and then (most accept one at most).
    return {"eagle3": biased_eagle3_head(cfg, frequent, DRAFT_VOCAB, seed=7, num_layers=2),
            "eagle": agreeing_head(cfg, 0.3, residual=1.0, seed=1)}


@pytest.fixture(scope="module")
def eos(plain):
    """The first row's eleventh token (absent before it): that row stops at EOS, before its budget."""
    assert plain[0][10] not in plain[0][:10]
    return plain[0][10]


@pytest.fixture(scope="module")
def speculate(speculation_target, heads, prompts, eos):
    """Memoised: `speculate(kind, k)` -> the engine's results for the prompts, with EOS."""

    @functools.cache
    def generate(kind: str, k: int):
        engine = engine_lib.Engine(speculation_target, heads[kind], config=config_lib.EngineConfig(num_speculative_tokens=k, max_length=64))
        return engine.generate(prompts, max_new_tokens=MAX_NEW, eos_ids=[eos])

    return generate


@pytest.mark.parametrize("kind, k", [("eagle3", 4), ("eagle", 3)])
def test_replay_counts_what_the_engine_counts(speculation_target, heads, prompts, plain, speculate, kind, k):
    results = speculate(kind, k)
    records = [dict(prompt_ids=prompt, output_ids=result.token_ids, category="c") for prompt, result in
               zip(prompts, results)]
    # Lossless, and cut where the test means to: the first row by EOS, the others by the budget.
    assert [r["output_ids"] for r in records] == [plain[0][:11], plain[1], plain[2]]
    drafts, agreeing = replay_acceptance.unrolled_drafts(speculation_target, heads[kind], records, k)
    assert agreeing == sum(len(r["output_ids"]) for r in records)  # the outputs are the target's greedy tokens
    all_accepted = []
    for record, record_drafts, result in zip(records, drafts, results):
        [(_, accepted, _)] = replay_acceptance.replay_all([record], [record_drafts], k)
        stats = result.stats
        assert stats["num_drafts"] == len(accepted)
        assert stats["num_accepted_tokens"] == accepted.sum()
        assert [round(rate * len(accepted)) for rate in stats["acceptance_rate_per_position"]] == \
            [int(np.sum(accepted > j)) for j in range(k)]
        all_accepted.append(accepted)
    all_accepted = np.concatenate(all_accepted)
    assert 0 in all_accepted and max(all_accepted) >= 2  # steps that reject at once and steps that accept several
    summary = replay_acceptance.summarise(records, drafts, k)
    assert summary["acceptance_length"] == pytest.approx(result_lib.pooled_stats(results, k)["acceptance_length"],
                                                         abs=1e-4)


def test_the_script_reports_the_engines_acceptance(speculation_target, heads, prompts, speculate, tiny_hf_config, save_head,
                                                   tmp_path):
    """The command line end to end, from files: a converted target, an exported EAGLE-3 head, the
    outputs as JSONL and token counts from a distilled .npz."""
    k = 4
    results = speculate("eagle3", k)
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "config.json").write_text(json.dumps(tiny_hf_config(num_layers=3, head_dim=16)))
    model = models.save_converted(speculation_target, tmp_path / "source", tmp_path / "model")
    head = save_head(heads["eagle3"], tmp_path / "head")
    outputs = tmp_path / "outputs.jsonl"
    outputs.write_text("".join(json.dumps(dict(prompt_ids=p, output_ids=r.token_ids, category=c)) + "\n"
                               for p, r, c in zip(prompts, results, ["x", "y", "y"])))
    tokens = np.concatenate([p + r.token_ids for p, r in zip(prompts, results)])[None]
    train_data = data.save_dataset(dict(input_ids=tokens, loss_mask=np.ones_like(tokens, bool),
                                        lengths=np.array([tokens.shape[1]])), tmp_path / "train.npz")
    assert replay_acceptance.main(["--model", str(model), "--draft", str(head), "--outputs", str(outputs),
                                   "--k", str(k), "--train-data", str(train_data), "--vocab-sizes", "80",
                                   "--out", str(tmp_path / "replay.json")]) == 0
    summary = json.loads((tmp_path / "replay.json").read_text())
    pooled = result_lib.pooled_stats(results, k)
    assert summary["num_drafts"] == pooled["num_drafts"]
    assert summary["num_accepted_tokens"] == pooled["num_accepted_tokens"]
    assert summary["by_category"]["x"]["num_drafts"] == results[0].stats["num_drafts"]
    assert summary["target_greedy_agreement"] == 1.0
    vocab = summary["draft_vocabulary"]
    assert vocab["size"] == DRAFT_VOCAB and vocab["output_coverage"] < 1
    upper = vocab["full_vocabulary_upper_bound"]
    assert upper["acceptance_length"] > summary["acceptance_length"]
    # The training tokens hold fewer than 80 distinct ids, all of the outputs' among them: the top-80
    # vocabulary covers every output token, so its bound is the full vocabulary's.
    assert vocab["top_80"]["output_coverage"] == vocab["top_80"]["train_coverage"] == 1.0
    assert vocab["top_80"]["upper_bound"] == upper


def test_vocabulary_numbers_on_a_case_worked_by_hand():
    """k = 2, a draft vocabulary without token 9, drafts chosen by hand (row r predicts answer tokens r+1, r+2).

    Answer A = 3 9 4 5 6 7, B = 5 6 7. As drafted: A accepts 0 (9 is out of the vocabulary), 2, then
    1 (the answer ends); B accepts 1 (rejecting 7). With 9 drafted right: A accepts 2, 2. With the
    top-4 vocabulary by the counts below ({3, 5, 7, 9}: 9 drafted right, 4 and 6 always missed):
    A accepts 1, 0, 0, 1 and B 0, 1.
    """
    records = [dict(prompt_ids=[1], output_ids=[3, 9, 4, 5, 6, 7], category="a"),
               dict(prompt_ids=[1, 1], output_ids=[5, 6, 7], category="b")]
    drafts = [np.array([[8, 4], [4, 5], [0, 0], [6, 7], [7, 0]]), np.array([[6, 0], [7, 0]])]
    draft_vocabulary = np.arange(10) != 9
    counts = np.array([0, 0, 0, 5, 0, 5, 1, 5, 0, 9])
    summary = replay_acceptance.summarise(records, drafts, 2, draft_vocabulary, counts, [4])

    approx = lambda x: pytest.approx(x, abs=1e-4)
    assert (summary["num_drafts"], summary["num_accepted_tokens"]) == (4, 4)
    assert summary["acceptance_length"] == 2.0 and summary["acceptance_rate_per_position"] == [0.75, 0.25]
    assert summary["by_category"]["a"]["acceptance_rate_per_position"] == approx([2 / 3, 1 / 3])
    assert summary["by_category"]["b"]["acceptance_rate_per_position"] == [1.0, 0.0]
    vocab = summary["draft_vocabulary"]
    assert vocab["size"] == 9 and vocab["output_coverage"] == approx(8 / 9)
    assert vocab["train_coverage"] == approx(16 / 25)
    assert (vocab["rejections"], vocab["rejections_out_of_vocabulary"]) == (2, 0.5)  # 9 in A, 7 in B
    upper = vocab["full_vocabulary_upper_bound"]
    assert upper["acceptance_length"] == approx(8 / 3) and upper["acceptance_rate_per_position"] == approx([1, 2 / 3])
    assert upper["gain"] == approx(2 / 3)
    top = vocab["top_4"]
    assert top["output_coverage"] == approx(6 / 9) and top["train_coverage"] == approx(24 / 25)
    assert top["upper_bound"]["acceptance_length"] == 1.5
    assert top["upper_bound"]["acceptance_rate_per_position"] == [0.5, 0.0]
