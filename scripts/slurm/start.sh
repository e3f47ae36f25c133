#!/usr/bin/env bash
# Start (installing first if needed) the test cluster that common.sh describes: munged, a private MariaDB,
# slurmdbd, slurmctld and one slurmd per node, started directly (no systemd) with their PIDs recorded
# under $STATE/run. The default is the single-node cluster in /etc/slurm; MR_SLURM_INSTANCE=multinode starts
# a private multi-node one beside it (see common.sh). Idempotent: a running, healthy cluster with unchanged
# config is reused in well under a second; a changed config restarts that instance only.
# Prints nothing on stdout but `key=value` lines describing the cluster (for tests and notebooks).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"

bash "$HERE/install.sh"
mkdir -p "$STATE"/{run,log,ctld,slurmd}
chmod 755 "$STATE"
exec 9>"$STATE/.lock"
flock 9

describe() {
  echo "cluster=$CLUSTER"
  echo "partition=$PARTITION"
  echo "state_dir=$STATE"
  echo "slurm_conf=$SLURM_CONF"
  echo "nodes=$(partition_nodes | join_nodes)"
  if ((FAULT_NODES > 0)); then
    echo "fault_partition=$FAULT_PARTITION"
    echo "fault_nodes=$(fault_nodes | join_nodes)"
  fi
}

