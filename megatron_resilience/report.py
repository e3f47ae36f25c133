"""``python -m megatron_resilience.report RUN_DIR``: the run's chain of attempts, goodput/badput, PNG timeline.

See :mod:`megatron_resilience.jobs.report`.
"""

import sys

from megatron_resilience.jobs.report_cli import main

if __name__ == "__main__":
    sys.exit(main())
