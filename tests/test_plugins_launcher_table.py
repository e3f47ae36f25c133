"""The version table in ``megatron_resilience/upstream/launcher.py`` against the releases it describes.

Each row (which release has which ft_launcher flag, how a setting reaches ft_launcher, which spellings of
nemo_run's FT flags a release accepts, which restart policies it takes) is checked against the real
argument parser and FaultToleranceConfig of nvidia-resiliency-ext 0.4.1 (installed), 0.6.0 and 0.7.0
(unpacked here, ``tests/nvrx_releases.py``). A row that is wrong for any of them fails here. 0.5.x is
not loaded (its rows were read from its source at tag v0.5.0; the table's 0.5 claims are its
``--ft-use-infra-group-rank`` and the removal of ``--ignore-missing-fault-tol-cfg``, both bounded by the
0.4.1 and 0.6.0 checks from either side).
"""

from __future__ import annotations

import re

import pytest
from nvrx_releases import RELEASES, options

from megatron_resilience.upstream import (
    NEMO_RUN_FT_PARAM_FIELDS,
    ft_cfg_path_env,
    ft_launcher_accepts_ignore_missing_cfg,
    ft_param_flags,
    parse_version,
)
from megatron_resilience.upstream.launcher import LAUNCHER_SETTINGS, restart_policies


@pytest.mark.parametrize("release", RELEASES)
def test_which_release_has_which_flag(release):
    table, version = options(release), parse_version(release)
    wrong = [(s.field, s.flag, s.available(version)) for s in LAUNCHER_SETTINGS
             if s.flag is not None and (s.flag in table) != s.available(version)]
    assert wrong == [], f"nvidia-resiliency-ext {release}: (field, flag, table says available) contradicted: {wrong}"


@pytest.mark.parametrize("release", RELEASES)
def test_each_setting_reaches_ft_launcher_the_way_the_table_says(release):
    """yaml: a FaultToleranceConfig field of that release; env: the parser reads PET_<DEST>; flag: the command
    line only (no environment variable), and where the table keeps a config-file setting on the command line
    (0.6.x progress settings) it is because that release's command-line default is not None (it would win)."""
    table, version = options(release), parse_version(release)
    fields = table["__config_fields__"]
    for s in (s for s in LAUNCHER_SETTINGS if s.available(version) and s.flag):
        action, channel = table[s.flag], s.channel(version)
        if channel == "yaml":
            assert s.yaml_key in fields, (release, s.field)
            assert action["default"] is None, (release, s.field, "a command-line default overrides the YAML")
        elif channel == "env":
            assert action["env"] and s.env == f"PET_{action['dest'].upper()}", (release, s.field, action)
        else:
            assert not action["env"], (release, s.field, "has an env fallback: the flag channel is not needed")
            if s.yaml_key:
                assert s.yaml_key in fields and action["default"] is not None, (release, s.field, action)


@pytest.mark.parametrize("release", RELEASES)
def test_gpus_per_numa_environment_variable(release):
    """NVRX_GPUS_PER_NUMA has no flag: the launcher's source reads it, from the release the table names."""
    with open(options(release)["__module__"]) as f:
        reads = "NVRX_GPUS_PER_NUMA" in f.read()
    setting = next(s for s in LAUNCHER_SETTINGS if s.field == "gpus_per_numa")
    assert reads == setting.available(parse_version(release))


@pytest.mark.parametrize("release", RELEASES)
def test_nemo_run_flag_spellings_config_path_and_restart_policies(release):
    table, version = options(release), parse_version(release)
    for field in NEMO_RUN_FT_PARAM_FIELDS:
        spellings = set(ft_param_flags(field, version))
        known = {opt for opt in table if re.fullmatch(rf"--ft-(param-)?{field}|--ft-{field.replace('_', '-')}", opt)}
        assert known == spellings, (release, field)
    assert ("--ignore-missing-fault-tol-cfg" in table) == ft_launcher_accepts_ignore_missing_cfg(version)
    cfg_path = table["--ft-cfg-path"]
    assert cfg_path["env"] and f"PET_{cfg_path['dest'].upper()}" == ft_cfg_path_env(version)
    assert tuple(table["--ft-restart-policy"]["choices"]) == restart_policies(version)
