-- Issue 14: an approval is bound to what its preview resolved (a reply's recipients, an
-- event's current state) and remembers which external content the run had read, so the
-- approved call runs only if those facts still hold and stores memories with provenance.
ALTER TABLE agent.approvals
    ADD COLUMN binding text NOT NULL DEFAULT '',
    ADD COLUMN tainted_by text[] NOT NULL DEFAULT '{}';
