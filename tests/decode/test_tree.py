"""EAGLE-2 tree drafting: the tree's structure against brute-force walks, acceptance and KV
compaction against numpy, and end to end: greedy tree decoding equals plain greedy decoding,
its acceptance counts equal a reference that rebuilds every tree from scratch, K = 1 is the
chain, and nothing recompiles across prompts.

The end-to-end tests reuse test_speculative's aligned target, prompts and heads.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.model import attention_ops
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.model import kv_cache as kv_cache_lib
from eagle_jax.decode import speculative
from eagle_jax.decode import tree as tree_lib
from eagle_jax.decode import state as state_lib
from eagle_jax.decode import tree_step
from tests.decode.test_speculative import MAX_NEW, WIDTH, _features, _pad  # noqa: F401
from tests.decode.test_speculative import make_head, prompts, reference, target  # noqa: F401 (fixtures)

# ---- The tree's structure, acceptance and compaction, against brute force -----------------------


def random_pool(opts: tree_lib.TreeOptions, rng: np.random.Generator, alphabet: int = 1000):
    """One row's pool laid out as `tree_draft` lays it out: depth 1, then K children of each of K
    frontier entries of the depth before, parent-major. Scores are cumulative; some log-probabilities
    are exactly 0 (a child ties its parent) and some -inf (a truncated distribution)."""
    topk = opts.topk
    log_prob = lambda: rng.choice([0.0, -np.inf, -rng.exponential()], p=[0.2, 0.1, 0.7])
    tokens = list(rng.permutation(alphabet)[:topk])
    scores = [log_prob() for _ in range(topk)]
    parents = [-1] * topk
    frontier = list(range(topk))
    for _ in range(opts.num_steps - 1):
        start = len(tokens)
        for entry in frontier:
            tokens += list(rng.permutation(alphabet)[:topk])  # siblings are distinct
            scores += [scores[entry] + log_prob() for _ in range(topk)]
            parents += [entry] * topk
        frontier = list(rng.choice(np.arange(start, len(tokens)), topk, replace=False))
    return np.array(tokens, np.int32), np.array(scores, np.float32), np.array(parents, np.int32)


def walk(parents, node):
    """The nodes from `node` up to the root, by following parents."""
    nodes = [node]
    while nodes[-1] != 0:
        nodes.append(parents[nodes[-1]])
    return nodes


def brute_force_tree(tokens, scores, parents, opts):
    """(node tokens, node parents, depths, ancestor sets) of the N best pool entries, node 0 the root."""
    best = sorted(range(len(scores)), key=lambda entry: (-scores[entry], entry))[:opts.num_draft_tokens]
    chosen = sorted(best)
    node_of = {entry: node for node, entry in enumerate(chosen, 1)}
    # A KeyError here means a chosen entry's parent was left out: the tree would not be connected.
    node_parents = [0] + [0 if parents[entry] < 0 else node_of[parents[entry]] for entry in chosen]
    ancestors = [set(walk(node_parents, node)) for node in range(len(node_parents))]
    return [None] + [int(tokens[entry]) for entry in chosen], node_parents, [len(a) - 1 for a in ancestors], ancestors


@pytest.mark.parametrize("topk, num_steps, num_draft_tokens", [(1, 4, 4), (2, 3, 5), (3, 3, 21), (4, 2, 7)])
def test_tree_mask_and_positions_match_a_walk_over_parents(topk, num_steps, num_draft_tokens):
    opts = tree_lib.TreeOptions(topk, num_steps, num_draft_tokens)
    rng = np.random.default_rng(topk * 10 + num_steps)
    batch, num_slots = 6, 40
    pools = [random_pool(opts, rng) for _ in range(batch)]
    pool_tokens, pool_scores, pool_parents = (np.stack(column) for column in zip(*pools))
    root = rng.integers(0, 1000, batch).astype(np.int32)
    committed = rng.integers(0, num_slots - num_draft_tokens, batch).astype(np.int32)
    tree = tree_lib.select(*map(jnp.asarray, (pool_tokens, pool_scores, pool_parents, root)), opts)
    visible = np.asarray(attention_ops.visible_slots(jnp.asarray(committed), tree.ancestors, num_slots))
    positions = np.asarray(committed[:, None] + tree.depths)
    for row, (tokens, scores, parents) in enumerate(pools):
        node_tokens, node_parents, depths, ancestors = brute_force_tree(tokens, scores, parents, opts)
        assert np.asarray(tree.tokens[row]).tolist() == [root[row]] + node_tokens[1:]
        assert np.asarray(tree.parents[row]).tolist() == node_parents
        assert positions[row].tolist() == [committed[row] + depth for depth in depths]
        assert max(depths) <= num_steps
        for node, nodes_seen in enumerate(ancestors):
            assert set(np.flatnonzero(tree.ancestors[row, node])) == nodes_seen
            # Node j of the verify sits in slot committed + j; the context is every slot before.
            expected = set(range(committed[row])) | {committed[row] + j for j in nodes_seen}
            assert set(np.flatnonzero(visible[row, node])) == expected


@pytest.mark.parametrize("topk, num_steps, num_draft_tokens", [(1, 3, 3), (2, 3, 6), (3, 4, 12)])
def test_accept_follows_the_target_from_the_root(topk, num_steps, num_draft_tokens):
    opts = tree_lib.TreeOptions(topk, num_steps, num_draft_tokens)
    rng = np.random.default_rng(7)
    batch, alphabet = 64, 5  # few tokens: the target's choice often matches a child
    pools = [random_pool(opts, rng, alphabet) for _ in range(batch)]
    tree = tree_lib.select(*(jnp.asarray(np.stack(column)) for column in zip(*pools)),
                           jnp.zeros((batch,), jnp.int32), opts)
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    # The target's choice after each node: often one of its children's tokens, else any token.
    choices = rng.integers(0, alphabet, tokens.shape).astype(np.int32)
    for row, node in zip(*np.nonzero(rng.random(tokens.shape) < 0.6)):
        children = np.flatnonzero(parents[row, 1:] == node) + 1
        if len(children):
            choices[row, node] = tokens[row, rng.choice(children)]
    num_accepted, next_token, path = map(np.asarray, tree_lib.accept(tree, jnp.asarray(choices), num_steps))
    lengths = []
    for row in range(batch):
        node, nodes = 0, [0]
        while True:
            children = [j for j in range(1, num_draft_tokens + 1) if parents[row, j] == node and j != node]
            matching = [j for j in children if tokens[row, j] == choices[row, node]]
            assert len(matching) <= 1  # siblings are distinct
            if not matching:
                break
            node = matching[0]
            nodes.append(node)
        lengths.append(len(nodes) - 1)
        assert num_accepted[row] == len(nodes) - 1
        assert next_token[row] == choices[row, node]
        assert path[row].tolist() == nodes + [0] * (num_steps + 1 - len(nodes))
    assert len(set(lengths)) > 2 and max(lengths) >= 2, lengths  # the walk goes deep, sometimes


def test_compact_moves_the_path_into_consecutive_slots():
    rng = np.random.default_rng(0)
    batch, slots = 3, 16
    keys = rng.standard_normal((batch, slots, 2, 4)).astype(np.float32)
    values = rng.standard_normal((batch, slots, 2, 4)).astype(np.float32)
    cache = kv_cache_lib.KVCache(keys=(jnp.asarray(keys),), values=(jnp.asarray(values),),
                                 lengths=jnp.zeros((batch,), jnp.int32))
    start = np.array([0, 5, 9], np.int32)
    sources = np.array([[0, 2, 5, 6], [0, 1, 2, 3], [0, 4, 1, 6]], np.int32)  # a path, an identity, a backward move
    moved = kv_cache_lib.compact(cache, jnp.asarray(start), jnp.asarray(sources))
    for original, result in ((keys, moved.keys[0]), (values, moved.values[0])):
        expected = original.copy()
        for row in range(batch):
            expected[row, start[row]:start[row] + 4] = original[row, start[row] + sources[row]]
        np.testing.assert_array_equal(np.asarray(result), expected)


@pytest.mark.parametrize("settings, message", [
    ((0, 3, 3), "topk must be an integer >= 1, got 0"),
    ((2, 0, 3), "num_steps must be an integer >= 1, got 0"),
    ((2, 3, 11), r"num_draft_tokens must be an integer from num_steps \(3\) to topk \+ \(num_steps - 1\) \* "
                 r"topk\^2 \(10\), got 11"),
    ((2, 3, 2), r"from num_steps \(3\)"),
    ((1, 3, 4), r"to topk \+ \(num_steps - 1\) \* topk\^2 \(3\)"),
])
def test_bad_tree_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        tree_lib.TreeOptions(*settings)


# ---- End to end ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_tree(target, prompts, make_head):  # noqa: F811
    """Memoised greedy tree generation of all prompts for (head kind, K, D, N, batch size)."""

    @functools.cache
    def generate(kind: str, topk: int, num_steps: int, num_draft_tokens: int, batch_size: int):
        engine = engine_lib.Engine(target, make_head(kind), config=config_lib.EngineConfig(steps_per_call=4, tree=tree_lib.TreeOptions(topk, num_steps, num_draft_tokens),
                                   max_length=64, batch_size=batch_size))
        return engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)

    return generate


TREE_CASES = [  # (kind, K, D, N, batch size): EAGLE-1 and EAGLE-3, batch 2 runs ragged rows and an idle one
    ("eagle-agree", 2, 3, 5, 2),
    ("eagle-agree", 2, 4, 14, 2),  # the whole pool: deep enough to accept at depth 4
    ("eagle-noisy", 3, 2, 5, 1),
    ("eagle-bias", 2, 4, 5, 1),
    ("eagle3-biased", 2, 3, 5, 2),
    ("eagle3-random", 4, 2, 5, 1),
    ("eagle3-two-layers", 2, 3, 5, 2),  # each layer's cache under the tree mask
]


@pytest.mark.parametrize("case", TREE_CASES)
def test_tree_greedy_is_lossless(run_tree, reference, case):  # noqa: F811
    assert [r.token_ids for r in run_tree(*case)] == reference


def test_the_tree_draft_loop_written_out_changes_nothing(target, prompts, make_head, run_tree):  # noqa: F811
    kind, topk, num_steps, num_draft_tokens = "eagle3-biased", 2, 3, 5
    engine = engine_lib.Engine(target, make_head(kind), config=config_lib.EngineConfig(
        steps_per_call=4, tree=tree_lib.TreeOptions(topk, num_steps, num_draft_tokens), max_length=64,
        unroll_draft=True))
    results = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    expected = run_tree(kind, topk, num_steps, num_draft_tokens, 1)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.stats for r in results] == [r.stats for r in expected]


@pytest.mark.parametrize("shape, k", [((2, 3, 16384), 8), ((1, 4, 5000), 4), ((3, 1100), 1), ((2, 300), 8)])
def test_two_stage_top_k_equals_lax_top_k(shape, k):
    """Values and indices equal `lax.top_k`'s, ties (few distinct values) and -inf included, for
    rows a whole number of chunks long, with a padded last chunk, and too short to split."""
    rng = np.random.default_rng(k)
    values = jnp.asarray(rng.integers(-6, 3, shape), jnp.float32)  # nine values: ties everywhere
    values = jnp.where(jnp.asarray(rng.random(shape) < 0.3), -jnp.inf, values)
    for row_values in (values, jnp.asarray(rng.standard_normal(shape), jnp.float32)):
        top, indices = tree_lib.top_k(row_values, k)
        expected_top, expected_indices = jax.lax.top_k(row_values, k)
        np.testing.assert_array_equal(top, expected_top)
        np.testing.assert_array_equal(indices, expected_indices)


def test_trees_draft_the_same_with_two_stage_top_k(target, make_head, prompts, reference, run_tree,  # noqa: F811
                                                   monkeypatch):
    """The tiny test vocabularies are too short to split: chunks of 8 send them through both
    stages. Same drafts, so the same tokens accepted at each step, as with one `lax.top_k` (the
    default chunk, 1,024, holds the whole vocabulary: `run_tree`'s run of the same case)."""
    monkeypatch.setattr(tree_lib, "TOP_K_CHUNK", 8)
    engine = engine_lib.Engine(target, make_head("eagle3-random"), config=config_lib.EngineConfig(steps_per_call=4, tree=tree_lib.TreeOptions(4, 2, 5), max_length=64))
    split = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    whole = run_tree("eagle3-random", 4, 2, 5, 1)  # draft ids mapped to target ids
    assert [r.token_ids for r in split] == [r.token_ids for r in whole] == reference
    assert [r.stats for r in split] == [r.stats for r in whole]
    assert sum(r.stats["num_accepted_tokens"] for r in split) > 0  # drafts that the target takes: ids matter


@pytest.mark.parametrize("kind, num_steps, batch_size", [("eagle-noisy", 3, 2), ("eagle3-biased", 4, 1)])
def test_a_tree_of_topk_1_is_the_chain(target, prompts, make_head, run_tree, kind, num_steps, batch_size):  # noqa: F811
    chain = engine_lib.Engine(target, make_head(kind), config=config_lib.EngineConfig(steps_per_call=4, num_speculative_tokens=num_steps, max_length=64,
                              batch_size=batch_size))
    expected = chain.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    results = run_tree(kind, 1, num_steps, num_steps, batch_size)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.stats for r in results] == [r.stats for r in expected]
    assert sum(r.stats["num_accepted_tokens"] for r in results) > 0


