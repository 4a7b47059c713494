-- How many of a task agent's settled attempts ended because the service running their run was
-- restarted (a rolling deploy): they are attempts (each started its own run) but not tries, so
-- a task outlives as many deploys as it meets without using up E-12's retries.
ALTER TABLE agent.task_agents ADD COLUMN restarts int NOT NULL DEFAULT 0;
