-- A run that paused for approval resumes with the tools it was allowed when it asked (a
-- scheduled briefing's short list, a session opening's none), not the user's whole list.
-- NULL: the run could use every tool.
ALTER TABLE agent.approvals ADD COLUMN allowed_tools text[];
