"""`float32_logits.float32_logits`: float32 logits whose gradients run in the inputs' dtype."""

import functools
import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.model import float32_logits


def _inputs(dtype):
    x = jax.random.normal(jax.random.key(0), (2, 3, 16)).astype(dtype)
    weight = jax.random.normal(jax.random.key(1), (16, 40)) * 0.3  # float32, like the trained params
    return x, weight


def _loss(logits_fn, x, weight):
    logits = logits_fn(x, weight)
    return -jnp.sum(jax.nn.log_softmax(logits)[..., 3])


def _reference(x, weight):
    return jnp.einsum("...d,dv->...v", x, weight.astype(x.dtype), preferred_element_type=jnp.float32)


def test_values_and_float32_gradients_equal_a_plain_einsum():
    x, weight = _inputs(jnp.float32)
    np.testing.assert_allclose(float32_logits.float32_logits(x, weight), _reference(x, weight), rtol=1e-6)
    ours = jax.grad(functools.partial(_loss, float32_logits.float32_logits), argnums=(0, 1))(x, weight)
    plain = jax.grad(functools.partial(_loss, _reference), argnums=(0, 1))(x, weight)
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _dots(jaxpr):
    """Every dot_general of a jaxpr, nested ones (custom_vjp, pjit) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                found += _dots(inner)
    return found


def test_bfloat16_backward_has_no_float32_matmul():
    x, weight = _inputs(jnp.bfloat16)
    ours = functools.partial(_loss, float32_logits.float32_logits)
    plain = functools.partial(_loss, _reference)
    dots = _dots(jax.make_jaxpr(jax.grad(ours, argnums=(0, 1)))(x, weight).jaxpr)
    assert len(dots) == 3  # the forward and the two gradient GEMMs
    assert all(var.aval.dtype == jnp.bfloat16 for eqn in dots for var in eqn.invars)
    plain_dots = _dots(jax.make_jaxpr(jax.grad(plain, argnums=(0, 1)))(x, weight).jaxpr)
    assert any(var.aval.dtype == jnp.float32 for eqn in plain_dots for var in eqn.invars)  # what this avoids
    # The gradients stay close to the float32 ones: only the cotangent's precision is cut.
    exact = jax.grad(plain, argnums=(0, 1))(x.astype(jnp.float32), weight)
    for a, b in zip(jax.grad(ours, argnums=(0, 1))(x, weight), exact):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0.05, atol=0.05)
