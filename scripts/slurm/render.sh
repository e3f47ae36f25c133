#!/usr/bin/env bash
# Render the cluster's config files (slurm.conf, cgroup.conf, slurmdbd.conf) into OUTDIR for the layout
# that common.sh describes; start.sh installs them into $CONF_DIR when they differ. Reads the database
# password from $STATE/db.pass (start.sh creates it). Touches nothing else: `render.sh /tmp/x` shows what
# start.sh would write, e.g. to compare a changed layout with the running config before restarting it.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"
OUT=${1:?usage: render.sh OUTDIR}
mkdir -p "$OUT"
DB_PASS=$(cat "$STATE/db.pass" 2>/dev/null || true)

# Lines that differ between layouts. The single-node layout with default ports renders the same text as
# before multi-node support existed, so a running default cluster is not restarted by this change.
node_lines() {
  local node i=0
  if ! multi_node; then
    echo "NodeName=localhost NodeAddr=127.0.0.1 CPUs=16 Boards=1 SocketsPerBoard=1 CoresPerSocket=16 ThreadsPerCore=1 RealMemory=16000 State=UNKNOWN"
    echo "PartitionName=$PARTITION Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
    return
  fi
  echo "# One slurmd per node on this machine, each on its own port (MULTIPLE_SLURMD build)."
  # Weight (multi-node only, so the single-node text stays as it was): Slurm allocates the lowest-Weight usable
  # node first, so a test's job in $FAULT_PARTITION starts on the reserved node it then takes DOWN, while a
  # later attempt (that node down or excluded) still runs on any other node; the default partition is unchanged.
  echo "# Weight: a job of partition $FAULT_PARTITION starts on a reserved node while one is usable (lowest first)."
  local weight
  while read -r node; do
    i=$((i + 1))
    weight=2; ((i > NODES)) && weight=1
    echo "NodeName=$node NodeAddr=127.0.0.1 Port=$((NODE_PORT_BASE + i)) CPUs=16 Boards=1 SocketsPerBoard=1 CoresPerSocket=16 ThreadsPerCore=1 RealMemory=16000 State=UNKNOWN Weight=$weight"
  done < <(all_nodes)
  echo "PartitionName=$PARTITION Nodes=$(partition_nodes | join_nodes) Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  if ((FAULT_NODES > 0)); then
    echo "# Every node, incl. the reserved ones no job of the default partition runs on: tests that take a node DOWN."
    echo "PartitionName=$FAULT_PARTITION Nodes=$(all_nodes | join_nodes) MaxTime=INFINITE State=UP OverSubscribe=NO"
  fi
}
ctld_port_line() {
  ((CTLD_PORT == 6817)) || echo "SlurmctldPort=$CTLD_PORT"
  multi_node || ((SLURMD_PORT == 6818)) || echo "SlurmdPort=$SLURMD_PORT"
}
slurm_dbd_port_line() { ((DBD_PORT == 6819)) || echo "AccountingStoragePort=$DBD_PORT"; }
dbd_port_line() { ((DBD_PORT == 6819)) || echo "DbdPort=$DBD_PORT"; }

# render TEMPLATE PORT_LINE_FUNCTION: placeholders in lines, whole-line blocks (@NODES@, @*_PORT_LINE@).
render() {
  local layout="Single-node" node_dir="" node_suffix=""
  if multi_node; then layout="Multi-node ($((NODES + FAULT_NODES)) nodes)"; node_dir="/%n"; node_suffix="-%n"; fi
  local line
  while IFS= read -r line || [[ -n $line ]]; do
    case $line in
      @NODES@) node_lines ;;
      @CTLD_PORT_LINE@) ctld_port_line ;;
      @DBD_PORT_LINE@) "$2" ;;
      *) line=${line//@STATE@/$STATE}; line=${line//@CLUSTER@/$CLUSTER}; line=${line//@FIRST_JOB_ID@/$FIRST_JOB_ID}; line=${line//@PARTITION@/$PARTITION}
         line=${line//@DB_PORT@/$DB_PORT}; line=${line//@DB_PASS@/$DB_PASS}; line=${line//@LAYOUT@/$layout}
         line=${line//@NODE_DIR@/$node_dir}; line=${line//@NODE_SUFFIX@/$node_suffix}
         printf '%s\n' "$line" ;;
    esac
  done <"$1"
}
render "$HERE/slurm.conf.in" slurm_dbd_port_line >"$OUT/slurm.conf"
render "$HERE/cgroup.conf.in" dbd_port_line >"$OUT/cgroup.conf"
(umask 077; render "$HERE/slurmdbd.conf.in" dbd_port_line >"$OUT/slurmdbd.conf")
