-- A token refresh holds its account by a committed lease (refresh_holder until refresh_until)
-- instead of a row lock inside an open transaction, so no pooled connection is held while the
-- OAuth token endpoint answers (issue 13). Reconnecting an account clears the lease.
ALTER TABLE gateway.accounts
    ADD COLUMN refresh_holder text,
    ADD COLUMN refresh_until timestamptz;
