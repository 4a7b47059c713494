-- GetUsage sums an owner's model usage over a window (E-10).
--
-- Runs by owner and creation: without this index every run of every owner is read. One more
-- index entry per admitted run. A plain CREATE INDEX holds off writes to agent.runs while it
-- builds; on a large table build it first with CREATE INDEX CONCURRENTLY under this name (see
-- deploy/README.md) and this migration finds it in place. One such build that was interrupted
-- leaves an invalid index under the name: it is dropped and built here.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE n.nspname = 'agent' AND c.relname = 'runs_owner_created' AND NOT i.indisvalid) THEN
        DROP INDEX agent.runs_owner_created;
    END IF;
END $$;
CREATE INDEX IF NOT EXISTS runs_owner_created ON agent.runs (owner, created_at);

-- What each session summary's model call cost (same shape as runs.usage), its owner's like a
-- run's calls. Recorded whether or not its archive is made: the call was paid for.
CREATE TABLE agent.summary_spend (
    id    bigserial   PRIMARY KEY,
    owner text        NOT NULL,
    at    timestamptz NOT NULL DEFAULT now(),
    usage jsonb       NOT NULL
);
CREATE INDEX summary_spend_owner_at ON agent.summary_spend (owner, at);
