-- The last attempt of a task agent whose outcome was recorded (B-5, E-12). A later attempt
-- first looks at the newest run on the task's thread: a run of an attempt after this one was
-- never accounted for (its worker died, was stopped, or could not follow it), so it is
-- followed, or its ending used, instead of a second run being started beside it.
ALTER TABLE agent.task_agents ADD COLUMN settled_attempt integer NOT NULL DEFAULT 0;
