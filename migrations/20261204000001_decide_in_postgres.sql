-- A batch of requests decided inside PostgreSQL, in one statement (src/store/postgres/mod.rs).
--
-- HOT updates: a decision rewrites tokens_ut, updated_us and full_at_us. With an index on
-- full_at_us every such update had to add index entries (no heap-only tuple); now the primary
-- key is the only index, and its column never changes, so an update stays on its page when the
-- page has room: the fillfactor keeps a fifth of each page free for that.
DROP INDEX IF EXISTS tollgate_buckets_full_at;
ALTER TABLE tollgate_buckets SET (fillfactor = 80);

-- tollgate_decide decides a batch of requests exactly as lua/decide.lua does (the same
-- per-bucket arguments, worked out by tollgate from each bucket's plan; the same integer
-- micro-token arithmetic, here in bigint and numeric rather than doubles below 2^53), so the
-- shared vectors pin both (tests/vectors/token_bucket.yaml). Schedules (kind 2 in the script)
-- are never sent here: tollgate decides those in a transaction of its own.
--
-- Units: microseconds since the epoch, micro-tokens (1 token = 1,000,000).
--
-- now_override: the time to decide at (tests only); NULL = clock_timestamp(), read once every
--   row is locked, so a bucket's decisions follow its lock order in time.
-- keys: the batch's distinct row keys, sorted (the order rows are locked in: requests over
--   {A, B} and {B, A} never deadlock).
-- req: per request 2 numbers: #buckets, #demands.
-- bk: per bucket 9, request after request: key (1-based index into keys), kind (1 F a constant
--   limit, 3 Q a calendar quota, 4 D a debt quota, 5 E an expiring allowance), cap, num, den
--   (capacity in µt, refill num µt per den µs), lo, hi (the limit holds over [lo, hi), 0 =
--   unbounded; for Q and D, lo is the last reset edge), bound (D: the edge after hi; E: the
--   length of a period), since (when a reload replaced the limit, 0 = none).
-- dm: per demand 5, request after request: instance (1-based within its request), kind (1
--   consume, 2 check, 3 refund, 4 debit, 5 debt check), amount (µt), enforced (1/0), need (4
--   and 5: the µt the bucket must hold to pass).
--
-- Returns one array per request, in order; its first number says what it is:
--   0: decided: 0, now, denied (1/0), passed (1/0) per demand, then per bucket 8: stored
--      tokens, stored updated, tokens before, updated before, tokens after, updated after,
--      changed (1/0), lost (µt of debits that found the bucket empty);
--   1: {1, now}: some bucket's time lies outside its [lo, hi) (retry with the limit at now);
--   2: {2, now}: a bucket written before a reload that replaced its limit, or a debt quota
--      written before its last edge, must be walked by tollgate;
--   3: {3, now}: a stored state that is not tollgate's (negative).
-- Nothing of a request answered 1, 2 or 3 is changed; the other requests are decided.
CREATE OR REPLACE FUNCTION tollgate_decide(
    now_override bigint, keys bytea[], req bigint[], bk bigint[], dm bigint[]
) RETURNS SETOF bigint[] LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
DECLARE
    micro constant bigint := 1000000;
    never constant numeric := 9223372036854775807;
    nk int := coalesce(array_length(keys, 1), 0);
    nreq int := coalesce(array_length(req, 1), 0) / 2;
    now_us bigint;
    -- Per key: its current state (NULL: none, a full bucket), its full-again time, whether a
    -- request changed it.
    kt bigint[];
    ku bigint[];
    kf bigint[] := array_fill(NULL::bigint, ARRAY[nk]);
    kdirty boolean[] := array_fill(false, ARRAY[nk]);
    -- Per bucket of the request being decided.
    xk int[]; xkind bigint[]; xcap bigint[]; xnum bigint[]; xden bigint[];
    xlo bigint[]; xhi bigint[]; xbound bigint[];
    xst bigint[]; xsu bigint[]; xbt bigint[]; xbu bigint[];
    xcons bigint[]; xref bigint[]; xdeb bigint[];
    bo int := 0;
    dof int := 0;
    nb int; nd int; o int; k int; status int;
    st bigint; su bigint; t bigint; at bigint; c bigint; whole bigint; elapsed bigint; missing bigint;
    q bigint; r bigint; w numeric; full_at numeric; debited bigint; amount bigint;
    ok boolean; denied boolean; take boolean; give boolean; changed boolean;
    out bigint[];
    upd_k bytea[] := '{}'; upd_t bigint[] := '{}'; upd_u bigint[] := '{}'; upd_f bigint[] := '{}';
    del_k bytea[] := '{}';
    locked int;
