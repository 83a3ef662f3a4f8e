"""EAGLE head training: the loop behind `eagle-jax-train` (`eagle_jax.cli.train`).

The target stays frozen and computes its features on the fly inside the compiled train step
(Flax target, never another framework). Params and optimizer state are checkpointed with
orbax and training resumes from the latest checkpoint in `output/checkpoints`, once that
checkpoint is verified (`resume`). A step whose loss or updated parameters are not finite stops
training with `divergence.DivergedError`, so a diverged run never writes a checkpoint or exports
a head. A new head's draft vocabulary is `draft_vocabulary`'s; growing a trained one,
`head_growth`'s.
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
from eagle_jax.model import eagle
from eagle_jax.model import llama
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import result as result_lib
from eagle_jax.train import data as data_lib
from eagle_jax.train import divergence
from eagle_jax.train import draft_vocabulary
from eagle_jax.train import objective as train_objective
from eagle_jax.train import resume


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
        head.d2t[...] = jnp.asarray(draft_vocabulary.draft_vocabulary(token_counts, cfg.draft_vocab_size))
    return head


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps + 1),
                                                  end_value=cfg.learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))


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
            divergence.DivergedError: a step's loss or a parameter is not finite.
        """
        self.check_finite()
        bad = divergence.non_finite_paths(self.params)
        if bad:
            raise divergence.DivergedError(f"the head at step {self.step} has non-finite parameters "
                                           f"({', '.join(bad[:3])}): not exported", self.step)
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
        metrics["finite_params"] = divergence.all_finite(params)
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
        """Raises `divergence.DivergedError` naming the first step since the last check whose loss or
        updated parameters are not finite (a learning rate too high, or bad data)."""
        unchecked, self._unchecked = jax.device_get(self._unchecked), []
        for step, loss, finite_params in unchecked:
            if not np.isfinite(loss):
                raise divergence.DivergedError(f"training diverged at step {step}: the loss is {float(loss)} "
                                               f"(learning rate {self.cfg.learning_rate:g}: lower it)", step)
            if not finite_params:
                raise divergence.DivergedError(f"training diverged at step {step}: its update made parameters "
                                               f"non-finite (learning rate {self.cfg.learning_rate:g}: lower it)", step)

    def checkpoint_manager(self, directory: Path) -> ocp.CheckpointManager:
        """The manager of this run's checkpoints in `directory` (`resume.checkpoint_manager`)."""
        return resume.checkpoint_manager(directory)

    def save(self, manager: ocp.CheckpointManager) -> None:
        """Checkpoints the params and optimizer state, once the steps since the last check are finite."""
        self.check_finite()
        resume.save(manager, self.step, {"params": self.params, "opt_state": self.opt_state})

    def restore(self, manager: ocp.CheckpointManager) -> bool:
        """Loads the latest checkpoint if there is one, after verifying it (`resume.restore`); returns
        whether it did."""
        restored = resume.restore(manager, {"params": self.params, "opt_state": self.opt_state})
        if restored is None:
            return False
        state, self.step = restored
        self.params, self.opt_state = state["params"], state["opt_state"]
        return True


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
        divergence.DivergedError: a step's loss or updated parameters are not finite (checked every 25
            steps and before each checkpoint, so nothing non-finite is saved).
        hf_files.CheckpointError: the checkpoint to resume from fails its verification.
    """
    data_lib.check_token_ids(dataset, target.config.vocab_size)
    if head is None:
        counts = draft_vocabulary.token_counts(dataset, target.config.vocab_size) if cfg.method == "eagle3" else None
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
