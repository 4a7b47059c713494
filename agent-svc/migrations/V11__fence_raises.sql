-- Issue 13: a run's commit goes to the database as one pipeline — BEGIN, the lease fence, the
-- writes and COMMIT sent together, one round trip. Nothing after a failed fence may commit, so
-- the fence aborts its transaction by raising this (the writes behind it then fail unexecuted
-- and COMMIT answers ROLLBACK). VOLATILE keeps the planner from evaluating it ahead of time.
CREATE FUNCTION agent.lease_lost() RETURNS integer
    LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'the run''s thread lease is no longer held by this writer'
        USING ERRCODE = 'SWL01';
END
$$;
