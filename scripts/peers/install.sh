#!/usr/bin/env bash
# The peers' own code, for the compatibility tests (tests/peers.py): what Megatron-Bridge and NeMo 2.0 users run.
#
#   .venv-peers/bridge/   megatron-bridge's wheel, unpacked: its plugins (recipes/run_plugins.py), its Hydra
#                         override parser (training/utils/omegaconf_utils.py) and config sources
#   .venv-peers/hydra/    hydra-core, omegaconf and antlr4 (the parser's dependencies the main .venv lacks)
#   .venv-peers/nemo/     the nemo_toolkit wheel's plugin, callback and llm.pretrain sources (read, not imported:
#                         they need Lightning)
#
# Why unpack: megatron-bridge declares Python 3.12 and dozens of heavy dependencies; the modules the tests load are
# pure Python and run on 3.11 with the few above (its package __init__ and config module import Transformer
# Engine, which is CUDA only, so the tests load those modules one by one). Megatron-LM's argument parser comes
# with megatron-core 0.19.2 in the newest lane (scripts/newest/install.sh).
#
# Usage: scripts/peers/install.sh   (idempotent; ~10 MB; prints the folder)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
TARGET=.venv-peers
exec 9>"$TARGET.lock"  # several pytest workers may ask at once: one installs, the others wait and reuse it
flock 9
PINS="megatron-bridge==0.6.2 nemo_toolkit==2.7.3 hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3"
if [ -f "$TARGET/.installed" ] && [ "$(cat "$TARGET/.installed")" = "$PINS" ]; then
    echo "$TARGET"; exit 0
fi
rm -rf "$TARGET" "$TARGET.wheels"
mkdir -p "$TARGET/bridge" "$TARGET/hydra" "$TARGET/nemo" "$TARGET.wheels"
pip_q=(-q --disable-pip-version-check --no-deps)
"$PY" -m pip download "${pip_q[@]}" --ignore-requires-python --python-version 3.12 --only-binary=:all: \
    -d "$TARGET.wheels" megatron-bridge==0.6.2 nemo_toolkit==2.7.3
"$PY" -m zipfile -e "$TARGET.wheels"/megatron_bridge-0.6.2-*.whl "$TARGET/bridge"
"$PY" - "$TARGET.wheels" "$TARGET/nemo" <<'PYEOF'
import glob, sys, zipfile
wanted = ("nemo/lightning/run/plugins.py", "nemo/lightning/pytorch/callbacks/preemption.py", "nemo/collections/llm/api.py")
with zipfile.ZipFile(glob.glob(f"{sys.argv[1]}/nemo_toolkit-2.7.3-*.whl")[0]) as whl:
    for name in wanted:
        whl.extract(name, sys.argv[2])
PYEOF
"$PY" -m pip install "${pip_q[@]}" --target "$TARGET/hydra" hydra-core==1.3.2 omegaconf==2.3.0 \
    antlr4-python3-runtime==4.9.3
rm -rf "$TARGET.wheels"
echo "$PINS" > "$TARGET/.installed"
echo "$TARGET"
