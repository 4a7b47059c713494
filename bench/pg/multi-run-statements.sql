-- The same four runs' commits as one statement per table for all four: 3 statements.
\set b random(0, 7) * 8
\set s random(1, 2000000000)
\startpipeline
BEGIN;
UPDATE agent.threads SET updated_at = now() WHERE id = ANY (ARRAY['t' || (:b + 1), 't' || (:b + 2), 't' || (:b + 3), 't' || (:b + 4)]);
INSERT INTO agent.run_events (run_id, seq, payload) SELECT r, :s, '\x0a0b' FROM unnest(ARRAY['r' || (:b + 1), 'r' || (:b + 2), 'r' || (:b + 3), 'r' || (:b + 4)]) r;
UPDATE agent.runs SET iterations = iterations + 1 WHERE id = ANY (ARRAY['r' || (:b + 1), 'r' || (:b + 2), 'r' || (:b + 3), 'r' || (:b + 4)]);
COMMIT;
\endpipeline
