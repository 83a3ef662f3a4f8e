"""`eagle-jax-convert SRC DST`: converts a model for eagle_jax.

SRC is one of:
  * an HF Llama directory or a llama `.gguf` file: DST gets the converted format (config.json,
    params.safetensors keyed by Flax paths, tokenizer files), which loads without a name table;
  * an EAGLE-1 or EAGLE-3 head directory (safetensors or pytorch_model.bin): it is checked against
    `--target` and written back in its public HF layout (config.json + model.safetensors), so a
    pytorch_model.bin head becomes safetensors and stays loadable by vLLM and SGLang. `--int8
    lm_head.weight` stores those weights as int8 with a scale per row (`eagle_jax.int8_weights`:
    eagle_jax reads it, vLLM does not); a head stored so is written back widened to its dtype.

DST appears only when complete: everything is written into a locked `.DST.tmp-*` beside it and
renamed into place last, so an interrupted or failed conversion (a full disk included) leaves
nothing at DST, and what a killed one left is removed by the next.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from eagle_jax.io import gguf_file
from eagle_jax.io import hf_files
from eagle_jax.io import int8_weights
from eagle_jax.io import models
from eagle_jax.io import staging


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="eagle-jax-convert", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="HF Llama directory, .gguf file, or EAGLE head directory")
    parser.add_argument("dst", help="output directory (must not exist, or be empty)")
    parser.add_argument("--dtype", choices=sorted(models.DTYPES),
                        help="weight dtype (default: float32 for targets; a head keeps its own)")
    parser.add_argument("--target", help="the target a head is for (any target source); required for heads")
    parser.add_argument("--int8", default="", metavar="NAME[,NAME]",
                        help="heads: store these 2-D weights (e.g. lm_head.weight) as int8, one float32 scale a row")
    return parser.parse_args(argv)


def is_head(src: Path) -> bool:
    """An EAGLE head: config architectures name Eagle3, or the tensors are fc.weight / midlayer.*."""
    if not src.is_dir() or not (src / "config.json").is_file():
        return False
    architectures = " ".join(hf_files.load_config(src).get("architectures") or [])
    if "Eagle3" in architectures:
        return True
    names = set(hf_files.tensor_names(src))  # an index or a header: a target's weights are not read here
    return "fc.weight" in names or any(name.startswith("midlayer.") for name in names)


def convert_target(src: Path, dst: Path, dtype: str) -> None:
    """Writes the converted format of an HF directory or a GGUF to `dst`, which appears only when complete."""
    if src.is_file() and src.suffix == ".gguf":
        # The GGUF's HF form is an intermediate: kept beside dst (not in /tmp, nor the cache) and
        # removed with it, or by the next run if this one is killed.
        dst.parent.mkdir(parents=True, exist_ok=True)
        with staging.temporary_directory(dst.parent, f"{dst.name}.gguf-source") as scratch:
            hf_dir = gguf_file.gguf_to_hf_dir(src, scratch / "hf")
            model, source_dir = models.load_target(hf_dir, dtype)
            models.save_converted(model, source_dir, dst, dtype)
        return
    model, source_dir = models.load_target(src, dtype)
    models.save_converted(model, source_dir, dst, dtype)


def convert_head(src: Path, dst: Path, target_path: str | None, dtype: str | None, int8: tuple[str, ...] = ()) -> None:
    if target_path is None:
        raise hf_files.CheckpointError(f"{src} is an EAGLE head: pass --target (the model it drafts for) to check it")
    target, _ = models.load_target(target_path)
    tensors = hf_files.load_tensors(src)
    config = hf_files.load_config(src)
    stored = int8_weights.dequantize(tensors)
    models.head_from_tensors(stored, config, target)  # raises if the head does not fit the target
    if dtype is not None or stored is not tensors:  # an int8-stored head is widened back to its own dtype
        dtype = dtype or config.get("torch_dtype", "bfloat16")
        cast = np.dtype(models.DTYPES[dtype])
        # Floating tensors only (bfloat16 has numpy kind "V"); d2t and t2d stay integer and bool.
        tensors = {name: array if array.dtype.kind in "biu" else array.astype(cast) for name, array in stored.items()}
        config["torch_dtype"] = dtype
    tensors = int8_weights.quantize(tensors, list(int8))  # after the widening: a stored head can be re-stored
    with staging.staged_directory(dst) as staged:
        hf_files.save_tensors(tensors, staged / "model.safetensors", metadata={"format": "pt"})
        (staged / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    src, dst = Path(args.src).expanduser(), Path(args.dst).expanduser()
    try:
        if not src.exists():
            raise FileNotFoundError(f"{src} does not exist")
        if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
            raise FileExistsError(f"{dst} already exists and is not an empty directory")
        staging.remove_stale(dst.parent, f".{dst.name}.")  # what killed conversions to dst left
        if is_head(src):
            convert_head(src, dst, args.target, args.dtype, tuple(name for name in args.int8.split(",") if name))
            kind = "EAGLE head"
        elif args.int8:
            raise ValueError("--int8 applies to EAGLE heads only")
        else:
            convert_target(src, dst, args.dtype or "float32")
            kind = "target"
    except (hf_files.CheckpointError, FileNotFoundError, FileExistsError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # reading the source failed (writes fail as CheckpointError, leaving nothing)
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {kind} to {dst}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
