-- The last attempt of a task agent whose outcome was recorded (B-5, E-12). A later attempt
-- first looks at the newest run on the task's thread: a run of an attempt after this one was
-- never accounted for (its worker died, was stopped, or could not follow it), so it is
-- followed, or its ending used, instead of a second run being started beside it.
ALTER TABLE agent.task_agents ADD COLUMN settled_attempt integer NOT NULL DEFAULT 0;
-- Tasks already queued have recorded every attempt they made; one still running has not
-- recorded its current attempt, whose run is followed by whatever takes it up next.
UPDATE agent.task_agents
   SET settled_attempt = CASE WHEN state = 'running' THEN greatest(attempts - 1, 0) ELSE attempts END;
