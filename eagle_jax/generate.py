"""`python -m eagle_jax.generate`: the generation command line (`eagle_jax.cli.generate`)."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from eagle_jax.cli import generate

    sys.exit(generate.main())
