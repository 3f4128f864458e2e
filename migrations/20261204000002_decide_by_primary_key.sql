-- tollgate_decide finds a batch's rows through the primary key, one lookup per key.
--
-- The function's statements are planned once per connection and reused for every batch, so
-- PostgreSQL cannot know how many keys a batch carries: it assumes 10 for an array parameter,
-- and a batch under load carries dozens. Joining dozens of keys to a table of a few thousand
-- rows, it then preferred reading every row of the table into a hash join over the lookups:
-- two whole-table scans a batch, about an eighth of the database's CPU under load
-- (benches/README.md, "Issue 22"). No statement in the function needs a row its batch does not
-- name, so while it runs the planner may not scan whole tables nor hash or merge join (the
-- session's settings come back when it returns); every plan left is lookups by key.
ALTER FUNCTION tollgate_decide(bigint, bytea[], bigint[], bigint[], bigint[])
    SET enable_seqscan = off
    SET enable_hashjoin = off
    SET enable_mergejoin = off;
