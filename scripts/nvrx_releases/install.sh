#!/usr/bin/env bash
# Unpack one nvidia-resiliency-ext release's pure-Python parts into .venv-nvrx/<release>/, to load that release's
# ft_launcher argument parser and config loader here (tests/nvrx_releases.py puts it first on PYTHONPATH, on top
# of .venv-newest, which has the pure-Python dependencies of releases >= 0.5: scripts/newest/install.sh).
#
# Why unpack: releases >= 0.5 ship cp312 / glibc 2.39 wheels only (one compiled CUPTI module); their launcher and
# config modules are pure Python and run on Python 3.11. 0.7.0 is the newest lane itself (.venv-newest).
#
# Usage: scripts/nvrx_releases/install.sh 0.6.0   (idempotent; prints the folder)
set -euo pipefail
cd "$(dirname "$0")/../.."
RELEASE=${1:?usage: $0 RELEASE (e.g. 0.6.0)}
PY=${PY:-.venv/bin/python}
TARGET=.venv-nvrx/$RELEASE
mkdir -p .venv-nvrx
exec 8>"$TARGET.lock"  # test workers may ask for the same release at once: one unpacks, the others wait
flock 8
if [ ! -f "$TARGET/.installed" ]; then
    rm -rf "$TARGET" "$TARGET.wheel"
    mkdir -p "$TARGET" "$TARGET.wheel"
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_39_x86_64 -d "$TARGET.wheel" "nvidia-resiliency-ext==$RELEASE"
    "$PY" -m zipfile -e "$TARGET.wheel"/nvidia_resiliency_ext-*.whl "$TARGET"
    rm -rf "$TARGET.wheel"
    touch "$TARGET/.installed"
fi
echo "$TARGET"
