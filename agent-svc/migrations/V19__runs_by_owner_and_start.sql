-- GetUsage sums an owner's runs started in a window (E-10): without this index it reads every
-- run of every owner. One more index entry per admitted run.
CREATE INDEX runs_owner_created ON agent.runs (owner, created_at);
