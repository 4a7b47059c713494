-- The retention sweep's index: only the rows it may ever delete. A lapsed claim whose call
-- marked itself acting is kept for good (R-3: its call may have acted), so in the plain
-- updated_at index such rows gather at the old end, and every batch of every sweep read past
-- all of them before finding one to delete. The sweep's condition implies this one, so the
-- planner uses it. idempotency_updated_at stays while the build before this one may run (its
-- sweep uses it); a later build drops it. On a large table build it first, CONCURRENTLY,
-- under this name (see deploy/README.md); an invalid index one such build left is dropped
-- and built here.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE n.nspname = 'gateway' AND c.relname = 'idempotency_prunable' AND NOT i.indisvalid) THEN
        DROP INDEX gateway.idempotency_prunable;
    END IF;
END $$;
CREATE INDEX IF NOT EXISTS idempotency_prunable ON gateway.idempotency (updated_at)
    WHERE state = 'done' OR NOT acting;
