"""`python -m eagle_jax.generate`: the generation command line (`eagle_jax.cli.generate`)."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        from eagle_jax.cli import generate
    except KeyboardInterrupt:  # Ctrl-C while jax imports (seconds): nothing has started, so no traceback
        print("interrupted", file=sys.stderr)
        sys.exit(130)

    sys.exit(generate.main())
