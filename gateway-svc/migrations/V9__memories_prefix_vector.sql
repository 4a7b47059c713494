-- Issue 13: when no note holds a memory search's words whole, its second pass matches the
-- words as prefixes against each of the user's notes in the 'simple' configuration, which it
-- parsed anew, note by note, on every search: 150 ms for a user with 20,000 notes, on every
-- run's [ABOUT THE USER] lookup, and as long for the up to 31 lookups read with it. The parse
-- is kept here instead, once per note. There is deliberately no index on it: an index over
-- every user's notes would make a prefix common to many users ("the:*" — 'simple' keeps stop
-- words) read all their matches, where the user's own notes bound this pass now.
-- Adding a stored column rewrites the table once, under its exclusive lock.
ALTER TABLE gateway.memories
    ADD COLUMN tsv_simple tsvector GENERATED ALWAYS AS (to_tsvector('simple', search_text)) STORED;
