"""`python -m eagle_jax.serve`: an OpenAI-compatible HTTP server (needs `pip install -e ".[serve]"`).

    python -m eagle_jax.serve --max-num-seqs 16 --host 127.0.0.1 --port 8000
    python -m eagle_jax.serve --model path/to/hf-llama --draft path/to/eagle3-head --num-speculative-tokens 4

Flags share their names with `python -m eagle_jax.generate`. The engine runs in a process of its
own beside the HTTP process (`serve/engine_process.py`), which listens once the model is loaded;
the server compiles every program it will run before `/health` answers 200; SIGTERM (or Ctrl-C)
stops taking requests, finishes those in flight, then exits.
"""

from __future__ import annotations

import argparse
import os
import sys

from eagle_jax.cli import errors as script_errors
from eagle_jax.serve.launch import build, served_name


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eagle_jax.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF directory, converted directory or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", help="the model id clients send (default: the model's directory name)")
    parser.add_argument("--draft", help="EAGLE head directory; 'none' disables (default: the shipped head with the "
                                        "default model)")
    parser.add_argument("--method", choices=["eagle", "eagle3"], help="which shipped head")
    parser.add_argument("--num-speculative-tokens", type=int,
                        help="k drafted tokens per step; 0 = plain decoding (default: the measured best k for as "
                             "many running requests as each call holds, eagle_jax/heads/defaults.json)")
    parser.add_argument("--speculative-disable-by-batch-size", type=int, metavar="N")
    parser.add_argument("--max-num-seqs", "--batch-size", dest="batch_size", type=int, default=16,
                        help="decode slots (requests decoded together)")
    parser.add_argument("--max-length", type=int, default=2048, help="KV cache per slot: prompt + new tokens")
    parser.add_argument("--max-queue", type=int, default=1024, help="requests waiting for a slot before a 429")
    parser.add_argument("--steps-per-call", type=int, default=16,
                        help="decode steps per device call: waiting requests are prefilled between calls")
    parser.add_argument("--temperature", type=float, default=0.0, help="the temperature of a request that sends "
                                                                       "none (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="the top_p of a request that sends none")
    parser.add_argument("--seed", type=int, default=0, help="the key of requests without a seed of their own")
    parser.add_argument("--max-logprobs", type=int, default=20, help="the most alternatives a request's logprobs "
                                                                     "(top_logprobs) may ask for, 0..20 (vLLM's)")
    parser.add_argument("--greedy-only", action="store_true",
                        help="compile the plain argmax programs: requests that sample, penalise, ask for logprobs "
                             "or min_tokens are refused (by default every request setting is served, per request)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--decode-kernels", choices=("auto", "xla", "pallas", "pallas_linear"), default="auto")
    parser.add_argument("--cache-dir", help="compilation cache root (default: $EAGLE_JAX_CACHE_DIR/xla)")
    parser.add_argument("--gil-switch-interval", type=_positive_seconds, default=0.0005, metavar="SECONDS",
                        help="Python's thread switch interval in the server's processes (sys.setswitchinterval; "
                             "Python's default is 0.005): how long the device loop may wait for the interpreter "
                             "after a device call while another thread runs")
    parser.add_argument("--engine-in-process", action="store_true",
                        help="run the engine in the HTTP process, as one process (by default it runs in a process "
                             "of its own, so that the device loop never waits for the interpreter behind the HTTP "
                             "handlers)")
    parser.add_argument("--profile-dir", metavar="DIR",
                        help="adds POST /start_profile and /stop_profile, which write a jax.profiler trace "
                             "(TensorBoard, Perfetto) of the device loop between them into DIR")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    return parser.parse_args(argv)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1 second, got {text}")
    return value


def main(argv=None) -> int:
    """Runs the server until SIGTERM; bad flags or files print `error: ...` and return 2."""
    return script_errors.run(lambda: serve(argv))


def serve(argv=None) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ModuleNotFoundError as error:
        script_errors.fail(f"the server needs {error.name}; install it with: pip install -e \".[serve]\"")
    from eagle_jax.serve import engine_process, server

    args = parse_args(argv)
    # The device thread releases the interpreter while a device call runs and needs it back the
    # moment the call returns; with Python's 5 ms interval it can wait that long behind the other
    # threads at every call (on an H100 at 16 slots, 0.5 ms served 8% more tokens/s in a closed
    # loop with the engine in the HTTP process: docs/serving.md). The engine process sets it too.
    sys.setswitchinterval(args.gil_switch_interval)
    if args.engine_in_process:
        backend = build(args)[0]
    else:  # the spawned process imports `build` by name (`launch.build`)
        backend = engine_process.EngineProcess(build, args)
        print(f"eagle_jax: the engine runs in process {backend.process.pid}", file=sys.stderr, flush=True)
        import jax  # this process never runs a program: keep it off the accelerator the engine holds

        jax.config.update("jax_platforms", "cpu")
    name = served_name(args)
    app = server.create_app(backend, name, args.profile_dir)
    print(f"eagle_jax: serving {name} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=600)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
