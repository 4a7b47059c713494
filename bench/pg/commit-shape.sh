#!/usr/bin/env bash
# What PostgreSQL spends per run-commit when a commit's statements are one per run (as
# agent-svc sends them today) against one per table for several runs at once (what a commit
# batched across runs would send): bench/pg/commit-shape.sh [ROUNDS]
# Makes a scratch database with agent-svc's migrations (dropped at the end), runs each pgbench
# script alternately on one client (pipelined, prepared), and prints the server's CPU per
# run-commit, read as the postmaster's reaped children's time — so run it on an otherwise
# idle server. Needs the test PostgreSQL at 127.0.0.1:5432 and read access to its data dir.
set -euo pipefail
cd "$(dirname "$0")"
rounds=${1:-3}
db=commit_shape_$$
psql=(psql -h 127.0.0.1 -U postgres -v ON_ERROR_STOP=1 -q)
# The postmaster is the checkpointer's parent.
checkpointer=$("${psql[@]}" -d postgres -Atc "SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'")
postmaster=$(awk '{ print $4 }' "/proc/$checkpointer/stat")
"${psql[@]}" -d postgres -c "CREATE DATABASE $db"
trap '"${psql[@]}" -d postgres -c "DROP DATABASE IF EXISTS $db" >/dev/null' EXIT
for f in $(ls ../../agent-svc/migrations/*.sql | sort -V); do "${psql[@]}" -d "$db" -f "$f"; done
"${psql[@]}" -d "$db" <<'SQL'
INSERT INTO agent.threads (id, owner, title) SELECT 't' || i, 'u' || i, 'x' FROM generate_series(1, 64) i;
INSERT INTO agent.runs (id, thread_id, owner, state, channel)
  SELECT 'r' || i, 't' || i, 'u' || i, 'executing', 'api' FROM generate_series(1, 64) i;
SQL
children() { awk '{ print $16 + $17 }' "/proc/$postmaster/stat"; }
tx=6000
for _ in $(seq "$rounds"); do
  for script in per-run-statements multi-run-statements; do
    sleep 0.5 # the previous backend is reaped
    before=$(children)
    tps=$(pgbench -h 127.0.0.1 -U postgres -n -M prepared -c 1 -t "$tx" -f "$script.sql" "$db" 2>&1 |
      awk '/^tps/ { printf "%.0f", $3 }')
    sleep 0.5
    after=$(children)
    python3 -c "import sys; t, b, a, tx, tps = sys.argv[1:]; print(f'{t:22} {tps:>6} tx/s  server CPU per run-commit {(int(a) - int(b)) * 1e6 / $(getconf CLK_TCK) / (int(tx) * 4):6.1f} µs')" \
      "$script" "$before" "$after" "$tx" "$tps"
  done
done
