"""`EngineConfig`: every setting of an `Engine`, checked once.

The names follow vLLM's and SGLang's where they have one (`num_speculative_tokens`,
`speculative_disable_by_batch_size`, `tensor_parallel_size`, `draft_tensor_parallel_size`;
`batch_size` is vLLM's `max_num_seqs`). The CLI and the benchmarks build one of these and
report its `InputError` as one line.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal

from eagle_jax import heads
from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.decode import tree as tree_lib
from eagle_jax.kernels import decode_attention
from eagle_jax.model import layers

SCHEDULERS = ("static", "continuous")
# "auto" picks per backend (`choose_decode_kernels`); the rest are `layers.Kernels` settings.
DECODE_KERNELS = ("auto",) + layers.DECODE_KERNELS


class InputError(ValueError):
    """Bad user input (token ids, lengths, settings): reported without a traceback by the CLI."""


def choose_decode_kernels(backend: str, tensor_parallel_size: int = 1) -> str:
    """What decode_kernels="auto" runs: "pallas" where it measured faster, else "xla".

    H200, bf16, MT-Bench 80 x 256, one GPU (docs/BENCHMARKS.md): EAGLE-3 chains ran faster with
    them, 31,586 against 22,007 tokens/s at 64 rows and 14,209 against 13,064 at 16 (k = 5,
    continuous scheduler), and 2,078 against 1,914 at batch 1 (k = 6). Plain decoding: 942
    against 785 tokens/s at batch 1. Trees (batch 1): 2,321 against XLA's 2,120 with the
    attention kernel's few-row tiling (`Tiling.for_rows`). The kernels run on one device, and
    interpret slowly off a GPU.
    """
    return "pallas" if backend == "gpu" and tensor_parallel_size == 1 else "xla"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How an `Engine` drafts, batches, compiles and places its programs.

    Attributes:
        num_speculative_tokens: k, a chain of k drafts per step; 0 means plain decoding.
        tree: draft an EAGLE-2 tree per step instead of a chain (`tree.TreeOptions`: topk,
            num_steps, num_draft_tokens); excludes num_speculative_tokens.
        max_length: the largest KV cache (prompt + new tokens + the step's headroom must fit).
            Each batch uses the power-of-two cache length its request needs, up to this:
            attention reads the whole cache, so a right-sized one is faster.
        batch_size: rows per compiled program (vLLM's max_num_seqs); shorter batches are padded.
        scheduler: "static" runs batches of `batch_size` prompts until each batch's longest row
            ends; "continuous" keeps `batch_size` decode slots and refills a slot as soon as its
            row finishes (`serve.scheduler`), all programs compiled up front.
        refill_at: the continuous scheduler's device call returns (to refill slots) once this many
            of its rows have finished; None: a quarter of the slots, at least 1 (`resolved_refill_at`).
        speculative_disable_by_batch_size: while more rows than this are active, steps decode
            plainly (vLLM's flag); None speculates at every step. Greedy outputs are the same.
        speculative_tokens_by_rows: (rows, k) pairs for the continuous scheduler: a run call over
            R rows (a row bucket, `inputs.row_buckets`) drafts the k of the largest listed rows
            <= R (of the smallest listed, below them all), at most num_speculative_tokens, which
            sizes the state. A lone request drafts more than a full batch's rows can afford, in
            the same slots. Empty: every call drafts num_speculative_tokens. Greedy outputs are
            the same.
        decode_kernels: "auto", "xla", "pallas" or "pallas_linear" (`layers.Kernels`); "auto"
            picks the Pallas kernels on one GPU, XLA elsewhere (`choose_decode_kernels`).
        attention_tiling: the Pallas attention kernel's block size and launch settings
            (`decode_attention.Tiling`); needs decode_kernels "pallas" (or "auto"). None: the
            kernel's own choice for the batch.
        unroll_draft: write the draft loop out in the step program instead of looping on the
            device (`decode.state.Options.unroll_draft`).
        sampling_mode: what every program may sample with (`sampling.SamplingMode`: which
            processors it traces). None: each `generate` call compiles (once per mode) the
            smallest mode that covers its requests, so greedy calls keep the plain argmax
            program; a fixed mode (a server's, say `SamplingMode(sample=True, penalties=True,
            top_k=64, min_p=True, min_tokens=True, logprobs=5)`) serves every request it covers
            with the same programs, whatever the mix, and refuses the others.
        tensor_parallel_size: devices the target is split over, Megatron-style (`sharding`).
        draft_tensor_parallel_size: 1 keeps the head whole on every device; the tensor
            parallel size splits its MLPs and draft vocabulary too.
        fixed_shapes: one prefill width (max_length // 2) and one cache length (max_length)
            for every static batch: two programs in all instead of one per bucket.
        steps_per_check: steps between the device loop's "all rows done" tests.
        steps_per_call: steps per device call before the host reads tokens (streams, refills).
        eager: run the same functions op by op, without jit (for comparison only: slow).
        cache_dir: persistent compilation cache root; None compiles in memory only.
    """

    num_speculative_tokens: int = 0
    tree: tree_lib.TreeOptions | None = None
    max_length: int = 2048
    batch_size: int = 1
    scheduler: Literal["static", "continuous"] = "static"
    refill_at: int | None = None
    speculative_disable_by_batch_size: int | None = None
    speculative_tokens_by_rows: tuple[tuple[int, int], ...] = ()
    decode_kernels: Literal["auto", "xla", "pallas", "pallas_linear"] = "auto"
    attention_tiling: decode_attention.Tiling | None = None
    unroll_draft: bool = False
    sampling_mode: sampling_lib.SamplingMode | None = None
    tensor_parallel_size: int = 1
    draft_tensor_parallel_size: int = 1
    fixed_shapes: bool = False
    steps_per_check: int = 1
    steps_per_call: int = 64
    eager: bool = False
    cache_dir: str | None = None

    def __post_init__(self):
        for name in ("max_length", "batch_size", "tensor_parallel_size", "draft_tensor_parallel_size",
                     "steps_per_check", "steps_per_call"):
            _check_at_least(name, getattr(self, name), 1)
        _check_at_least("num_speculative_tokens", self.num_speculative_tokens, 0)
        for name in ("refill_at", "speculative_disable_by_batch_size"):
            if getattr(self, name) is not None:
                _check_at_least(name, getattr(self, name), 1)
        if self.num_speculative_tokens and self.tree is not None:
            raise InputError("num_speculative_tokens (a chain) and tree exclude each other")
        if self.speculative_tokens_by_rows and self.scheduler != "continuous":
            raise InputError("speculative_tokens_by_rows sets the continuous scheduler's row buckets; "
                             f"scheduler={self.scheduler!r} runs every row in one program")
        for pair in self.speculative_tokens_by_rows:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise InputError(f"speculative_tokens_by_rows holds (rows, k) pairs, got {pair!r}")
            _check_at_least("speculative_tokens_by_rows' rows", pair[0], 1)
            _check_at_least("speculative_tokens_by_rows' k", pair[1], 0)
            if pair[1] > self.num_speculative_tokens:
                raise InputError(f"speculative_tokens_by_rows asks k = {pair[1]} at {pair[0]} rows, more than "
                                 f"num_speculative_tokens = {self.num_speculative_tokens}, which sizes the state")
        if self.tree is not None and not isinstance(self.tree, tree_lib.TreeOptions):
            raise InputError(f"tree must be a tree.TreeOptions, got {self.tree!r}")
        if self.sampling_mode is not None and not isinstance(self.sampling_mode, sampling_lib.SamplingMode):
            raise InputError(f"sampling_mode must be a sampling.SamplingMode or None, got {self.sampling_mode!r}")
        if self.scheduler not in SCHEDULERS:
            raise InputError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if self.decode_kernels not in DECODE_KERNELS:
            raise InputError(f"decode_kernels must be one of {DECODE_KERNELS}, got {self.decode_kernels!r}")
        if self.tensor_parallel_size > 1 and self.decode_kernels not in ("auto", "xla"):
            raise InputError(f"decode_kernels={self.decode_kernels!r} runs on one device; it does not take "
                             f"tensor_parallel_size={self.tensor_parallel_size}")
        if self.attention_tiling is not None and self.decode_kernels not in ("auto", "pallas"):
            raise InputError(f"attention_tiling sets the Pallas attention kernel; decode_kernels="
                             f"{self.decode_kernels!r} does not run it (pass decode_kernels='pallas')")
        if self.draft_tensor_parallel_size not in (1, self.tensor_parallel_size):
            raise InputError(f"draft_tensor_parallel_size must be 1 (the head whole on every device) or the tensor "
                             f"parallel size {self.tensor_parallel_size} (split like the target), got "
                             f"{self.draft_tensor_parallel_size}")

    @property
    def speculative(self) -> bool:
        """Whether steps draft (a chain or a tree), so a head is needed."""
        return bool(self.num_speculative_tokens) or self.tree is not None

    @property
    def k(self) -> int:
        """The most drafts one step can accept: the chain's length, or the tree's depth."""
        return self.tree.num_steps if self.tree is not None else self.num_speculative_tokens

    @property
    def cache_headroom(self) -> int:
        """Cache slots past a row's committed length that one step may write."""
        return self.tree.cache_headroom if self.tree is not None else self.k + 1

    def k_for_rows(self, rows: int) -> int:
        """The drafts a continuous run call over `rows` rows makes a step (`speculative_tokens_by_rows`)."""
        if not self.speculative_tokens_by_rows:
            return self.num_speculative_tokens
        return heads.k_at(self.speculative_tokens_by_rows, rows)

    @property
    def resolved_refill_at(self) -> int:
        """`refill_at`, or a quarter of the slots (at least 1), capped at batch_size."""
        return min(self.refill_at or max(1, self.batch_size // 4), self.batch_size)

    def mode_for(self, samplings) -> sampling_lib.SamplingMode:
        """The sampling mode of a call with these requests: the fixed one, or the smallest covering them.

        Raises:
            InputError: a request the fixed mode does not cover, naming what it asks.
        """
        samplings = list(samplings)
        if self.sampling_mode is None:
            return sampling_lib.SamplingMode.of(samplings)
        for index, sampling in enumerate(samplings):
            if not self.sampling_mode.covers(sampling):
                raise InputError(f"request {index} asks for {sampling}, more than this engine's sampling_mode "
                                 f"{self.sampling_mode} covers")
        return self.sampling_mode

    def kernels(self, backend: str) -> layers.Kernels:
        """The kernels the programs run on `backend` ("auto" resolved).

        Raises:
            InputError: attention_tiling given where "auto" chose XLA's kernels.
        """
        name = self.decode_kernels
        if name == "auto":
            name = choose_decode_kernels(backend, self.tensor_parallel_size)
        if self.attention_tiling is not None and name != "pallas":
            raise InputError(f"attention_tiling sets the Pallas attention kernel; decode_kernels={name!r} "
                             "does not run it (pass decode_kernels='pallas')")
        return layers.Kernels(name, self.attention_tiling)


def _check_at_least(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
