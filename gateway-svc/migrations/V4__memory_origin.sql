-- Issue 14: where a memory came from. Empty: the user's own words. Otherwise the external
-- content the run had read when it was written (e.g. "read by search_gmail in run r1"), shown
-- with the memory wherever it is read back.
ALTER TABLE gateway.memories ADD COLUMN origin text NOT NULL DEFAULT '';
