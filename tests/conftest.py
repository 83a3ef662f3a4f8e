"""Shared fixtures: tiny Llama configs, tiny HF torch models saved to disk, random targets and heads.

Everything is small enough to compile and run on two CPU cores in seconds. Factories are
fixtures returning functions so that test modules need no imports from this file. Fixtures are
scoped to the `tests` package, the root of every test directory: since pytest 8 its sub-packages
are its children, so each fixture is built once for the whole run.
"""

from __future__ import annotations

import functools
import gc
import os
import sys

# Tests compile dozens of small programs and never time them: XLA:CPU's LLVM optimisation
# level 0 halves compile time here without changing what is computed. Set before jax starts its
# backend; subprocesses started by tests inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# Four CPU devices for the tensor-parallel tests (test_sharding.py); programs without a mesh run
# on the first, as before. Here rather than in that module: jax reads the flag once, at its first
# use, which an earlier test module may make.
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402 (after the flags)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from eagle_jax.io import checkpoint
from eagle_jax.model import config as config_lib
from eagle_jax.io import default_model
from eagle_jax.model import eagle
from eagle_jax.model import llama
from eagle_jax.io import models

# Tests marked slow need the real default model (a ~100 MB download on a fresh machine); they run
# only with EAGLE_JAX_SLOW=1 (and `-m slow` to run nothing else). The default run makes no network
# access: the guard fixture below makes any use of the default model fail loudly instead.
SLOW = os.environ.get("EAGLE_JAX_SLOW") == "1"
NOT_SLOW = "this test used the default model: mark it @pytest.mark.slow (it runs with EAGLE_JAX_SLOW=1)"


def pytest_collection_modifyitems(config, items):
    if SLOW:
        return
    skip = pytest.mark.skip(reason="needs the default model: set EAGLE_JAX_SLOW=1 (and pass -m slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs(request):
    """After each test module, drops the programs it compiled: jit caches, the engines its
    memoised helpers keep, and engines it no longer holds.

    Every live XLA:CPU executable keeps a few memory mappings, and a process may hold 65,530
    (`vm.max_map_count`): past that LLVM cannot map a new program's code, and the compile
    crashes the process. One xdist worker compiles thousands of programs over the suite; freeing
    each module's keeps it far below the limit.
    """
    yield
    for value in vars(request.module).values():  # e.g. a module's @functools.cache engine factory
        if type(value) is functools._lru_cache_wrapper:
            value.cache_clear()
    jax.clear_caches()
    if "fastapi" in sys.modules:  # it keeps the route handlers of every app it has seen in lru_caches,
        # and an app built in a test (`server.create_app`) holds its engine's programs through them
        for cached in gc.get_objects():
            if type(cached) is functools._lru_cache_wrapper and cached.__module__.startswith("fastapi"):
                cached.cache_clear()
    gc.collect()


@pytest.fixture(scope="package", autouse=True)
def no_default_model_unless_slow():
    """Outside the slow run, the default model cannot be found, downloaded or converted.

    Scoped to the whole tests package, so it is in place before any module fixture loads a model. The environment
    override reaches subprocesses too and hides a cached or installed copy, so a test that forgets
    the slow mark fails here as it would on a fresh CI machine, rather than downloading there.
    """
    if SLOW:
        yield
        return

    def refuse(destination):
        raise RuntimeError(NOT_SLOW)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EAGLE_JAX_DEFAULT_GGUF", f"/nonexistent/{NOT_SLOW}")
        patch.setattr(default_model, "_download", refuse)
        yield


def hf_config_dict(*, vocab_size=101, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   intermediate_size=64, tied=False, rope_scaling=None, max_position_embeddings=512,
                   **extra) -> dict:
    """An HF `config.json` dictionary for a tiny Llama (keyword names as transformers.LlamaConfig)."""
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
        hidden_act="silu",
    )
    if rope_scaling is not None:
        config["rope_scaling"] = dict(rope_scaling)
    config.update(extra)
    return config


@pytest.fixture(scope="package")
def tiny_hf_config():
    """Factory: `tiny_hf_config(**overrides)` -> HF config dict."""
    return hf_config_dict


@pytest.fixture(scope="package")
def tiny_config():
    """Factory: `tiny_config(**overrides)` -> eagle_jax LlamaConfig."""
    return lambda **overrides: config_lib.LlamaConfig.from_hf_config(hf_config_dict(**overrides))


