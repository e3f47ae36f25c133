"""``python -m megatron_resilience.watch RUN_DIR``: watch a run's chain of Slurm attempts (see watch/watcher.py)."""

import sys

from megatron_resilience.watch.cli import main

if __name__ == "__main__":
    sys.exit(main())
