"""Per-request settings through the engine, speculation on: one set of programs for any mix a
fixed sampling mode covers (compile counts), seeded rows whatever their neighbours, n samples,
logprobs, stop strings and finish reasons, for both schedulers; and bad settings refused."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.decode import sampling
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib

ROWS, MAX_NEW, K = 4, 10, 3
# Covers every request below: a server-style fixed mode, so no call compiles anything new.
MODE = sampling.SamplingMode(sample=True, penalties=True, min_p=True, top_k=8, top_p=True, logprobs=3,
                             min_tokens=True)
GREEDY, SAMPLED = sampling.Sampling(), sampling.Sampling(temperature=1.0, top_k=8)


@pytest.fixture(scope="module")
def target(speculation_target):
    return speculation_target


@pytest.fixture(scope="module")
def head(target, agreeing_head):
    return agreeing_head(target.config, 0.3, residual=1.0, seed=1)  # agrees partly: steps accept 0..k drafts


@pytest.fixture(scope="module")
def prompts(random_prompts):
    # One length (every call reads the same cache lengths), different tokens.
    return [random_prompts((7,), seed=seed)[0] for seed in range(ROWS)]


@pytest.fixture(scope="module")
def engines(target, head):
    """`engines(scheduler, k=K, mode=MODE)`, memoised."""
    @functools.cache
    def make(scheduler: str, k: int = K, mode: sampling.SamplingMode | None = MODE):
        return engine_lib.Engine(target, head if k else None, config=config_lib.EngineConfig(
            num_speculative_tokens=k, max_length=64, batch_size=ROWS, scheduler=scheduler, sampling_mode=mode,
            steps_per_call=3))

    return make


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_mixed_batches_share_one_set_of_programs(engines, prompts, scheduler, xla_compilations):
    """Greedy, sampled, top-k, top-p, min-p, penalised, seeded and stopping rows in one batch, then
    another mix: the second call compiles nothing. A request the mode does not cover is refused."""
    engine = engines(scheduler)
    first = [GREEDY, SAMPLED, sampling.Sampling(repetition_penalty=1.3),
             sampling.Sampling(temperature=0.7, top_p=0.9, presence_penalty=0.5)]
    second = [sampling.Sampling(temperature=1.2, min_p=0.1, logprobs=2, seed=3),
              sampling.Sampling(frequency_penalty=1.0, min_tokens=4), sampling.Sampling(logprobs=3),
              sampling.Sampling(temperature=0.5, top_k=8, ignore_eos=True, stop_token_ids=(5,))]
    engine.generate(prompts, max_new_tokens=MAX_NEW, sampling=first)
    compiled = engine.num_compilations
    with xla_compilations() as new:
        results = engine.generate(prompts, max_new_tokens=MAX_NEW, sampling=second)
    assert engine.num_compilations == compiled and new == [], new
    assert [r.logprobs is not None for r in results] == [True, False, True, False]
    with pytest.raises(config_lib.InputError, match="more than this engine's sampling_mode"):
        engine.generate(prompts[:1], max_new_tokens=MAX_NEW, sampling=sampling.Sampling(temperature=1.0, top_k=9))


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_without_a_fixed_mode_each_mode_compiles_once(engines, prompts, scheduler):
    """The default: a call runs the smallest mode covering its requests (greedy keeps the plain
    argmax program); each mode's programs compile once (the slots' too: their state follows the mode)."""
    engine = engines(scheduler, mode=None)
    greedy = engine.generate(prompts, max_new_tokens=MAX_NEW)
    after_greedy = engine.num_compilations
    engine.generate(prompts, max_new_tokens=MAX_NEW, sampling=[GREEDY, SAMPLED] * 2)
    after_mixed = engine.num_compilations
    assert after_mixed > after_greedy
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=MAX_NEW)] == [r.token_ids for r in greedy]
    engine.generate(prompts, max_new_tokens=MAX_NEW, sampling=[SAMPLED, GREEDY] * 2)
    assert engine.num_compilations == after_mixed


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_a_seeded_row_draws_the_same_tokens_whatever_its_neighbours(engines, prompts, scheduler):
    """Its keys come from its seed and its emitted count alone: other rows' settings, the call's
    seed and (continuous) the slot it lands in change nothing; an unseeded row does change."""
    engine = engines(scheduler)
    seeded = sampling.Sampling(temperature=1.0, top_k=8, repetition_penalty=1.2, seed=1234)
    neighbours = [[GREEDY] * 3, [sampling.Sampling(temperature=1.5)] * 3,
                  [sampling.Sampling(temperature=0.8, seed=7, min_p=0.05), SAMPLED, GREEDY]]
    outputs = []
    for call, others in enumerate(neighbours):
        at = 2 if call == 1 else 0  # another row (static), another slot (continuous)
        settings = others[:at] + [seeded] + others[at:]
        row_prompts = prompts[1:at + 1] + prompts[:1] + prompts[at + 1:]  # the seeded row keeps prompt 0
        results = engine.generate(row_prompts, max_new_tokens=MAX_NEW, sampling=settings, seed=call)
        outputs.append(results[at].token_ids)
    assert outputs[0] == outputs[1] == outputs[2]
    unseeded = [engine.generate(prompts[:1], max_new_tokens=MAX_NEW, sampling=SAMPLED, seed=seed)[0].token_ids
                for seed in (0, 1, 2)]
    assert len(set(map(tuple, unseeded))) > 1


def test_n_samples_are_rows_with_their_own_keys(engines, prompts):
    """A request with n = 3 gives three consecutive results drawn apart; the first sample uses the
    request's seed as a lone request would, the others `Sampling.sample_seed`."""
    engine = engines("continuous")
    request = sampling.Sampling(temperature=1.0, top_k=8, seed=11, n=3)
    results = engine.generate(prompts[:2], max_new_tokens=MAX_NEW, sampling=[request, GREEDY])
    assert len(results) == 4
    samples = [tuple(r.token_ids) for r in results[:3]]
    assert len(set(samples)) == 3
    assert results[3].token_ids == engine.generate(prompts[1:2], max_new_tokens=MAX_NEW)[0].token_ids
    for index in range(3):
        alone = engine.generate(prompts[:1], max_new_tokens=MAX_NEW, sampling=sampling.Sampling(
            temperature=1.0, top_k=8, seed=request.sample_seed(index)))[0]
        assert tuple(alone.token_ids) == samples[index]


