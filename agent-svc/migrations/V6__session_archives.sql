-- Archived sessions (B-4): the LLM history of an idle thread, summarised and cleared.
CREATE TABLE agent.session_archives (
    id              bigserial   PRIMARY KEY,
    thread_id       text        NOT NULL,
    owner           text        NOT NULL,
    summary         text        NOT NULL,
    transcript      jsonb       NOT NULL,
    transcript_text text        NOT NULL,
    turn_count      integer     NOT NULL,
    started_at      timestamptz,
    archived_at     timestamptz NOT NULL DEFAULT now(),
    tsv             tsvector    GENERATED ALWAYS AS (to_tsvector('english', summary || ' ' || transcript_text)) STORED
);
CREATE INDEX session_archives_owner ON agent.session_archives (owner, archived_at DESC);
CREATE INDEX session_archives_tsv ON agent.session_archives USING gin (tsv);
