-- Threads and their user-visible messages, the internal LLM transcript, runs and their
-- sequenced events (S-2). Every query is scoped by owner at the API edge.

CREATE TABLE agent.threads (
    id              text        PRIMARY KEY,
    owner           text        NOT NULL,
    title           text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    -- The execution lock (E-11): the run holding it and when its lease ends.
    lock_run_id     text,
    lock_expires_at timestamptz,
    last_run_id     text
);
CREATE INDEX threads_owner_updated ON agent.threads (owner, updated_at DESC, id);

CREATE TABLE agent.messages (
    id         bigserial   PRIMARY KEY,
    thread_id  text        NOT NULL REFERENCES agent.threads (id) ON DELETE CASCADE,
    run_id     text,
    source     text        NOT NULL,
    kind       text        NOT NULL,
    content    text        NOT NULL,
    metadata   jsonb       NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX messages_thread ON agent.messages (thread_id, id);

CREATE TABLE agent.llm_history (
    thread_id text   NOT NULL REFERENCES agent.threads (id) ON DELETE CASCADE,
    seq       bigint NOT NULL,
    turn      jsonb  NOT NULL,
    PRIMARY KEY (thread_id, seq)
);

CREATE TABLE agent.runs (
    id               text        PRIMARY KEY,
    thread_id        text        NOT NULL REFERENCES agent.threads (id) ON DELETE CASCADE,
    owner            text        NOT NULL,
    request_id       text,
    state            text        NOT NULL,
    channel          text        NOT NULL,
    model            text        NOT NULL DEFAULT '',
    usage            jsonb       NOT NULL DEFAULT '{}',
    iterations       integer     NOT NULL DEFAULT 0,
    error            text,
    failure_kind     text,
    summary          text        NOT NULL DEFAULT '',
    cancel_requested boolean     NOT NULL DEFAULT false,
    last_event_seq   bigint      NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,
    finished_at      timestamptz
);
CREATE UNIQUE INDEX runs_owner_request ON agent.runs (owner, request_id) WHERE request_id IS NOT NULL;

CREATE TABLE agent.run_events (
    run_id  text   NOT NULL REFERENCES agent.runs (id) ON DELETE CASCADE,
    seq     bigint NOT NULL,
    payload bytea  NOT NULL,
    PRIMARY KEY (run_id, seq)
);
