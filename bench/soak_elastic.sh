#!/usr/bin/env bash
# A bounded soak of `dcp launch --max-restarts` across two hosts (network namespaces joined by a veth pair, as
# tests/distributed/two_hosts_elastic.sh): one training run, FAULTS random faults injected one after another, each
# once the run has made progress since the last restart:
#   kill_rank      kill -9 of a rank (either host)
#   kill_launcher  kill -9 of a launcher (either host); the soak starts it again, as a scheduler would
#   stop_rank      SIGSTOP of a rank, left stopped beyond dist.timeout_s (its launcher ends it)
#   full_disk      the run's file system (a tmpfs) filled right after a checkpoint, freed once the run failed
#   corrupt        kill -9 of rank 0 (it writes the checkpoints), then a byte of the newest checkpoint's model.pt
#                  flipped (the restart must fall back to checkpoint.old)
# It reports each fault, the restarts it cost, the steps it lost (steps reached before it - the step resumed
# from), the wall-time overhead against the same run without faults, and whether the per-step losses and the final
# model.pt equal the fault-free run's (fp32, bit for bit). Bounded: FAULTS faults, LIMIT_S seconds in all.
#
# usage: sudo bash bench/soak_elastic.sh [FAULTS] [OUT.md]   (env: SEED=1, LIMIT_S=1500, STEPS=800, KEEP_LOGS=DIR, DCP_BINARY=build/dcp)
# Needs root (network and mount namespaces). Run it under flock /work/locks/netns.lock (and bench.lock for timing).
set -uo pipefail
cd "$(dirname "$0")/.."
FAULTS=${1:-50}
OUT=${2:-bench/results/cpu$(nproc)_$(date +%Y%m)_soak_elastic.md}
SEED=${SEED:-1}
LIMIT_S=${LIMIT_S:-1500}
STEPS=${STEPS:-800}
TIMEOUT_S=4   # dist.timeout_s
DCP=$(readlink -f "${DCP_BINARY:-./build/dcp}")   # DCP_BINARY: another build of dcp
[ -x "$DCP" ] || { echo "soak_elastic.sh: build first (bash scripts/build.sh)" >&2; exit 2; }
[[ "$FAULTS" =~ ^[0-9]+$ ]] && [ "$FAULTS" -ge 1 ] || { echo "soak_elastic.sh: FAULTS must be a whole number >= 1" >&2; exit 2; }
mkdir -p "$(dirname "$OUT")" && touch "$OUT" || { echo "soak_elastic.sh: cannot write '$OUT'" >&2; exit 2; }
OUT=$(readlink -f "$OUT")

# A private mount namespace for the tmpfs of the full-disk faults (and so that nothing is left mounted).
if [ -z "${DCP_SOAK_INNER:-}" ]; then
  exec env DCP_SOAK_INNER=1 unshare -m --propagation private bash "$0" "$FAULTS" "$OUT"
fi

NS0=dcp_s0_$$ NS1=dcp_s1_$$ IF0=dcpsa$$ IF1=dcpsb$$ ADDR0=10.215.0.1 ADDR1=10.215.0.2
T=$(mktemp -d /tmp/dcp_soak.XXXXXX)
PORT=$((20000 + $$ % 20000))
START_EPOCH=$(date +%s)
LOAD_START=$(cut -d' ' -f1 /proc/loadavg)

