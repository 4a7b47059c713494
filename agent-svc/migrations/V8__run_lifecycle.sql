-- The run as one durable state machine (issue 11): a fencing token on the thread lease, the
-- system prompt a run was assembled with (continuations reuse it), every action transition,
-- and the indexes the monitor and fair-use checks read.
ALTER TABLE agent.threads ADD COLUMN lock_token text;
ALTER TABLE agent.runs ADD COLUMN system_prompt text NOT NULL DEFAULT '';
ALTER TABLE agent.actions ADD COLUMN transitions jsonb NOT NULL DEFAULT '[]';
-- Run, action and approval states are closed sets: a typo can never be stored.
ALTER TABLE agent.runs ADD CONSTRAINT runs_state_known CHECK (state IN
    ('queued', 'planning', 'executing', 'awaiting_confirmation', 'completed', 'failed', 'cancelled'));
ALTER TABLE agent.actions ADD CONSTRAINT actions_state_known CHECK (state IN
    ('planned', 'awaiting_confirmation', 'executing', 'completed', 'failed', 'rejected'));
ALTER TABLE agent.approvals ADD CONSTRAINT approvals_state_known CHECK (state IN
    ('pending', 'approved', 'rejected', 'expired'));
-- Live runs per owner (fair use) and across owners (the monitor).
CREATE INDEX runs_live ON agent.runs (owner) WHERE state IN ('queued', 'planning', 'executing');
CREATE INDEX runs_paused_thread ON agent.runs (thread_id) WHERE state = 'awaiting_confirmation';
CREATE INDEX approvals_pending_thread ON agent.approvals (thread_id) WHERE state = 'pending';
CREATE INDEX task_agents_owner_open ON agent.task_agents (owner) WHERE state IN ('queued', 'running');
ALTER TABLE agent.actions ADD COLUMN ord bigserial;
CREATE INDEX actions_run_ord ON agent.actions (run_id, ord);
CREATE INDEX actions_call ON agent.actions (call_id);
