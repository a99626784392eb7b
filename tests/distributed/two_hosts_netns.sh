#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces joined by a veth pair, one `dcp launch --nnodes 2` in each.
#  1. A 3-step training across the two hosts has the losses of the same run on one host (same world size 2).
#  2. The other host dies mid-training (its processes killed): the survivor stops with a named error, non-zero.
#  3. The other host vanishes (link down, then its processes killed, so no FIN or RST arrives): the survivor
#     stops within dist.timeout_s plus slack.
# Usage: two_hosts_netns.sh DCP_BINARY. Exit 0 pass, 1 fail, 77 skip (no root / CAP_NET_ADMIN: CTest SKIPPED).
# KEEP_LOGS=DIR keeps a copy of the logs and run folders there.
# The addresses exist only inside the namespaces this script makes, which it always deletes (trap).
set -uo pipefail

DCP=${1:?usage: $0 DCP_BINARY}
TIMEOUT_S=5   # dist.timeout_s of the failure runs
SLACK_S=3     # what detection may take beyond it (a step in flight, process exit)
NS0=dcp_h0_$$ NS1=dcp_h1_$$
IF0=dcpa$$ IF1=dcpb$$   # interface names have at most 15 characters
ADDR0=10.213.0.1 ADDR1=10.213.0.2
T=$(mktemp -d /tmp/dcp_netns.XXXXXX)
PORT=$((20000 + $$ % 20000))

fail() { echo "FAIL: $*"; exit 1; }

cleanup() {
  for ns in "$NS0" "$NS1"; do
    # Every process of the test inside the namespace: launchers, ranks, their watchers.
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
    ip netns del "$ns" 2>/dev/null   # also deletes the veth end inside it, hence the pair
  done
  [ -n "${KEEP_LOGS:-}" ] && cp -r "$T" "$KEEP_LOGS"; rm -rf "$T"
}
trap cleanup EXIT
trap 'echo "FAIL: stopped by a signal"; exit 1' INT TERM HUP   # so that the EXIT trap cleans up

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

# A tiny JSONL corpus, as in test_cli_runs.
for i in $(seq 0 299); do
  text="Document $i: the quick brown fox jumps over the lazy dog. "
  for j in $(seq 1 $((i % 7))); do text+="Lorem ipsum dolor sit amet $j. "; done
  printf '{"text": "%s"}\n' "$text"
done >"$T/corpus.jsonl"

S=(--data.path="$T/corpus.jsonl" --model.d_model=32 --model.n_layers=1 --model.n_heads=2 --model.d_ff=64
   --data.max_seq_len=256 --train.micro_batch_tokens=1024 --train.global_batch_tokens=4096 --train.threads=1
   --eval.max_tokens=4096 --train.planner=static --train.cost_model=h200)
export OMP_NUM_THREADS=1

# start_host NS K LOG VAR=VALUE TRAIN_ARGS...: host K of 2, in namespace NS, in the background (pid in $!).
start_host() {
  local ns=$1 k=$2 log=$3 var=$4; shift 4
  timeout 120 ip netns exec "$ns" env "$var" "$DCP" launch --nproc 1 --nnodes 2 --node-rank "$k" \
    --master-addr "$ADDR0" --master-port "$PORT" --grace 3 -- train "${S[@]}" "$@" >"$log" 2>&1 &
}

lines() { [ -f "$1" ] && wc -l <"$1" || echo 0; }

# --- 1. the same losses across two hosts as on one -------------------------------------------------------------
timeout 120 "$DCP" launch --nproc 2 --grace 3 -- train "${S[@]}" --train.max_steps=3 --run.dir="$T/one_host" \
  >"$T/one_host.log" 2>&1 || { cat "$T/one_host.log"; fail "the one-host run failed"; }
start_host "$NS0" 0 "$T/h0.log" DCP_TEST=1 --train.max_steps=3 --run.dir="$T/two_hosts" --dist.timeout_s=60; H0=$!
start_host "$NS1" 1 "$T/h1.log" DCP_TEST=1 --train.max_steps=3 --run.dir="$T/two_hosts" --dist.timeout_s=60; H1=$!
wait $H0; rc0=$?
wait $H1; rc1=$?
if [ $rc0 -ne 0 ] || [ $rc1 -ne 0 ]; then
  cat "$T/h0.log" "$T/h1.log"; fail "two-host run: host 0 exit $rc0, host 1 exit $rc1"
