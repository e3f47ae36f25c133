# Shared by start.sh and stop.sh: where the cluster keeps its run-time state, and pid helpers.
# Override the state folder with MR_SLURM_STATE_DIR (config files always go to /etc/slurm, where the
# client tools and nemo_run's sbatch/sacct calls look for them).
STATE=${MR_SLURM_STATE_DIR:-/var/tmp/mr-slurm}
CLUSTER=mrlocal
PARTITION=debug
DB_PORT=${MR_SLURM_DB_PORT:-33061}
DAEMONS=(munged mariadbd slurmdbd slurmctld slurmd)  # start order; stop goes in reverse

log() { echo "scripts/slurm: $*" >&2; }

# pid_of NAME -> prints the pid recorded for NAME if that process is alive and is NAME, else nothing.
pid_of() {
  local name=$1 file=$STATE/run/$1.pid pid
  [[ -s $file ]] || return 0
  pid=$(<"$file")
  [[ $pid =~ ^[0-9]+$ ]] || return 0
  [[ -r /proc/$pid/comm && $(</proc/$pid/comm) == "$name" ]] && echo "$pid"
  return 0
}