@functools.partial(jax.jit, static_argnums=(0, 2))
def _head_forward(head_def, head_params, target_def, target_params, tokens, features):
    """The head over W (token, feature) pairs from an empty draft cache: (out [1, W, D], log q [1, W, V_draft])."""
    from eagle_jax.model import eagle

    head, target = nnx.merge(head_def, head_params), nnx.merge(target_def, target_params)
    positions = jnp.arange(WIDTH, dtype=jnp.int32)[None]
    out, logits, _ = head(tokens, features, positions, eagle.init_cache(head.config, 1, WIDTH, jnp.float32), target)
    return out, jax.nn.log_softmax(logits, axis=-1)


def reference_tree(target, head, context_tokens, context_features, opts: tree_lib.TreeOptions) -> dict:
    """{path of tokens: score} of the N nodes EAGLE-2 chooses, recomputed from scratch.

    Each node's children come from a head forward over the context pairs (t_{i+1}, f_i) followed
    by the node's path, each path token paired with the head output of its parent's forward. The
    frontier of each depth is the K best of its K^2 children, the tree the N best of all nodes
    (ties to the earlier one).
    """
    head_split, target_split = nnx.split(head), nnx.split(target)
    to_target = np.asarray(head.to_target_ids(jnp.arange(head.config.draft_vocab_size or target.config.vocab_size)))

    def children(node):  # node: (score, path tokens, path features)
        score, path_tokens, path_features = node
        tokens, features = list(context_tokens) + path_tokens, list(context_features) + path_features
        out, log_q = _head_forward(*head_split, *target_split, _pad(tokens), _pad(np.stack(features)))
        out, log_q = np.asarray(out[0, len(tokens) - 1]), np.asarray(log_q[0, len(tokens) - 1])
        best = np.argsort(-log_q, kind="stable")[:opts.topk]
        return [(score + log_q[i], path_tokens + [int(to_target[i])], path_features + [out]) for i in best]

    ranked = lambda nodes, count: [nodes[i] for i in sorted(range(len(nodes)), key=lambda i: -nodes[i][0])[:count]]
    frontier = children((0.0, [], []))
    pool = list(frontier)
    for _ in range(opts.num_steps - 1):
        grown = [child for node in frontier for child in children(node)]
        pool += grown
        frontier = ranked(grown, opts.topk)
    return {tuple(tokens): score for score, tokens, _ in ranked(pool, opts.num_draft_tokens)}


