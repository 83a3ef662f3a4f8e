"""EAGLE head training: `python -m eagle_jax.train` and the functions behind it.

The target stays frozen and computes its features on the fly inside the compiled train step
(Flax target, never another framework). Params and optimizer state are checkpointed with
orbax and training resumes from the latest checkpoint in `--output/checkpoints`. At the end
the head is exported in the public HF layout and evaluated on held-out prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
from eagle_jax.train import data as data_lib
from eagle_jax.model import eagle
from eagle_jax.serve import engine as engine_lib
from eagle_jax.model import layers
from eagle_jax.model import llama
from eagle_jax.io import models
from eagle_jax.io import tokenization
from eagle_jax.train import objective as train_objective


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
    the target's geometry closely. Offline, on the run-8 head with its 8,192 added columns so
    placed from run 7's (docs/TRAINING.md, run 8; `benchmarks/vocab_init_probe.py`): top-1 agreement
    with the target 0.923 at once, against 0.817 with every added column at the trained columns'
    mean, and 0.925 once trained.
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
        self._train_step = jax.jit(self._step_fn, donate_argnums=(0, 1))

    def head(self):
        return nnx.merge(self.head_def, self.params, self.rest)

    def _loss(self, params, target_state, tokens, loss_mask, rng):
        head = nnx.merge(self.head_def, params, self.rest)
        target = nnx.merge(self.target_def, target_state)  # an argument, not a constant: no folding of weights
        return train_objective.loss(head, target, tokens, loss_mask, rng, self.cfg.objective, self.draft_ids)

    def _step_fn(self, params, opt_state, target_state, tokens, loss_mask, rng):
        (_, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(params, target_state, tokens, loss_mask, rng)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        metrics["grad_norm"] = optax.global_norm(grads)
        return optax.apply_updates(params, updates), opt_state, metrics

    def train_step(self, tokens: np.ndarray, loss_mask: np.ndarray) -> dict[str, float]:
        rng = jax.random.fold_in(jax.random.key(self.cfg.seed), self.step)
        self.params, self.opt_state, metrics = self._train_step(
            self.params, self.opt_state, self.target_state, jnp.asarray(tokens, jnp.int32), jnp.asarray(loss_mask), rng)
        self.step += 1
        return metrics

    # ---- orbax checkpoints ---------------------------------------------------------------
    def checkpoint_manager(self, directory: Path) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
        return ocp.CheckpointManager(directory.resolve(), options=options)

    def save(self, manager: ocp.CheckpointManager) -> None:
        state = {"params": self.params, "opt_state": self.opt_state}
        manager.save(self.step, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()

    def restore(self, manager: ocp.CheckpointManager) -> bool:
        """Loads the latest checkpoint if there is one; returns whether it did."""
        step = manager.latest_step()
        if step is None:
            return False
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": self.params, "opt_state": self.opt_state})
        state = manager.restore(step, args=ocp.args.StandardRestore(abstract))
        self.params, self.opt_state, self.step = state["params"], state["opt_state"], int(step)
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
    run fits a fixed lease; the learning-rate schedule still spans `cfg.steps`.
    """
    if head is None:
        counts = token_counts(dataset, target.config.vocab_size) if cfg.method == "eagle3" else None
        head = new_head(target.config, cfg, counts, dtype=target.embed_tokens.embedding[...].dtype)
    trainer = Trainer(target, head, cfg)
    manager = trainer.checkpoint_manager(output / "checkpoints")
    if trainer.restore(manager):
        print(f"resumed from step {trainer.step}", file=sys.stderr)
    log = []
    bar = tqdm.tqdm(total=cfg.steps, initial=trainer.step, desc=f"train {cfg.method}", disable=not progress)
    began, tokens_seen = time.perf_counter(), 0
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
            metrics = {name: float(value) for name, value in jax.device_get(metrics).items()}
            metrics.update(step=trainer.step, tokens_per_second=tokens_seen / (time.perf_counter() - began))
            log.append(metrics)
            shown = {"loss": f"{metrics['loss']:.3f}", "tok/s": f"{metrics['tokens_per_second']:.0f}"}
            shown.update({f"acc{j}": f"{metrics[f'accuracy_{j}']:.2f}" for j in range(cfg.objective.num_steps)})
            bar.set_postfix(shown)
        bar.update(1)
        if trainer.step % cfg.checkpoint_every == 0 or trainer.step == cfg.steps:
            trainer.save(manager)
    bar.close()
    return trainer, log


