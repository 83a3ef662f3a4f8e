"""Tensor parallelism as data: logical axes of the target's parameters and KV cache, mapped to a mesh.

Megatron-style, over one mesh axis ("tensor") of P devices, with XLA SPMD inserting the
collectives (an all-reduce after each row-parallel matmul) except for the embedding lookup:
  * column-parallel: `qkv_proj` and `gate_up_proj` split over their output features;
  * row-parallel: `o_proj` and `down_proj` split over their input features;
  * vocabulary-parallel: `embed_tokens` and `lm_head`. The lookup is written out
    (`vocab_parallel_lookup`: each device its own rows, then one all-reduce of [B, T, D]) because
    XLA SPMD, left to itself on 2 H200s, all-gathered the whole table (bf16[128256,4096], 1 GB)
    in every Llama-3.1-8B decode and draft step (decode 6.57 ms at TP 2 against 4.81 ms on one;
    on CPUs it chose this lookup itself);
  * replicated: norms, row-parallel biases, the EAGLE head, and the decode state apart from the
    target's KV cache, which is split over its kv heads. `shard_head` splits the head's MLPs and
    EAGLE-3 draft vocabulary instead (vLLM's `draft_tensor_parallel_size` equal to the target's):
    a smaller share of its weights for each device to read, against one more all-reduce and the
    argmax's gathers a draft step.
Where the kv heads do not divide P (SmolLM2 has 3), attention is replicated and only the MLP
and the vocabulary are split; the intermediate size and the vocabulary must divide P.

Fused projections. `qkv_proj` stores [q | k | v] along its output axis, so cutting that axis
into P equal pieces would give device 0 all of q. `shard_target` therefore reorders the columns
into P blocks [q_p | k_p | v_p], block p holding heads p N/P .. (p+1) N/P - 1 of q and
p K/P .. (p+1) K/P - 1 of k and v, and sets the layer's `num_shards = P` so that
`layers.Attention.project` splits inside each block. `gate_up_proj` likewise becomes blocks
[gate_p | up_p]. It is a permutation of columns, once at load: every device then computes its
own heads (and its slice of the intermediate features) with no communication; only the sums
that the all-reduces complete are added in another order than on one device.

A single device needs none of this: with no mesh the model and the engine are unchanged.
"""

from __future__ import annotations

import collections
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eagle_jax.model import config as config_lib
from eagle_jax.model import kv_cache as kv_cache_lib
from eagle_jax.model import layers
from eagle_jax.model import llama

TENSOR = "tensor"
P = PartitionSpec

# Logical axes of each target parameter, matched by the end of its Flax path, one per array
# dimension (kernels are [in, out]). Parameters not listed (norms, row-parallel biases) are replicated.
PARAM_AXES = (
    ("embed_tokens/embedding", ("vocab", "embed")),
    ("lm_head/kernel", ("embed", "vocab")),
    ("lm_head/scale", ("vocab",)),  # an int8 lm_head's column scales (`int8_linear`), split with its columns
    ("self_attn/qkv_proj/kernel", ("embed", "heads")),
    ("self_attn/qkv_proj/bias", ("heads",)),
    ("self_attn/o_proj/kernel", ("heads", "embed")),
    ("mlp/gate_up_proj/kernel", ("embed", "mlp")),
    ("mlp/gate_up_proj/bias", ("mlp",)),
    ("mlp/down_proj/kernel", ("mlp", "embed")),
)
CACHE_AXES = ("batch", "length", "kv_heads", "head_dim")  # `kv_cache.KVCache` keys and values [B, S, K, H]

# Logical axis -> mesh axis; logical axes not listed are replicated.
RULES = {"vocab": TENSOR, "mlp": TENSOR, "heads": TENSOR, "kv_heads": TENSOR}


class ShardingError(ValueError):
    """A mesh that does not fit the devices or the model."""


def make_mesh(tensor_parallel_size: int) -> Mesh:
    """A 1-D mesh ("tensor",) over the first `tensor_parallel_size` devices of all processes.

    Auto axes: XLA SPMD propagates shardings from the parameters and places the collectives.
    """
    devices = jax.devices()
    if not 1 <= tensor_parallel_size <= len(devices):
        raise ShardingError(f"tensor_parallel_size={tensor_parallel_size} needs that many devices; "
                            f"{len(devices)} {devices[0].platform} device(s) are visible")
    return jax.make_mesh((tensor_parallel_size,), (TENSOR,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices[:tensor_parallel_size])


def tensor_parallel_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TENSOR]


def rules_for(cfg: config_lib.LlamaConfig, mesh: Mesh) -> dict[str, str]:
    """The rules for this target on this mesh: attention's axes dropped when kv heads do not divide P.

    Raises:
        ShardingError: the vocabulary or the intermediate size does not divide P.
    """
    size = tensor_parallel_size(mesh)
    for name, value in (("vocab_size", cfg.vocab_size), ("intermediate_size", cfg.intermediate_size)):
        if value % size:
            raise ShardingError(f"tensor_parallel_size={size} does not divide the target's {name}={value}; "
                                f"choose a size that does")
    if cfg.num_kv_heads % size:  # q heads are whole groups of kv heads, so these divide too otherwise
        return {axis: mesh_axis for axis, mesh_axis in RULES.items() if axis not in ("heads", "kv_heads")}
    return dict(RULES)


