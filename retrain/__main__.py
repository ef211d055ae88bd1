"""`python -m retrain`: the `retrain` command, also what torchrun starts on every rank
(`torchrun --nproc-per-node N -m retrain config.toml`; docs/distributed.md)."""

import sys

from retrain.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
