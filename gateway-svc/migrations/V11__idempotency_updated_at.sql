-- When an idempotency row last changed (claimed, taken over, marked acting, completed), so
-- rows past IDEMPOTENCY_RETENTION can be found and deleted in small batches by index: a
-- settled key is only worth keeping while a retry of its call may still come. created_at
-- stays the first claim's time, which a takeover long after would make look old while
-- freshly settled. Rows already stored count from this migration, so none goes sooner than
-- the retention after it.
ALTER TABLE gateway.idempotency
    ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now();
CREATE INDEX idempotency_updated_at ON gateway.idempotency (updated_at);
