"""The trainer's command line, for run.Script tasks and for launching by hand under torchrun or ft_launcher.

usage: python -m megatron_resilience run_dir=DIR [section.field=value ...]
       python -m megatron_resilience --help [RECIPE]   every key with its type, default and meaning
                                                       (and RECIPE's value: gpt_tiny, gpt_126m, ...)

Values are parsed by the key's type (null for None, true/false, a,b for lists). Every key and
value is checked before torch loads; the run and checkpoint folders and data paths are
checked on this machine before the model is built.
"""

from __future__ import annotations

import sys

from megatron_resilience.config.keys import key_listing
from megatron_resilience.config.overrides import config_from_overrides
from megatron_resilience.config.validate import ConfigError

PROG = "megatron_resilience"


def help_text(recipe_name: str | None = None) -> str:
    """The usage lines and the key listing; with a recipe name, the recipe's values in a column."""
    recipe = None
    if recipe_name is not None:
        from megatron_resilience.recipes import RECIPES, to_config  # imports nemo_run (never torch)

        if recipe_name not in RECIPES:
            raise ConfigError(f"--help {recipe_name}: unknown recipe; recipes: {', '.join(RECIPES)}")
        recipe = to_config(RECIPES[recipe_name]())
    return f"{__doc__.strip()}\n\n{key_listing(recipe, recipe_name)}"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args and args[0] in ("-h", "--help"):
            if len(args) > 2:
                raise ConfigError(f"{args[0]}: takes at most one recipe name, got {args[1:]}")
            print(help_text(args[1] if len(args) == 2 else None), end="")
            return
        config = config_from_overrides(args)
    except ConfigError as err:
        sys.exit(f"{PROG}: {err}")
    from megatron_resilience.trainer import run_pretraining

    run_pretraining(config)


if __name__ == "__main__":
    main()
