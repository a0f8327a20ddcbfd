#!/usr/bin/env bash
# The shadowkv binary on the hostile-model corpus (scripts/make_hostile_models.py): `generate` and
# `serve` must each refuse every file at load with exit code 1 or 2 and a message matching the
# file's pattern, within a time limit, without a signal, abort or sanitizer report; `serve` must
# never start listening. The unmodified model must generate and serve, so each refusal is the
# mutation's doing.
set -u
bin=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tmp=$(mktemp -d)
server_pid=
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2> /dev/null; wait "$server_pid" 2> /dev/null; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
limit=30
failures=0
passes=0

python3 "$here/../../scripts/make_hostile_models.py" "$tmp/corpus" || exit 1
crash_markers='AddressSanitizer|LeakSanitizer|runtime error:|terminate called|Aborted|core dumped'

fail() {
  echo "FAIL $1"; sed 's/^/     /' "$tmp/err" | head -n 5; failures=$((failures + 1))
}

# check NAME PATTERN CODE: the run that wrote $tmp/out and $tmp/err failed cleanly with PATTERN.
check() {
  local name=$1 pattern=$2 code=$3
  if [ "$code" -eq 0 ] || [ "$code" -gt 2 ]; then fail "$name: exit code $code"; return; fi
  if grep -qE "$crash_markers" "$tmp/err"; then fail "$name: crash report on stderr"; return; fi
  if ! grep -qiE "$pattern" "$tmp/err"; then fail "$name: stderr lacks /$pattern/"; return; fi
  if grep -q "listening" "$tmp/out"; then fail "$name: started listening"; return; fi
  passes=$((passes + 1))
}

# The controls: the unmodified model generates, and serves until stopped.
valid=$tmp/corpus/valid.gguf
timeout -k 5 $limit "$bin" generate -m "$valid" -p hi -n 2 > "$tmp/out" 2> "$tmp/err"
code=$?
if [ $code -ne 0 ]; then fail "valid_generate: exit code $code"; else passes=$((passes + 1)); fi
"$bin" serve -m "$valid" --host 127.0.0.1 --port 0 > "$tmp/out" 2> "$tmp/err" &
server_pid=$!
for _ in $(seq 1 $((limit * 10))); do
  if grep -q "listening" "$tmp/out" || ! kill -0 "$server_pid" 2> /dev/null; then break; fi
  sleep 0.1
done
if grep -q "listening" "$tmp/out"; then
  passes=$((passes + 1))
else
  fail "valid_serve: never listened"
fi
kill "$server_pid" 2> /dev/null
wait "$server_pid" 2> /dev/null
server_pid=

while IFS=$'\t' read -r file pattern; do
  name=${file%.gguf}
  timeout -k 5 $limit "$bin" generate -m "$tmp/corpus/$file" -p hi -n 2 > "$tmp/out" 2> "$tmp/err"
  check "generate $name" "$pattern" $?
  timeout -k 5 $limit "$bin" serve -m "$tmp/corpus/$file" --host 127.0.0.1 --port 0 \
    > "$tmp/out" 2> "$tmp/err"
  check "serve $name" "$pattern" $?
done < "$tmp/corpus/manifest.tsv"

echo "$passes passed, $failures failed"
[ $failures -eq 0 ]