def target_features(target, head, sequence):
    """(the head-space target features [len, D] of `sequence`, its greedy continuation [len])."""
    features, greedy = _features(*nnx.split(target), *nnx.split(head), _pad(sequence))
    return np.asarray(features[0, :len(sequence)]), np.asarray(greedy[0, :len(sequence)])


def tree_reference_stats(target, head, prompt, output, opts: tree_lib.TreeOptions, plain_steps: int = 0):
    """(num_drafts, accepted per depth) of EAGLE-2 greedy decoding, every tree rebuilt from scratch:
    each step accepts the longest chosen path equal to the target's greedy tokens. The first
    `plain_steps` steps draft nothing (speculation disabled) and emit one token each."""
    sequence = list(prompt) + list(output)
    while len(sequence) < len(prompt) + MAX_NEW + opts.num_steps + 1:  # the target's tokens past the budget too
        sequence.append(int(target_features(target, head, sequence)[1][-1]))
    features, _ = target_features(target, head, sequence)
    length, generated, steps, accepted = len(prompt), 1, 0, np.zeros(opts.num_steps, int)
    while generated < MAX_NEW:
        if plain_steps:
            plain_steps, generated, length = plain_steps - 1, generated + 1, length + 1
            continue
        paths = reference_tree(target, head, sequence[1:length + 1], features[:length], opts)
        kept = 0
        while tuple(sequence[length + 1:length + 2 + kept]) in paths:
            kept += 1
        emitted = len(sequence[length + 1:length + 2 + kept][:MAX_NEW - generated])
        accepted[:min(kept, emitted)] += 1
        steps, generated, length = steps + 1, generated + emitted, length + emitted
    return steps, accepted