def acceptance_length(target: llama.Llama, head, prompts: list[np.ndarray], k: int, max_new_tokens: int = 256,
                      batch_size: int = 1) -> dict:
    """Greedy acceptance length over prompts, vLLM's convention (1 + accepted / drafts, pooled)."""
    engine = engine_lib.Engine(target, head, num_speculative_tokens=k, batch_size=batch_size,
                               max_length=max(len(p) for p in prompts) + max_new_tokens + k + 1)
    results = engine.generate(prompts, max_new_tokens=max_new_tokens)
    return dict(k=k, num_prompts=len(prompts), **engine_lib.pooled_stats(results, k))


def attention_implementation(choice: str, dtype: str) -> str:
    """`--attention auto`: cuDNN's fused attention on a GPU in half precision, else XLA's einsums."""
    if choice != "auto":
        return choice
    return "cudnn" if jax.default_backend() == "gpu" and dtype in ("bfloat16", "float16") else "xla"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle_jax.train", description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["eagle", "eagle3"], default="eagle3")
    parser.add_argument("--model", help="target (HF dir, converted dir or .gguf; default SmolLM2-135M-Instruct)")
    parser.add_argument("--data", required=True, help="npz from eagle_jax.cli.prepare_data or eagle_jax.train.distill, "
                                                      "or a directory of such parts")
    parser.add_argument("--output", required=True, help="run directory: checkpoints/, head/, metrics.json")
    parser.add_argument("--dtype", choices=sorted(models.DTYPES), default="bfloat16")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--unroll", type=int, help="training-time-test steps (default: 1 eagle, 7 eagle3)")
    parser.add_argument("--draft-vocab-size", type=int,
                        help="EAGLE-3 draft vocabulary (default: an --init-head's, else 8192); larger than an "
                             "--init-head's, that head's is extended with the most frequent other tokens "
                             "(`extend_draft_vocabulary`)")
    parser.add_argument("--attention", choices=["auto", "xla", "cudnn"], default="auto",
                        help="attention of the train step: XLA einsums, or cuDNN's fused kernel (GPU, bf16/fp16; "
                             "1.7x faster steps on an H200); auto picks cuDNN where it runs")
    parser.add_argument("--train-tokens", type=int,
                        help="train on random whole rows holding this many generated tokens (data-scaling runs)")
    parser.add_argument("--head-intermediate-size", type=int,
                        help="MLP width of a new head (default: the target's); a wider head costs little at "
                             "inference, where the head's step is a small part of a speculative step. With "
                             "--init-head, that head's MLP is widened to it (`widen_mlp`)")
    parser.add_argument("--head-layers", type=int,
                        help="EAGLE-3: decoder layers of a new head (default 1); more than an --init-head's, "
                             "layers that start as the identity are added to it (`add_layers`)")
    parser.add_argument("--init-head", help="start from this exported head (public layout) instead of random "
                                            "weights; a fresh optimiser and schedule (ignored when resuming)")
    parser.add_argument("--max-seconds", type=float, help="stop (and checkpoint) after this much training time")
    parser.add_argument("--eval-prompts", type=int, default=80, help="MT-Bench first turns for the final check")
    parser.add_argument("--eval-k", type=int, default=5)
    parser.add_argument("--eval-max-new-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    if args.head_layers is not None and (args.head_layers < 1 or (args.method == "eagle" and args.head_layers != 1)):
        parser.error(f"--head-layers {args.head_layers}: an EAGLE-3 head has 1 or more layers, an EAGLE-1 head one")
    # Read before training, so a missing MT-Bench file fails at once rather than after the run.
    questions = data_lib.load_mtbench()[:args.eval_prompts] if args.eval_prompts else []

    target, tokenizer_dir = models.load_target(args.model, args.dtype)
    dataset = data_lib.load_dataset(args.data)
    if args.train_tokens:
        dataset = data_lib.subset_by_tokens(dataset, args.train_tokens)
    output = Path(args.output)
    head = None
    draft_vocab_size = args.draft_vocab_size or TrainConfig.draft_vocab_size
    if args.init_head:
        head = models.load_head(args.init_head, target, args.dtype, param_dtype="float32")
        kind = "eagle3" if isinstance(head, eagle.Eagle3Head) else "eagle"
        if kind != args.method:
            parser.error(f"--init-head {args.init_head} is an {kind} head, not {args.method}")
        if kind == "eagle3":  # by default the head keeps its vocabulary
            draft_vocab_size = args.draft_vocab_size or head.config.draft_vocab_size
        if kind == "eagle3" and head.config.draft_vocab_size > draft_vocab_size:
            parser.error(f"--init-head {args.init_head} has a {head.config.draft_vocab_size}-token draft vocabulary, "
                         f"more than --draft-vocab-size {draft_vocab_size} (a vocabulary extends, never shrinks)")
        width = head.config.layer.intermediate_size
        if args.head_intermediate_size and args.head_intermediate_size < width:
            parser.error(f"--init-head {args.init_head} has an MLP {width} wide, more than --head-intermediate-size "
                         f"{args.head_intermediate_size} (a head widens, never narrows)")
        if args.head_intermediate_size and args.head_intermediate_size > width:
            head = widen_mlp(head, args.head_intermediate_size)
        if args.head_layers and args.head_layers < head.config.num_layers:
            parser.error(f"--init-head {args.init_head} has {head.config.num_layers} layers, more than --head-layers "
                         f"{args.head_layers} (a head deepens, never loses layers)")
        if args.head_layers and args.head_layers > head.config.num_layers:
            head = add_layers(head, args.head_layers)
        if kind == "eagle3" and head.config.draft_vocab_size < draft_vocab_size:
            head = extend_draft_vocabulary(head, token_counts(dataset, target.config.vocab_size), draft_vocab_size,
                                           np.asarray(target.output_embedding()))
    unroll = args.unroll or (1 if args.method == "eagle" else 7)
    cfg = TrainConfig(method=args.method, steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                      warmup_steps=args.warmup_steps, draft_vocab_size=draft_vocab_size,
                      head_intermediate_size=args.head_intermediate_size, head_layers=args.head_layers or 1,
                      objective=train_objective.Objective(num_steps=unroll,
                                                          attention=attention_implementation(args.attention, args.dtype)))
    began = time.perf_counter()
    trainer, log = train(target, dataset, cfg, output, head=head, max_seconds=args.max_seconds)
    seconds = time.perf_counter() - began
    head = trainer.head()
    models.export_head(head, target.config, output / "head")
    summary = dict(method=args.method, steps=trainer.step, train_seconds=seconds, final=log[-1] if log else None,
                   device=jax.devices()[0].device_kind, jax_version=jax.__version__, config=repr(cfg),
                   num_sequences=len(dataset["input_ids"]), sequence_length=int(dataset["input_ids"].shape[1]),
                   num_trained_tokens=int(dataset["loss_mask"].sum()))
    if args.method == "eagle3":  # how much of the trained text the draft vocabulary can express
        counts = token_counts(dataset, target.config.vocab_size)
        chosen = np.arange(cfg.draft_vocab_size) + np.asarray(head.d2t[...])  # the head's own (an extended one's too)
        summary["draft_vocab_coverage"] = float(counts[chosen].sum() / counts.sum())
    if args.eval_prompts:
        tokenizer = tokenization.load(tokenizer_dir)
        prompts = [np.asarray(tokenization.encode(tokenizer, q["turns"][0], chat=True)) for q in questions]
        exported = models.load_head(output / "head", target, args.dtype)
        summary["eval"] = acceptance_length(target, exported, prompts, args.eval_k, args.eval_max_new_tokens)
        print(f"MT-Bench acceptance length at k={args.eval_k}: {summary['eval']['acceptance_length']:.3f}")
    (output / "metrics.json").write_text(json.dumps(dict(summary, log=log), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