@pytest.fixture(scope="package")
def hf_llama(tmp_path_factory):
    """Factory: `hf_llama(seed=0, **config overrides)` -> (torch LlamaForCausalLM, saved dir, Flax Llama).

    The torch model is float32 and in eval mode; the directory is written with
    `save_pretrained(safe_serialization=True)` and the Flax model loaded from it by `models.load_target`.
    """
    import torch
    import transformers

    def make(seed: int = 0, initializer_range: float = 0.2, **overrides):
        config = hf_config_dict(**overrides)
        config.pop("architectures")
        config.pop("model_type")
        hf_config = transformers.LlamaConfig(initializer_range=initializer_range, **config)
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(hf_config).float().eval()
        directory = tmp_path_factory.mktemp("hf-llama")
        model.save_pretrained(directory, safe_serialization=True)
        target, _ = models.load_target(directory)
        return model, directory, target

    return make


def random_module(factory, seed: int = 0) -> nnx.Module:
    """Builds `factory()` with numpy random weights (no jax initialisers: those compile op by op, seconds).

    Kernels ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2),
    integer tables (EAGLE-3 d2t) zero.
    """
    rng = np.random.default_rng(seed)
    params = {}
    abstract = checkpoint.abstract_model(factory)
    for path, leaf in checkpoint.param_shapes(abstract).items():
        name, shape = path.rsplit("/", 1)[-1], tuple(leaf.shape)
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            params[path] = np.zeros(shape, leaf.dtype)
        elif name == "kernel":
            params[path] = rng.standard_normal(shape) / np.sqrt(shape[0])
        elif name == "embedding":
            params[path] = rng.standard_normal(shape)
        elif name == "weight":
            params[path] = 1 + 0.1 * rng.standard_normal(shape)
        else:
            params[path] = 0.1 * rng.standard_normal(shape)
    return checkpoint.build_model(abstract, params, jnp.float32)


@pytest.fixture(scope="package")
def random_target(tiny_config):
    """Factory: `random_target(seed=0, **config overrides)` -> Flax Llama with random weights."""

    def make(seed: int = 0, **overrides):
        cfg = tiny_config(**overrides)
        return random_module(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)), seed)

    return make


def head_config(target_cfg: config_lib.LlamaConfig, method: str, *, fc_bias: bool = False,
                draft_vocab_size: int = 0, feature_layers: tuple[int, ...] = (),
                num_layers: int = 1) -> eagle.EagleConfig:
    """An EAGLE head config fitting `target_cfg` (its layers are the target's; EAGLE-3 may have several)."""
    layer = config_lib.LlamaConfig(**{**target_cfg.__dict__, "num_layers": 1})
    if method == "eagle3":
        return eagle.EagleConfig(method="eagle3", layer=layer, draft_vocab_size=draft_vocab_size,
                                 target_hidden_size=target_cfg.hidden_size,
                                 feature_layers=feature_layers or tuple(range(min(3, target_cfg.num_layers))),
                                 num_layers=num_layers)
    return eagle.EagleConfig(method="eagle", layer=layer, fc_bias=fc_bias)


def vocab_map(vocab_size: int, draft_vocab_size: int, seed: int = 0) -> np.ndarray:
    """A nontrivial EAGLE-3 d2t: draft id i -> a distinct target id, stored as the offset target - i."""
    targets = np.random.default_rng(seed).permutation(vocab_size)[:draft_vocab_size]
    return (targets - np.arange(draft_vocab_size)).astype(np.int32)


@pytest.fixture(scope="package")
def random_head():
    """Factory: `random_head(target_cfg, method, seed=0, fc_bias=False, draft_vocab_size=0, feature_layers=(), num_layers=1)`.

    Weights as `random_module`; EAGLE-3 heads get a d2t from `vocab_map` (draft ids -> distinct target ids).
    """

    def make(target_cfg, method: str, seed: int = 0, **kwargs):
        cfg = head_config(target_cfg, method, **kwargs)
        head = random_module(lambda: eagle.make_head(cfg, rngs=nnx.Rngs(0)), seed)
        if method == "eagle3":
            head.d2t[...] = jnp.asarray(vocab_map(target_cfg.vocab_size, cfg.draft_vocab_size, seed))
        return head

    return make


def _set(module: nnx.Module, path: str, value) -> None:
    """Assigns a parameter by its '/'-joined NNX path."""
    *parents, name = path.split("/")
    for part in parents:
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    getattr(module, name)[...] = jnp.asarray(value, jnp.float32)


@pytest.fixture(scope="package")
def set_param():
    """`set_param(module, "self_attn/o_proj/kernel", array)`."""
    return _set