fail() {
  log "$*"
  for f in "$STATE"/log/*.log; do echo "--- $f" >&2; tail -n 20 "$f" >&2 || true; done
  exit 1
}

# wait_for SECONDS WHAT COMMAND... : poll until COMMAND succeeds.
wait_for() {
  local seconds=$1 what=$2; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || fail "timed out after ${seconds}s waiting for $what"
    sleep 0.2
  done
}

node_state() { sinfo -h -N -n "$1" -o %T 2>/dev/null | head -n1; }
usable() { [[ $(node_state "$1") =~ ^(idle|mixed|allocated|completing)$ ]]; }
# The default partition's nodes must all be usable. The reserved fault nodes may be DOWN on purpose (a test).
node_usable() { local n; for n in $(partition_nodes); do usable "$n" || return 1; done; }
# Bring nodes back that are down/drained, except reserved ones a test took down (Reason=mr-test...).
resume_nodes() {
  local node state reason
  while read -r node state reason; do
    [[ $state =~ (down|drain|fail) ]] || continue
    if fault_nodes | grep -qx "$node" && [[ $reason == mr-test* ]]; then continue; fi
    scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
  done < <(sinfo -h -N -o "%N %T %E" 2>/dev/null | sort -u)
}
# Multi-node: every slurmd runs in a UTS namespace of its own named after its node, so a job step on mn2 sees the
# host name mn2 (`hostname`, os.uname()) as on a real cluster, where Megatron's rerun state machine tells hardware
# apart by it and log lines name their node. /etc/hosts maps those names to the nodes' address (NodeAddr 127.0.0.1).
node_named() { [[ $(nsenter --target "$2" --uts hostname 2>/dev/null) == "$1" ]]; }
names_ok() {
  multi_node || return 0
  local node; for node in $(all_nodes); do node_named "$node" "$(pid_of "slurmd-$node")" || return 1; done
}
HOSTS_TAG="# mr-slurm $CLUSTER"
hosts_line() { echo "127.0.0.1 $(all_nodes | xargs) $HOSTS_TAG"; }
hosts_ok() { ! multi_node || grep -qxF "$(hosts_line)" /etc/hosts; }
write_hosts() {  # rewritten in place: /etc/hosts may be a bind mount that a rename cannot replace
  local kept; kept=$(grep -vF "$HOSTS_TAG" /etc/hosts || true)
  printf '%s\n%s\n' "$kept" "$(hosts_line)" >/etc/hosts
}
all_alive() { local d; for d in "${DAEMONS[@]}"; do [[ -n $(pid_of "$d") ]] || [[ $d == munged ]] || return 1; done; }
# Any daemon this instance started still running (also node daemons of a previous node layout).
any_alive() {
  local file
  for file in "$STATE"/run/*.pid; do [[ -e $file && -n $(pid_of "$(basename "$file" .pid)") ]] && return 0; done
  return 1
}
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>/dev/null; }

# --- config: render the templates; restart everything if a file changed while running -------------------
[[ -s $STATE/db.pass ]] || { (umask 077; head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$STATE/db.pass"); }
DB_PASS=$(<"$STATE/db.pass")
RENDERED=$(mktemp -d)
bash "$HERE/render.sh" "$RENDERED"
changed=0
install_conf() {  # install_conf NAME MODE
  if ! cmp -s "$RENDERED/$1" "$CONF_DIR/$1"; then install -m "$2" "$RENDERED/$1" "$CONF_DIR/$1"; changed=1; fi
}
mkdir -p "$CONF_DIR"
install_conf slurm.conf 644
install_conf cgroup.conf 644
install_conf slurmdbd.conf 600
rm -rf "$RENDERED"

if [[ $changed -eq 0 ]] && all_alive && names_ok && hosts_ok && munge_ok && scontrol ping 2>/dev/null | grep -q UP &&
   node_usable; then
  resume_nodes
  log "already running (state in $STATE)"
  describe
  exit 0
fi
if [[ $changed -eq 1 ]] && any_alive; then
  # Every daemon, so none keeps the old config (e.g. slurmctld with the old node list).
  log "config changed: restarting"
  flock -u 9
  bash "$HERE/stop.sh"
  flock 9
fi
started=$SECONDS

# --- munge ------------------------------------------------------------------------------------------------
if ! munge_ok; then
  install -d -o munge -g munge -m 755 /run/munge
  install -d -o munge -g munge -m 700 /var/log/munge /var/lib/munge
  [[ -s /etc/munge/munge.key ]] || { mungekey --create --keyfile=/etc/munge/munge.key; chown munge:munge /etc/munge/munge.key; }
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged 9>&-  # daemons must not inherit the lock
  wait_for 10 "munged" test -s /run/munge/munged.pid
  cp /run/munge/munged.pid "$STATE/run/munged.pid"
  wait_for 10 "munge credentials" munge_ok
  log "started munged (pid $(<"$STATE/run/munged.pid"))"
fi

# --- MariaDB (private datadir, 127.0.0.1:$DB_PORT) -------------------------------------------------------
SOCK=$STATE/mysql-run/mysqld.sock
sql() { mariadb --no-defaults --socket="$SOCK" -uroot "$@"; }
if [[ -z $(pid_of mariadbd) ]]; then
  install -d -o mysql -g mysql -m 755 "$STATE/mysql" "$STATE/mysql-run"
  if [[ ! -d $STATE/mysql/mysql ]]; then
    mariadb-install-db --no-defaults --user=mysql --datadir="$STATE/mysql" --auth-root-authentication-method=socket \
      --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1 || fail "mariadb-install-db failed"
  fi
  setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$STATE/mysql" --socket="$SOCK" \
    --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve --pid-file="$STATE/mysql-run/mariadbd.pid" \
    --log-error="$STATE/log/mariadb.log" --innodb-buffer-pool-size=64M --innodb-log-file-size=64M \
    --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 9>&- &
  echo $! >"$STATE/run/mariadbd.pid"
  wait_for 60 "MariaDB" sql -e "SELECT 1"
  log "started mariadbd (pid $(<"$STATE/run/mariadbd.pid"))"
fi
for host in 127.0.0.1 localhost; do
  sql -e "CREATE USER IF NOT EXISTS 'slurm'@'$host' IDENTIFIED BY '$DB_PASS';
          ALTER USER 'slurm'@'$host' IDENTIFIED BY '$DB_PASS';
          GRANT ALL ON slurm_acct_db.* TO 'slurm'@'$host';"
done

# --- slurmdbd, then the cluster's record in it --------------------------------------------------------------
if [[ -z $(pid_of slurmdbd) ]]; then
  /usr/sbin/slurmdbd 9>&-
  wait_for 60 "slurmdbd" sacctmgr -n list cluster
  log "started slurmdbd (pid $(<"$STATE/run/slurmdbd.pid"))"
fi
if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
  sacctmgr -i add cluster "$CLUSTER" >/dev/null
fi

# --- slurmctld and slurmd ------------------------------------------------------------------------------------
if [[ -z $(pid_of slurmctld) ]]; then
  /usr/sbin/slurmctld 9>&-
  wait_for 30 "slurmctld" bash -c "scontrol ping | grep -q UP"
  log "started slurmctld (pid $(<"$STATE/run/slurmctld.pid"))"
fi
multi_node && ! hosts_ok && write_hosts
for node in $(all_nodes); do
  daemon=slurmd; multi_node && daemon=slurmd-$node
  pid=$(pid_of "$daemon")
  if multi_node && [[ -n $pid ]] && ! node_named "$node" "$pid"; then  # started before nodes had names of their own
    kill -TERM "$pid"
    for _ in $(seq 1 100); do [[ -z $(pid_of "$daemon") ]] && break; sleep 0.1; done
    rm -f "$STATE/run/$daemon.pid"
    log "restarting $daemon under its own host name"
  fi
  if [[ -z $(pid_of "$daemon") ]]; then
    mkdir -p "$STATE/slurmd/$node"
    if multi_node; then
      unshare --uts /bin/sh -c 'hostname "$1" && exec /usr/sbin/slurmd -N "$1"' sh "$node" 9>&-
    else
      /usr/sbin/slurmd -N "$node" 9>&-
    fi
    wait_for 30 "$daemon pid file" test -s "$STATE/run/$daemon.pid"
    log "started $daemon (pid $(<"$STATE/run/$daemon.pid"))"
  fi
done
resume_nodes
wait_for 30 "nodes $(partition_nodes | join_nodes) to be idle ($(sinfo -h -N -o '%N:%T' | sort -u | xargs))" node_usable
wait_for 30 "sacct" sacct -n -X
log "cluster up in $((SECONDS - started))s (state in $STATE)"
describe
