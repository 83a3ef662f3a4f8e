"""EAGLE head training: the functions behind `eagle-jax-train` (`eagle_jax.cli.train`).

The target stays frozen and computes its features on the fly inside the compiled train step
(Flax target, never another framework). Params and optimizer state are checkpointed with
orbax and training resumes from the latest checkpoint in `output/checkpoints`, once that
checkpoint is verified (the head's tree and shapes, finite values). A step whose loss or
updated parameters are not finite stops training with `DivergedError`, so a diverged run never
writes a checkpoint or exports a head.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm
from flax import nnx

from eagle_jax.io import checkpoint
from eagle_jax.io import hf_files
from eagle_jax.model import eagle
from eagle_jax.model import layers
from eagle_jax.model import llama
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import result as result_lib
from eagle_jax.train import data as data_lib
from eagle_jax.train import objective as train_objective


class DivergedError(ValueError):
    """A train step's loss or updated parameters are not finite; `step` is the first such step."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    method: str = "eagle3"
    steps: int = 2000
    batch_size: int = 16
    learning_rate: float = 5e-4
    warmup_steps: int = 100
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    draft_vocab_size: int = 8192  # EAGLE-3
    head_intermediate_size: int | None = None  # the head's MLP width (None: the target's)
    head_layers: int = 1  # EAGLE-3: decoder layers of a new head
    objective: train_objective.Objective = train_objective.Objective()
    seed: int = 0
    checkpoint_every: int = 500


def new_head(target_config, cfg: TrainConfig, token_counts: np.ndarray | None = None, dtype=jnp.float32):
    """A randomly initialised head shaped after the target (`cfg.head_layers` layers of the target's width)."""
    layer = dataclasses.replace(target_config, num_layers=1,
                                intermediate_size=cfg.head_intermediate_size or target_config.intermediate_size)
    if cfg.method == "eagle3":
        head_cfg = eagle.EagleConfig(method="eagle3", layer=layer, draft_vocab_size=cfg.draft_vocab_size,
                                     target_hidden_size=target_config.hidden_size,
                                     feature_layers=eagle.default_feature_layers(target_config.num_layers),
                                     num_layers=cfg.head_layers)
    else:
        head_cfg = eagle.EagleConfig(method="eagle", layer=layer, fc_bias=True)
    head = eagle.make_head(head_cfg, rngs=nnx.Rngs(cfg.seed), dtype=dtype, param_dtype=jnp.float32)
    if cfg.method == "eagle3":
        if token_counts is None:
            raise ValueError("EAGLE-3 needs token counts to choose its draft vocabulary")
        head.d2t[...] = jnp.asarray(draft_vocabulary(token_counts, cfg.draft_vocab_size))
    return head


def draft_vocabulary(token_counts: np.ndarray, size: int) -> np.ndarray:
    """d2t for the `size` most frequent target tokens: draft id i -> target id i + d2t[i] (ids ascending)."""
    if size > len(token_counts):
        raise ValueError(f"draft_vocab_size {size} exceeds the target vocabulary {len(token_counts)}")
    chosen = np.sort(np.argsort(-token_counts, kind="stable")[:size])
    return (chosen - np.arange(size)).astype(np.int32)


