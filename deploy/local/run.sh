#!/usr/bin/env bash
# Runs both services on this machine with the embedded defaults: in-memory stores, no keys, no
# network beyond loopback. agent-svc on :50051, gateway-svc on :50052. Ctrl-C stops both
# gracefully. Any variable from the README's configuration table can be set in the environment
# (e.g. DATABASE_URL to use PostgreSQL instead of the in-memory stores).
#
# --demo also starts fake Gmail, Calendar and Slack servers on loopback (the ones the tests use)
# and connects their demo accounts for user `me`, so a metadata-only search, an approval and a
# send can be watched without a Google or Slack account.
set -euo pipefail
cd "$(dirname "$0")/../.."

demo=false
case "${1:-}" in
  "") ;;
  --demo) demo=true ;;
  *) echo "usage: $0 [--demo]" >&2; exit 2 ;;
esac

if $demo; then
  cargo build --bins -p gateway-svc -p agent-svc -p steward-tests
else
  cargo build --bins -p gateway-svc -p agent-svc
fi
bin="${CARGO_TARGET_DIR:-target}/debug"
export LOG_FORMAT="${LOG_FORMAT:-pretty}"
# The secret agent-svc presents to gateway-svc; a fixed local value so grpcurl users can use it.
export GATEWAY_SERVICE_TOKEN="${GATEWAY_SERVICE_TOKEN:-local-dev-service-token}"
gateway_url="${GATEWAY_URL:-http://127.0.0.1:50052}"

# Each child runs in a session of its own (setsid), so Ctrl-C reaches only this script, which
# sends each child one SIGTERM: a graceful drain. (A second signal would make them exit at once.)
pids=()
stopped=false
stop() {
  $stopped && return
  stopped=true
  [ ${#pids[@]} -eq 0 ] || kill -TERM "${pids[@]}" 2>/dev/null || true
}
settings=""
trap 'stop; [ -z "$settings" ] || rm -f "$settings"' EXIT
trap 'stop' INT TERM

if $demo; then
  settings=$(mktemp)
  setsid "$bin/steward-demo-upstreams" --env-file "$settings" --user me --gateway "$gateway_url" &
  pids+=($!)
  # The fakes write their URLs once they listen (a few milliseconds).
  for _ in $(seq 100); do
    [ -s "$settings" ] && break
    kill -0 "${pids[0]}" 2>/dev/null || break
    sleep 0.1
  done
  [ -s "$settings" ] || { echo "the demo upstreams did not start" >&2; exit 1; }
  set -a; . "$settings"; set +a
fi

# The gateway's tools for MCP clients too, on loopback (same token and user header).
MCP_LISTEN_ADDR="${MCP_LISTEN_ADDR:-127.0.0.1:50053}" setsid "$bin/gateway-svc" &
pids+=($!)
# No JWT issuer locally: callers name themselves with x-user-id, which agent-svc accepts only on
# a machine flagged as a development one (STEWARD_DEVELOPMENT).
AUTH_DEV_USER_HEADER="${AUTH_DEV_USER_HEADER:-true}" STEWARD_DEVELOPMENT="${STEWARD_DEVELOPMENT:-true}" \
GATEWAY_URL="$gateway_url" setsid "$bin/agent-svc" &
pids+=($!)

cat <<MSG
Steward is starting: agent-svc on 127.0.0.1:50051, gateway-svc on $gateway_url.
Try:  grpcurl -plaintext 127.0.0.1:50051 list
      grpcurl -plaintext 127.0.0.1:50051 grpc.health.v1.Health/Check
      grpcurl -plaintext -H "authorization: Bearer $GATEWAY_SERVICE_TOKEN" -H 'x-steward-user-id: me' \
        127.0.0.1:50052 steward.gateway.v1.GatewayService/ListTools
MCP clients reach the gateway's tools at http://${MCP_LISTEN_ADDR:-127.0.0.1:50053}/mcp with the headers
      authorization: Bearer $GATEWAY_SERVICE_TOKEN   and   x-steward-user-id: me
Ctrl-C stops everything.
MSG
if $demo; then
  if [ -n "${MODEL_CHAIN:-}" ]; then
    echo "Demo: MODEL_CHAIN is set, so prompts and the fake mailbox's metadata go to $MODEL_CHAIN."
  fi
  cat <<'MSG'
Demo: user `me` has Gmail, Calendar and Slack connected to local fakes on loopback.
      grpcurl -plaintext -H 'x-user-id: me' -d '{"input":{"prompt":"what is new in my email?"}}' \
        127.0.0.1:50051 steward.agent.v1.AgentService/Run
      grpcurl -plaintext -H 'x-user-id: me' \
        -d '{"input":{"prompt":"Send an email to maria@client.example saying the contract looks good."}}' \
        127.0.0.1:50051 steward.agent.v1.AgentService/Run
      grpcurl -plaintext -H 'x-user-id: me' -d '{"approval_id":"<approval.id from above>","decision":"DECISION_APPROVE"}' \
        127.0.0.1:50051 steward.agent.v1.AgentService/DecideApproval
MSG
fi
# Whichever exits first (a crash, or Ctrl-C) takes the others down with it.
status=0
wait -n "${pids[@]}" || status=$?
stop
wait "${pids[@]}" 2>/dev/null || true
exit "$status"
