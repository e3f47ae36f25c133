"""Login-node rule: plugins and recipes import without torch or megatron (checked in a fresh interpreter)."""

import subprocess
import sys


def test_plugins_and_recipes_do_not_import_torch_or_megatron():
    code = (
        "import sys\n"
        "import megatron_resilience, megatron_resilience.plugins, megatron_resilience.recipes\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
