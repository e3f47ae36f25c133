#!/usr/bin/env bash
# Build the "newest" lane: the newest megatron-core and nvidia-resiliency-ext (scripts/newest/pins.txt) in a
# target folder that goes first on PYTHONPATH, on top of the main .venv (torch, nemo_run, ...). Idempotent.
#
# Why not a second venv: megatron-core >= 0.17 declares Python >= 3.12 although its cp311 wheel works here, and
# nvidia-resiliency-ext >= 0.5 ships only cp312 / glibc 2.39 wheels because of one compiled CUPTI module; its
# pure-Python parts (ft_launcher, the rank monitor, the straggler package) run on Python 3.11. So the wheels are
# installed with --ignore-requires-python / unpacked, and the missing pure-Python dependencies added.
#
# Usage: scripts/newest/install.sh [TARGET]   (default: .venv-newest); prints the versions it resolved.
set -euo pipefail
cd "$(dirname "$0")/../.."
TARGET=${1:-.venv-newest}
PY=${PY:-.venv/bin/python}
PINS=scripts/newest/pins.txt
STAMP="$TARGET/.installed"
# One installer at a time: `make test` starts one in the background while its tests may ask for the lane too
# (tests/nvrx_releases.py); a second caller waits here and then finds it up to date.
exec 8>"$TARGET.lock"
flock 8
pins=$(grep -v '^#' "$PINS" | grep -v '^$')
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$pins" ]; then
    echo "newest lane: up to date in $TARGET"
else
    rm -rf "$TARGET" "$TARGET.wheels"
    mkdir -p "$TARGET" "$TARGET.wheels"
    pip_q=(-q --disable-pip-version-check --no-deps)
    nvrx=$(grep '^nvidia-resiliency-ext==' "$PINS")
    # nvidia-resiliency-ext: the cp312 wheel, unpacked (a wheel is a zip); its compiled CUPTI module stays unloadable.
    "$PY" -m pip download "${pip_q[@]}" --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_39_x86_64 -d "$TARGET.wheels" "$nvrx"
    "$PY" -m zipfile -e "$TARGET.wheels"/nvidia_resiliency_ext-*.whl "$TARGET"
    # megatron-core and triton: cp311 wheels exist; only megatron-core's metadata asks for Python 3.12.
    "$PY" -m pip install "${pip_q[@]}" --no-compile --ignore-requires-python --target "$TARGET" \
        $(grep -v -e '^#' -e '^$' -e '^nvidia-resiliency-ext' "$PINS")
    # Pure-Python dependencies of nvidia-resiliency-ext >= 0.5 that the main .venv lacks (its launcher imports them).
    "$PY" -m pip install -q --disable-pip-version-check --no-compile --target "$TARGET" defusedxml nvidia-ml-py
    rm -rf "$TARGET.wheels"
    echo "$pins" > "$STAMP"
fi
PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'PYEOF'
import importlib.metadata as md
import megatron.core, nvidia_resiliency_ext.fault_tolerance.launcher  # noqa: E401,F401  (they import here)
for name in ("torch", "megatron-core", "nvidia-resiliency-ext", "triton", "nemo-run"):
    print(f"newest lane: {name}=={md.version(name)}")
PYEOF
