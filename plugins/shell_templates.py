"""The shell this package adds to a job's sbatch script, kept in template files (``plugins/templates/*.j2``).

Shell in Python strings is hard to read and to review; in a file of its own it reads as the shell it is, with a few
Jinja placeholders and blocks (every value shell-quoted by the caller). Jinja is nemo_run's
own template engine (its sbatch script is a Jinja template too), so this adds no dependency.
"""

from __future__ import annotations

import functools
import os
from typing import Any

TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")


@functools.lru_cache(maxsize=None)
def _environment() -> Any:
    import jinja2

    # trim_blocks/lstrip_blocks: a line holding only a block tag leaves no line behind; StrictUndefined: a
    # placeholder the caller forgot fails at render time instead of leaving an empty word in the script
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), trim_blocks=True, lstrip_blocks=True,
                              keep_trailing_newline=False, undefined=jinja2.StrictUndefined, autoescape=False)


def render_shell(name: str, **values: Any) -> str:
    """The template ``plugins/templates/<name>`` filled in: lines for ``executor.setup_lines``, without a final
    newline (the caller joins blocks)."""
    return _environment().get_template(name).render(**values).rstrip("\n")
