#!/usr/bin/env bash
# One node's `unbroken run` under a cluster manager (Kubernetes: the container's command;
# Slurm: what each `srun` task runs):
#
#     bash deploy/unbroken-entrypoint.sh unbroken run [FLAGS] SCRIPT [ARGS...]
#
# What it adds to the command it runs, and why:
# - With UNBROKEN_WAIT_FOR_HOST set, it first waits until that name resolves (at most
#   UNBROKEN_WAIT_FOR_HOST_S seconds, default 300), on node 0 (UNBROKEN_NODE_RANK=0) to this
#   pod's own address: a headless Service's DNS record appears a moment after the pod starts,
#   and node 0's controller binds to it.
# - SIGTERM (pod deletion or eviction, `scancel`, the time limit) is passed on to `unbroken run`:
#   with --save, the job dumps its newest committed step there (at most --sigterm-dump-timeout-s,
#   default 20 s), stops its workers (SIGTERM, SIGKILL after its 3 s stop grace), removes its
#   shared memory and exits 143; a second SIGTERM stops it at once. The cluster's kill deadline
#   (Kubernetes' terminationGracePeriodSeconds, Slurm's KillWait) must be at least
#   --sigterm-dump-timeout-s + 10 s. SIGINT is passed on as SIGINT (exit 130).
# - The exit status is `unbroken run`'s: 0 finished, 1 failed (restartable), 2 bad usage,
#   97 EXIT_FATAL (a rank said "do not restart me": JobSet FailJobSet, Slurm no requeue),
#   130 interrupted, 143 terminated (restartable; resume with --load). An older unbroken that
#   exits 1 for EXIT_FATAL is mapped to 97 here from its log.
set -uo pipefail

readonly EXIT_FATAL=97

if [ "$#" -eq 0 ]; then
  echo "usage: unbroken-entrypoint.sh unbroken run [FLAGS] SCRIPT [ARGS...]" >&2
  exit 2
fi

# Wait until $1 resolves (to $2, when given), at most UNBROKEN_WAIT_FOR_HOST_S seconds.
wait_for_host() {
  local host="$1" want="${2:-}" limit_s="${UNBROKEN_WAIT_FOR_HOST_S:-300}" waited_s=0 addr
  case "$limit_s" in ''|*[!0-9]*)
    echo "unbroken-entrypoint: UNBROKEN_WAIT_FOR_HOST_S=$limit_s must be a whole number of seconds" >&2
    exit 2 ;;
  esac
  while :; do
    addr=""
    read -r addr _ < <(getent hosts "$host" 2>/dev/null) || true
    if [ -n "$addr" ] && { [ -z "$want" ] || [ "$addr" = "$want" ]; }; then
      return 0
    fi
    if [ "$waited_s" -ge "$limit_s" ]; then
      echo "unbroken-entrypoint: $host did not resolve${want:+ to the address of this pod ($want)} within" \
           "${limit_s} s (UNBROKEN_WAIT_FOR_HOST_S); check the controller's headless Service and that" \
           "node 0's pod is running" >&2
      exit 1
    fi
    sleep 1
    waited_s=$((waited_s + 1))
  done
}

if [ -n "${UNBROKEN_WAIT_FOR_HOST:-}" ]; then
  # Node 0's controller binds to that name: wait until it names this pod, not a pod of an
  # earlier attempt whose record is still around.
  own=""
  if [ "${UNBROKEN_NODE_RANK:-}" = 0 ]; then
    read -r own _ < <(getent hosts "$(hostname)" 2>/dev/null) || true
  fi
  wait_for_host "$UNBROKEN_WAIT_FOR_HOST" "$own"
fi

# stderr goes to our stderr as it comes (the pod's log) and to a file read at the end.
errlog="$(mktemp "${TMPDIR:-/tmp}/unbroken-entrypoint.XXXXXX")"
trap 'rm -f "$errlog"' EXIT
exec 3> >(tee -a "$errlog" >&2)
tee_pid=$!

# Job control on: a background command of a script without it starts with SIGINT ignored,
# and `unbroken run` would then never see the SIGINT it is sent below.
set -m
"$@" 2>&3 &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM
trap 'kill -INT "$child" 2>/dev/null' INT

# `wait` returns early (status > 128) when a trapped signal arrives: wait again until the
# child is really gone, and keep its own exit status.
rc=0
wait "$child" || rc=$?
while kill -0 "$child" 2>/dev/null; do
  rc=0
  wait "$child" || rc=$?
done
exec 3>&-
wait "$tee_pid" 2>/dev/null

if [ "$rc" -eq 1 ] && grep -q "exited with EXIT_FATAL" "$errlog"; then
  echo "unbroken-entrypoint: exit $EXIT_FATAL (EXIT_FATAL): the job failed on a fatal error; do not restart it" >&2
  exit "$EXIT_FATAL"
fi
exit "$rc"
