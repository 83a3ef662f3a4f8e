"""Writes a converted model of a config.json's shapes with random weights and a word-level tokenizer.

For timing what weights do not change (a server's step, its kernels) where the real model is not
at hand: `python -m eagle_jax.serve --model OUT/model --draft HEAD` serves it as it would serve
the real one, with any head of the same shapes as the draft (`eagle_jax/heads/...` for SmolLM2).
Its tokens mean nothing, so neither does its acceptance. The tokenizer is the server tests' one
(`tests.cli.test_generate_cli`), widened to the config's vocabulary: ids 1 and 2 are bos and eos.

    python benchmarks/random_model.py --config config.json --out /tmp/random_model
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests.cli.test_generate_cli`, whose tokenizer the model takes
    sys.path.insert(0, str(ROOT))


def write(config_json: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """The converted model directory (OUT/model), tokenizer included."""
    from eagle_jax.io import models
    from tests.cli import test_generate_cli

    config = json.loads(Path(config_json).read_text())
    source = out / "source"
    source.mkdir(parents=True, exist_ok=True)
    (source / "config.json").write_text(json.dumps(config))
    test_generate_cli.save_tokenizer(source, config["vocab_size"])
    target = models.random_target(source / "config.json")
    return models.save_converted(target, source, out / "model", dtype=dtype)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="an HF config.json (a Llama's)")
    parser.add_argument("--out", required=True, help="folder to write (its model/ must not exist yet)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    print(write(Path(args.config), Path(args.out), args.dtype))


if __name__ == "__main__":
    main()
