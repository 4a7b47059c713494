-- An archived session remembers whether its transcript held others' words (a tool result
-- marked as external content), so a later run that reads its summary (the prompt's recent
-- sessions, search_agent_history) counts as having read external content (P-1, issue 14).
-- Archives made before this cannot say, and count as not.
ALTER TABLE agent.session_archives ADD COLUMN external boolean NOT NULL DEFAULT false;
