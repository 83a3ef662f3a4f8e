"""What names a compilation cache entry in place of the traced program: the code it is traced from."""

import importlib.util
import sys
import textwrap
import warnings

import pytest
from flax import nnx

from eagle_jax.model import llama
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import program_identity

SUBCLASS = textwrap.dedent("""
    from eagle_jax.model import llama

    class ScaledLlama(llama.Llama):
        SCALE = {scale}
""")


def subclass_model(directory, tiny_config, scale, monkeypatch):
    """A user's Llama subclass, from a file outside eagle_jax, imported (as a fresh module)."""
    path = directory / "user_model.py"
    path.write_text(SUBCLASS.format(scale=scale))
    name = f"user_model_{scale}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module.ScaledLlama(tiny_config(), rngs=nnx.Rngs(0))


def test_identity_is_stable_and_ignores_weights(random_target):
    first = program_identity.code_identity(random_target(seed=1))
    assert first == program_identity.code_identity(random_target(seed=2))
    assert len(first) == 64


def test_a_static_attribute_changes_the_identity(random_target):
    target = random_target()
    before = program_identity.code_identity(target)
    target.norm.eps = 1e-3
    assert program_identity.code_identity(target) != before


def test_a_head_changes_the_identity(random_target, random_head):
    target = random_target()
    head = random_head(target.config, "eagle")
    assert program_identity.code_identity(target, head) != program_identity.code_identity(target, None)


def test_a_user_subclass_file_is_part_of_the_identity(tmp_path, tiny_config, monkeypatch):
    one = program_identity.code_identity(subclass_model(tmp_path, tiny_config, 1, monkeypatch))
    assert one is not None
    assert one == program_identity.code_identity(subclass_model(tmp_path, tiny_config, 1, monkeypatch))
    assert one != program_identity.code_identity(subclass_model(tmp_path, tiny_config, 2, monkeypatch))


def test_a_class_without_source_disables_the_persistent_cache(tmp_path, tiny_config):
    namespace = {"llama": llama, "__name__": "__main__"}
    exec("class Typed(llama.Llama):\n    pass\n", namespace)  # as at an interactive prompt: no file
    target = namespace["Typed"](tiny_config(), rngs=nnx.Rngs(0))
    assert program_identity.code_identity(target) is None
    with pytest.warns(UserWarning, match="cannot be read"):
        engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=64, cache_dir=str(tmp_path / "xla")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no cache warning at generation either
        [result] = engine.generate([[5, 6, 7]], max_new_tokens=3, ignore_eos=True)
    assert len(result.token_ids) == 3
    assert engine.compile_cache.root is None and not (tmp_path / "xla").exists()


def test_an_edit_to_the_package_source_changes_the_identity(tmp_path, monkeypatch, random_target):
    package = tmp_path / "eagle_jax"
    (package / "model").mkdir(parents=True)
    layers = package / "model" / "layers.py"
    layers.write_text("SCALE = 1\n")
    monkeypatch.setattr(program_identity, "PACKAGE", package)
    identities = []
    for source in ("SCALE = 1\n", "SCALE = 2\n"):
        layers.write_text(source)
        program_identity.package_digest.cache_clear()
        identities.append(program_identity.code_identity(random_target()))
    program_identity.package_digest.cache_clear()  # the real package's, for later tests
    assert identities[0] != identities[1]
