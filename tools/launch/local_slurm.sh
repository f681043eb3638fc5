#!/usr/bin/env bash
# A Slurm cluster of one node on this machine, for trying --cluster=slurm (and its test) without a cluster:
# munged, slurmctld and slurmd of Debian's slurm-wlm and munge packages, run as the current user, with every
# file of theirs under one folder.
#
#   tools/launch/local_slurm.sh start FOLDER   # prints `export SLURM_CONF=FOLDER/slurm.conf`; then srun -n2 ...
#   tools/launch/local_slurm.sh stop FOLDER
#
# The node offers every CPU of the machine; tasks are not confined (no cgroups), as in a container.
set -euo pipefail
action=${1:-}
folder=${2:-}
if [[ -z "$action" || -z "$folder" ]]; then
  echo "usage: $0 start|stop FOLDER" >&2
  exit 2
fi
for program in munged slurmctld slurmd srun sinfo; do
  if ! command -v "$program" >/dev/null 2>&1 && [[ ! -x "/usr/sbin/$program" ]]; then
    echo "error: $program not found: install Slurm and munge (Debian: apt-get install slurm-wlm munge)" >&2
    exit 3
  fi
done
export PATH="$PATH:/usr/sbin"
mkdir -p "$folder"
folder=$(cd "$folder" && pwd)

stop() {
  for name in slurmd slurmctld munged; do
    if [[ -f "$folder/$name.pid" ]]; then
      kill "$(cat "$folder/$name.pid")" 2>/dev/null || true
      rm -f "$folder/$name.pid"
    fi
  done
}

if [[ "$action" == stop ]]; then
  stop
  exit 0
fi
if [[ "$action" != start ]]; then
  echo "error: unknown action $action (start or stop)" >&2
  exit 2
fi

user=$(id -un)
node=$(hostname -s)
cpus=$(nproc)
memory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
mkdir -p "$folder/munge" "$folder/spool" "$folder/state" "$folder/log"
chmod 700 "$folder/munge"
if [[ ! -f "$folder/munge/munge.key" ]]; then
  dd if=/dev/urandom of="$folder/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$folder/munge/munge.key"
fi
munge_socket="$folder/munge/munge.socket"
munged --key-file="$folder/munge/munge.key" --socket="$munge_socket" --pid-file="$folder/munged.pid" \
  --log-file="$folder/log/munged.log" --seed-file="$folder/munge/munge.seed" --force

cat > "$folder/slurm.conf" <<CONF
ClusterName=local
SlurmctldHost=$node
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
AuthInfo=socket=$munge_socket
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldPidFile=$folder/slurmctld.pid
SlurmdPidFile=$folder/slurmd.pid
SlurmdSpoolDir=$folder/spool
StateSaveLocation=$folder/state
SlurmctldLogFile=$folder/log/slurmctld.log
SlurmdLogFile=$folder/log/slurmd.log
SlurmctldPort=$(( 6817 + RANDOM % 1000 * 2 ))
SlurmdPort=$(( 7817 + RANDOM % 1000 * 2 ))
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$node CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
export SLURM_CONF="$folder/slurm.conf"
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 1 60); do
  if sinfo -h -o '%T' 2>/dev/null | grep -q -E '^(idle|mixed|allocated)'; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 0.5
done
echo "error: the Slurm node did not come up within 30 s; see $folder/log" >&2
stop
exit 4