def export_head(head, directory, *, embeddings=None, torch_bin: bool = False):
    """Writes a head in its public HF layout with `models.export_head` (float32), plus variants.

    Args:
        embeddings: optional [V, D] array added as `embed_tokens.weight` (as SafeAILab heads ship).
        torch_bin: write `pytorch_model.bin` instead of `model.safetensors` (older public heads).
    """
    from eagle_jax.io import hf_files

    # The head's layer config carries the target's vocabulary and special tokens (see head_config).
    directory = models.export_head(head, head.config.layer, directory, dtype="float32")
    if embeddings is None and not torch_bin:
        return directory
    tensors = {name: np.array(array) for name, array in hf_files.load_tensors(directory, progress=False).items()}
    if embeddings is not None:
        tensors["embed_tokens.weight"] = np.asarray(embeddings, np.float32)
    if torch_bin:
        import torch

        (directory / "model.safetensors").unlink()
        torch.save({name: torch.from_numpy(array) for name, array in tensors.items()}, directory / "pytorch_model.bin")
    else:
        hf_files.save_tensors(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="package")
def save_head():
    """`save_head(head, directory, embeddings=None, torch_bin=False)` -> directory: see `export_head`."""
    return export_head


DEFAULT_SYSTEM = "You are a helpful assistant."
# ChatML, like SmolLM2's, including its default system prompt.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="package")
def chat_tokenizer():
    """A tiny byte-level fast tokenizer with a ChatML template (SmolLM2-like, default system prompt)."""
    import tokenizers
    import transformers
    from tokenizers import decoders, pre_tokenizers

    # One token per byte plus the two ChatML specials: tiny, yet any text tokenizes.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


# ---- A target whose next token is predictable, and heads that agree with it partly -------------

def _get(module: nnx.Module, path: str):
    for part in path.split("/"):
        module = getattr(module, part)
    return module[...]


@pytest.fixture(scope="package")
def aligned_target(random_target):
    """Factory: `aligned_target(seed=14, **config overrides)` -> a random Llama whose next token is
    close to argmax(lm_head(embed(t))): embedding rows have RMS 1, the final norm is 1 and the
    residual branches (o_proj, down_proj) are scaled down by 10."""

    def make(seed: int = 14, **overrides):
        model = random_target(seed=seed, **overrides)
        embeddings = np.asarray(model.embed_tokens.embedding[...])
        _set(model, "embed_tokens/embedding", embeddings / np.sqrt(np.mean(embeddings ** 2, -1, keepdims=True)))
        _set(model, "norm/weight", np.ones(model.config.hidden_size))
        for index, layer in enumerate(model.layers):
            for name in ("self_attn/o_proj/kernel", "mlp/down_proj/kernel"):
                _set(model, f"layers/{index}/{name}", 0.1 * np.asarray(_get(layer, name)))
        return model

    return make


@pytest.fixture(scope="package")
def speculation_target(aligned_target):
    """The aligned target of the speculative decoding tests (seed 14, three layers, head_dim 16)."""
    return aligned_target(seed=14, num_layers=3, head_dim=16)


@pytest.fixture(scope="package")
def random_prompts():
    """Factory: `random_prompts(lengths, seed=0)` -> one prompt of random ids (of the tiny configs'
    101) per length, each drawn from `seed + length`, so a length always gives the same prompt."""
    return lambda lengths, seed=0: [np.random.default_rng(seed + n).integers(0, 101, n).tolist() for n in lengths]


@pytest.fixture(scope="package")
def agreeing_head(random_head):
    """Factory: `agreeing_head(target_cfg, noise, residual=0.0, fc_bias=False, seed=0)` -> EAGLE-1 head.

    fc = [I; 0] and zeroed attention and MLP outputs compute exactly lm_head(embed(t)), which an
    `aligned_target` mostly agrees with. `noise` perturbs fc; `residual` > 0 keeps that fraction of
    the attention and MLP outputs, so drafts depend on the draft cache too.
    """

    def make(target_cfg, noise: float, residual: float = 0.0, fc_bias: bool = False, seed: int = 0):
        head = random_head(target_cfg, "eagle", seed=seed, fc_bias=fc_bias)
        hidden = target_cfg.hidden_size
        fc = np.concatenate([np.eye(hidden), np.zeros((hidden, hidden))])
        fc = fc + noise * np.random.default_rng(seed).standard_normal(fc.shape) / np.sqrt(2 * hidden)
        _set(head, "fc/kernel", fc)
        for name in ("self_attn/o_proj/kernel", "mlp/down_proj/kernel"):
            _set(head, name, residual * np.asarray(_get(head, name)))
        return head

    return make


