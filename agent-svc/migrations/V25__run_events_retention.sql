-- RUN_EVENTS_RETENTION: the events of a run that ended long ago are thinned to its last one,
-- the result (its answer stays in the thread's messages, its record in agent.runs).
-- `events_pruned` marks the runs done, so each is thinned once; the partial index finds the
-- runs still to do, oldest first, without reading those done. A plain CREATE INDEX holds off
-- writes to agent.runs while it builds: on a large table build it first with CREATE INDEX
-- CONCURRENTLY under this name (see deploy/README.md) and this migration finds it in place. One
-- such build that was interrupted leaves an invalid index under the name: it is dropped and
-- built here.
ALTER TABLE agent.runs ADD COLUMN IF NOT EXISTS events_pruned boolean NOT NULL DEFAULT false;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE n.nspname = 'agent' AND c.relname = 'runs_events_to_prune' AND NOT i.indisvalid) THEN
        DROP INDEX agent.runs_events_to_prune;
    END IF;
END $$;
CREATE INDEX IF NOT EXISTS runs_events_to_prune ON agent.runs (finished_at)
    WHERE finished_at IS NOT NULL AND NOT events_pruned;
