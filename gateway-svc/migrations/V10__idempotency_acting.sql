-- A pending idempotency claim whose call let a write leave for upstream is marked before the
-- write leaves: once its hold lapses such a claim is never taken over (its call may have
-- acted, R-3), while one never marked still is (its holder died before acting).
ALTER TABLE gateway.idempotency
    ADD COLUMN acting boolean NOT NULL DEFAULT false;
