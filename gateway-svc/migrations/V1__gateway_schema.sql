-- gateway-svc owns this schema; agent-svc never touches it (S-1).
CREATE SCHEMA IF NOT EXISTS gateway;
