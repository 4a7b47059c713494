-- Which replica's idle-session sweep is summarising the thread, until when (B-4): the others
-- skip it rather than each calling the summary model for the same session. NULL: unclaimed.
ALTER TABLE agent.threads ADD COLUMN archive_claimed_until timestamptz;
