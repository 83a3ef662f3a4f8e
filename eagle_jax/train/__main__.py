"""`python -m eagle_jax.train`: trains an EAGLE head (`eagle_jax.train.trainer`)."""

import sys

from eagle_jax.train import trainer

sys.exit(trainer.main())
