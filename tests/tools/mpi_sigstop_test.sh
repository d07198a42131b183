#!/usr/bin/env bash
# A rank that hangs (SIGSTOP: alive, silent) must not keep the job alive: the other ranks time out,
# report the failure, and after a bounded grace leave through MPI_Abort, so the launcher ends the
# whole job, the stopped rank included (docs/cluster.md, "Errors"; Note [Leaving after a failure]
# in runtime/comm/mpi_process.cc).
#
#   mpi_sigstop_test.sh MPIEXEC PIPEWRIGHT NP STOP_RANK TIMEOUT_S -- TRAIN_ARGS...
#
# Starts `MPIEXEC -np NP pipewright train TRAIN_ARGS --timeout TIMEOUT_S --json --steps <many>`,
# each rank through a wrapper that records its pid, waits until rank 0 has reported two steps,
# stops rank STOP_RANK, then checks that mpirun and every rank are gone within TIMEOUT_S + 10 s
# (the issue's bound; measured: TIMEOUT_S + 5 s), that the exit status is non-zero and that stderr
# names the stopped rank. Whatever happens, nothing it started outlives it: at the end every
# process left is resumed and killed.
set -u

if [[ $# -lt 6 || "$6" != "--" ]]; then
  echo "usage: $0 MPIEXEC PIPEWRIGHT NP STOP_RANK TIMEOUT_S -- TRAIN_ARGS..." >&2
  exit 2
fi
mpiexec=$1 bin=$2 np=$3 stop_rank=$4 timeout_s=$5
shift 6

dir=$(mktemp -d "${TMPDIR:-/tmp}/pw_sigstop.XXXXXX")
launcher_pid=
fail() {
  echo "FAIL: $*" >&2
  echo "---- stderr of the job:" >&2
  cat "$dir/err" >&2 2>/dev/null
  exit 1
}
# Alive and not a zombie (a killed rank may stay a zombie until its parent reaps it).
alive() {
  local state
  state=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [[ -n "$state" && "$state" != Z* ]]
}
cleanup() {
  local p
  for p in $(cat "$dir"/pid.* 2>/dev/null) $launcher_pid; do
    kill -CONT "$p" 2>/dev/null
    kill -KILL "$p" 2>/dev/null
  done
  rm -rf "$dir"
}
trap cleanup EXIT

cat >"$dir/wrap.sh" <<EOF
#!/usr/bin/env bash
echo \$\$ > "$dir/pid.\${OMPI_COMM_WORLD_RANK:-\${PMIX_RANK:-\${PMI_RANK:-0}}}"
exec "\$@"
EOF
chmod +x "$dir/wrap.sh"

"$mpiexec" ${PIPEWRIGHT_MPIEXEC_FLAGS:-} -np "$np" "$dir/wrap.sh" "$bin" train "$@" \
  --steps 100000000 --timeout "$timeout_s" --json >"$dir/out" 2>"$dir/err" &
launcher_pid=$!

# Wait (at most 120 s: start-up on a loaded machine) until the run is in its steady state.
for ((i = 0; i < 1200; ++i)); do
  steps=$(grep -c '"step"' "$dir/out" 2>/dev/null)
  [[ ${steps:-0} -ge 2 && -s "$dir/pid.$stop_rank" ]] && break
  alive "$launcher_pid" || fail "the job ended before rank $stop_rank was stopped"
  sleep 0.1
done
[[ ${steps:-0} -ge 2 ]] || fail "the job did not report two steps within 120 s"
victim=$(cat "$dir/pid.$stop_rank")
kill -STOP "$victim" || fail "could not stop rank $stop_rank (pid $victim)"
stopped_at=$SECONDS
echo "stopped rank $stop_rank (pid $victim)"

# The liveness bound: --timeout to notice, then the grace and the launcher's teardown.
bound=$((timeout_s + 10))
while alive "$launcher_pid" && ((SECONDS - stopped_at <= bound)); do sleep 0.2; done
alive "$launcher_pid" && fail "mpirun still alive $bound s after rank $stop_rank was stopped"
wait "$launcher_pid"
status=$?
launcher_pid=
took=$((SECONDS - stopped_at))
# Every rank is gone too (mpirun waits for them, but check rather than trust).
for ((i = 0; i < 20; ++i)); do
  left=
  for f in "$dir"/pid.*; do alive "$(cat "$f")" && left+=" ${f##*.}"; done
  [[ -z "$left" ]] && break
  sleep 0.1
done
[[ -z "$left" ]] || fail "ranks$left still alive after mpirun exited"
echo "the job ended ${took}s after the stop, exit status $status"

[[ $status -ne 0 ]] || fail "the job exited 0 although rank $stop_rank hung"
grep -q "rank $stop_rank did not reach the end of the run" "$dir/err" ||
  fail "stderr does not name the stopped rank $stop_rank"
grep -q "timed out after ${timeout_s}s" "$dir/err" || fail "stderr does not report the timeout"
echo "PASS"
