#!/usr/bin/env bash
# Checks bench/passkey_corpus's documents (the retrieval task of dcp kv-eval, docs/kv_cache.md): each has exactly
# the asked length, states each marker's key once and asks it once, and ends with '#' and the key stated after
# '#', the continuation kv-eval scores. Usage: passkey_corpus_check.sh PASSKEY_CORPUS_BINARY OUT_DIR
set -euo pipefail
bin=$1 out=$2
rm -rf "$out"
"$bin" --out "$out" --docs 20 --min-bytes 230 --max-bytes 400 --needles 8 --seed 3 >/dev/null
[ "$(ls "$out" | wc -l)" -eq 20 ] || { echo "expected 20 documents in $out"; exit 1; }
for f in "$out"/*.txt; do
  text=$(cat "$f")
  bytes=$(stat -c %s "$f")
  [ "$bytes" -ge 230 ] && [ "$bytes" -le 400 ] || { echo "$f: $bytes bytes, outside 230..400"; exit 1; }
  for m in '#' '$' '%' '&' '@' '*' '+' '='; do
    [ "$(grep -o -F "$m" "$f" | wc -l)" -eq 2 ] || { echo "$f: marker $m not exactly twice"; exit 1; }
    stated=$(awk -v m="$m" '{ i = index($0, m); print substr($0, i + 1, 5) }' "$f")
    asked=$(awk -v m="$m" '{ s = $0; i = index(s, m); s = substr(s, i + 1); j = index(s, m); print substr(s, j + 1, 5) }' "$f")
    [[ "$stated" =~ ^[0-9]{5}$ ]] && [ "$stated" = "$asked" ] || { echo "$f: marker $m states '$stated', asks '$asked'"; exit 1; }
  done
  [[ "${text: -6}" =~ ^#[0-9]{5}$ ]] || { echo "$f: does not end with '#' and 5 digits: '${text: -6}'"; exit 1; }
done
# Usage errors exit 2 naming the value: a needle count out of range, a length too short for the keys.
rc=0; "$bin" --out "$out/bad" --needles 9 2>"$out.err" || rc=$?
[ "$rc" -eq 2 ] && grep -q -- "--needles: Value 9" "$out.err" || { echo "--needles 9: exit $rc"; cat "$out.err"; exit 1; }
rc=0; "$bin" --out "$out/bad" --min-bytes 150 --max-bytes 400 --needles 8 2>"$out.err" || rc=$?
[ "$rc" -eq 2 ] && grep -q -- "--min-bytes 150 is too short for 8 needles" "$out.err" || { echo "--min-bytes 150: exit $rc"; cat "$out.err"; exit 1; }
echo "passkey corpus ok"