def extend_draft_vocabulary(head: eagle.Eagle3Head, token_counts: np.ndarray, size: int,
                            output_embedding: np.ndarray) -> eagle.Eagle3Head:
    """A trained EAGLE-3 head with a `size`-token draft vocabulary: its own tokens plus the most
    frequent others (by `token_counts`), for draft-vocabulary sweeps that continue a trained head.

    The rest of the head is shared, and so are the trained tokens' lm_head columns. Each added
    token's column starts where a least-squares fit over the trained ones puts it: a column as a
    linear function of its token's row of the target's `output_embedding` [V, D], the token's log
    count and a constant (frequent tokens score higher a priori). A trained head's columns follow
    the target's geometry closely. Measured on a CPU on 2026-12-01 (commit d109116,
    `benchmarks/vocab_init_probe.py`; docs/training.md): a 16,384-token head whose 8,192 added
    columns were placed from an 8,192-token head's agreed with the target's top-1 token 0.923 of
    the time at once, against 0.817 with every added column at the trained columns' mean, and
    0.925 once trained.
    """
    old_size = head.config.draft_vocab_size
    if not old_size <= size <= len(token_counts):
        raise ValueError(f"a {old_size}-token draft vocabulary extends to {old_size}..{len(token_counts)} "
                         f"tokens, not {size}")
    old_ids = np.arange(old_size) + np.asarray(head.d2t[...])
    by_count = np.argsort(-token_counts, kind="stable")
    added = by_count[~np.isin(by_count, old_ids)][:size - old_size]
    new_ids = np.sort(np.concatenate([old_ids, added]))
    kernel = np.asarray(head.lm_head.kernel[...], np.float64)  # [hidden, old_size]
    embedding = np.asarray(output_embedding, np.float64)
    features = lambda ids: np.concatenate([embedding[ids], np.log1p(token_counts[ids])[:, None],
                                           np.ones((len(ids), 1))], axis=1)
    fit, *_ = np.linalg.lstsq(features(old_ids), kernel.T, rcond=None)
    columns = np.zeros((kernel.shape[0], size))
    is_old = np.isin(new_ids, old_ids)
    columns[:, is_old] = kernel  # new_ids is sorted and old_ids too: the trained columns keep their order
    columns[:, ~is_old] = (features(new_ids[~is_old]) @ fit).T
    extended = eagle.make_head(dataclasses.replace(head.config, draft_vocab_size=size), rngs=nnx.Rngs(0),
                               dtype=head.lm_head.dtype, param_dtype=head.lm_head.kernel[...].dtype)
    extended.fc, extended.midlayer, extended.layers, extended.norm = head.fc, head.midlayer, head.layers, head.norm
    extended.lm_head.kernel[...] = jnp.asarray(columns, head.lm_head.kernel[...].dtype)
    extended.d2t[...] = jnp.asarray(new_ids - np.arange(size), jnp.int32)
    return extended


def widen_mlp(head, intermediate_size: int, seed: int = 0):
    """Widens a trained head's (either kind's) MLPs, every layer's, to `intermediate_size` in place; returns the head.

    The added units get fresh gate and up columns and zero down_proj rows, so the head's output
    is unchanged at the start; training then grows them (Net2Net-style widening), to try a wider
    head without starting over.
    """
    layer = head.config.layer
    old = layer.intermediate_size
    if intermediate_size < old or layer.mlp_bias:
        raise ValueError(f"an MLP {old} wide (bias {layer.mlp_bias}) widens to {old} or more units without biases, "
                         f"not {intermediate_size}")
    wide_layer = dataclasses.replace(layer, intermediate_size=intermediate_size)

    def widened(mlp):
        wide = layers.MLP(wide_layer, rngs=nnx.Rngs(seed), dtype=mlp.down_proj.dtype,
                          param_dtype=mlp.down_proj.kernel.dtype)
        gate_up, fresh = mlp.gate_up_proj.kernel[...], wide.gate_up_proj.kernel[...]  # [H, 2F]: [gate | up]
        wide.gate_up_proj.kernel[...] = jnp.concatenate(
            [gate_up[:, :old], fresh[:, old:intermediate_size], gate_up[:, old:], fresh[:, intermediate_size + old:]],
            axis=1)
        down = mlp.down_proj.kernel[...]
        wide.down_proj.kernel[...] = jnp.concatenate([down, jnp.zeros((intermediate_size - old, down.shape[1]),
                                                                      down.dtype)])
        return wide

    first = head.midlayer if isinstance(head, eagle.Eagle3Head) else head
    for owner in (first, *head.extra_layers):
        owner.mlp = widened(owner.mlp)
    head.config = dataclasses.replace(head.config, layer=wide_layer)
    return head


def add_layers(head: eagle.Eagle3Head, num_layers: int, seed: int = 0) -> eagle.Eagle3Head:
    """Deepens a trained EAGLE-3 head to `num_layers` decoder layers in place; returns the head.

    Each added layer is a fresh Llama decoder layer whose o_proj and down_proj are zero, so it
    adds nothing to its residual stream and the head's output is unchanged at the start; training
    then grows it, to try a deeper head without starting over.
    """
    cfg = head.config
    if num_layers < cfg.num_layers:
        raise ValueError(f"a head of {cfg.num_layers} layers deepens to {cfg.num_layers} or more, not {num_layers}")
    kernel = head.midlayer.mlp.down_proj.kernel
    for index in range(cfg.num_layers, num_layers):
        layer = layers.DecoderLayer(cfg.layer, rngs=nnx.Rngs(seed + index), dtype=head.midlayer.mlp.down_proj.dtype,
                                    param_dtype=kernel.dtype)
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            linear.kernel[...] = jnp.zeros_like(linear.kernel[...])
        head.layers.append(layer)
    head.config = dataclasses.replace(cfg, num_layers=num_layers)
    return head


