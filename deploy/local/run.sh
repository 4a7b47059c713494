#!/usr/bin/env bash
# Runs both services on this machine with the embedded defaults: in-memory stores, no keys, no
# network beyond loopback. agent-svc on :50051, gateway-svc on :50052. Ctrl-C stops both
# gracefully. Any variable from the README's configuration table can be set in the environment
# (e.g. DATABASE_URL to use PostgreSQL instead of the in-memory stores).
set -euo pipefail
cd "$(dirname "$0")/../.."

cargo build --bins -p gateway-svc -p agent-svc
bin="${CARGO_TARGET_DIR:-target}/debug"
export LOG_FORMAT="${LOG_FORMAT:-pretty}"
# The secret agent-svc presents to gateway-svc; a fixed local value so grpcurl users can use it.
export GATEWAY_SERVICE_TOKEN="${GATEWAY_SERVICE_TOKEN:-local-dev-service-token}"

"$bin/gateway-svc" &
gateway=$!
# No JWT issuer locally: callers name themselves with x-user-id, which agent-svc accepts only on
# a machine flagged as a development one (STEWARD_DEVELOPMENT).
AUTH_DEV_USER_HEADER="${AUTH_DEV_USER_HEADER:-true}" STEWARD_DEVELOPMENT="${STEWARD_DEVELOPMENT:-true}" \
GATEWAY_URL="${GATEWAY_URL:-http://127.0.0.1:${GATEWAY_PORT:-50052}}" "$bin/agent-svc" &
agent=$!

stop() { kill -TERM "$agent" "$gateway" 2>/dev/null || true; }
trap stop INT TERM
cat <<MSG
Steward is starting: agent-svc on 127.0.0.1:50051, gateway-svc on 127.0.0.1:50052.
Try:  grpcurl -plaintext 127.0.0.1:50051 list
      grpcurl -plaintext 127.0.0.1:50051 grpc.health.v1.Health/Check
      grpcurl -plaintext -H "authorization: Bearer $GATEWAY_SERVICE_TOKEN" -H 'x-steward-user-id: me' \
        127.0.0.1:50052 steward.gateway.v1.GatewayService/ListTools
Ctrl-C stops both.
MSG
# Whichever exits first (a crash, or Ctrl-C) takes the other down with it.
status=0
wait -n "$agent" "$gateway" || status=$?
stop
wait "$agent" "$gateway" 2>/dev/null || true
exit "$status"
