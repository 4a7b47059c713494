-- Scheduled runs (issue 16): briefings, check-ins and heartbeats. Any replica claims a due
-- occurrence with FOR UPDATE SKIP LOCKED; at most one occurrence per schedule is in progress
-- (occurrence_at set) and it is held by one worker until held_until.
CREATE TABLE agent.schedules (
    id             text        PRIMARY KEY,
    owner          text        NOT NULL,
    kind           text        NOT NULL CHECK (kind IN ('briefing', 'check_in', 'heartbeat')),
    prompt         text        NOT NULL,
    cron           text,
    every_secs     bigint      CHECK (every_secs > 0),
    time_zone      text        NOT NULL,
    enabled        boolean     NOT NULL,
    thread_id      text        REFERENCES agent.threads (id) ON DELETE CASCADE,
    next_due_at    timestamptz NOT NULL,
    last_outcome   text        CHECK (last_outcome IN
        ('running', 'completed', 'awaiting_approval', 'retrying', 'failed', 'postponed')),
    last_run_id    text,
    last_error     text,
    last_fired_at  timestamptz,
    occurrence_at  timestamptz,
    attempts       integer     NOT NULL DEFAULT 0,
    holder         text,
    held_until     timestamptz,
    created_at     timestamptz NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    CHECK ((cron IS NULL) <> (every_secs IS NULL))
);
CREATE INDEX schedules_owner ON agent.schedules (owner, created_at);
CREATE INDEX schedules_due ON agent.schedules (next_due_at) WHERE enabled AND occurrence_at IS NULL;
CREATE INDEX schedules_held ON agent.schedules (held_until) WHERE occurrence_at IS NOT NULL;
