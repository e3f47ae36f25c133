"""Login-node rule: plugins, recipes and the trainer's command-line checks run without torch or megatron.

Each check runs in a fresh interpreter and reads ``sys.modules`` there, so an import of torch anywhere on the
path (directly or through a dependency such as nemo_run) makes it fail.
"""

import json
import subprocess
import sys

HEAVY = "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))"


def test_plugins_and_recipes_do_not_import_torch_or_megatron():
    code = (
        "import sys\n"
        "import megatron_resilience, megatron_resilience.plugins, megatron_resilience.recipes\n"
        f"print({HEAVY})\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_dashboards_and_the_reports_tensorboard_scalars_stay_torch_free():
    """The login node's report writes TensorBoard scalars with the tensorboard package's own writer (tensorboardX
    would import torch): importing the dashboards and writing an event file loads neither torch nor wandb."""
    code = (
        "import sys, tempfile\n"
        "from megatron_resilience.report import cli as report_cli\n"
        "from megatron_resilience.dashboards import Point\n"
        "from megatron_resilience.dashboards.tensorboard import EventWriter\n"
        "w = EventWriter(tempfile.mkdtemp()); w.write([Point('goodput/goodput-percent', 50.0, 3)]); w.close()\n"
        f"print({HEAVY}, 'wandb' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] False"


def test_command_line_rejects_a_bad_key_before_importing_torch():
    """``python -m megatron_resilience`` with a typo exits 1 with the key's message, and torch was never imported."""
    code = (
        "import json, runpy, sys\n"
        "sys.argv = ['megatron_resilience', 'run_dir=/tmp/r', 'train.max_step=3']\n"
        "try:\n"
        "    runpy.run_module('megatron_resilience', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as stop:\n"
        f"    print(json.dumps({{'exit': str(stop.code), 'heavy': {HEAVY}}}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["exit"].startswith("megatron_resilience: train.max_step: unknown key; did you mean train.max_steps? "
                                     "valid keys in train:")
    assert result["heavy"] == []
