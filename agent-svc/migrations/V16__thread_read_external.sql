-- Whether the thread's current session has read others' words in any way a transcript does
-- not show (an attached item, a memory taken from external content, an earlier session's
-- summary in a run's prompt): set by a run's commit under its lease, read and cleared by the
-- archive that ends the session, which then records itself as external (P-1, U-2).
ALTER TABLE agent.threads ADD COLUMN read_external boolean NOT NULL DEFAULT false;
-- A development build briefly kept the mark on runs instead; no database needs it.
ALTER TABLE agent.runs DROP COLUMN IF EXISTS read_external;
