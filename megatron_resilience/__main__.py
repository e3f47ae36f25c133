"""``python -m megatron_resilience run_dir=... train.max_steps=100 ft.enabled=true``

The trainer's command line, for ``run.Script`` tasks and for launching by hand
under ``torchrun`` or ``ft_launcher``. Bad keys or values fail before torch loads.
"""

from __future__ import annotations

import sys

from megatron_resilience.config._validate import ConfigError
from megatron_resilience.config.overrides import config_from_overrides


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return
    try:
        config = config_from_overrides(args)
    except ConfigError as err:
        sys.exit(f"megatron_resilience: {err}")
    from megatron_resilience.runtime.pretrain import run_pretraining

    run_pretraining(config)


if __name__ == "__main__":
    main()
