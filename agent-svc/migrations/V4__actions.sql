-- One row per tool call of a run, with its A-5 state (planned, awaiting_confirmation,
-- executing, completed, failed, rejected); every transition is an update of this row.
CREATE TABLE agent.actions (
    id          text        PRIMARY KEY,
    run_id      text        NOT NULL REFERENCES agent.runs (id) ON DELETE CASCADE,
    call_id     text        NOT NULL,
    tool        text        NOT NULL,
    arguments   jsonb       NOT NULL,
    side_effect boolean     NOT NULL,
    state       text        NOT NULL,
    result_text text,
    error_kind  text,
    approval_id text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX actions_run ON agent.actions (run_id, created_at);
