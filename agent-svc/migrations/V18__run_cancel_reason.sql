-- The reason a caller gave CancelRun for a live run: the replica running it, which may be
-- another, ends the run with it ("The run was cancelled: <reason>") in its terminal event and
-- error, as the API promises. The first reason given is kept.
ALTER TABLE agent.runs ADD COLUMN cancel_reason text;
