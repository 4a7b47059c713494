-- An archived session remembers whether it read others' words — a tool result marked as
-- external content in its transcript, or a run of it that read external content some other
-- way (attached items, memories from external content, earlier sessions' summaries) — so a
-- later run that reads its summary (the prompt's recent sessions, search_agent_history)
-- counts as having read external content (P-1, U-2, issue 14). Archives and runs from before
-- this cannot say, and count as not.
ALTER TABLE agent.session_archives ADD COLUMN external boolean NOT NULL DEFAULT false;
ALTER TABLE agent.runs ADD COLUMN read_external boolean NOT NULL DEFAULT false;
