#!/usr/bin/env bash
# A run that heals itself across two "hosts" (network namespaces joined by a veth pair, as two_hosts_netns.sh):
# one `dcp launch --nnodes 2 --max-restarts 3` in each, and three faults while it trains:
#  1. kill -9 of host 1's rank mid-step;
#  2. SIGSTOP of host 0's rank, left stopped beyond dist.timeout_s (its launcher ends it when the peer gives up);
#  3. host 1's link down for longer than dist.timeout_s, then up again.
# The run must finish by itself (exit 0 on both hosts, 3 restarts in summary.json) with per-step losses and a final
# model.pt bitwise equal to an uninterrupted run's (fp32, the same two hosts).
# Usage: two_hosts_elastic.sh DCP_BINARY. Exit 0 pass, 1 fail, 77 skip (no root / CAP_NET_ADMIN: CTest SKIPPED).
# KEEP_LOGS=DIR keeps a copy of the logs and run folders there. The addresses exist only inside the namespaces
# this script makes, which it always deletes (trap); every wait is bounded.
set -uo pipefail

DCP=${1:?usage: $0 DCP_BINARY}
TIMEOUT_S=4   # dist.timeout_s
STEPS=200   # ~0.1 s a step on 2 idle cores: long enough to inject three faults while it runs
NS0=dcp_e0_$$ NS1=dcp_e1_$$
IF0=dcpea$$ IF1=dcpeb$$   # interface names have at most 15 characters
ADDR0=10.214.0.1 ADDR1=10.214.0.2
T=$(mktemp -d /tmp/dcp_elastic.XXXXXX)
PORT=$((20000 + $$ % 20000))