cleanup() {
  for ns in "$NS0" "$NS1"; do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -CONT $pids 2>/dev/null && kill -9 $pids 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
  [ -n "${KEEP_LOGS:-}" ] && cp -r "$T" "$KEEP_LOGS" 2>/dev/null
  umount "$T/disk" 2>/dev/null
  rm -rf "$T"
}
trap cleanup EXIT
trap 'echo "soak: stopped by a signal"; exit 1' INT TERM HUP
die() { echo "soak: FAIL: $*"; for f in "$T"/*.log; do echo "==== $f"; tail -n 30 "$f"; done; exit 1; }
over_time() { [ $(( $(date +%s) - START_EPOCH )) -ge "$LIMIT_S" ]; }

ip netns add "$NS0" || { echo "soak: needs root or CAP_NET_ADMIN (ip netns add)"; exit 77; }
ip netns add "$NS1" && ip link add "$IF0" type veth peer name "$IF1" && ip link set "$IF0" netns "$NS0" &&
  ip link set "$IF1" netns "$NS1" && ip -n "$NS0" addr add "$ADDR0/24" dev "$IF0" &&
  ip -n "$NS1" addr add "$ADDR1/24" dev "$IF1" && ip -n "$NS0" link set lo up && ip -n "$NS1" link set lo up &&
  ip -n "$NS0" link set "$IF0" up && ip -n "$NS1" link set "$IF1" up || die "network set-up"
mkdir -p "$T/disk" && mount -t tmpfs -o size=48m tmpfs "$T/disk" || die "cannot mount a tmpfs"

for i in $(seq 0 299); do
  text="Document $i: the quick brown fox jumps over the lazy dog. "
  for j in $(seq 1 $((i % 7))); do text+="Lorem ipsum dolor sit amet $j. "; done
  printf '{"text": "%s"}\n' "$text"
done >"$T/corpus.jsonl"
S=(--data.path="$T/corpus.jsonl" --model.d_model=32 --model.n_layers=1 --model.n_heads=2 --model.d_ff=64
   --data.max_seq_len=256 --train.micro_batch_tokens=1024 --train.global_batch_tokens=4096 --train.threads=1
   --eval.max_tokens=1024 --train.planner=static --train.cost_model=h200 --train.precision=fp32
   --train.max_steps=$STEPS --train.checkpoint_every=2 --dist.timeout_s=$TIMEOUT_S)
export OMP_NUM_THREADS=1
LAUNCH_OPTS=(--max-restarts $((FAULTS * 2 + 5)) --restart-backoff-s 0.5 --join-timeout-s 120)

# start_host K RUN_DIR LOG [OPTION ...]: host K's launcher in the background; its pid in HOST_PID[K].
declare -A HOST_PID
start_host() {
  local k=$1 run=$2 log=$3; shift 3
  local ns=$NS0; [ "$k" = 1 ] && ns=$NS1
  ip netns exec "$ns" "$DCP" launch --nproc 1 --nnodes 2 --node-rank "$k" --master-addr "$ADDR0" \
    --master-port "$PORT" --grace 2 "$@" -- train "${S[@]}" --run.dir="$run" >>"$log" 2>&1 &
  HOST_PID[$k]=$!
}
ns_of() { [ "$1" = 1 ] && echo "$NS1" || echo "$NS0"; }
rank_pid() {  # the training rank of host $1
  for p in $(ip netns pids "$(ns_of "$1")" 2>/dev/null); do
    tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q '^dcp train ' && { echo "$p"; return; }
  done
}
launcher_pid() {  # host $1's launcher: the one we started (its watcher has the same command line)
  local p=${HOST_PID[$1]}; kill -0 "$p" 2>/dev/null && echo "$p"
}
last_step() { [ -s "$RUN/metrics.jsonl" ] && tail -n 1 "$RUN/metrics.jsonl" | /usr/bin/python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["step"])' 2>/dev/null || echo 0; }
# Restarts so far: the distinct "restart N" lines of both launchers' logs (a launcher started again after kill -9
# did not see the restarts before it, and the one whose store died decides that restart alone).
restarts_now() {
  cat "$T/h0.log" "$T/h1.log" 2>/dev/null | grep -o '^dcp launch: restart [0-9]*' | sort -u | wc -l
}
newest_resume_step() { grep -o 'resumed from [^ ]* at step [0-9]*' "$RUN/logs/rank0.log" 2>/dev/null | tail -n 1 | grep -o '[0-9]*$' || echo 0; }
begins() { local n; n=$(grep -c '==== dcp train' "$RUN/logs/rank0.log" 2>/dev/null); echo "${n:-0}"; }
# Conditions for wait_until, re-evaluated at every poll.
more_restarts() { [ "$(restarts_now)" -gt "$1" ]; }
more_begins() { [ "$(begins)" -gt "$1" ]; }
wait_until() { local limit=$1; shift; local d=$((SECONDS + limit)); until "$@"; do [ $SECONDS -lt $d ] && ! over_time || return 1; sleep 0.1; done; }
alive() { [ -n "$(rank_pid 0)" ] && [ -n "$(rank_pid 1)" ]; }
progressed() { alive && [ "$(last_step)" -ge "$1" ]; }

# --- the fault-free run -------------------------------------------------------------------------------------------
REF="$T/ref"
t0=$(date +%s.%N)
start_host 0 "$REF" "$T/ref0.log"; start_host 1 "$REF" "$T/ref1.log"
wait "${HOST_PID[0]}"; r0=$?; wait "${HOST_PID[1]}"; r1=$?
t1=$(date +%s.%N)
[ $r0 -eq 0 ] && [ $r1 -eq 0 ] || die "the fault-free run failed ($r0, $r1)"
REF_WALL=$(/usr/bin/python3 -c "print($t1 - $t0)")

# --- the run with faults ------------------------------------------------------------------------------------------
PORT=$((PORT + 1))
RUN="$T/disk/run"
FAULT_LOG="$T/faults.tsv"
echo -e "fault\tkind\ttarget\tstep_at_fault\trestarts\tresumed_from\tsteps_lost\tseconds_to_resume" >"$FAULT_LOG"
RANDOM=$SEED
t0=$(date +%s.%N)
start_host 0 "$RUN" "$T/h0.log" "${LAUNCH_OPTS[@]}"; start_host 1 "$RUN" "$T/h1.log" "${LAUNCH_OPTS[@]}"
kinds=(kill_rank kill_launcher stop_rank full_disk corrupt)
injected=0
resume_step=0
for ((f = 1; f <= FAULTS; ++f)); do
  over_time && { echo "soak: time limit ${LIMIT_S}s reached after $injected faults"; break; }
  [ "$(last_step)" -ge $((STEPS - 4)) ] && { echo "soak: the run reached step $(last_step) of $STEPS after $injected faults"; break; }
  kind=${kinds[$((RANDOM % ${#kinds[@]}))]}
  host=$((RANDOM % 2))
  # Progress first: two steps past where the last restart resumed (and past a checkpoint for full_disk).
  wait_until 120 progressed $((resume_step + 2)) || die "fault $f: no progress after the last restart (step $(last_step))"
  before_restarts=$(restarts_now); before_begins=$(begins)
  case $kind in
    kill_rank) kill -9 "$(rank_pid $host)" 2>/dev/null ;;
    kill_launcher)
      lp=$(launcher_pid $host); [ -n "$lp" ] && kill -9 "$lp"
      sleep 0.5
      start_host "$host" "$RUN" "$T/h$host.log" "${LAUNCH_OPTS[@]}" ;;
    stop_rank) kill -STOP "$(rank_pid $host)" 2>/dev/null ;;
    full_disk)
      host=0
      # Right after a checkpoint: the next save (or a metrics line) meets a full disk.
      s=$(last_step); wait_until 60 progressed $(( (s / 2 + 1) * 2 )) || die "fault $f: no checkpoint step"
      avail=$(df --output=avail -B1 "$T/disk" | tail -n 1)
      head -c "$avail" /dev/zero >"$T/disk/filler" 2>/dev/null ;;
    corrupt)
      # Rank 0 (host 0) writes the checkpoints: killed first, so that no save replaces the flipped file before the
      # restart reads it; then a byte in the middle of the newest checkpoint's model.pt is flipped.
      host=0
      kill -9 "$(rank_pid 0)" 2>/dev/null
      sleep 0.2
      m="$RUN/checkpoint/model.pt"
      [ -f "$m" ] && /usr/bin/python3 -c "
import sys; f = open(sys.argv[1], 'r+b'); f.seek(0, 2); n = f.tell() // 2; f.seek(n); b = f.read(1)
f.seek(n); f.write(bytes([b[0] ^ 0xFF])); f.close()" "$m" ;;
  esac
  step_at=$(last_step)
  injected=$((injected + 1))
  tf=$(date +%s.%N)
  wait_until 120 more_restarts "$before_restarts" || die "fault $f ($kind): no restart"
  step_at=$(( $(last_step) > step_at ? $(last_step) : step_at ))
  [ "$kind" = full_disk ] && rm -f "$T/disk/filler"
  # The new round's rank 0 says where it resumed from (or begins from scratch).
  wait_until 120 more_begins "$before_begins" || die "fault $f ($kind): the restarted rank 0 never began"
  wait_until 60 alive || die "fault $f ($kind): the ranks did not come back"
  sleep 0.2
  if tail -n 40 "$RUN/logs/rank0.log" | grep -q 'starting from scratch'; then resume_step=0; else resume_step=$(newest_resume_step); fi
  wait_until 120 progressed $((resume_step + 1)) || die "fault $f ($kind): no step after the restart"
  tr=$(date +%s.%N)
  echo -e "$f\t$kind\thost $host\t$step_at\t$(( $(restarts_now) - before_restarts ))\t$resume_step\t$((step_at - resume_step))\t$(/usr/bin/python3 -c "print(f'{$tr - $tf:.1f}')")" >>"$FAULT_LOG"
  echo "soak: fault $f/$FAULTS $kind (host $host) at step $step_at: resumed from step $resume_step"
done
deadline=$(( LIMIT_S - ($(date +%s) - START_EPOCH) )); [ $deadline -lt 30 ] && deadline=30
for k in 0 1; do
  for ((w = 0; w < deadline * 10; ++w)); do kill -0 "${HOST_PID[$k]}" 2>/dev/null || break; sleep 0.1; done
  kill -0 "${HOST_PID[$k]}" 2>/dev/null && die "host $k still running at the time limit"
  wait "${HOST_PID[$k]}"; rc[$k]=$?
done
t1=$(date +%s.%N)
RUN_WALL=$(/usr/bin/python3 -c "print($t1 - $t0)")
LOAD_END=$(cut -d' ' -f1 /proc/loadavg)
[ "${rc[0]}" -eq 0 ] && [ "${rc[1]}" -eq 0 ] || die "the run with faults ended with exit ${rc[0]} / ${rc[1]}"

COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
DIRTY=$(git status --porcelain 2>/dev/null | grep -q . && echo " (with uncommitted changes)" || echo "")
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
/usr/bin/python3 - "$REF" "$RUN" "$FAULT_LOG" "$OUT" "$REF_WALL" "$RUN_WALL" "$injected" "$FAULTS" "$SEED" \
  "$COMMIT$DIRTY" "$CPU" "$LOAD_START" "$LOAD_END" "$STEPS" "$TIMEOUT_S" "$(restarts_now)" <<'EOF'
import json, sys, csv, collections
(ref, run, faults, out, ref_wall, run_wall, injected, asked, seed, commit, cpu, load0, load1, steps, timeout,
 restarts) = sys.argv[1:]
ref_wall, run_wall = float(ref_wall), float(run_wall)
m = lambda d: [json.loads(l) for l in open(d + "/metrics.jsonl")]
a, b = m(ref), m(run)
steps_ok = [x["step"] for x in b] == list(range(1, int(steps) + 1))
losses_equal = steps_ok and all(x["loss"] == y["loss"] for x, y in zip(a, b)) and len(a) == len(b)
model_equal = open(ref + "/checkpoint/model.pt", "rb").read() == open(run + "/checkpoint/model.pt", "rb").read()
summary = json.load(open(run + "/summary.json"))
rows = list(csv.DictReader(open(faults), delimiter="\t"))
by = collections.OrderedDict()
for r in rows:
    by.setdefault(r["kind"], []).append(r)
L = []
L.append("# Soak of `dcp launch --max-restarts` across two hosts (issue 30)\n")
L.append(f"Command: `sudo SEED={seed} STEPS={steps} bash bench/soak_elastic.sh {asked}` (under `flock /work/locks/netns.lock "
         f"flock /work/locks/bench.lock`), commit {commit}, {cpu}, 2 cores; 1-minute load average {load0} at the "
         f"start, {load1} at the end.\n")
L.append(f"Two hosts (network namespaces, a veth pair), one rank each, `--max-restarts {int(asked) * 2 + 5} "
         f"--restart-backoff-s 0.5 --grace 2`; the model of the CTest `two_hosts_elastic` (d_model 32, 1 layer, "
         f"fp32), {steps} steps, a checkpoint every 2 steps, dist.timeout_s {timeout}; the run dir on a 48 MB tmpfs.\n")
L.append("## Result\n")
L.append(f"- faults injected: **{injected}** of {asked}; restarts: **{restarts}** (summary.json `restarts`: "
         f"{summary.get('restarts')})")
L.append(f"- steps: {len(b)} lines, 1..{steps} each once: {steps_ok}; per-step losses equal to the fault-free "
         f"run's bit for bit: **{losses_equal}**; final model.pt identical: **{model_equal}**")
lost = sum(int(r["steps_lost"]) for r in rows)
L.append(f"- wall time: fault-free {ref_wall:.1f} s, with faults {run_wall:.1f} s: overhead {run_wall - ref_wall:.1f} s "
         f"({run_wall / ref_wall:.2f}x), {(run_wall - ref_wall) / max(1, int(injected)):.1f} s per fault; steps lost "
         f"{lost} in all (re-run after a restart)\n")
L.append("| fault kind | faults | restarts | steps lost: mean | max | seconds from the fault to the next step: mean | max |")
L.append("|---|---|---|---|---|---|---|")
for k, rs in by.items():
    sl = [int(r["steps_lost"]) for r in rs]; sec = [float(r["seconds_to_resume"]) for r in rs]
    rst = sum(int(r["restarts"]) for r in rs)
    L.append(f"| {k} | {len(rs)} | {rst} | {sum(sl) / len(sl):.1f} | {max(sl)} | {sum(sec) / len(sec):.1f} | {max(sec):.1f} |")
fallbacks = open(run + "/logs/rank0.log", errors="replace").read().count("loading the previous checkpoint")
L.append("\nSteps lost = the last step logged when the fault took effect - the step the restart resumed from (0: from "
         f"scratch). `corrupt` kills rank 0 and flips a byte of the newest checkpoint's model.pt: the restart "
         f"falls back to checkpoint.old (fallbacks in rank 0's log: {fallbacks}). `full_disk` fills the run's tmpfs "
         "right after a checkpoint and frees it once the "
         "run failed. `kill_launcher` restarts the killed launcher at once, as a scheduler would.\n")
L.append("## Every fault\n")
L.append("| # | kind | target | step at fault | restarts | resumed from | steps lost | s to next step |")
L.append("|---|---|---|---|---|---|---|---|")
for r in rows:
    L.append(f"| {r['fault']} | {r['kind']} | {r['target']} | {r['step_at_fault']} | {r['restarts']} | "
             f"{r['resumed_from']} | {r['steps_lost']} | {r['seconds_to_resume']} |")
open(out, "w").write("\n".join(L) + "\n")
print("\n".join(L[:8]))
ok = losses_equal and model_equal and int(injected) == int(asked)
sys.exit(0 if ok else 1)
EOF
