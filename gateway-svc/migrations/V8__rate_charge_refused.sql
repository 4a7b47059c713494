-- A rate-limit charge is one statement when the whole charge fits every window of its key
-- (issue 13): each window is raised by the charge only where it has room, and the statement
-- undoes itself through this function when some window had none (SQLSTATE SWR01), so a
-- charge never lands in part. The gateway then decides that charge under the key's lock.
CREATE FUNCTION gateway.charge_refused() RETURNS bigint
    LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'the charge does not fit every window of its key' USING ERRCODE = 'SWR01';
END
$$;