@pytest.fixture(scope="package")
def biased_eagle3_head(random_head):
    """Factory: `biased_eagle3_head(target_cfg, frequent, draft_vocab_size, seed=0, num_layers=1)` -> EAGLE-3 head.

    The draft (nearly) always drafts draft id 0 or 1, by the sign of its normalised output's first
    component (which depends on the features and the draft cache); d2t maps those two ids to the
    target ids `frequent` (two of the target's most frequent outputs). Drafts are then accepted now
    and then, and only if d2t is applied in the right direction.
    """

    def make(target_cfg, frequent, draft_vocab_size: int, seed: int = 0, num_layers: int = 1):
        head = random_head(target_cfg, "eagle3", seed=seed, draft_vocab_size=draft_vocab_size,
                           feature_layers=tuple(range(min(3, target_cfg.num_layers))), num_layers=num_layers)
        norm = np.full(target_cfg.hidden_size, 0.1)
        norm[0] = 3.0
        _set(head, "norm/weight", norm)
        lm_head = np.array(_get(head, "lm_head/kernel"))
        lm_head[0, :2] = [4.0, -4.0]
        _set(head, "lm_head/kernel", lm_head)
        targets = np.arange(draft_vocab_size) + np.asarray(head.d2t[...])
        rest = [t for t in targets if t not in frequent]
        targets = np.concatenate([np.asarray(frequent), rest[:draft_vocab_size - 2]])
        head.d2t[...] = jnp.asarray(targets - np.arange(draft_vocab_size), jnp.int32)
        return head

    return make


def with_dtype(module: nnx.Module, dtype) -> nnx.Module:
    """The same target or head with parameters and computation in `dtype` (integer tables kept)."""
    if isinstance(module, llama.Llama):
        factory = models.target_factory(module.config, dtype)
    else:
        factory = lambda: eagle.make_head(module.config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    params = {path: np.asarray(leaf) for path, leaf in checkpoint.flat_state(nnx.split(module)[1]).items()}
    return checkpoint.build_model(checkpoint.abstract_model(factory), params, dtype)


@pytest.fixture(scope="package")
def cast_module():
    """`cast_module(target_or_head, jnp.bfloat16)`: see `with_dtype`."""
    return with_dtype


# ---- Goodness of fit for the sampling tests ------------------------------------------------------

def chi_square_p_value(observed, probabilities, min_expected: float = 5.0) -> float:
    """Pearson's chi-square test of token counts against exact probabilities; returns the p-value.

    Each row of `observed` [G, C] (or a single row [C]) is one multinomial sample with its own
    probabilities [G, C]; the statistic is summed over rows (independent given the row totals).
    A count where the probability is exactly 0 fails at once: no sample size excuses it. Cells
    expected fewer than `min_expected` times are pooled, per row, so the chi-square
    approximation holds; jax's chi2.sf saves a scipy dependency.
    """
    import jax.scipy.stats

    observed = np.atleast_2d(np.asarray(observed, np.float64))
    probabilities = np.atleast_2d(np.asarray(probabilities, np.float64))
    assert observed.shape == probabilities.shape, (observed.shape, probabilities.shape)
    impossible = probabilities <= 0
    assert not observed[impossible].any(), f"{int(observed[impossible].sum())} samples where the probability is 0"
    statistic, dof = 0.0, 0
    for counts, probs, zero in zip(observed, probabilities, impossible):
        if counts.sum() == 0:
            continue
        expected = probs / probs.sum() * counts.sum()
        small = ~zero & (expected < min_expected)
        big = ~zero & ~small
        cells_observed = list(counts[big])
        cells_expected = list(expected[big])
        if small.any():
            cells_observed.append(counts[small].sum())
            cells_expected.append(expected[small].sum())
            if cells_expected[-1] < min_expected and len(cells_expected) > 1:
                # Still too small: merge the pool into the smallest other cell.
                smallest = int(np.argmin(cells_expected[:-1]))
                cells_observed[smallest] += cells_observed.pop()
                cells_expected[smallest] += cells_expected.pop()
        cells_observed, cells_expected = np.asarray(cells_observed), np.asarray(cells_expected)
        statistic += float(np.sum((cells_observed - cells_expected) ** 2 / cells_expected))
        dof += len(cells_expected) - 1
    if dof == 0:
        return 1.0
    return float(jax.scipy.stats.chi2.sf(statistic, dof))


@pytest.fixture(scope="package")
def chi_square():
    """`chi_square(observed counts [G, C] or [C], probabilities of the same shape)` -> p-value: see
    `chi_square_p_value`."""
    return chi_square_p_value


@pytest.fixture(scope="package")
def xla_compilations():
    """Context manager factory: `with xla_compilations() as compiled:` lists every XLA compilation in
    the process inside the block (jax reports each as a '/jax/core/compile/backend_compile_duration'
    event), the engine's or not."""
    import contextlib

    import jax

    @contextlib.contextmanager
    def listening():
        compiled = []

        def listen(event: str, seconds: float, **kwargs) -> None:
            if "backend_compile" in event:
                compiled.append(kwargs.get("fun_name", "?"))

        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            yield compiled
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)

    return listening