fail() { echo "FAIL: $*"; for f in "$T"/*.log; do echo "==== $f"; tail -n 40 "$f"; done; exit 1; }

cleanup() {
  for ns in "$NS0" "$NS1"; do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -CONT $pids 2>/dev/null && kill -9 $pids 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
  [ -n "${KEEP_LOGS:-}" ] && cp -r "$T" "$KEEP_LOGS"; rm -rf "$T"
}
trap cleanup EXIT
trap 'echo "FAIL: stopped by a signal"; exit 1' INT TERM HUP

if ! err=$(ip netns add "$NS0" 2>&1); then
  echo "SKIP: cannot create a network namespace ('ip netns add' needs root or CAP_NET_ADMIN): $err"
  exit 77
fi
ip netns add "$NS1" || fail "ip netns add $NS1"
ip link add "$IF0" type veth peer name "$IF1" || fail "ip link add $IF0 type veth peer name $IF1"
ip link set "$IF0" netns "$NS0" && ip link set "$IF1" netns "$NS1" || fail "moving the veth ends"
ip -n "$NS0" addr add "$ADDR0/24" dev "$IF0" && ip -n "$NS1" addr add "$ADDR1/24" dev "$IF1" || fail "addresses"
for ns in "$NS0" "$NS1"; do ip -n "$ns" link set lo up || fail "lo up in $ns"; done
ip -n "$NS0" link set "$IF0" up && ip -n "$NS1" link set "$IF1" up || fail "veth up"

for i in $(seq 0 299); do
  text="Document $i: the quick brown fox jumps over the lazy dog. "
  for j in $(seq 1 $((i % 7))); do text+="Lorem ipsum dolor sit amet $j. "; done
  printf '{"text": "%s"}\n' "$text"
done >"$T/corpus.jsonl"

S=(--data.path="$T/corpus.jsonl" --model.d_model=32 --model.n_layers=1 --model.n_heads=2 --model.d_ff=64
   --data.max_seq_len=256 --train.micro_batch_tokens=1024 --train.global_batch_tokens=4096 --train.threads=1
   --eval.max_tokens=1024 --train.planner=static --train.cost_model=h200 --train.precision=fp32
   --train.max_steps=$STEPS --train.checkpoint_every=4 --dist.timeout_s=$TIMEOUT_S)
export OMP_NUM_THREADS=1

# start_host NS K LOG RUN_DIR [LAUNCH_OPTION ...]: host K of 2 in namespace NS, in the background (pid in $!).
start_host() {
  local ns=$1 k=$2 log=$3 run=$4; shift 4
  timeout 240 ip netns exec "$ns" "$DCP" launch --nproc 1 --nnodes 2 --node-rank "$k" --master-addr "$ADDR0" \
    --master-port "$PORT" --grace 2 "$@" -- train "${S[@]}" --run.dir="$run" >"$log" 2>&1 &
}
lines() { [ -f "$1" ] && wc -l <"$1" || echo 0; }
# The pid of the training rank (argv "dcp train ...", not the launcher or its watcher) in namespace $1.
rank_pid() {
  for p in $(ip netns pids "$1" 2>/dev/null); do
    if tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q '^dcp train '; then echo "$p"; return; fi
  done
}
# wait_until SECONDS COMMAND...: polls COMMAND every 0.1 s; fails the test when SECONDS pass first.
wait_until() {
  local limit=$1; shift
  local deadline=$((SECONDS + limit))
  until "$@"; do [ $SECONDS -lt $deadline ] || return 1; sleep 0.1; done
}
progress() { [ "$(lines "$RUN/metrics.jsonl")" -ge "$1" ] && [ -n "$(rank_pid "$NS0")" ] && [ -n "$(rank_pid "$NS1")" ]; }
restarts() { local n; n=$(grep -c 'dcp launch: restart ' "$T/e0.log" 2>/dev/null); echo "${n:-0}"; }
# restarted N: host 0's launcher has logged at least N restarts (evaluated at every poll, not once).
restarted() { [ "$(restarts)" -ge "$1" ]; }

# --- the uninterrupted run (no --max-restarts), the reference ----------------------------------------------------
start_host "$NS0" 0 "$T/ref0.log" "$T/ref"; R0=$!
start_host "$NS1" 1 "$T/ref1.log" "$T/ref"; R1=$!
wait $R0; rc0=$?; wait $R1; rc1=$?
[ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] || fail "the uninterrupted run: host 0 exit $rc0, host 1 exit $rc1"

# --- the elastic run with three faults ------------------------------------------------------------------------
PORT=$((PORT + 1))
RUN="$T/elastic"
t_start=$(date +%s.%N)
start_host "$NS0" 0 "$T/e0.log" "$RUN" --max-restarts 3 --restart-backoff-s 0.5 --join-timeout-s 60; E0=$!
start_host "$NS1" 1 "$T/e1.log" "$RUN" --max-restarts 3 --restart-backoff-s 0.5 --join-timeout-s 60; E1=$!

# 1. kill -9 of host 1's rank mid-step, after 4 steps.
wait_until 90 progress 4 || fail "no 4 steps before fault 1"
kill -9 "$(rank_pid "$NS1")"
echo "fault 1: killed host 1's rank at step $(lines "$RUN/metrics.jsonl")"
wait_until 60 restarted 1 || fail "no restart after fault 1"

# 2. SIGSTOP of host 0's rank, two steps after the restart resumed; left stopped beyond the timeout.
n=$(lines "$RUN/metrics.jsonl")
wait_until 90 progress $((n + 2)) || fail "no progress after restart 1"
kill -STOP "$(rank_pid "$NS0")"
echo "fault 2: stopped host 0's rank at step $(lines "$RUN/metrics.jsonl")"
wait_until 60 restarted 2 || fail "no restart after fault 2"

# 3. host 1's link down beyond the timeout, then up.
n=$(lines "$RUN/metrics.jsonl")
wait_until 90 progress $((n + 2)) || fail "no progress after restart 2"
ip -n "$NS1" link set "$IF1" down
echo "fault 3: host 1's link down at step $(lines "$RUN/metrics.jsonl") for $((TIMEOUT_S + 2)) s"
sleep $((TIMEOUT_S + 2))
ip -n "$NS1" link set "$IF1" up

wait $E0; rc0=$?; wait $E1; rc1=$?
t_end=$(date +%s.%N)
[ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] || fail "the elastic run did not finish by itself: host 0 exit $rc0, host 1 exit $rc1"
grep 'dcp launch: restart ' "$T/e0.log"

/usr/bin/python3 - "$T/ref" "$RUN" "$STEPS" <<'EOF' || fail "the elastic run differs from the uninterrupted one"
import json, sys
ref, run, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
def metrics(d):
    return [json.loads(l) for l in open(d + "/metrics.jsonl")]
a, b = metrics(ref), metrics(run)
assert [m["step"] for m in b] == list(range(1, steps + 1)), f"steps of the elastic run: {[m['step'] for m in b]}"
assert [m["step"] for m in a] == list(range(1, steps + 1)), f"steps of the reference: {[m['step'] for m in a]}"
diff = [(x["step"], x["loss"], y["loss"]) for x, y in zip(a, b) if x["loss"] != y["loss"]]
assert not diff, f"losses differ (step, uninterrupted, elastic): {diff[:5]}"
s = json.load(open(run + "/summary.json"))
assert s["restarts"] == 3, f"summary.json restarts = {s['restarts']}, expected 3"
assert json.load(open(ref + "/summary.json"))["restarts"] == 0
same = open(ref + "/checkpoint/model.pt", "rb").read() == open(run + "/checkpoint/model.pt", "rb").read()
assert same, "final model.pt differs"
print(f"{steps} steps, losses equal bit for bit, final model.pt identical, summary.json restarts {s['restarts']}")
EOF
grep -q 'resuming from the last good checkpoint' "$T/e0.log" || fail "no restart resumed from a checkpoint"
echo "elastic run: $(/usr/bin/python3 -c "print(f'{$t_end - $t_start:.1f}')") s with 3 faults"
echo "PASS"
