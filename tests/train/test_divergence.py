"""Finite checks of training (`train.divergence`): one device bool a step, paths named on the host."""

import jax.numpy as jnp
import numpy as np

from eagle_jax.train import divergence


def test_all_finite_looks_at_floating_point_leaves_only():
    tree = {"kernel": jnp.ones((2, 3)), "count": jnp.asarray([2**31 - 1], jnp.int32), "bias": np.zeros(3, np.float16)}
    assert bool(divergence.all_finite(tree))
    assert bool(divergence.all_finite({"steps": jnp.arange(3)}))  # no floating-point leaf at all
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        assert not bool(divergence.all_finite(dict(tree, kernel=tree["kernel"].at[1, 2].set(bad))))


def test_non_finite_paths_name_each_bad_leaf():
    tree = {"fc": {"kernel": jnp.ones((2, 2)).at[0, 1].set(jnp.nan)}, "norm": [jnp.zeros(2), jnp.asarray([jnp.inf])],
            "ids": jnp.arange(2)}
    assert divergence.non_finite_paths(tree) == ["['fc']['kernel']", "['norm'][1]"]
    assert divergence.non_finite_paths({"fc": jnp.ones(2)}) == []


def test_a_diverged_error_is_a_value_error_that_keeps_its_step():
    error = divergence.DivergedError("training diverged at step 3", 3)
    assert isinstance(error, ValueError) and error.step == 3 and str(error) == "training diverged at step 3"
