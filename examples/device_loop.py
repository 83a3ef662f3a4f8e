"""The device programs without the host loop: `speculative.start`, then `speculative.run_steps`.

    python examples/device_loop.py --prompt "Write a haiku about the sea."

One jitted prefill and one jitted loop of greedy EAGLE steps on one prompt; the state stays on
the device between them. Without --model: SmolLM2-135M-Instruct and its shipped EAGLE-3 head.
"""

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

import eagle_jax
from eagle_jax import heads
from eagle_jax.decode import speculative
from eagle_jax.io import tokenization
from eagle_jax.decode import state as state_lib


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF or converted model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", help="EAGLE head directory (default: the shipped EAGLE-3 head)")
    parser.add_argument("--prompt", default="Write a haiku about the sea.")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    target, tokenizer_dir = eagle_jax.load_target(args.model, "float32")
    head = eagle_jax.load_head(args.draft or heads.shipped_head("eagle3"), target)
    tokenizer = tokenization.load(tokenizer_dir)
    ids = tokenization.encode(tokenizer, args.prompt, chat=True)
    # Static settings: a chain of 3 drafts, greedy, room for the prompt, the budget and one step's headroom.
    opts = state_lib.Options(k=3, max_new_tokens=args.max_new_tokens,
                             cache_length=len(ids) + args.max_new_tokens + 4)
    graph, params = nnx.split((target, head))  # jit takes arrays: the modules are merged inside
    start = jax.jit(lambda params, tokens, lengths: speculative.start(
        *nnx.merge(graph, params), tokens, lengths, jax.random.key(0), opts))
    run = jax.jit(lambda params, state: speculative.run_steps(*nnx.merge(graph, params), state,
                                                              args.max_new_tokens, opts))
    state = run(params, start(params, jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)))
    tokens = state.output[0, :int(state.num_generated[0])].tolist()
    print(tokenizer.decode(tokens, skip_special_tokens=True))
    print(f"{len(tokens)} tokens in {int(state.num_steps[0])} steps, "
          f"acceptance length {state_lib.stats(jax.device_get(state), opts)[0]['acceptance_length']:.2f}")


if __name__ == "__main__":
    main()
