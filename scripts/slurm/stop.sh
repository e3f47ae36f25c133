#!/usr/bin/env bash
# Stop the daemons that start.sh started, by the PIDs it recorded (in reverse start order), for the instance
# that common.sh describes (MR_SLURM_INSTANCE=multinode: the private multi-node one).
# Daemons it did not start (e.g. a munged that was already running) are left alone. Idempotent.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"
mkdir -p "$STATE"
exec 9>"$STATE/.lock"
flock 9

# Also node daemons of another layout (the node list changed since they were started): stopped first.
names=("${DAEMONS[@]}")
for file in "$STATE"/run/slurmd*.pid; do
  [[ -e $file ]] || continue
  name=$(basename "$file" .pid)
  [[ " ${names[*]} " == *" $name "* ]] || names+=("$name")
done
for ((i = ${#names[@]} - 1; i >= 0; i--)); do
  name=${names[i]}
  pid=$(pid_of "$name")
  if [[ -n $pid ]]; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do [[ -z $(pid_of "$name") ]] && break; sleep 0.1; done
    if [[ -n $(pid_of "$name") ]]; then kill -KILL "$pid" 2>/dev/null || true; sleep 0.2; fi
    log "stopped $name (pid $pid)"
  fi
  rm -f "$STATE/run/$name.pid"
done
