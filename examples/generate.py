"""Generate through the library: a target, its EAGLE-3 head, an `EngineConfig`, `Engine.generate`.

    python examples/generate.py --prompt "Write a haiku about the sea."

Without --model it loads the default model (SmolLM2-135M-Instruct) and its shipped EAGLE-3 head.
"""

import argparse

import eagle_jax
from eagle_jax import heads
from eagle_jax.io import tokenization


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF or converted model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", help="EAGLE head directory (default: the shipped EAGLE-3 head)")
    parser.add_argument("--prompt", default="Write a haiku about the sea.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    args = parser.parse_args(argv)
    target, tokenizer_dir = eagle_jax.load_target(args.model, "float32")
    head = eagle_jax.load_head(args.draft or heads.shipped_head("eagle3"), target)
    tokenizer = tokenization.load(tokenizer_dir)
    engine = eagle_jax.Engine(target, head, eagle_jax.EngineConfig(num_speculative_tokens=args.num_speculative_tokens))
    ids = tokenization.encode(tokenizer, args.prompt, chat=True)
    [result] = engine.generate([ids], max_new_tokens=args.max_new_tokens, sampling=eagle_jax.Sampling())
    print(tokenizer.decode(result.token_ids, skip_special_tokens=True))
    print(f"{result.num_tokens} tokens, acceptance length {result.stats['acceptance_length']:.2f}")


if __name__ == "__main__":
    main()
