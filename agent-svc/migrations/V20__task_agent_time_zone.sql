-- The time zone of the run that started a task agent: the task's runs give their current time
-- in it, as the parent's did (B-1). NULL for tasks queued before, and for a parent run without
-- one: UTC.
ALTER TABLE agent.task_agents ADD COLUMN time_zone text;