def spec(axes: tuple[str, ...], rules: dict[str, str]) -> PartitionSpec:
    """The PartitionSpec of logical `axes` under `rules`."""
    return PartitionSpec(*(rules.get(axis) for axis in axes))


def param_axes(path: str) -> tuple[str, ...] | None:
    """The logical axes of the parameter at Flax `path`, or None (replicated)."""
    for suffix, axes in PARAM_AXES:
        if path == suffix or path.endswith("/" + suffix):
            return axes
    return None


def replicate(module: nnx.Module, mesh: Mesh) -> nnx.Module:
    """A copy of `module` with every variable replicated over the mesh (the EAGLE head)."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.device_put(state, NamedSharding(mesh, PartitionSpec())))


def shard_target(target: llama.Llama, mesh: Mesh) -> llama.Llama:
    """A copy of `target` laid out and placed for tensor parallelism over `mesh` (module docstring).

    The caller's model keeps its layout and placement.

    Raises:
        ShardingError: the vocabulary or the intermediate size does not divide the mesh.
    """
    cfg = target.config
    rules = rules_for(cfg, mesh)
    size = tensor_parallel_size(mesh)
    copy = nnx.merge(*nnx.split(target))
    if rules.get("vocab") == TENSOR:
        copy.embed_tokens = VocabParallelEmbed(copy.embed_tokens, mesh)
    attention_split = "heads" in rules
    for layer in copy.layers:
        layer.mlp.num_shards = size
        if attention_split:
            layer.self_attn.num_shards = size
    orders = {"mlp/gate_up_proj": block_order(layers.gate_up_sizes(cfg), size)}
    if attention_split:
        orders["self_attn/qkv_proj"] = block_order(layers.qkv_sizes(cfg), size)
    return _placed(copy, mesh, rules, orders)


def shard_head(head: nnx.Module, mesh: Mesh) -> nnx.Module:
    """A copy of an EAGLE head with its MLPs split as the target's (gate_up column-parallel in
    [gate_p | up_p] blocks, down_proj row-parallel) and an EAGLE-3 head's draft vocabulary
    (`lm_head`) split over `mesh`; attention, fc and norms stay replicated, so its KV cache (one
    or two layers) stays whole on every device and needs no layout of its own.

    Raises:
        ShardingError: the head's intermediate size or draft vocabulary does not divide the mesh.
    """
    size = tensor_parallel_size(mesh)
    cfg = head.config
    sizes = {"intermediate_size": cfg.layer.intermediate_size}
    if cfg.method == "eagle3":
        sizes["draft_vocab_size"] = cfg.draft_vocab_size
    for name, value in sizes.items():
        if value % size:
            raise ShardingError(f"draft_tensor_parallel_size={size} does not divide the head's {name}={value}; "
                                f"keep the head whole (draft tensor parallel size 1)")
    copy = nnx.merge(*nnx.split(head))
    for _, module in nnx.iter_modules(copy):
        if isinstance(module, layers.MLP):
            module.num_shards = size
    orders = {"mlp/gate_up_proj": block_order(layers.gate_up_sizes(cfg.layer), size)}
    return _placed(copy, mesh, {"mlp": TENSOR, "vocab": TENSOR}, orders)


def _placed(module: nnx.Module, mesh: Mesh, rules: dict[str, str], orders: dict[str, np.ndarray]) -> nnx.Module:
    """`module` with each parameter placed on `mesh` by its logical axes under `rules`, the output
    columns of every module whose path ends in a key of `orders` permuted by its value first."""
    graphdef, state = nnx.split(module)

    def place(key_path, leaf):
        path = "/".join(str(key.key) for key in key_path if isinstance(key, jax.tree_util.DictKey))
        owner = path.rsplit("/", 1)[0]
        for suffix, order in orders.items():
            if owner.endswith(suffix):
                leaf = leaf[..., order]  # kernel [in, out] or bias [out]: reorder the output axis
        axes = param_axes(path)
        return jax.device_put(leaf, NamedSharding(mesh, spec(axes, rules) if axes else PartitionSpec()))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(place, state))


def vocab_parallel_lookup(table: jax.Array, ids: jax.Array, mesh: Mesh) -> jax.Array:
    """`jnp.take(table, ids, axis=0)` for a table [V, D] split over its rows on `mesh`'s tensor axis:
    each device looks up the ids in its own rows (zeros elsewhere), then one all-reduce adds them.

    Exactly one device contributes each row and the others add zeros, so for ids in [-V, V) the
    result is one device's exactly (bit for bit but for the sign of a zero: a -0.0 in the table can
    come back +0.0); beyond, `jnp.take` gives NaN rows and this zeros.
    """
    vocab = table.shape[0]
    ids = jnp.where(ids < 0, ids + vocab, ids)  # negative ids count from the end, as in `jnp.take`

    def local(rows, ids):
        ids = ids - jax.lax.axis_index(TENSOR) * rows.shape[0]
        mine = (ids >= 0) & (ids < rows.shape[0])
        found = jnp.take(rows, jnp.where(mine, ids, 0), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], found, jnp.zeros_like(found)), TENSOR)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(TENSOR, None), P()), out_specs=P())(table, ids)


class VocabParallelEmbed(nnx.Module):
    """`embed_tokens` of a sharded target: the same `embedding` Param (so the same state path and
    `Llama.logits` reads it for a tied lm_head), looked up by `vocab_parallel_lookup`."""

    def __init__(self, embed: nnx.Embed, mesh: Mesh):
        self.embedding = embed.embedding
        self.dtype = embed.dtype
        self.mesh = mesh

    def __call__(self, tokens: jax.Array) -> jax.Array:
        # Cast the looked-up rows, not the table: a table stored wider than it computes is not copied.
        return vocab_parallel_lookup(self.embedding[...], tokens, self.mesh).astype(self.dtype)


COLLECTIVE = re.compile(r"= (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def collectives(hlo_text: str) -> dict[str, int]:
    """{"all-reduce bf16[1,1,4096]": count, ...} in a compiled program's text (a loop body counts
    once): which collectives XLA SPMD placed, so a slow tensor-parallel step can be read off its
    row without a trace. An asynchronous start op's shape is a tuple (operand, result): the result."""
    def result(shape: str) -> str:
        return re.sub(r"\{[^}]*\}", "", shape).strip("()").split(", ")[-1]
    return dict(collections.Counter(f"{op} {result(shape)}" for shape, op in COLLECTIVE.findall(hlo_text)))


