#!/usr/bin/env bash
# Install a single-node Slurm cluster's packages from Debian (slurm-wlm 22.05 on Debian 12):
# munge, slurmctld, slurmd, the client tools, slurmdbd and a MariaDB server (sacct needs accounting,
# and nemo_run polls job status with sacct). Idempotent: returns in milliseconds when installed.
# Needs root (CI runs as root). Daemons are NOT started here (no systemd): see start.sh.
set -euo pipefail

PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
BINARIES=(munged slurmctld slurmd sbatch sacct scontrol slurmdbd mariadbd mariadb-install-db)

missing=()
for bin in "${BINARIES[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || [[ -x /usr/sbin/$bin ]] || missing+=("$bin")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
  echo "scripts/slurm/install.sh: missing ${missing[*]}; installing needs root" >&2
  exit 1
fi

echo "scripts/slurm/install.sh: installing ${PACKAGES[*]} (missing: ${missing[*]})" >&2
# Keep package scripts from starting daemons (there is no init system to own them; start.sh does).
created_policy=0
if [[ ! -e /usr/sbin/policy-rc.d ]]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  created_policy=1
fi
cleanup() { if [[ $created_policy -eq 1 ]]; then rm -f /usr/sbin/policy-rc.d; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null
echo "scripts/slurm/install.sh: installed" >&2
