-- A side-effect call's idempotency key is claimed by a committed row (state 'pending', held by
-- one caller until lease_until) instead of an advisory lock inside an open transaction, so no
-- pooled connection is held while the upstream call runs (issue 13). 'done' rows hold the
-- stored result as before.
ALTER TABLE gateway.idempotency
    ALTER COLUMN outcome DROP NOT NULL,
    ADD COLUMN state text NOT NULL DEFAULT 'done' CHECK (state IN ('pending', 'done')),
    ADD COLUMN holder text,
    ADD COLUMN lease_until timestamptz,
    ADD CONSTRAINT idempotency_done_has_outcome CHECK (state = 'pending' OR outcome IS NOT NULL);
