"""`python -m eagle_jax.train`: trains an EAGLE head, as `eagle-jax-train` does (`eagle_jax.cli.train`)."""

import sys

from eagle_jax.cli import train

sys.exit(train.main())
