"""``python -m megatron_resilience.chaos RUN_DIR ...`` (see :mod:`megatron_resilience.chaos.cli`)."""

import sys

from megatron_resilience.chaos.cli import main

if __name__ == "__main__":
    sys.exit(main())
