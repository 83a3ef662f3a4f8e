"""`python -m eagle_jax.generate`: (speculative) generation from the command line.

With no `--model` it runs the embedded default model, SmolLM2-135M-Instruct, with its shipped
EAGLE head as the draft (on a CPU without one unless asked: speculation measured slower there).
Text streams to the terminal; `--json` prints one object per prompt, a line each, as each finishes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import jax

from eagle_jax import heads
from eagle_jax.cli import output
from eagle_jax.cli import sampling_flags
from eagle_jax.cli import user_input
from eagle_jax.decode import tree as tree_lib
from eagle_jax.io import hf_files
from eagle_jax.io import models
from eagle_jax.io import tokenization
from eagle_jax.serve import compile_cache
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import inputs
from eagle_jax.serve import sharding

TREE_FLAGS = ("--speculative-eagle-topk", "--speculative-num-steps", "--speculative-num-draft-tokens")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eagle_jax.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF directory, converted directory or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", help="JSONL with a 'prompt' field or MT-Bench 'turns' (first turn used; "
                                               "a string is one turn)")
    parser.add_argument("--no-chat", action="store_true", help="feed raw text, without the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(models.DTYPES), default="float32")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout, a line each, "
                                                            "written as each finishes")
    parser.add_argument("--draft", help="EAGLE head directory; 'none' disables (default: the shipped head "
                                        "when the model is the default one)")
    parser.add_argument("--method", choices=["eagle", "eagle3"],
                        help="which shipped head (default: eagle3; none on a CPU, where it measured slower)")
    parser.add_argument("--num-speculative-tokens", type=int, help="k drafted tokens per step; 0 = plain decoding")
    parser.add_argument("--speculative-eagle-topk", type=int, help="EAGLE-2 tree: children per expanded node, "
                                                                   "and nodes expanded per depth (K)")
    parser.add_argument("--speculative-num-steps", type=int, help="EAGLE-2 tree: its depth (D)")
    parser.add_argument("--speculative-num-draft-tokens", type=int,
                        help="EAGLE-2 tree: drafted nodes verified per step, the root excluded (N, D..K+(D-1)K^2)")
    parser.add_argument("--speculative-disable-by-batch-size", type=int, metavar="N",
                        help="decode without drafts in steps where more than N rows are active (default: always "
                             "speculate)")
    parser.add_argument("--eager", action="store_true", help="run op by op without jit (slow; for comparison)")
    parser.add_argument("--decode-kernels", choices=config_lib.DECODE_KERNELS, default="auto",
                        help="pallas: fused norm, projection and attention kernels in decode steps of up to 32 "
                             "rows, the attention kernel alone in larger ones (Pallas on a GPU, interpreted "
                             "elsewhere); pallas_linear: the fused norms and projections with XLA's attention; "
                             "xla: as XLA compiles them; auto: "
                             "pallas on one GPU, where it measured faster, xla on meshes and CPUs")
    parser.add_argument("--batch-size", "--max-num-seqs", dest="batch_size", type=int, default=1,
                        help="rows decoded together: a static batch, or the continuous scheduler's decode slots")
    parser.add_argument("--scheduler", choices=config_lib.SCHEDULERS,
                        help="continuous: a finished row's slot takes the next prompt at once; static: each batch "
                             "runs until its longest row ends (default: continuous with more than one prompt and "
                             "a batch size above 1, else static)")
    parser.add_argument("--max-length", type=int, default=2048,
                        help="largest KV cache (the continuous scheduler fits its slots' cache to the prompts, up to this)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="split the target over N devices (Megatron-style, XLA SPMD); the head is whole "
                             "on each unless --draft-tensor-parallel-size N")
    parser.add_argument("--draft-tensor-parallel-size", type=int, default=1, metavar="N",
                        help="1: the draft head whole on every device; the tensor parallel size: its MLP and draft "
                             "vocabulary split too")
    parser.add_argument("--cache-dir", help=f"compilation cache root (default: ${compile_cache.ENV_VAR}/xla or "
                                            "~/.cache/eagle_jax/xla)")
    parser.add_argument("--no-compile-cache", action="store_true")
    sampling_flags.add_arguments(parser)
    return parser.parse_args(argv)


def check_flags(args) -> config_lib.EngineConfig:
    """Rejects out-of-range flags before anything is loaded; the engine's own go to `EngineConfig`.

    Returns:
        The `EngineConfig` the flags ask for, before the draft plan and the prompts settle k and
        the cache length (`load`).

    Raises:
        config.InputError: naming the flag (or the setting) and the value given.
    """
    # Each check states what is valid, so a NaN (false in every comparison) fails it too.
    checks = [("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
              ("--temperature", args.temperature, 0 <= args.temperature < math.inf, ">= 0 and finite"),
              ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]")]
    for flag, value, valid, expected in checks:
        if not valid:
            raise config_lib.InputError(f"{flag} must be {expected}, got {value}")
    tree = tree_settings(args)
    if tree is not None:
        if None in tree:
            raise config_lib.InputError(f"a draft tree needs all of {', '.join(TREE_FLAGS)}")
        problem = tree_lib.check(*tree, names=TREE_FLAGS)
        if problem:
            raise config_lib.InputError(problem)
    return config_lib.EngineConfig(
        num_speculative_tokens=args.num_speculative_tokens or 0, tree=tree and tree_lib.TreeOptions(*tree),
        max_length=args.max_length, batch_size=args.batch_size, scheduler=args.scheduler or "static",
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size, decode_kernels=args.decode_kernels,
        tensor_parallel_size=args.tensor_parallel_size, draft_tensor_parallel_size=args.draft_tensor_parallel_size,
        eager=args.eager)


def tree_settings(args) -> tuple[int | None, int | None, int | None] | None:
    """(topk, num_steps, num_draft_tokens) when any tree flag is given, else None."""
    tree = (args.speculative_eagle_topk, args.speculative_num_steps, args.speculative_num_draft_tokens)
    return None if tree == (None, None, None) else tree


def read_prompts(args) -> list[str | list[dict]]:
    """--prompt, --prompts-file, then --messages-file; the default prompt when none is given."""
    messages = sampling_flags.read_messages(args.messages_file) if args.messages_file else []
    if messages and not args.prompt and not args.prompts_file:
        return messages
    return user_input.prompts(args.prompt, args.prompts_file) + messages


def choose_scheduler(args, num_prompts: int) -> str:
    """--scheduler, or by default continuous where there is something to refill slots with."""
    if args.scheduler is not None:
        return args.scheduler
    return "continuous" if num_prompts > 1 and args.batch_size > 1 else "static"


def load(args, prompts: list[str], config: config_lib.EngineConfig):
    """(engine, tokenizer, method, the prompts' token ids) for the parsed arguments (`config`: `check_flags`'s)."""
    target, tokenizer_dir = models.load_target(args.model, args.dtype)
    tokenizer = tokenization.load(tokenizer_dir)
    token_ids = [sampling_flags.encode(tokenizer, prompt, not args.no_chat) for prompt in prompts]
    platform = jax.devices()[0].platform
    tree = tree_settings(args)
    asked_k = args.num_speculative_tokens if tree is None else args.speculative_num_steps  # a tree always speculates
    draft, method, k, note = heads.draft_plan(args.model, args.draft, args.method, asked_k, platform, args.batch_size)
    if note:
        print(f"eagle_jax: {note}", file=sys.stderr)
    head = models.load_head(draft, target, args.dtype) if draft else None
    cache_dir = None if args.no_compile_cache else (args.cache_dir or compile_cache.default_root())
    tree = tree_lib.TreeOptions(*tree) if tree is not None and head is not None else None
    config = dataclasses.replace(config, num_speculative_tokens=k if tree is None else 0, tree=tree,
                                 scheduler=choose_scheduler(args, len(prompts)), cache_dir=cache_dir,
                                 # one prompt at a time streams as it is made: a device call of 8 steps
                                 steps_per_call=8 if streams(args) else 64)
    if config.scheduler == "continuous":  # every slot has one cache length: fit it to these prompts
        config = dataclasses.replace(config, max_length=inputs.fixed_max_length(
            max(len(ids) for ids in token_ids), args.max_new_tokens, config.cache_headroom, args.max_length))
    return engine_lib.Engine(target, head, config), tokenizer, method, token_ids


def streams(args) -> bool:
    """Whether text streams to the terminal (one prompt at a time)."""
    return not args.json and args.batch_size == 1 and args.n == 1


def main(argv=None) -> int:
    args = parse_args(argv)
    progress = output.Progress()
    try:
        config = check_flags(args)
        user_input.check_seed(args.seed)
        if sharding.initialize_distributed() and jax.process_index() > 0:
            # Every process computes the same tokens: process 0 prints them (fd 1, for native libraries too).
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sampling = sampling_flags.sampling(args)
        prompts = read_prompts(args)
        progress.total = len(prompts) * sampling.n
        engine, tokenizer, method, token_ids = load(args, prompts, config)
        engine.check_prompts(token_ids, args.max_new_tokens)  # all of them, before anything streams
        stream = streams(args)
        options = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, tokenizer=tokenizer)
        if stream:  # one prompt at a time, so each streams as it is made
            for index, ids in enumerate(token_ids):
                print(f"\n>>> {sampling_flags.shown(prompts[index])}\n", flush=True)
                on_tokens, finish = sampling_flags.streamer(tokenizer, sampling)
                [result] = engine.generate([ids], seed=user_input.prompt_seed(args.seed, index), on_tokens=on_tokens,
                                           **options)
                finish()
                report(args, index, prompts[index], tokenizer, result, method, engine, stream, progress)
        else:  # batched (static batches or decode slots): each result is written as soon as it is done
            shown_prompts = sampling_flags.per_sample(prompts, sampling)  # results come n to a prompt
            engine.generate(token_ids, seed=args.seed, **options, on_result=lambda row, result: report(
                args, row, shown_prompts[row], tokenizer, result, method, engine, stream, progress))
    except (config_lib.InputError, hf_files.CheckpointError, FileNotFoundError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return progress.interrupted()
    except BrokenPipeError:
        return output.reader_gone()
    return 0


def report(args, index, prompt, tokenizer, result, method, engine, streamed, progress) -> None:
    text = result.text  # decoded by the engine, cut before a stop string
    config = engine.config
    k, tree = config.k, config.tree
    if args.json:
        # A tree reports its three settings and no chain length; a chain or plain decoding, k and no tree.
        record = dict(prompt=prompt, text=text, token_ids=result.token_ids, num_tokens=result.num_tokens,
                      seconds=round(result.seconds, 4), tokens_per_second=round(result.tokens_per_second, 2),
                      compile_seconds=round(result.compile_seconds, 3), method=method,
                      num_speculative_tokens=None if tree else k,
                      speculative_eagle_topk=tree and tree.topk, speculative_num_steps=tree and tree.num_steps,
                      speculative_num_draft_tokens=tree and tree.num_draft_tokens,
                      scheduler=config.scheduler, batch_size=config.batch_size,
                      decode_kernels=engine.kernels.decode_kernels, tensor_parallel_size=config.tensor_parallel_size,
                      draft_tensor_parallel_size=config.draft_tensor_parallel_size, **result.stats,
                      **sampling_flags.json_fields(result))
        progress.write_result(json.dumps(dict(index=index, **record)))  # `index`: continuous slots finish out of order
        return
    if not streamed:
        print(f"\n>>> {sampling_flags.shown(prompt)}\n{text}", flush=True)
    summary = f"{result.num_tokens} tokens in {result.seconds:.2f} s, {result.tokens_per_second:.1f} tokens/s"
    if k:
        drafting = (f"tree topk={tree.topk} steps={tree.num_steps} draft tokens={tree.num_draft_tokens}" if tree
                    else f"k={k}")
        summary += f", acceptance length {result.stats['acceptance_length']:.2f} ({method}, {drafting})"
    print(f"\n[{summary}; compile {result.compile_seconds:.1f} s]", file=sys.stderr)
    progress.finished += 1


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