def token_counts(dataset: dict[str, np.ndarray], vocab_size: int) -> np.ndarray:
    """How often each target token appears among the trained (assistant) tokens."""
    return np.bincount(dataset["input_ids"][dataset["loss_mask"]].ravel(), minlength=vocab_size)[:vocab_size]


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps + 1),
                                                  end_value=cfg.learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))


def all_finite(tree) -> jax.Array:
    """One bool: every floating-point leaf of `tree` is finite (integer leaves always are)."""
    checks = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def non_finite_paths(tree) -> list[str]:
    """The paths of the floating-point leaves of `tree` holding a NaN or an infinity (read on the host)."""
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return [jax.tree_util.keystr(path) for path, leaf in leaves
            if np.issubdtype(np.asarray(leaf).dtype, np.inexact) and not np.isfinite(leaf).all()]


class Trainer:
    """Holds the split modules and the compiled train step."""

    def __init__(self, target: llama.Llama, head, cfg: TrainConfig):
        self.cfg = cfg
        self.target_def, self.target_state = nnx.split(target)
        self.head_def, params, rest = nnx.split(head, nnx.Param, ...)
        self.params, self.rest = checkpoint.pure_dict(params), checkpoint.pure_dict(rest)
        self.optimizer = optimizer(cfg)
        self.opt_state = self.optimizer.init(self.params)
        self.draft_ids = None
        if isinstance(head, eagle.Eagle3Head):
            self.draft_ids = head.to_target_ids(jnp.arange(head.config.draft_vocab_size, dtype=jnp.int32))
        self.step = 0
        # (step, loss, updated params finite) of the steps since the last `check_finite`, still on the
        # device: reading them every step would make the host wait for each step before queueing the next.
        self._unchecked: list[tuple[int, jax.Array, jax.Array]] = []
        self._train_step = jax.jit(self._step_fn, donate_argnums=(0, 1))

    def head(self):
        return nnx.merge(self.head_def, self.params, self.rest)

    def checked_head(self):
        """The head, once every step so far and every parameter is checked finite: the one to export.

        Raises:
            DivergedError: a step's loss or a parameter is not finite.
        """
        self.check_finite()
        bad = non_finite_paths(self.params)
        if bad:
            raise DivergedError(f"the head at step {self.step} has non-finite parameters ({', '.join(bad[:3])}): "
                                "not exported", self.step)
        return self.head()

    def _loss(self, params, target_state, tokens, loss_mask, rng):
        head = nnx.merge(self.head_def, params, self.rest)
        target = nnx.merge(self.target_def, target_state)  # an argument, not a constant: no folding of weights
        return train_objective.loss(head, target, tokens, loss_mask, rng, self.cfg.objective, self.draft_ids)

    def _step_fn(self, params, opt_state, target_state, tokens, loss_mask, rng):
        (_, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(params, target_state, tokens, loss_mask, rng)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        metrics["grad_norm"] = optax.global_norm(grads)
        params = optax.apply_updates(params, updates)
        # A NaN learning rate gives a finite loss and NaN parameters: the step checks both.
        metrics["finite_params"] = all_finite(params)
        return params, opt_state, metrics

    def train_step(self, tokens: np.ndarray, loss_mask: np.ndarray) -> dict[str, jax.Array]:
        """One optimizer step; its finiteness is checked later, by `check_finite`."""
        rng = jax.random.fold_in(jax.random.key(self.cfg.seed), self.step)
        self.params, self.opt_state, metrics = self._train_step(
            self.params, self.opt_state, self.target_state, jnp.asarray(tokens, jnp.int32), jnp.asarray(loss_mask), rng)
        self.step += 1
        self._unchecked.append((self.step, metrics["loss"], metrics.pop("finite_params")))
        return metrics

    def check_finite(self) -> None:
        """Raises `DivergedError` naming the first step since the last check whose loss or updated
        parameters are not finite (a learning rate too high, or bad data)."""
        unchecked, self._unchecked = jax.device_get(self._unchecked), []
        for step, loss, finite_params in unchecked:
            if not np.isfinite(loss):
                raise DivergedError(f"training diverged at step {step}: the loss is {float(loss)} (learning rate "
                                    f"{self.cfg.learning_rate:g}: lower it)", step)
            if not finite_params:
                raise DivergedError(f"training diverged at step {step}: its update made parameters non-finite "
                                    f"(learning rate {self.cfg.learning_rate:g}: lower it)", step)

    # ---- orbax checkpoints ---------------------------------------------------------------
    def checkpoint_manager(self, directory: Path) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
        # The handler named up front, so that a new manager can read a checkpoint's metadata
        # (`restore` checks its tree and shapes) before restoring anything.
        return ocp.CheckpointManager(directory.resolve(), options=options,
                                     item_handlers=ocp.StandardCheckpointHandler())

    def save(self, manager: ocp.CheckpointManager) -> None:
        """Checkpoints the params and optimizer state, once the steps since the last check are finite."""
        self.check_finite()
        state = {"params": self.params, "opt_state": self.opt_state}
        manager.save(self.step, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()

    def restore(self, manager: ocp.CheckpointManager) -> bool:
        """Loads the latest checkpoint if there is one, after verifying it; returns whether it did.

        Raises:
            hf_files.CheckpointError: the checkpoint was written for another head (its parameter
                tree or shapes differ), cannot be read into this head and optimizer, or holds
                non-finite values (damaged files, or a run that had diverged).
        """
        step = manager.latest_step()
        if step is None:
            return False
        where = f"the checkpoint of step {step} in {manager.directory}"
        try:
            stored = manager.item_metadata(step)["params"]
        except (KeyError, TypeError, ValueError, OSError) as error:  # no metadata, or not a trainer's checkpoint
            raise hf_files.CheckpointError(f"{where} cannot be read as a training checkpoint: {error!r}") from error
        check_checkpoint_params(stored, self.params, where)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": self.params, "opt_state": self.opt_state})
        try:
            state = manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except ValueError as error:
            raise hf_files.CheckpointError(f"{where} cannot be restored into this head and optimizer: {error}") \
                from error
        bad = non_finite_paths(state)
        if bad:
            earlier = [s for s in manager.all_steps() if s < step]
            instead = (f"delete {Path(manager.directory) / str(step)} to resume from step {earlier[-1]}" if earlier
                       else f"delete {manager.directory} to start over")
            raise hf_files.CheckpointError(f"{where} holds non-finite values in {len(bad)} arrays "
                                           f"({', '.join(bad[:3])}): {instead}")
        self.params, self.opt_state, self.step = state["params"], state["opt_state"], int(step)
        return True


def check_checkpoint_params(stored, params: dict, where: str) -> None:
    """Raises `hf_files.CheckpointError` unless a checkpoint's params metadata has `params`' tree and shapes.

    Checked before restoring, so that a checkpoint of another head (another method, width or
    draft vocabulary, written to the same output directory) is named as such.
    """
    shapes = lambda tree: {jax.tree_util.keystr(path): tuple(leaf.shape)
                           for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
    found, expected = shapes(stored), shapes(params)
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or extra:
        raise hf_files.CheckpointError(
            f"{where} was written for another head: it lacks {len(missing)} of this head's parameter arrays "
            f"{missing[:3]} and has {len(extra)} others {extra[:3]}; give another output directory")
    differ = [f"{name} {found[name]} there, {expected[name]} here" for name in sorted(expected)
              if found[name] != expected[name]]
    if differ:
        raise hf_files.CheckpointError(f"{where} was written for another head: {'; '.join(differ[:3])}; "
                                       "give another output directory")


def batches(dataset: dict[str, np.ndarray], batch_size: int, seed: int, start_step: int):
    """Endless shuffled batches (epoch order fixed by seed, so a resumed run sees the same stream)."""
    count = len(dataset["input_ids"])
    if count < batch_size:  # no whole batch: the loop below would spin forever
        raise ValueError(f"the dataset has {count} rows, fewer than one batch of {batch_size}: lower --batch-size")
    rng = np.random.default_rng(seed)
    order, step = rng.permutation(count), 0
    while True:
        for first in range(0, count - batch_size + 1, batch_size):
            if step >= start_step:
                rows = order[first:first + batch_size]
                yield dataset["input_ids"][rows], dataset["loss_mask"][rows]
            step += 1
        order = rng.permutation(count)


def train(target: llama.Llama, dataset: dict[str, np.ndarray], cfg: TrainConfig, output: Path,
          progress: bool = True, head=None, max_seconds: float | None = None) -> tuple[Trainer, list[dict]]:
    """Trains (or resumes) a head; returns the trainer and the logged metrics.

    `max_seconds` stops early (with a checkpoint) once that much wall time has passed, so a
    run fits a fixed time budget; the learning-rate schedule still spans `cfg.steps`.

    Raises:
        ValueError: a token id of `dataset` lies outside the target's vocabulary.
        DivergedError: a step's loss or updated parameters are not finite (checked every 25
            steps and before each checkpoint, so nothing non-finite is saved).
        hf_files.CheckpointError: the checkpoint to resume from fails its verification.
    """
    data_lib.check_token_ids(dataset, target.config.vocab_size)
    if head is None:
        counts = token_counts(dataset, target.config.vocab_size) if cfg.method == "eagle3" else None
        head = new_head(target.config, cfg, counts, dtype=target.embed_tokens.embedding[...].dtype)
    trainer = Trainer(target, head, cfg)
    manager = trainer.checkpoint_manager(output / "checkpoints")
    if trainer.restore(manager):
        print(f"resumed from step {trainer.step}", file=sys.stderr)
    log = []
    began, tokens_seen = time.perf_counter(), 0
    # A context, so that the bar is closed before an error's message is printed.
    with tqdm.tqdm(total=cfg.steps, initial=trainer.step, desc=f"train {cfg.method}", disable=not progress) as bar:
        for tokens, mask in batches(dataset, cfg.batch_size, cfg.seed, trainer.step):
            if trainer.step >= cfg.steps:
                break
            if max_seconds is not None and time.perf_counter() - began > max_seconds:
                print(f"stopping at step {trainer.step}: --max-seconds {max_seconds:g} reached", file=sys.stderr)
                trainer.save(manager)
                break
            metrics = trainer.train_step(tokens, mask)
            tokens_seen += int(mask.sum())
            if trainer.step % 25 == 0 or trainer.step in (1, cfg.steps):
                trainer.check_finite()
                metrics = {name: float(value) for name, value in jax.device_get(metrics).items()}
                metrics.update(step=trainer.step, tokens_per_second=tokens_seen / (time.perf_counter() - began))
                log.append(metrics)
                shown = {"loss": f"{metrics['loss']:.3f}", "tok/s": f"{metrics['tokens_per_second']:.0f}"}
                shown.update({f"acc{j}": f"{metrics[f'accuracy_{j}']:.2f}" for j in range(cfg.objective.num_steps)})
                bar.set_postfix(shown)
            bar.update(1)
            if trainer.step % cfg.checkpoint_every == 0 or trainer.step == cfg.steps:
                trainer.save(manager)
    trainer.check_finite()
    return trainer, log


def acceptance_length(target: llama.Llama, head, prompts: list[np.ndarray], k: int, max_new_tokens: int = 256,
                      batch_size: int = 1) -> dict:
    """Greedy acceptance length over prompts, vLLM's convention (1 + accepted / drafts, pooled)."""
    engine = engine_lib.Engine(target, head, config_lib.EngineConfig(
        num_speculative_tokens=k, batch_size=batch_size, max_length=max(len(p) for p in prompts) + max_new_tokens + k + 1))
    results = engine.generate(prompts, max_new_tokens=max_new_tokens)
    return dict(k=k, num_prompts=len(prompts), **result_lib.pooled_stats(results, k))


def attention_implementation(choice: str, dtype: str) -> str:
    """`--attention auto`: cuDNN's fused attention on a GPU in half precision, else XLA's einsums."""
    if choice != "auto":
        return choice
    return "cudnn" if jax.default_backend() == "gpu" and dtype in ("bfloat16", "float16") else "xla"
