#!/usr/bin/env bash
# Every benchmark, side by side with the peer frameworks, in one command; ends with one table.
#   bench/run.sh            (needs the test PostgreSQL at 127.0.0.1:5432, like the tests)
# The peers' virtualenv is made once from the package registry (bench/peers/setup.sh); nothing
# is fetched while measuring. Release builds; the first one takes ~10 minutes on 2 cores.
# LOAD_RUNS, LOAD_BACKENDS, BENCH_RUNS pass through to the benches (see their headers).
set -euo pipefail
cd "$(dirname "$0")/.."

PEERS_PYTHON=$(bench/peers/setup.sh | tail -1)
export PEERS_PYTHON
out=$(mktemp)
trap 'rm -f "$out"' EXIT

for bench in runs load gateway bootstrap tokens commit_shapes; do
  echo "== cargo bench -p steward-tests --bench $bench"
  cargo bench -p steward-tests --bench "$bench" | tee -a "$out"
done
echo "== cargo bench -p agent-svc --bench executor"
cargo bench -p agent-svc --bench executor | tee -a "$out"

echo
echo "## Summary ($(nproc) cores, $(date -u +%Y-%m-%d))"
echo
echo "| what | measured | target |"
echo "|---|---|---|"
grep '^SUMMARY' "$out" | awk -F'\t' '{ printf "| %s | %s | %s |\n", $2, $3, $4 }'
