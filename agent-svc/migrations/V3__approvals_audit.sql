-- Approvals of side-effecting actions (P-4) and the audit trail of side effects and approval
-- events (P-5).

CREATE TABLE agent.approvals (
    id          text        PRIMARY KEY,
    run_id      text        NOT NULL REFERENCES agent.runs (id) ON DELETE CASCADE,
    thread_id   text        NOT NULL,
    owner       text        NOT NULL,
    call_id     text        NOT NULL,
    tool        text        NOT NULL,
    arguments   jsonb       NOT NULL,
    args_sha256 text        NOT NULL,
    preview     text        NOT NULL,
    reason      text        NOT NULL,
    state       text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    decided_by  text,
    decided_at  timestamptz
);
CREATE INDEX approvals_run ON agent.approvals (run_id);

CREATE TABLE agent.audit (
    id     bigserial   PRIMARY KEY,
    at     timestamptz NOT NULL DEFAULT now(),
    owner  text        NOT NULL,
    kind   text        NOT NULL,
    run_id text,
    detail jsonb       NOT NULL
);
CREATE INDEX audit_owner ON agent.audit (owner, id);
