#!/usr/bin/env bash
# agent-svc's instructions per run (or gateway-svc's: SERVICE=gateway-svc), counted by callgrind through the load bench's waves.
#   bench/agent-instructions.sh [DIR]       (default DIR: target/release, after
#                                           `cargo bench --no-run -p steward-tests --bench load`
#                                           and `cargo build --release -p agent-svc -p gateway-svc`)
# DIR holds agent-svc, gateway-svc and the load bench as deps/load-* (or deps/load), so two
# builds compare by copying each into its own DIR. Instructions are repeatable where wall-clock
# CPU moves 2x between machines of one kind, so an A/B of code reads the same on any of them.
# LOAD_RUNS (default 100) runs per wave, LOAD_WAVES (default 1) waves of them in one process (a
# second wave shows the steady state: pools and caches warm), the model's turns 1 s as in the
# load bench; LOAD_BACKEND
# memory (default) or postgres (the test PostgreSQL, as the load bench uses it).
# Prints the instructions per run (the wave's agent-svc minus the start-up-only one the bench
# launches before it) and the top functions, inclusive, per run: agent-svc's own, or those whose
# names start with TOP_PREFIX (e.g. tokio_postgres). KEEP_CALLGRIND=1 keeps the callgrind files.
# SERVICE=gateway-svc counts gateway-svc's instructions instead (top functions: gateway_svc).
set -euo pipefail
dir=$(cd "${1:-$(dirname "$0")/../target/release}" && pwd)
runs=${LOAD_RUNS:-100}
waves=${LOAD_WAVES:-1}
backend=${LOAD_BACKEND:-memory}
service=${SERVICE:-agent-svc}
case $service in
  agent-svc) other=gateway-svc ;;
  gateway-svc) other=agent-svc ;;
  *) echo "agent-instructions.sh: SERVICE is agent-svc or gateway-svc, not $service" >&2; exit 2 ;;
esac
load=$( (ls -t "$dir"/deps/load-* "$dir"/deps/load 2>/dev/null || true) | grep -v '\.d$' | head -1)
[[ -x "$dir/agent-svc" && -x "$dir/gateway-svc" && -x "$load" ]] || {
  echo "agent-instructions.sh: $dir needs agent-svc, gateway-svc and deps/load-*" >&2
  exit 2
}
command -v valgrind >/dev/null || { echo "agent-instructions.sh: valgrind is not installed" >&2; exit 2; }

work=$(mktemp -d)
if [[ -n "${KEEP_CALLGRIND:-}" ]]; then
  echo "callgrind output kept in $work/out" >&2
else
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work/deps" "$work/out"
cp "$load" "$work/deps/load"
cp "$dir/$other" "$work/"
cp "$dir/$service" "$work/$service.real"
# The bench starts "$service" beside itself; this one runs the real binary under callgrind.
cat > "$work/$service" <<EOF
#!/bin/sh
exec valgrind --tool=callgrind --callgrind-out-file=$work/out/cg.%p $work/$service.real "\$@"
EOF
chmod +x "$work/$service"

(cd "$work" && STEWARD_SKIP_BINARY_BUILD=1 LOAD_BACKENDS="$backend" LOAD_RUNS="$runs" LOAD_WAVES="$waves" \
  ./deps/load --bench >"$work/load.log" 2>&1) || { cat "$work/load.log" >&2; exit 1; }

# In order of process id, the last dot-separated part of each name.
mapfile -t files < <(ls "$work"/out/cg.* | awk -F. '{ print $NF, $0 }' | sort -n | cut -d' ' -f2-)
[[ ${#files[@]} -ge 2 ]] || { echo "expected two $service processes or more, got ${#files[@]}" >&2; exit 1; }
# The last process ran the wave; the one before it started and stopped with no runs (on
# PostgreSQL after a migrating one).
start=${files[-2]} wave=${files[-1]}
total() { awk '/^summary:/ { print $2 }' "$1"; }
all=$(( runs * waves ))
echo "$service instructions per run, $waves x $runs runs, $backend: $(( ($(total "$wave") - $(total "$start")) / all ))"
echo
echo "top functions, inclusive, instructions per run (start-up subtracted):"
python3 - "$start" "$wave" "$all" "${TOP_PREFIX:-${service//-/_}}" <<'EOF'
import re, subprocess, sys
def inclusive(path):
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", path],
                         capture_output=True, text=True, check=True).stdout
    costs = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(?:\?\?\?:)?(.*?)(?: \[.*\])?$", line)
        if m:
            costs[m.group(2)] = costs.get(m.group(2), 0) + int(m.group(1).replace(",", ""))
    return costs
start, wave, runs = inclusive(sys.argv[1]), inclusive(sys.argv[2]), int(sys.argv[3])
prefix = sys.argv[4]
rows = sorted(((wave[k] - start.get(k, 0)) / runs, k) for k in wave)
for cost, name in [r for r in reversed(rows) if r[1].startswith(prefix)][:25]:
    print(f"{cost:>12,.0f}  {name[:140]}")
EOF
