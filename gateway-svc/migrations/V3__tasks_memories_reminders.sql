-- The built-in tools' own data (I-6, I-7), always scoped by user_id from identity.

CREATE TABLE gateway.tasks (
    id           bigserial   PRIMARY KEY,
    user_id      text        NOT NULL,
    title        text        NOT NULL,
    description  text,
    due_at       timestamptz,
    completed_at timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX tasks_user ON gateway.tasks (user_id, id);

CREATE TABLE gateway.memories (
    id          bigserial   PRIMARY KEY,
    user_id     text        NOT NULL,
    content     text        NOT NULL,
    tags        text[]      NOT NULL DEFAULT '{}',
    -- content and tags, as searched; maintained by the service
    search_text text        NOT NULL,
    tsv         tsvector    GENERATED ALWAYS AS (to_tsvector('english', search_text)) STORED,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX memories_user ON gateway.memories (user_id, id);
CREATE INDEX memories_tsv ON gateway.memories USING gin (tsv);

CREATE TABLE gateway.reminders (
    id         bigserial   PRIMARY KEY,
    user_id    text        NOT NULL,
    text       text        NOT NULL,
    due_at     timestamptz NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX reminders_user_due ON gateway.reminders (user_id, due_at);
