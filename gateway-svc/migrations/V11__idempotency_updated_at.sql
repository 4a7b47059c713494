-- When an idempotency row last changed (claimed, taken over, marked acting, completed), so
-- rows past IDEMPOTENCY_RETENTION can be found and deleted in small batches by index: a
-- settled key is only worth keeping while a retry of its call may still come. created_at
-- stays the first claim's time, which a takeover long after would make look old while
-- freshly settled. Rows already stored count from this migration, so none goes sooner than
-- the retention after it. A plain CREATE INDEX holds off claims while it builds: on a large
-- table add the column and build the index first, CONCURRENTLY, under these names (see
-- deploy/README.md), and this migration finds them in place; an invalid index one such
-- build left is dropped and built here.
ALTER TABLE gateway.idempotency
    ADD COLUMN IF NOT EXISTS updated_at timestamptz NOT NULL DEFAULT now();
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE n.nspname = 'gateway' AND c.relname = 'idempotency_updated_at' AND NOT i.indisvalid) THEN
        DROP INDEX gateway.idempotency_updated_at;
    END IF;
END $$;
CREATE INDEX IF NOT EXISTS idempotency_updated_at ON gateway.idempotency (updated_at);
