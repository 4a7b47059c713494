-- The IANA time zone a run was started with: a continuation after an approval starts its task
-- agents in it, as the segment before the pause would have (B-1). NULL: none was given (UTC),
-- or the run was admitted before this column.
ALTER TABLE agent.runs ADD COLUMN time_zone text;
