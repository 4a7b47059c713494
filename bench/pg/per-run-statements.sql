-- Four runs' commits (fence, event, patch) as one statement per run and row: 12 statements.
\set b random(0, 7) * 8
\set s random(1, 2000000000)
\startpipeline
BEGIN;
UPDATE agent.threads SET updated_at = now() WHERE id = 't' || (:b + 1);
INSERT INTO agent.run_events (run_id, seq, payload) VALUES ('r' || (:b + 1), :s, '\x0a0b');
UPDATE agent.runs SET iterations = iterations + 1 WHERE id = 'r' || (:b + 1);
UPDATE agent.threads SET updated_at = now() WHERE id = 't' || (:b + 2);
INSERT INTO agent.run_events (run_id, seq, payload) VALUES ('r' || (:b + 2), :s, '\x0a0b');
UPDATE agent.runs SET iterations = iterations + 1 WHERE id = 'r' || (:b + 2);
UPDATE agent.threads SET updated_at = now() WHERE id = 't' || (:b + 3);
INSERT INTO agent.run_events (run_id, seq, payload) VALUES ('r' || (:b + 3), :s, '\x0a0b');
UPDATE agent.runs SET iterations = iterations + 1 WHERE id = 'r' || (:b + 3);
UPDATE agent.threads SET updated_at = now() WHERE id = 't' || (:b + 4);
INSERT INTO agent.run_events (run_id, seq, payload) VALUES ('r' || (:b + 4), :s, '\x0a0b');
UPDATE agent.runs SET iterations = iterations + 1 WHERE id = 'r' || (:b + 4);
COMMIT;
\endpipeline
