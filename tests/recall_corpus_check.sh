#!/usr/bin/env bash
# Checks bench/recall_corpus's documents (the retrieval task of dcp kv-eval, docs/kv_cache.md "Retrieval"): one
# JSON line per document; before '|' only filler '.' and pairs of a distinct uppercase key and a lowercase value,
# as many as asked; after '|' every key exactly once with the value it was stated with; lengths 4P + F + 1 within
# the asked ranges. Usage errors exit 2 and a file that cannot be written exits 1, each naming the value; only a
# new or regular --out is replaced.
# Usage: recall_corpus_check.sh RECALL_CORPUS_BINARY OUT_DIR
set -euo pipefail
bin=$1 out=$2
rm -rf "$out" && mkdir -p "$out"
"$bin" --out "$out/c.jsonl" --docs 50 --min-pairs 3 --max-pairs 26 --min-filler 0 --max-filler 40 --seed 3 >/dev/null
[ "$(wc -l < "$out/c.jsonl")" -eq 50 ] || { echo "expected 50 lines in $out/c.jsonl"; exit 1; }
awk -v minp=3 -v maxp=26 -v minf=0 -v maxf=40 '
function fail(why) { print "document " NR ": " why ": " $0; bad = 1; exit 1 }
{
  if (!match($0, /^\{"text":"[A-Za-z.|]*"\}$/)) fail("not {\"text\":\"...\"} of letters, . and |")
  text = substr($0, 10, length($0) - 11)
  bar = index(text, "|")
  if (bar == 0 || index(substr(text, bar + 1), "|") != 0) fail("not exactly one |")
  ctx = substr(text, 1, bar - 1); q = substr(text, bar + 1)
  delete value; pairs = 0; filler = 0
  for (i = 1; i <= length(ctx); i++) {
    c = substr(ctx, i, 1)
    if (c == ".") { filler++; continue }
    v = substr(ctx, i + 1, 1)
    if (c !~ /[A-Z]/ || v !~ /[a-z]/) fail("byte " i " is not a key followed by a value")
    if (c in value) fail("key " c " stated twice")
    value[c] = v; pairs++; i++
  }
  if (pairs < minp || pairs > maxp) fail(pairs " pairs")
  if (filler < minf || filler > maxf) fail(filler " filler bytes")
  if (length(text) != 4 * pairs + filler + 1) fail("length " length(text))
  if (length(q) != 2 * pairs) fail("questions of " length(q) " bytes")
  for (i = 1; i <= length(q); i += 2) {
    k = substr(q, i, 1); v = substr(q, i + 1, 1)
    if (!(k in value)) fail("asks " k ", not stated or asked twice")
    if (value[k] != v) fail("asks " k v ", stated " k value[k])
    delete value[k]
  }
}' "$out/c.jsonl"
# Fixed sizes give fixed lengths (kv-eval's --context B-1 scores the last value of every document).
"$bin" --out "$out/e.jsonl" --docs 5 --min-pairs 20 --max-pairs 20 --min-filler 150 --max-filler 150 >/dev/null
[ "$(awk '{ print length($0) - 11 }' "$out/e.jsonl" | sort -u)" = 231 ] || { echo "eval documents not 231 bytes"; exit 1; }
rc=0; "$bin" --out "$out/bad.jsonl" --max-pairs 27 2>"$out/err" || rc=$?
[ "$rc" -eq 2 ] && grep -q -- "--max-pairs: Value 27" "$out/err" || { echo "--max-pairs 27: exit $rc"; cat "$out/err"; exit 1; }
rc=0; "$bin" --out "$out/bad.jsonl" --min-filler 9 --max-filler 8 2>"$out/err" || rc=$?
[ "$rc" -eq 2 ] && grep -q -- "--min-filler 9 exceeds --max-filler 8" "$out/err" || { echo "--min-filler 9: exit $rc"; cat "$out/err"; exit 1; }
rc=0; "$bin" --out "$out/bad.jsonl" --seed -1 2>"$out/err" || rc=$?
[ "$rc" -eq 2 ] && grep -q -- "--seed: must be a whole number" "$out/err" || { echo "--seed -1: exit $rc"; cat "$out/err"; exit 1; }
rc=0; "$bin" --out "$out/missing/c.jsonl" 2>"$out/err" || rc=$?
[ "$rc" -eq 1 ] && grep -q -- "cannot write $out/missing/c.jsonl: No such file" "$out/err" || { echo "unwritable --out: exit $rc"; cat "$out/err"; exit 1; }
# Only a new or regular file is replaced (a rename would turn a device into a file), and a file beside the target
# that happens to be called OUT.tmp is not touched.
rc=0; "$bin" --out /dev/null 2>"$out/err" || rc=$?
[ "$rc" -eq 2 ] && [ -c /dev/null ] && grep -q -- "--out /dev/null exists and is not a regular file" "$out/err" || { echo "--out /dev/null: exit $rc"; cat "$out/err"; exit 1; }
echo keep > "$out/c.jsonl.tmp"
"$bin" --out "$out/c.jsonl" --docs 3 >/dev/null
[ "$(cat "$out/c.jsonl.tmp")" = keep ] && [ "$(ls "$out" | grep -c '^c.jsonl')" -eq 2 ] || { echo "c.jsonl.tmp touched or a temporary left"; ls "$out"; exit 1; }
echo "recall corpus ok"
