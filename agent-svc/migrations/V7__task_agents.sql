-- Background task agents (B-5): a queue any replica may take work from (SKIP LOCKED), with the
-- E-12 retry schedule.
CREATE TABLE agent.task_agents (
    id               text        PRIMARY KEY,
    owner            text        NOT NULL,
    parent_thread_id text        NOT NULL REFERENCES agent.threads (id) ON DELETE CASCADE,
    instructions     text        NOT NULL,
    goal             text        NOT NULL,
    state            text        NOT NULL,
    attempts         integer     NOT NULL DEFAULT 0,
    last_error       text,
    result           text,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    claimed_by       text,
    claimed_until    timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX task_agents_ready ON agent.task_agents (state, next_attempt_at);