def block_order(sizes: tuple[int, ...], size: int) -> np.ndarray:
    """Column order turning parts [a | b | ...] of widths `sizes` into `size` blocks [a_p | b_p | ...]."""
    starts = np.cumsum((0,) + sizes[:-1])
    return np.concatenate([np.arange(start + p * width // size, start + (p + 1) * width // size)
                           for p in range(size) for start, width in zip(starts, sizes)])


def cache_shardings(cache: kv_cache_lib.KVCache, cfg: config_lib.LlamaConfig, mesh: Mesh) -> kv_cache_lib.KVCache:
    """Where the target's KV cache (arrays or shapes) lives: keys and values [B, S, K, H] split
    over kv heads when attention is split, lengths replicated."""
    split = NamedSharding(mesh, spec(CACHE_AXES, rules_for(cfg, mesh)))
    return cache.replace(keys=tuple(split for _ in cache.keys), values=tuple(split for _ in cache.values),
                         lengths=NamedSharding(mesh, PartitionSpec()))


def state_shardings(state, cfg: config_lib.LlamaConfig, mesh: Mesh):
    """Where each leaf of a `decode.state.DecodeState` (arrays or shapes) lives.

    The target's KV cache (`state.cache`) as `cache_shardings`; the rest (tokens, counters, the
    head's cache, pending features) is small and replicated.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda _: replicated, state).replace(cache=cache_shardings(state.cache, cfg, mesh))


def pin_state(state, cfg: config_lib.LlamaConfig, mesh: Mesh | None):
    """A decode state, inside a traced program, constrained to `state_shardings` (unchanged without a mesh).

    Every program that returns a state pins it, so a state passes from program to program,
    donated, in the layout each was compiled for, never resharded in between.
    """
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(state, cfg, mesh))


def abstract_state(shape, cfg: config_lib.LlamaConfig, mesh: Mesh | None):
    """Abstract decode state `shape` with its `state_shardings` attached, to lower programs for it."""
    if mesh is None:
        return shape
    return jax.tree.map(lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where), shape,
                        state_shardings(shape, cfg, mesh))


def initialize_distributed() -> bool:
    """Joins a multi-process JAX job when the environment describes one (entry points only).

    Called before anything else touches jax. Recognised: a manual launch setting
    JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID in
    every process; Slurm (`srun` with more than one task) and Open MPI (`mpirun`), whose settings
    jax reads itself. Other environments jax could detect (any Kubernetes pod, any machine with
    mpi4py installed) are not taken as a request: a single process stays single.

    Returns:
        Whether `jax.distributed.initialize` ran.
    """
    env = os.environ
    if "JAX_COORDINATOR_ADDRESS" in env:
        count, index = env.get("JAX_NUM_PROCESSES"), env.get("JAX_PROCESS_ID")
        if count is None or index is None:
            raise ShardingError("JAX_COORDINATOR_ADDRESS is set: set JAX_NUM_PROCESSES and JAX_PROCESS_ID too")
        jax.distributed.initialize(num_processes=int(count), process_id=int(index))
    elif int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        jax.distributed.initialize()
    else:
        return False
    return True