fi
grep -q "Gloo binds to address $ADDR0" "$T/h0.log" || { cat "$T/h0.log"; fail "host 0 did not bind Gloo to $ADDR0"; }
grep -q "Gloo binds to address $ADDR1" "$T/h1.log" || { cat "$T/h1.log"; fail "host 1 did not bind Gloo to $ADDR1"; }
# Gloo sums the same two gradients in the same order whatever the transport, so the losses should be equal;
# 1e-6 relative allows only for rounding.
/usr/bin/python3 - "$T/one_host/metrics.jsonl" "$T/two_hosts/metrics.jsonl" <<'EOF' || fail "losses differ"
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
assert len(a) == len(b) == 3, f"steps: one host {len(a)}, two hosts {len(b)}"
diff = max(abs(x - y) / max(1.0, abs(x)) for x, y in zip(a, b))
print(f"losses one host {a}\nlosses two hosts {b}\nlargest relative difference {diff:.3g} (tolerance 1e-6)")
sys.exit(0 if diff <= 1e-6 else 1)
EOF

# --- 2. and 3. the other host dies mid-training ----------------------------------------------------------------
# run_and_lose_host NAME CUT_LINK: trains with many steps, waits for 2 logged steps, then kills every process in
# host 1's namespace (after taking its link down when CUT_LINK=1) and times how long host 0 takes to stop.
run_and_lose_host() {
  local name=$1 cut=$2 run="$T/$1"
  PORT=$((PORT + 1))
  # Host 1 names its interface, host 0 finds its address by route: both ways of binding are used.
  start_host "$NS0" 0 "$T/$name.h0.log" DCP_TEST=1 --train.max_steps=100000 --run.dir="$run" --dist.timeout_s=$TIMEOUT_S
  local h0=$!
  start_host "$NS1" 1 "$T/$name.h1.log" GLOO_SOCKET_IFNAME="$IF1" --train.max_steps=100000 --run.dir="$run" \
    --dist.timeout_s=$TIMEOUT_S
  disown $!   # it is killed below; bash would report that as if it were news
  local deadline=$((SECONDS + 120))
  while [ "$(lines "$run/metrics.jsonl")" -lt 2 ] && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  [ "$(lines "$run/metrics.jsonl")" -ge 2 ] || { cat "$T/$name.h0.log" "$T/$name.h1.log"; fail "$name: no steps"; }
  grep -q "Gloo binds to interface(s) $IF1" "$T/$name.h1.log" || { cat "$T/$name.h1.log"; fail "$name: no $IF1"; }
  [ "$cut" = 1 ] && ip -n "$NS1" link set "$IF1" down
  local t0=$(date +%s.%N)
  kill -9 $(ip netns pids "$NS1")
  local deadline=$((SECONDS + TIMEOUT_S + SLACK_S + 30))
  while kill -0 $h0 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.05; done
  local t1=$(date +%s.%N)
  kill -0 $h0 2>/dev/null && { kill -9 $(ip netns pids "$NS0"); fail "$name: host 0 still running"; }
  wait $h0; local rc=$?
  local took=$(/usr/bin/python3 -c "print(f'{$t1 - $t0:.2f}')")
  echo "$name: host 0 stopped $took s after host 1 was lost (exit $rc, dist.timeout_s $TIMEOUT_S): $(grep -m1 -o '\[error\] .*' "$T/$name.h0.log" | cut -c1-240)"
  [ $rc -ne 0 ] || fail "$name: host 0 exited 0"
  grep -q "on process group '.*' (rank 0 of 2) failed: a peer died or did not answer" "$T/$name.h0.log" ||
    { cat "$T/$name.h0.log"; fail "$name: no named error on host 0"; }
  /usr/bin/python3 -c "import sys; sys.exit(0 if $took <= $TIMEOUT_S + $SLACK_S else 1)" ||
    fail "$name: host 0 took $took s, more than dist.timeout_s $TIMEOUT_S + $SLACK_S s"
  ip -n "$NS1" link set "$IF1" up
}
run_and_lose_host killed 0
run_and_lose_host vanished 1
echo "PASS"