def reference_log_probs(target, prompt, tokens) -> np.ndarray:
    """log_softmax of the target's logits at each emitted position, by one full forward: [len(tokens), V]."""
    sequence = jnp.asarray([list(prompt) + list(tokens)], jnp.int32)
    hidden = target(sequence, jnp.arange(sequence.shape[1])[None], target.init_cache(1, sequence.shape[1]))[0]
    return np.asarray(jax.nn.log_softmax(target.logits(hidden)[0, len(prompt) - 1:-1].astype(jnp.float32), axis=-1))


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_logprobs_of_the_emitted_tokens(engines, target, prompts, scheduler):
    """Greedy rows: the token is its own best alternative, at the log-probability a full forward gives
    (speculation or not); a top-k row's alternatives are its top k at most, as many as it asked."""
    settings = [sampling.Sampling(logprobs=3), sampling.Sampling(temperature=1.0, top_k=2, logprobs=3), GREEDY,
                sampling.Sampling(temperature=1.0, logprobs=0)]
    speculated = engines(scheduler).generate(prompts, max_new_tokens=MAX_NEW, sampling=settings)
    plain = engines(scheduler, k=0).generate(prompts, max_new_tokens=MAX_NEW, sampling=settings)
    assert speculated[0].token_ids == plain[0].token_ids
    expected = reference_log_probs(target, prompts[0], speculated[0].token_ids)
    for result in (speculated[0], plain[0]):
        assert [e["token_id"] for e in result.logprobs] == result.token_ids
        for entry, row in zip(result.logprobs, expected):
            assert entry["rank"] == 1 and entry["top_logprobs"][0]["token_id"] == entry["token_id"]
            np.testing.assert_allclose([entry["logprob"]] + [t["logprob"] for t in entry["top_logprobs"]],
                                       [row.max()] + np.sort(row)[::-1][:3].tolist(), atol=1e-4)
            assert [t["token_id"] for t in entry["top_logprobs"]] == np.argsort(-row, kind="stable")[:3].tolist()
    top_k = speculated[1]
    assert len(top_k.logprobs) == len(top_k.token_ids)
    for entry in top_k.logprobs:  # two tokens survive top-k: their processed log-probabilities sum to 1
        assert entry["rank"] in (1, 2) and len(entry["top_logprobs"]) == 2
        assert np.isclose(sum(np.exp(t["logprob"]) for t in entry["top_logprobs"]), 1.0, atol=1e-5)
    assert speculated[2].logprobs is None
    assert all(e["top_logprobs"] == [] and e["logprob"] <= 0 for e in speculated[3].logprobs)


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_stop_strings_cut_text_and_tokens(engines, prompts, scheduler, chat_tokenizer):
    """A stop string found across token boundaries ends its row: the text stops before it, the
    tokens end with the one that completed it, the finish reason is "stop"; rows beside it run on."""
    engine = engines(scheduler)
    free = engine.generate(prompts, max_new_tokens=MAX_NEW, tokenizer=chat_tokenizer)
    text = free[0].text
    assert text == chat_tokenizer.decode(free[0].token_ids, skip_special_tokens=True)
    stop = text[4:6]
    assert len(stop) == 2 and text.index(stop) == 4  # the first occurrence, mid-output
    settings = [sampling.Sampling(stop=(stop, "never seen")), GREEDY, GREEDY, sampling.Sampling(stop="never seen")]
    results = engine.generate(prompts, max_new_tokens=MAX_NEW, sampling=settings, tokenizer=chat_tokenizer)
    cut = results[0]
    assert cut.text == text[:4] and (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == free[0].token_ids[:len(cut.token_ids)]
    assert stop in chat_tokenizer.decode(cut.token_ids) and stop not in chat_tokenizer.decode(cut.token_ids[:-1])
    for row in (1, 2, 3):
        assert (results[row].token_ids, results[row].finish_reason) == (free[row].token_ids, free[row].finish_reason)


def test_bad_settings_are_refused(engines, prompts):
    engine = engines("static")
    generate = functools.partial(engine.generate, max_new_tokens=MAX_NEW)
    with pytest.raises(config_lib.InputError, match="3 sampling settings for 4 prompts"):
        generate(prompts, sampling=[GREEDY] * 3)
    with pytest.raises(config_lib.InputError, match="stop strings: pass the tokenizer"):
        generate(prompts, sampling=sampling.Sampling(stop="x"))
    with pytest.raises(config_lib.InputError, match="stop token id 101 is outside the vocabulary"):
        generate(prompts, sampling=sampling.Sampling(stop_token_ids=[3, 101]))
    with pytest.raises(config_lib.InputError, match="must be a sampling.Sampling"):
        generate(prompts[:1], sampling=[{"temperature": 1.0}])
    with pytest.raises(config_lib.InputError, match="at most 8 EOS ids"):
        generate(prompts, eos_ids=list(range(9)))
    with pytest.raises(config_lib.InputError, match="sampling_mode must be"):
        config_lib.EngineConfig(sampling_mode="greedy")
