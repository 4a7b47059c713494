-- agent-svc owns this schema; gateway-svc never touches it (S-1).
CREATE SCHEMA IF NOT EXISTS agent;