@pytest.mark.parametrize("case", TREE_CASES)
def test_tree_acceptance_matches_a_reference_without_caches(target, make_head, prompts, reference, run_tree,  # noqa: F811
                                                            case):
    """Exact per-depth acceptance: catches tree mask, rotary position, draft cache and pending-pair
    mistakes on the head's side, which leave the output lossless and only cost acceptance."""
    kind, *settings, _ = case
    opts = tree_lib.TreeOptions(*settings)
    results = run_tree(*case)
    for prompt, output, result in zip(prompts, reference, results):
        steps, accepted = tree_reference_stats(target, make_head(kind), prompt, output, opts)
        assert result.stats["num_drafts"] == steps
        assert [round(rate * steps) for rate in result.stats["acceptance_rate_per_position"]] == accepted.tolist()
        assert result.stats["num_draft_tokens"] == steps * opts.num_draft_tokens


# (kind, tree, whether some of the steps accept drafts: measured, the EAGLE-3 head accepts none in these)
@pytest.mark.parametrize("kind, settings, accepts", [("eagle-bias", (2, 3, 5), True), ("eagle3-biased", (3, 3, 8), False)])
def test_drafted_tree_matches_a_reference_without_caches(target, make_head, prompts, kind, settings, accepts):  # noqa: F811
    """The drafted nodes and their scores, step after step, for ragged rows: any error in the
    head's tree mask, rotary positions or scratch slots shifts the scores."""
    head, tree = make_head(kind), tree_lib.TreeOptions(*settings)
    opts = state_lib.Options(k=tree.num_steps, tree=tree, max_new_tokens=MAX_NEW, cache_length=64)
    tokens = np.zeros((len(prompts), 16), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    state = jax.jit(lambda t, n: speculative.start(target, head, t, n, jax.random.key(0), opts))(tokens, lengths)
    draft = jax.jit(lambda s: tree_step.draft_tree(target, head, s, opts)[0])
    step = jax.jit(lambda s: speculative.step(target, head, s, opts))
    pending_counts = set()
    for _ in range(6):
        drafted = jax.device_get(draft(state))
        committed, output, generated = jax.device_get((state.cache.lengths, state.output, state.num_generated))
        pending_counts |= set(jax.device_get(state.pending_count).tolist())
        for row, prompt in enumerate(prompts):
            sequence = list(prompt) + output[row, :generated[row]].tolist()  # t_0 .. t_L, t_L the root
            length = committed[row]
            assert len(sequence) == length + 1 and drafted.tokens[row, 0] == sequence[-1]
            features, _ = target_features(target, head, sequence[:length])
            expected = reference_tree(target, head, sequence[1:], features, tree)
            nodes = range(1, tree.num_draft_tokens + 1)
            paths = [tuple(drafted.tokens[row, np.flatnonzero(drafted.ancestors[row, node])][1:]) for node in nodes]
            assert set(paths) == set(expected)
            np.testing.assert_allclose([drafted.scores[row, node] for node in nodes], [expected[p] for p in paths],
                                       rtol=1e-4, atol=1e-4)
        state = step(state)
    assert (len(pending_counts) > 1) == accepts, pending_counts  # steps that accepted different numbers of drafts


# The verify's N + 1 nodes bound the first tree's writes, the draft's (D-1)K scratch slots the second's.
@pytest.mark.parametrize("settings", [(2, 3, 6), (4, 3, 5)])
def test_a_step_writes_within_its_headroom(target, make_head, settings):  # noqa: F811
    """With the cache just long enough (`TreeOptions.cache_headroom` past the prompt), a step drafts,
    fills its scratch slots and emits what it does in a roomier cache, and leaves every committed
    entry alone (a write past the end would be clamped back onto earlier slots)."""
    tree, length = tree_lib.TreeOptions(*settings), 9
    head = make_head("eagle-bias")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 101, (1, length)), jnp.int32)

    def first_step(cache_length):
        opts = state_lib.Options(k=tree.num_steps, tree=tree, max_new_tokens=4, cache_length=cache_length)
        state = jax.jit(lambda t: speculative.start(target, head, t, jnp.array([length]), jax.random.key(0), opts))(
            tokens)
        drafted = jax.jit(lambda s: tree_step.draft_tree(target, head, s, opts))(state)
        return state, drafted, jax.jit(lambda s: speculative.step(target, head, s, opts))(state)

    state, drafted, after = first_step(length + tree.cache_headroom)
    _, roomy_drafted, roomy_after = first_step(length + tree.cache_headroom + 8)
    (drafted, scratch), (roomy_drafted, roomy_scratch) = drafted, roomy_drafted
    np.testing.assert_array_equal(drafted.tokens, roomy_drafted.tokens)
    np.testing.assert_allclose(drafted.scores, roomy_drafted.scores, rtol=1e-5, atol=1e-5)
    used = length + (tree.num_steps - 1) * tree.topk  # the frontiers of depths 1..D-1 sit before this slot
    for entries, roomy_entries in zip(scratch.keys + scratch.values, roomy_scratch.keys + roomy_scratch.values):
        np.testing.assert_allclose(entries[:, :used], roomy_entries[:, :used], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(after.output, roomy_after.output)
    assert int(after.cache.lengths[0]) > length
    draft_committed = int(state.draft_cache.lengths[0])  # the step's pending pair rewrites its own slot
    for cache, new, committed in ((state.cache, after.cache, length),
                                  (state.draft_cache, after.draft_cache, draft_committed)):
        for old_entries, new_entries in zip(cache.keys + cache.values, new.keys + new.values):
            np.testing.assert_array_equal(old_entries[:, :committed], new_entries[:, :committed])


def test_nothing_recompiles_across_prompts(target, make_head, xla_compilations):  # noqa: F811
    engine = engine_lib.Engine(target, make_head("eagle3-biased"), config=config_lib.EngineConfig(steps_per_call=3, tree=tree_lib.TreeOptions(3, 3, 6), max_length=64))
    prompt = lambda length: np.random.default_rng(length).integers(0, 101, length).tolist()
    with xla_compilations() as compiled:
        engine.generate([prompt(5)], max_new_tokens=MAX_NEW, ignore_eos=True)
    assert engine.num_compilations == 2 and len(compiled) >= 2, compiled
    with xla_compilations() as compiled:
        for length in (3, 8, 11):  # the same 16-wide prefill and 32-slot cache (11 + 12 + 7 <= 32)
            [result] = engine.generate([prompt(length)], max_new_tokens=MAX_NEW, ignore_eos=True)
            assert len(result.token_ids) == MAX_NEW
    assert engine.num_compilations == 2
    assert compiled == []


def test_continuous_batching_runs_trees(target, prompts, make_head, reference):  # noqa: F811
    engine = engine_lib.Engine(target, make_head("eagle-bias"), config=config_lib.EngineConfig(steps_per_call=3, tree=tree_lib.TreeOptions(2, 3, 5), max_length=64,
                               batch_size=2, scheduler="continuous"))
    results = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert [r.token_ids for r in results] == reference


def test_tree_speculation_resumes_with_the_draft_state_it_would_have_had(target, make_head, prompts,  # noqa: F811
                                                                          reference):  # noqa: F811
    """speculative_disable_by_batch_size with a tree: while both rows are active the step decodes
    plainly (the chain's plain step: the head still eats the pending pairs); then the long row drafts
    trees again. Its acceptance, depth by depth, must be what rebuilding every tree from scratch
    gives after SHORT - 1 plain steps, and its tokens plain greedy decoding's."""
    short, tree = 5, tree_lib.TreeOptions(2, 3, 5)
    engine = engine_lib.Engine(target, make_head("eagle-bias"), config=config_lib.EngineConfig(steps_per_call=3, tree=tree, max_length=64, batch_size=2,
                               scheduler="continuous", speculative_disable_by_batch_size=1))
    plain, speculated = engine.generate([prompts[2], prompts[1]], max_new_tokens=[short, MAX_NEW], ignore_eos=True)
    assert [plain.token_ids, speculated.token_ids] == [reference[2][:short], reference[1]]
    assert plain.stats["num_drafts"] == 0 and plain.stats["num_accepted_tokens"] == 0
    steps, accepted = tree_reference_stats(target, make_head("eagle-bias"), prompts[1], reference[1], tree,
                                           plain_steps=short - 1)
    assert speculated.stats["num_drafts"] == steps > 0
    assert speculated.stats["num_draft_tokens"] == steps * tree.num_draft_tokens
    assert [round(rate * steps) for rate in speculated.stats["acceptance_rate_per_position"]] == accepted.tolist()
    assert accepted[0] > 0  # drafts were accepted after the pause: a test that can tell


def test_tree_settings_are_checked(target, make_head):  # noqa: F811
    tree = tree_lib.TreeOptions(2, 2, 3)
    with pytest.raises(config_lib.InputError, match="exclude each other"):
        engine_lib.Engine(target, make_head("eagle-agree"), config=config_lib.EngineConfig(num_speculative_tokens=2, tree=tree))
    with pytest.raises(config_lib.InputError, match="needs a draft head"):
        engine_lib.Engine(target, config=config_lib.EngineConfig(tree=tree))
    with pytest.raises(ValueError, match="with a tree, k must be its depth 2, got 3"):
        state_lib.Options(k=3, tree=tree)  # the decode state's shapes follow k
    engine = engine_lib.Engine(target, make_head("eagle-agree"), config=config_lib.EngineConfig(tree=tree, max_length=32))
    assert engine.headroom == 4  # the verify's N + 1 nodes
    with pytest.raises(config_lib.InputError, match=r"prompt 0 has 17 tokens; with 12 new tokens and a 4-slot tree "
                                                    r"step it needs 33 cache slots, more than max_length=32"):
        engine.generate([[1] * 17], max_new_tokens=MAX_NEW)
