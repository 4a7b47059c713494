-- How many of a schedule occurrence's attempts ended because the service running their run was
-- restarted (a rolling deploy): as for task agents (V23), they are attempts (each started its
-- own run, under its own request id) but not tries, so an occurrence outlives the deploys it
-- meets without using up E-12's retries. Reset with the attempts when the occurrence settles.
ALTER TABLE agent.schedules ADD COLUMN restarts int NOT NULL DEFAULT 0;