BEGIN
    -- Every row locked in ascending key order, the missing ones inserted (NULL state: full).
    -- DO UPDATE ... WHERE false locks an existing row without writing a version of it; it waits
    -- for whoever holds the row, and inserts it again if that holder deleted it.
    INSERT INTO tollgate_buckets AS b (key) SELECT k FROM unnest(keys) AS k ORDER BY k
        ON CONFLICT (key) DO UPDATE SET tokens_ut = b.tokens_ut WHERE false;
    -- A statement of its own, so its snapshot sees what the holders we waited for committed.
    SELECT array_agg(b.tokens_ut ORDER BY u.i), array_agg(b.updated_us ORDER BY u.i), count(*)
        INTO kt, ku, locked
        FROM unnest(keys) WITH ORDINALITY AS u(k, i) JOIN tollgate_buckets AS b ON b.key = u.k;
    IF locked <> nk THEN
        RAISE EXCEPTION 'tollgate: locked % of % bucket rows', locked, nk;
    END IF;
    now_us := coalesce(now_override, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint);

    FOR rq IN 1 .. nreq LOOP
        nb := req[2 * rq - 1];
        nd := req[2 * rq];
        status := 0;
        -- Read every bucket: none stored means full at the capacity in force.
        FOR i IN 1 .. nb LOOP
            o := (bo + i - 1) * 9;
            k := bk[o + 1];
            xk[i] := k; xkind[i] := bk[o + 2]; xcap[i] := bk[o + 3]; xnum[i] := bk[o + 4];
            xden[i] := bk[o + 5]; xlo[i] := bk[o + 6]; xhi[i] := bk[o + 7]; xbound[i] := bk[o + 8];
            xcons[i] := 0; xref[i] := 0; xdeb[i] := 0;
            IF kt[k] IS NULL OR ku[k] IS NULL THEN
                xst[i] := xcap[i]; xsu[i] := now_us;
            ELSE
                xst[i] := kt[k]; xsu[i] := ku[k];
                IF xst[i] < 0 OR xsu[i] < 0 THEN
                    status := 3;
                ELSIF status = 0 AND ((bk[o + 9] > 0 AND xsu[i] < bk[o + 9])
                        OR (xkind[i] = 4 AND now_us > xsu[i] AND xlo[i] > xsu[i])) THEN
                    status := 2;
                END IF;
            END IF;
        END LOOP;
        -- The limit holds at the bucket's own time: now, or its write when the clock stepped
        -- back. Outside [lo, hi) tollgate must look it up again.
        IF status = 0 THEN
            FOR i IN 1 .. nb LOOP
                IF xkind[i] <> 1 OR xlo[i] > 0 OR xhi[i] > 0 THEN
                    at := greatest(now_us, xsu[i]);
                    IF at < xlo[i] OR (xhi[i] > 0 AND at >= xhi[i]) THEN
                        status := 1;
                    END IF;
                END IF;
            END LOOP;
        END IF;
        IF status <> 0 THEN
            RETURN NEXT ARRAY[status, now_us];
        ELSE
            -- Bring each forward to now (before).
            FOR i IN 1 .. nb LOOP
                st := xst[i]; su := xsu[i];
                IF xkind[i] = 5 THEN
                    -- An expiring allowance: whole, with no period yet, once its period ended.
                    IF now_us >= su + xbound[i] OR st >= xcap[i] THEN
                        xbt[i] := xcap[i]; xbu[i] := greatest(now_us, su);
                    ELSE
                        xbt[i] := least(st, xcap[i]); xbu[i] := su;
                    END IF;
                ELSIF xkind[i] >= 3 THEN
                    IF now_us > su AND xlo[i] > su THEN
                        xbt[i] := xcap[i]; xbu[i] := now_us;
                    ELSE
                        xbt[i] := least(st, xcap[i]); xbu[i] := greatest(su, now_us);
                    END IF;
                ELSE
                    -- Refill (Rate::credit): trim to the capacity, earn for the time elapsed.
                    t := least(st, xcap[i]);
                    elapsed := greatest(now_us - su, 0);
                    missing := xcap[i] - t;
                    IF xnum[i] = 0 THEN
                        c := 0;
                    ELSE
                        whole := elapsed / xden[i];
                        IF whole > missing / xnum[i] THEN
                            c := NULL;
                        ELSE
                            c := whole * xnum[i] + ((elapsed - whole * xden[i]) * xnum[i]) / xden[i];
                            IF c >= missing THEN c := NULL; END IF;
                        END IF;
                    END IF;
                    xbt[i] := CASE WHEN c IS NULL THEN xcap[i] ELSE t + c END;
                    xbu[i] := greatest(now_us, su);
                END IF;
            END LOOP;
            -- Add up the demands per bucket (clamped: never past bigint, far past any capacity).
            FOR j IN 1 .. nd LOOP
                o := (dof + j - 1) * 5;
                k := dm[o + 1];
                amount := dm[o + 3];
                CASE dm[o + 2]
                    WHEN 1 THEN xcons[k] := least(xcons[k] + amount, 4611686018427387904);
                    WHEN 3 THEN xref[k] := least(xref[k] + amount, 4611686018427387904);
                    WHEN 4 THEN xdeb[k] := least(xdeb[k] + amount, 4611686018427387904);
                    ELSE NULL;
                END CASE;
            END LOOP;
            denied := false;
            out := ARRAY[0, now_us, 0];
            FOR j IN 1 .. nd LOOP
                o := (dof + j - 1) * 5;
                k := dm[o + 1];
                ok := CASE dm[o + 2]
                    WHEN 1 THEN xbt[k] >= xcons[k]
                    WHEN 2 THEN xbt[k] >= xcons[k] + micro
                    WHEN 3 THEN true
                    ELSE xbt[k] >= dm[o + 5]
                END;
                out := out || CASE WHEN ok THEN 1::bigint ELSE 0::bigint END;
                IF NOT ok AND dm[o + 4] = 1 THEN denied := true; END IF;
            END LOOP;
            IF denied THEN out[3] := 1; END IF;
            FOR i IN 1 .. nb LOOP
                k := xk[i];
                t := xbt[i];
                take := NOT denied AND xcons[i] > 0 AND t >= xcons[i];
                IF take THEN t := t - xcons[i]; END IF;
                -- Usage that happened is recorded whatever the decision, down to the floor.
                debited := least(xdeb[i], t);
                t := t - debited;
                give := xref[i] > 0 AND t < xcap[i];
                IF give THEN t := least(t + xref[i], xcap[i]); END IF;
                changed := take OR give OR debited > 0;
                IF changed THEN
                    kdirty[k] := true;
                    IF t >= xcap[i] THEN
                        -- A full bucket is the same as no bucket.
                        kt[k] := NULL; ku[k] := NULL;
                    ELSE
                        kt[k] := t; ku[k] := xbu[i];
                        -- When it is full again (Rate::time_to_earn; q * den in numeric, as den
                        -- can be near 2^53), for the sweep; the far future saturates.
                        w := NULL;
                        IF xnum[i] > 0 THEN
                            q := (xcap[i] - t) / xnum[i];
                            r := (xcap[i] - t) - q * xnum[i];
                            c := (r * xden[i]) / xnum[i];
                            IF c * xnum[i] < r * xden[i] THEN c := c + 1; END IF;
                            w := q::numeric * xden[i] + c;
                        END IF;
                        full_at := CASE xkind[i]
                            WHEN 1 THEN xbu[i] + w
                            WHEN 4 THEN coalesce(nullif(xbound[i], 0), nullif(xhi[i], 0))
                            WHEN 5 THEN xbu[i]::numeric + xbound[i]
                            ELSE nullif(xhi[i], 0)
                        END;
                        kf[k] := least(coalesce(full_at, never), never)::bigint;
                    END IF;
                END IF;
                out := out || ARRAY[xst[i], xsu[i], xbt[i], xbu[i], t, xbu[i],
                    CASE WHEN changed THEN 1::bigint ELSE 0::bigint END, xdeb[i] - debited];
            END LOOP;
            RETURN NEXT out;
        END IF;
        bo := bo + nb;
        dof := dof + nd;
    END LOOP;

    -- Write what changed in one statement each; a row with no state (full again, or created
    -- here and left unchanged) is deleted.
    FOR i IN 1 .. nk LOOP
        IF kt[i] IS NULL OR ku[i] IS NULL THEN
            del_k := del_k || keys[i];
        ELSIF kdirty[i] THEN
            upd_k := upd_k || keys[i]; upd_t := upd_t || kt[i]; upd_u := upd_u || ku[i];
            upd_f := upd_f || kf[i];
        END IF;
    END LOOP;
    IF cardinality(upd_k) > 0 THEN
        UPDATE tollgate_buckets AS b SET tokens_ut = u.t, updated_us = u.u, full_at_us = u.f
            FROM unnest(upd_k, upd_t, upd_u, upd_f) AS u(k, t, u, f) WHERE b.key = u.k;
    END IF;
    IF cardinality(del_k) > 0 THEN
        DELETE FROM tollgate_buckets WHERE key = ANY(del_k);
    END IF;
END
$fn$;
