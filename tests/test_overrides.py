"""`python -m megatron_resilience key=value ...`: typed overrides, exact round trip, errors that list valid keys."""

import re
import subprocess
import sys

import pytest

from megatron_resilience.config import ConfigError, PretrainConfig
from megatron_resilience.config.overrides import config_from_overrides, config_to_overrides


def test_overrides_change_exactly_the_named_fields():
    config = config_from_overrides(["run_dir=/tmp/r", "train.max_steps=7", "ft.enabled=true",
                                    "ft.simulated_fault_rank=1", "optim.lr=1e-3", "data.data_path=a,b",
                                    "checkpoint.keep_last_n=null"])
    default = PretrainConfig(run_dir="/tmp/r")
    assert config.train.max_steps == 7 and config.ft.enabled is True and config.ft.simulated_fault_rank == 1
    assert config.optim.lr == 1e-3 and config.data.data_path == ["a", "b"]
    assert config.model == default.model and config.rerun == default.rerun
    assert config.train.micro_batch_size == default.train.micro_batch_size


def test_round_trip_is_exact():
    config = config_from_overrides(["run_dir=/tmp/r", "train.max_steps=9", "straggler.enabled=true",
                                    "rerun.rerun_mode=validate_results"])
    assert config_from_overrides(config_to_overrides(config)) == config


@pytest.mark.parametrize("args, message", [
    (["run_dir=/r", "train.maxsteps=1"],
     "train.maxsteps: unknown key; did you mean train.max_steps? valid keys in train: train.max_steps, "),
    (["run_dir=/r", "trian.max_steps=1"], "trian.max_steps: unknown key; did you mean train.max_steps? sections: "
                                          "run_dir, model, parallel, data, optim, train, checkpoint, ft, straggler, "
                                          "rerun, logger (every key: python -m megatron_resilience --help)"),
    (["run_dir=/r", "model.layers=2"], "model.layers: unknown key; did you mean model.num_layers? valid keys in model"),
    (["run_dir=/r", "optim.warmup=2"], "optim.warmup: unknown key; valid keys in optim: optim.optimizer, optim.lr,"),
    (["run_dir=/r", "ft.mode=sections", "train.exit_duration_in_mins=inf"],
     "train.exit_duration_in_mins: must be a finite number, got inf"),
    (["run_dir=/r", "train.max_steps=ten"], "train.max_steps: must be an integer, got 'ten'"),
    (["run_dir=/r", "ft.enabled=maybe"], "ft.enabled: must be true or false, got 'maybe'"),
    (["run_dir=/r", "train.max_steps"], "'train.max_steps': expected key=value"),
    (["train.max_steps=3"], "run_dir: required"),
    (["run_dir=/r", "train=5"], "train: unknown key (train is a section: name one of its fields); valid keys in "
                                "train: train.max_steps, "),
    (["run_dir=/r", "rerun.rerun_mode=sometimes"],
     "rerun.rerun_mode: must be one of ['disabled', 'validate_results', 'report_stats'], got 'sometimes'"),
])
def test_bad_overrides_fail_with_the_key(args, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_overrides(args)


def test_command_line_rejects_bad_key_before_importing_torch():
    out = subprocess.run([sys.executable, "-m", "megatron_resilience", "run_dir=/tmp/r", "train.max_step=3"],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.startswith("megatron_resilience: train.max_step: unknown key; did you mean train.max_steps? "
                                 "valid keys in train:")
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
