# Shared by start.sh, stop.sh and render.sh: which cluster instance, where it keeps config and state, its
# layout (nodes, partitions, ports), and pid helpers.
#
# Every setting has an MR_SLURM_* override. MR_SLURM_INSTANCE=NAME first reads scripts/slurm/NAME.env, a
# preset for a second, private cluster next to the default one (its own config dir, state dir, ports,
# MariaDB and slurmdbd): `MR_SLURM_INSTANCE=multinode scripts/slurm/start.sh`. Values set in the
# environment win over the preset.
#
# Layout: NODES compute nodes in the default partition $PARTITION, plus FAULT_NODES nodes that only the
# partition $FAULT_PARTITION reaches ($FAULT_PARTITION spans every node). Tests that take a node DOWN use
# those reserved nodes, so no other test's job runs there. With NODES=1 and FAULT_NODES=0 (the default)
# the one node is `localhost` and the rendered config is the single-node one. With more, every node is a
# slurmd of its own (Debian's slurm-wlm is built with MULTIPLE_SLURMD): NodeName=$NODE_PREFIX<i>, its own
# port, spool dir, pid and log file, and its own cgroup (/slurm_<node>, under proctrack/cgroup), running in a UTS
# namespace named after its node (its job steps see that host name; start.sh maps the names in /etc/hosts).
HERE=${HERE:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
if [[ -n ${MR_SLURM_INSTANCE:-} ]]; then
  [[ -f $HERE/$MR_SLURM_INSTANCE.env ]] || { echo "scripts/slurm: no preset $HERE/$MR_SLURM_INSTANCE.env" >&2; exit 2; }
  source "$HERE/$MR_SLURM_INSTANCE.env"
fi
STATE=${MR_SLURM_STATE_DIR:-/var/tmp/mr-slurm}
CONF_DIR=${MR_SLURM_CONF_DIR:-/etc/slurm}  # client tools find it through SLURM_CONF (exported below)
CLUSTER=${MR_SLURM_CLUSTER:-mrlocal}
# Job ids of this instance start here: two instances on one machine never hand out the same id, so their jobs never
# share a port block (config/ports.py derives a job's ports from its id, as on a real cluster where ids are unique).
FIRST_JOB_ID=${MR_SLURM_FIRST_JOB_ID:-1}
PARTITION=debug
FAULT_PARTITION=faults
NODES=${MR_SLURM_NODES:-1}
FAULT_NODES=${MR_SLURM_FAULT_NODES:-0}
NODE_PREFIX=${MR_SLURM_NODE_PREFIX:-node}
CTLD_PORT=${MR_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${MR_SLURM_SLURMD_PORT:-6818}       # the single node's port
NODE_PORT_BASE=${MR_SLURM_NODE_PORT_BASE:-6830}  # multi-node layout: node <i> listens on NODE_PORT_BASE + i
DBD_PORT=${MR_SLURM_DBD_PORT:-6819}
DB_PORT=${MR_SLURM_DB_PORT:-33061}
export SLURM_CONF=$CONF_DIR/slurm.conf  # also tells slurmdbd and slurmd where slurmdbd.conf and cgroup.conf are

for _var in NODES FAULT_NODES CTLD_PORT SLURMD_PORT NODE_PORT_BASE DBD_PORT DB_PORT; do
  [[ ${!_var} =~ ^[0-9]+$ ]] || { echo "scripts/slurm: MR_SLURM_$_var must be a whole number, got '${!_var}'" >&2; exit 2; }
done
((NODES >= 1)) || { echo "scripts/slurm: MR_SLURM_NODES must be >= 1, got $NODES" >&2; exit 2; }

multi_node() { ((NODES + FAULT_NODES > 1)); }
# all_nodes / partition_nodes / fault_nodes: node names, one per line.
all_nodes() {
  if multi_node; then seq -f "$NODE_PREFIX%g" 1 $((NODES + FAULT_NODES)); else echo localhost; fi
}
partition_nodes() { all_nodes | head -n "$NODES"; }
fault_nodes() { all_nodes | tail -n +$((NODES + 1)); }
join_nodes() { paste -sd, -; }

# Daemons in start order (stop goes in reverse). One slurmd per node: pid file slurmd-<node>.pid (multi-node).
slurmd_daemons() {
  if multi_node; then all_nodes | sed 's/^/slurmd-/'; else echo slurmd; fi
}
mapfile -t DAEMONS < <(printf '%s\n' munged mariadbd slurmdbd slurmctld; slurmd_daemons)

log() { echo "scripts/slurm: $*" >&2; }

# pid_of NAME -> prints the pid recorded for NAME if that process is alive and is that daemon, else nothing.
# NAME is a daemon (slurmctld) or a daemon with its node (slurmd-node1); the process name is the part before '-'.
pid_of() {
  local name=$1 file=$STATE/run/$1.pid pid
  [[ -s $file ]] || return 0
  pid=$(<"$file")
  [[ $pid =~ ^[0-9]+$ ]] || return 0
  [[ -r /proc/$pid/comm && $(</proc/$pid/comm) == "${name%%-*}" ]] && echo "$pid"
  return 0
}
