-- tollgate_decide finds a batch's rows through the primary key, one lookup per key.
--
-- PL/pgSQL keeps its statements' plans per connection and, after a few calls, reuses one
-- generic plan for batches of any size, assuming 10 keys for an array parameter; a batch under
-- load carries dozens. Joining dozens of keys to a table of a few thousand rows, PostgreSQL
-- preferred reading every row of the table into a hash join over the lookups, in plans for the
-- real size too: about an eighth of the CPU of a core shared with tollgate under load, a fifth
-- of PostgreSQL's own (benches/README.md, "Issue 22"). No statement in the function needs a row
-- its batch does not name, so while it runs the planner may not scan whole tables nor hash or
-- merge join (the session's settings come back when it returns); every plan left is lookups by
-- key.
--
-- A later CREATE OR REPLACE FUNCTION tollgate_decide resets these settings: it must restate
-- them (SET enable_seqscan = off ...) or be followed by this ALTER again.
ALTER FUNCTION tollgate_decide(bigint, bytea[], bigint[], bigint[], bigint[])
    SET enable_seqscan = off
    SET enable_hashjoin = off
    SET enable_mergejoin = off;
