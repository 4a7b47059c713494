-- actions_run (run_id, created_at) has served no query since V8 ordered a run's actions by ord
-- (actions_run_ord, which also serves the cascade from runs), yet every action insert still
-- wrote an entry in it (issue 13).
DROP INDEX agent.actions_run;
