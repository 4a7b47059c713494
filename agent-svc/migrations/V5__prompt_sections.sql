-- Which system prompt sections a run used and their estimated tokens (B-1), for GetRun.
ALTER TABLE agent.runs ADD COLUMN prompt_sections jsonb NOT NULL DEFAULT '[]';
