"""``python -m megatron_resilience.report RUN_DIR``: the run's chain of attempts, goodput/badput, PNG timeline."""

import sys

from megatron_resilience.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
