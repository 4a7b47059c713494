-- Issue 13: an admission goes to the database as one pipeline, COMMIT included — one round
-- trip instead of two, while a pooled connection is held through the start of every run.
-- What used to be decided between the statements and COMMIT (too many live runs, a busy
-- thread, a run paused for approval, a retried request id) is decided by the statements
-- themselves: each raises this when its condition fails, which aborts the transaction, so the
-- statements behind it fail unexecuted and COMMIT answers ROLLBACK. The SQLSTATE says which
-- condition failed and DETAIL carries what the caller is told (a count, a run id).
CREATE FUNCTION agent.admission_refused(code text, detail text) RETURNS bigint
    LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'the admission was refused (%)', code USING ERRCODE = code, DETAIL = detail;
END
$$;
