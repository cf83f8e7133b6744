package flush

// Settle on Postgres: the statements, in network round trips ("|" separates
// statements sent together in one pgx.Batch).
//
// Events on (C = the batch has charges, R = it has refunds):
//
//	1. BEGIN | mark | SAVEPOINT settle_events                              (C)
//	   | the neighbouring month's rows of client ids charged near a month's
//	     edge (pgCrossMonthSQL; only when the batch has such charges)
//	2. COPY events FROM STDIN (binary), straight into the partitioned table (C)
//	   -- only if that COPY hits the unique key (a duplicate event id):
//	   ROLLBACK TO SAVEPOINT settle_events
//	   CREATE TEMP TABLE settle_charges ... ON COMMIT DROP
//	   COPY settle_charges FROM STDIN (binary)
//	   WITH ins AS (INSERT INTO events SELECT ... FROM settle_charges
//	       ON CONFLICT DO NOTHING RETURNING seq) SELECT the staged rows not in
//	       ins, with the origin of the row they collided with
//	   -- and per duplicate: a retry that takes a refunded event over, or one
//	   served again under a billed event (counted before step 3 reads it)
//	3. refunds: one statement over UNNEST arrays that marks found and
//	   unrefunded events refunded, inserts tombstones for the missing ones,
//	   and says which was which                                            (R)
//	4. usage upsert | create missing monthly grants | [the node's
//	   reservation lock, shared, when units go back into a reservation] |
//	   lock grants FOR UPDATE | reservations update/insert | grants update
//	5. COMMIT
//
// Why the direct COPY first: duplicates are rare (a client retry that
// reached a new owner after a failover), and the unique key on (account_id,
// event_id, period_start) proves their absence for free. Staging every batch
// and inserting with ON CONFLICT DO NOTHING cost twice as much (measured:
// 100k charges, COPY to staging 130-300 ms plus 800-950 ms for the
// INSERT ... ON CONFLICT with its duplicate report, against 450-550 ms for
// the direct COPY), which missed the 100,000 events/s target. A batch that
// does contain a duplicate pays for both: the failed COPY, then staging.
//
// Events off: nothing depends on the event log, so everything is known
// before the first statement and the whole settle is two round trips:
//
//	1. BEGIN | mark | usage upsert | monthly grants | lock | reservations | grants
//	2. COMMIT
//
// If the mark shows the batch applied before (or a conflict), the
// statements queued behind it are rolled back unread. SettleResult.RoundTrips
// counts statements (BEGIN, COPY and COMMIT count one each): at most 11 with
// the event log (15 when a duplicate sends the batch through staging; one
// more near a month's edge, one more when a refund gives units back to a
// reservation) and 8 without (9), whatever the batch size.
// Creating event partitions, the first time this process settles into a
// month, adds 3 statements plus one per month (BEGIN | advisory lock |
// CREATE TABLE ... PARTITION OF, then COMMIT).

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/quotaring/quotaring/shard"
)

// pgMarkSQL moves the settled mark from Prev to Next and reads it, in one
// statement. The subquery sees the mark as it was when the statement began.
const pgMarkSQL = `WITH upd AS (
	UPDATE nodes SET settled_seq = $4, heartbeat_at = now(), stopped_at = NULL,
		settled_through = CASE WHEN $5::timestamptz IS NULL THEN settled_through ELSE LEAST(now(), $5::timestamptz) END
	WHERE node_id = $1 AND incarnation = $2 AND settled_seq = $3 AND ($6 = '' OR process IS NULL OR process = $6)
	RETURNING 1
)
SELECT (SELECT count(*) FROM upd), n.settled_seq, n.process FROM (SELECT 1) one
	LEFT JOIN nodes n ON n.node_id = $1 AND n.incarnation = $2`

const pgStagingSQL = `CREATE TEMP TABLE settle_charges (
	account_id text, event_id text, client_id boolean, key_id text, route text, units bigint,
	charged_at timestamptz, period text, period_start date, seq bigint, grant_ids text[], grant_units bigint[]
) ON COMMIT DROP`

// pgStagingColumns are the columns of settle_charges, in COPY order.
var pgStagingColumns = []string{"account_id", "event_id", "client_id", "key_id", "route", "units",
	"charged_at", "period", "period_start", "seq", "grant_ids", "grant_units"}

// pgEventColumns are the columns the direct COPY into events fills.
var pgEventColumns = []string{"account_id", "event_id", "client_id", "key_id", "route", "units",
	"charged_at", "period", "period_start", "seq", "grant_ids", "grant_units", "node_id", "incarnation"}

// pgOriginSelect and pgOriginJoin read, for each charge d (seq,
// account_id, event_id, period_start, charged_at) found in the way, the
// origin of the event's row e and what it means for d (see origin); they
// go around the FROM item naming d and the kind of join. $1: the batch's
// node. The LATERAL ... LIMIT 1 probe keeps the planner on the primary key:
// a plain join chose to scan and sort the month's partition.
const pgOriginSelect = `SELECT d.seq, e.node_id, e.incarnation, e.seq,
	e.refunded AND NOT e.tombstone AND NOT $1 = ANY(e.owed) AND e.served_again - cardinality(e.served_by) + cardinality(e.owed) >= 0
		AND (e.refund_wall IS NULL OR d.charged_at > e.refund_wall),
	e.tombstone AND e.refund_pending AND e.node_id <> $1 AND NOT $1 = ANY(e.owed) AND e.served_again - cardinality(e.served_by) + cardinality(e.owed) >= 0
FROM `

const pgOriginJoin = ` JOIN LATERAL (
	SELECT e.node_id, e.incarnation, e.seq, e.refunded, e.tombstone, e.refund_pending, e.served_again, e.refund_wall, e.charged_at, e.served_by, e.owed FROM events e
	WHERE e.account_id = d.account_id AND e.event_id = d.event_id AND e.period_start = d.period_start
	LIMIT 1
) e ON true`

// pgInsertChargesSQL inserts the staged charges and returns the ones that
// were not inserted, with the origin of the row already there (NULL when it
// came in this very statement: the same event id twice in one batch, or a
// concurrent settle: see reprobe).
const pgInsertChargesSQL = `WITH ins AS (
	INSERT INTO events (account_id, event_id, client_id, key_id, route, units, charged_at, period, period_start,
		node_id, incarnation, seq, grant_ids, grant_units)
	SELECT account_id, event_id, client_id, key_id, route, units, charged_at, period, period_start,
		$1, $2, seq, grant_ids, grant_units
	FROM settle_charges
	ORDER BY account_id, event_id
	ON CONFLICT DO NOTHING
	RETURNING seq
), dup AS MATERIALIZED (
	SELECT s.seq, s.account_id, s.event_id, s.period_start, s.charged_at FROM settle_charges s
	WHERE NOT EXISTS (SELECT 1 FROM ins WHERE ins.seq = s.seq)
)
` + pgOriginSelect + `dup d LEFT` + pgOriginJoin

// pgTakeOverSQL gives a refunded event to a retry another node charged and
// served: the retry is billed under the event id, the other nodes' late
// charges still owed (owed.go). $1, $2: node, incarnation;
// $13: the row's month; $14, $15: the retry's, into which the row moves
// (pgTakeOverWhere).
const pgTakeOverSQL = `UPDATE events SET refunded = false, refunded_at = NULL, refund_wall = NULL, served_again = -cardinality(owed), served_by = '{}', replays = 0, replayed_by = '{}', refund_pending = false,
	client_id = $3, key_id = $4, route = $5, units = $6, charged_at = $7, node_id = $1, incarnation = $2, seq = $8,
	grant_ids = $9, grant_units = $10, period = $14, period_start = $15` + pgTakeOverWhere + ` AND refunded AND NOT tombstone`

// pgTakeOverWhere picks the row a take-over updates. A row in the
// neighbouring month (pgCrossMonthSQL) moves into the retry's month, where it
// is billed, as SQLite's single row takes the retry's period; unless that
// month has a row of the event by now (then the take-over updates nothing
// and the charge is decided again: see decideCharge).
const pgTakeOverWhere = `
WHERE account_id = $11 AND event_id = $12 AND period_start = $13
	AND ($13::date = $15::date OR NOT EXISTS (SELECT 1 FROM events x WHERE x.account_id = $11 AND x.event_id = $12 AND x.period_start = $15))`

// pgTakeOverTombstoneSQL gives the tombstone of one attempt's refund (the
// charge of node_id, not settled yet; see pgRefundsSQL) to another attempt,
// served: it is billed under the event id, and the refunded attempt's
// charge, when it arrives, is owed (a debt named for node_id in owed).
// $1, $2: node, incarnation.
const pgTakeOverTombstoneSQL = `UPDATE events SET refunded = false, refunded_at = NULL, tombstone = false,
	served_again = -cardinality(owed) - 1, served_by = '{}', owed = owed || node_id, replays = 0, replayed_by = '{}',
	refund_pending = false, client_id = $3, key_id = $4, route = $5, units = $6, charged_at = $7, node_id = $1, incarnation = $2,
	seq = $8, grant_ids = $9, grant_units = $10, period = $14, period_start = $15` + pgTakeOverWhere + ` AND tombstone AND refund_pending`

// pgServedAgainSQL settles a charge of node $4 (incarnation $5, seq $6)
// that neither takes its event over nor was settled before (see owed.go):
// the late charge of an attempt whose refund settled first, owed (owed
// names $4), pays that debt back, the event billed or not; the charge of
// the attempt whose refund left the tombstone ($4's, refund pending) makes
// the row that refunded charge, no tombstone (another attempt, served, then
// takes it over owing nothing for it); a late charge pays an older build's
// unnamed debt; and a retry served while the event stands billed counts as
// served again, in served_by.
const pgServedAgainSQL = `UPDATE events SET
	served_again = CASE WHEN ` + pgOwedMine + ` OR NOT refunded OR ` + pgUnnamed + ` < 0 THEN served_again + 1 ELSE served_again END,
	owed = CASE WHEN ` + pgOwedMine + ` THEN owed[1:array_position(owed, $4) - 1] || owed[array_position(owed, $4) + 1:cardinality(owed)] ELSE owed END,
	served_by = CASE WHEN NOT ` + pgOwedMine + ` AND NOT refunded AND ` + pgUnnamed + ` >= 0 THEN served_by || $4 ELSE served_by END,
	tombstone = tombstone AND NOT ` + pgOwnTombstone + `,
	refund_pending = refund_pending AND NOT ` + pgOwnTombstone + `,
	incarnation = CASE WHEN ` + pgOwnTombstone + ` THEN $5 ELSE incarnation END,
	seq = CASE WHEN ` + pgOwnTombstone + ` THEN $6 ELSE seq END
WHERE account_id = $1 AND event_id = $2 AND period_start = $3
	AND (` + pgOwedMine + ` OR NOT refunded OR ` + pgUnnamed + ` < 0 OR ` + pgOwnTombstone + `)`

// pgOwedMine: the row owes node $4's late charge.
const pgOwedMine = `($4 = ANY(owed))`

// pgOwnTombstone: the row is the tombstone of node $4's attempt's refund,
// and $4 owes nothing else.
const pgOwnTombstone = `(tombstone AND refund_pending AND node_id = $4 AND NOT $4 = ANY(owed))`

// pgUnnamed is served_again's part no name accounts for (againRow.unnamed).
const pgUnnamed = `(served_again - cardinality(served_by) + cardinality(owed))`

// pgCrossMonthSQL finds, for charges near a month's edge whose own month
// has no row of their event id, the row in the neighbouring month's
// partition (the unique key is per month), with its origin as
// pgOriginSelect reads it: a retry that crossed the month boundary and a
// failover, or a node whose clock ran into the next month. The charge then
// decides on that row as it would on one in its own month (billed: a
// duplicate; refunded: a take-over, or covered by the event's own refund;
// another attempt's tombstone: a take-over), as on SQLite, whose event log
// is one table. $1: the batch's node; $2..$6: seq, account, event id, the
// neighbouring month's start, charged at; $7: the charge's own month.
const pgCrossMonthSQL = pgOriginSelect + `unnest($2::bigint[], $3::text[], $4::text[], $5::date[], $6::timestamptz[], $7::date[])
	AS d(seq, account_id, event_id, period_start, charged_at, own_start)` + pgOriginJoin + `
WHERE NOT EXISTS (SELECT 1 FROM events o WHERE o.account_id = d.account_id AND o.event_id = d.event_id AND o.period_start = d.own_start)
	AND abs(extract(epoch FROM d.charged_at - e.charged_at)) <= $8`

// crossMonthWindow is how close to its month's start or end a charge or
// refund must be for its event id to be looked up in the neighbouring month
// too: a retry comes within the owners' dedup window of the first attempt.
func crossMonthWindow() int64 { return shard.DefaultParams().DedupWindow }

// neighbourMonth is the month next to p that an event at wall may share its
// id with: the previous one near p's start, the next one near its end.
func neighbourMonth(p shard.Period, wall int64) (shard.Period, bool) {
	switch w := crossMonthWindow(); {
	case wall-p.Start() < w:
		return p - 1, true
	case p.End()-wall <= w:
		return p + 1, true
	}
	return 0, false
}

// chargeMonths are the months charge c's event row may be in: its own and,
// near its edge, the neighbouring one (neighbourMonth).
func chargeMonths(c *Charge) []shard.Period {
	months := []shard.Period{c.Period}
	if p, near := neighbourMonth(c.Period, c.Wall); near {
		months = append(months, p)
	}
	return months
}

// pgRefundsSQL applies refunds: found and unrefunded -> refunded (returning
// the event as the log has it); not found -> a tombstone; found refunded ->
// a duplicate refund. $1, $2: node, incarnation; $3..$12: the refunds;
// $13..$15: their allocations, flattened (refund ordinal, grant, units), for
// the tombstones; $16, $17: attempt, origin; $18: the neighbouring month to
// look in (the refund's own month when it is not near an edge); $19: the
// refunds' walls; $20: released (Refund.Released).
const pgRefundsSQL = `WITH r0 AS (
	SELECT * FROM unnest($3::int[], $4::text[], $5::text[], $6::date[], $7::text[], $8::text[], $9::bigint[],
		$10::timestamptz[], $11::text[], $12::bigint[], $16::bool[], $17::text[], $18::date[], $19::timestamptz[], $20::bool[])
		AS r(ord, account_id, event_id, period_start, key_id, route, units, charged_at, period, seq, attempt, origin, other_start, refund_wall, released)
), r AS (
	-- A refund near a month's edge whose event is not in its own month but
	-- in the neighbouring one (other_start; its own month when none) applies
	-- there (see pgCrossMonthSQL).
	SELECT r0.ord, r0.account_id, r0.event_id,
		CASE WHEN r0.other_start <> r0.period_start
			AND NOT EXISTS (SELECT 1 FROM events e WHERE e.account_id = r0.account_id AND e.event_id = r0.event_id AND e.period_start = r0.period_start)
			AND EXISTS (SELECT 1 FROM events e WHERE e.account_id = r0.account_id AND e.event_id = r0.event_id AND e.period_start = r0.other_start)
		THEN r0.other_start ELSE r0.period_start END AS period_start,
		r0.key_id, r0.route, r0.units, r0.charged_at, r0.period, r0.seq, r0.attempt, r0.origin, r0.refund_wall, r0.released
	FROM r0
), a AS (
	SELECT * FROM unnest($13::int[], $14::text[], $15::bigint[]) WITH ORDINALITY AS a(ord, grant_id, units, i)
), cur AS MATERIALIZED (
	-- again: a released refund (Refund.Released) on another node's row,
	-- counted off already by the same attempt's refund logged before.
	SELECT r.ord, r.seq, e.refunded, (r.released AND NOT e.refunded AND e.node_id <> r.origin) AS again
	FROM r LEFT JOIN LATERAL (
		SELECT e.refunded, e.node_id FROM events e
		WHERE e.account_id = r.account_id AND e.event_id = r.event_id AND e.period_start = r.period_start
		LIMIT 1
	) e ON true
), upd AS (
	-- Applies: nobody else's retry was served under the event, nor a
	-- replay stands (replays: see replay.go) (and the
	-- refund is not of another node's attempt whose charge has not
	-- settled yet: origin <> $1 names one, and it is not this row's), or
	-- this node's refund of its own unbilled retry releases the event's
	-- own pending refund (see Batch).
	-- The event's own refund keeps when it was decided (refund_wall): the
	-- retries charged before it are covered by it (pgInsertChargesSQL).
	-- (served: the retries served under the event, againRow.standing;
	-- counts: this refund counts off a served retry of origin's, or an
	-- older build's unnamed one.)
	UPDATE events e SET refunded = true, refunded_at = now(), refund_pending = false,
		served_again = least(e.served_again - cardinality(e.served_by), -cardinality(e.owed)), served_by = '{}',
		refund_wall = CASE WHEN r.attempt THEN NULL ELSE r.refund_wall END
	FROM r
	WHERE e.account_id = r.account_id AND e.event_id = r.event_id AND e.period_start = r.period_start
		AND NOT e.refunded
		AND (NOT (r.released AND e.node_id <> r.origin) AND (NOT r.attempt
				OR (e.served_again + cardinality(e.owed) <= 0 AND e.replays <= 0 AND (r.origin = $1 OR r.origin = e.node_id))
				OR (e.node_id <> r.origin AND e.served_again + cardinality(e.owed) = 1 AND e.replays <= 0 AND e.refund_pending
					AND (r.origin = ANY(e.served_by) OR e.served_again - cardinality(e.served_by) + cardinality(e.owed) > 0)))
			-- a released refund on another node's row, its take-back
			-- leaving nothing served: the event's own pending refund
			OR (r.released AND e.node_id <> r.origin AND e.served_again + cardinality(e.owed) <= 0 AND e.replays <= 0 AND e.refund_pending))
	RETURNING r.ord, e.key_id, e.route, e.charged_at, e.units, e.grant_ids, e.grant_units
), kept AS (
	-- Kept: the event's own node asks while others' retries were served
	-- (pending), or another node refunds its unbilled retry (one less;
	-- below zero when that retry's charge has not settled yet, so that it
	-- does not count as served when it does).
	UPDATE events e SET refund_pending = e.refund_pending OR e.node_id = r.origin,
		served_again = CASE WHEN e.node_id <> r.origin THEN e.served_again - 1 ELSE e.served_again END,
		-- origin's served retry counted off, or an older build's unnamed
		-- one, else a debt of origin's (owed.go)
		served_by = CASE WHEN e.node_id <> r.origin AND r.origin = ANY(e.served_by)
			THEN e.served_by[1:array_position(e.served_by, r.origin) - 1] || e.served_by[array_position(e.served_by, r.origin) + 1:cardinality(e.served_by)]
			ELSE e.served_by END,
		owed = CASE WHEN e.node_id <> r.origin AND NOT r.origin = ANY(e.served_by) AND e.served_again - cardinality(e.served_by) + cardinality(e.owed) <= 0
			THEN e.owed || r.origin ELSE e.owed END
	FROM r
	WHERE e.account_id = r.account_id AND e.event_id = r.event_id AND e.period_start = r.period_start
		AND NOT e.refunded AND r.attempt AND NOT (r.released AND e.node_id <> r.origin)
		AND NOT (e.served_again + cardinality(e.owed) <= 0 AND e.replays <= 0 AND (r.origin = $1 OR r.origin = e.node_id))
		AND NOT (e.node_id <> r.origin AND e.served_again + cardinality(e.owed) = 1 AND e.replays <= 0 AND e.refund_pending
			AND (r.origin = ANY(e.served_by) OR e.served_again - cardinality(e.served_by) + cardinality(e.owed) > 0))
	RETURNING r.ord
), owed AS (
	-- Refunded already, and this is the refund of a retry another node
	-- (origin) charged after it, not settled yet (settled, it would have
	-- taken the event over): that charge is owed, one served retry fewer,
	-- so that it does not take the event over when it settles.
	UPDATE events e SET served_again = e.served_again - 1, owed = e.owed || r.origin
	FROM r
	WHERE e.account_id = r.account_id AND e.event_id = r.event_id AND e.period_start = r.period_start
		AND e.refunded AND r.attempt AND r.origin <> $1 AND e.node_id <> r.origin
		AND (e.refund_wall IS NULL OR r.charged_at > e.refund_wall)
	RETURNING r.ord
), tomb AS (
	-- Not found: a tombstone. An attempt's refund of another node's charge
	-- (origin <> $1) stands for that charge only: the tombstone names that
	-- node and is marked refund_pending, and another node's charge, served,
	-- takes the event over (pgTakeOverTombstoneSQL).
	INSERT INTO events (account_id, event_id, client_id, key_id, route, units, charged_at, period, period_start,
		node_id, incarnation, seq, grant_ids, grant_units, refunded, refunded_at, tombstone, refund_pending)
	SELECT r.account_id, r.event_id, false, r.key_id, r.route, r.units, r.charged_at, r.period, r.period_start,
		CASE WHEN r.attempt AND r.origin <> $1 THEN r.origin ELSE $1 END, $2, r.seq,
		coalesce((SELECT array_agg(a.grant_id ORDER BY a.i) FROM a WHERE a.ord = r.ord), '{}'),
		coalesce((SELECT array_agg(a.units ORDER BY a.i) FROM a WHERE a.ord = r.ord), '{}'),
		true, now(), true, r.attempt AND r.origin <> $1
	FROM r JOIN cur ON cur.ord = r.ord
	WHERE cur.refunded IS NULL
	ORDER BY r.account_id, r.event_id
	ON CONFLICT DO NOTHING
	RETURNING seq
)
SELECT cur.ord, cur.refunded OR cur.again IS TRUE OR k.ord IS NOT NULL, u.ord IS NOT NULL, t.seq IS NOT NULL,
	u.key_id, u.route, u.charged_at, u.units, u.grant_ids, u.grant_units
FROM cur
LEFT JOIN upd u ON u.ord = cur.ord
LEFT JOIN kept k ON k.ord = cur.ord
LEFT JOIN tomb t ON t.seq = cur.seq`

const pgUsageSQL = `INSERT INTO usage_daily AS u (account_id, key_id, route, day, units, requests)
SELECT t.account_id, t.key_id, t.route, date '1970-01-01' + t.day, t.units, t.requests
FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::bigint[], $6::bigint[])
	AS t(account_id, key_id, route, day, units, requests)
ORDER BY 1, 2, 3, 4
ON CONFLICT (account_id, key_id, route, day) DO UPDATE
SET units = u.units + excluded.units, requests = u.requests + excluded.requests`

// pgMonthlySQL creates monthly grants from their account's plan if they do
// not exist yet. An account that does not exist gets none (and the lock
// statement then reports the grant missing).
const pgMonthlySQL = `INSERT INTO grants (account_id, grant_id, kind, period, units, starts_at, expires_at)
SELECT m.account_id, m.grant_id, 'monthly', m.period, p.monthly_quota, m.starts_at, m.expires_at
FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[], $5::timestamptz[])
	AS m(account_id, grant_id, period, starts_at, expires_at)
JOIN accounts a ON a.account_id = m.account_id
JOIN plans p ON p.plan_id = a.plan_id
ORDER BY m.account_id, m.grant_id
ON CONFLICT (account_id, grant_id) DO NOTHING`

// pgGrantRoomSQL locks an account's grants $2 in grant order, as
// pgLockGrantsSQL would, and reads their free units and whether the
// account's plan is hard (replayFits).
const pgGrantRoomSQL = `SELECT g.grant_id, g.units - g.used - g.reserved, p.hard
FROM grants g
JOIN accounts a ON a.account_id = g.account_id
JOIN plans p ON p.plan_id = a.plan_id
WHERE g.account_id = $1 AND g.grant_id = ANY($2::text[])
ORDER BY g.grant_id
FOR UPDATE OF g`

// grantRoom reads (and locks, until the commit: a reserve waits rather
// than take the units meanwhile) what replayFits needs of account's grants
// in allocs. NB: the lock comes before the batch's ordered lock of all its
// grants; a settle of another node touching the same account's grants may
// then deadlock with this one, and Postgres cancels one of the two, which
// is retried (replays billed again are rare: a refund elsewhere first).
func (s *pgSettle) grantRoom(ctx context.Context, tx pgx.Tx, account string, allocs []shard.Alloc) (map[string]grantRoom, error) {
	ids := make([]string, 0, len(allocs))
	for _, a := range allocs {
		ids = append(ids, a.Grant)
	}
	s.res.RoundTrips++
	rows, err := tx.Query(ctx, pgGrantRoomSQL, account, ids)
	if err != nil {
		return nil, err
	}
	room := map[string]grantRoom{}
	for rows.Next() {
		var id string
		var r grantRoom
		if err := rows.Scan(&id, &r.free, &r.hard); err != nil {
			rows.Close()
			return nil, err
		}
		room[id] = r
	}
	rows.Close()
	return room, rows.Err()
}

// pgLockGrantsSQL locks grants in (account, grant) order, the one order
// every writer uses, and returns the ones it found.
const pgLockGrantsSQL = `SELECT g.account_id, g.grant_id FROM grants g
JOIN unnest($1::text[], $2::text[]) AS k(account_id, grant_id)
	ON g.account_id = k.account_id AND g.grant_id = k.grant_id
ORDER BY g.account_id, g.grant_id
FOR UPDATE OF g`

// pgReservationsSQL moves node $1's reservations by the deltas, never below
// zero, and creates the rows that a positive delta needs. The grants are
// locked first, so no one else writes these rows meanwhile.
const pgReservationsSQL = `WITH d AS (
	SELECT * FROM unnest($2::text[], $3::text[], $4::bigint[]) AS d(account_id, grant_id, delta)
), upd AS (
	UPDATE reservations r SET units = GREATEST(r.units + d.delta, 0)
	FROM d
	WHERE r.account_id = d.account_id AND r.grant_id = d.grant_id AND r.node_id = $1
	RETURNING r.account_id, r.grant_id
)
INSERT INTO reservations (account_id, grant_id, node_id, units)
SELECT d.account_id, d.grant_id, $1, d.delta FROM d
WHERE d.delta > 0 AND NOT EXISTS (SELECT 1 FROM upd WHERE upd.account_id = d.account_id AND upd.grant_id = d.grant_id)`

// pgGrantsSQL adds the used deltas and sets reserved to the sum of the
// grant's reservations, which keeps the two equal whatever was floored.
const pgGrantsSQL = `UPDATE grants g
SET used = g.used + d.used,
	reserved = (SELECT coalesce(sum(r.units), 0) FROM reservations r WHERE r.account_id = g.account_id AND r.grant_id = g.grant_id)
FROM unnest($1::text[], $2::text[], $3::bigint[]) AS d(account_id, grant_id, used)
WHERE g.account_id = d.account_id AND g.grant_id = d.grant_id`

// errAppliedBefore stops a batch's callbacks when the mark says the batch
// is in the ledger already.
var errAppliedBefore = errors.New("flush: batch applied before")

// errMarkRace: the mark did not move and still reads Prev, which happens
// when a concurrent transaction moved it after this statement's snapshot.
var errMarkRace = errors.New("flush: settled mark moved concurrently")

// Settle applies a batch exactly once (see Batch and the file comment).
func (p *Postgres) Settle(ctx context.Context, b *Batch) (SettleResult, error) {
	var res SettleResult
	if err := validateBatch(b); err != nil {
		return res, err
	}
	op := fmt.Sprintf("settle %s/%s (%d, %d]", b.Node, b.Incarnation, b.Prev, b.Next)
	if b.Events {
		n, err := p.ensurePartitions(ctx, b)
		res.RoundTrips += n
		if err != nil {
			return res, p.fail(op+": create event partitions", err)
		}
	}
	s := &pgSettle{p: p, b: b, res: &res, plan: newSettlePlan()}
	err := s.run(ctx)
	if errors.Is(err, errMarkRace) {
		err = p.recheckMark(ctx, b, &res)
	}
	if pgCode(err) == sqlCheckViolation && strings.Contains(err.Error(), "no partition of relation") {
		// A partition this process knew was dropped since (quotad prune):
		// look again at the next try, which creates it.
		p.mu.Lock()
		clear(p.partitions)
		p.mu.Unlock()
	}
	if err != nil && !errors.Is(err, ErrMarkConflict) && !errors.Is(err, ErrInvalid) {
		res = SettleResult{RoundTrips: res.RoundTrips}
	}
	return res, p.fail(op, err)
}

// takeOver gives the event's row (in month from) to charge c with query
// (pgTakeOverSQL or pgTakeOverTombstoneSQL), billed, moving it into c's
// month. It reports false, billing nothing, when the row is no longer one
// to take over: this batch changed it (an earlier retry of the event took
// it over) or moved it.
func (s *pgSettle) takeOver(ctx context.Context, tx pgx.Tx, query string, c *Charge, from time.Time) (bool, error) {
	ids, units := allocArrays(c.Allocs)
	s.res.RoundTrips++
	tag, err := tx.Exec(ctx, query, s.b.Node, s.b.Incarnation, c.ClientID, c.Key, c.Route, c.Units,
		time.Unix(0, c.Wall).UTC(), int64(c.Seq), ids, units, c.Account, c.EventID, from, c.Period.String(), periodDate(c.Period))
	if err != nil || tag.RowsAffected() == 0 {
		return false, err
	}
	s.plan.billCharge(c)
	return true, nil
}

// pgSettle is one Settle call's state.
type pgSettle struct {
	p    *Postgres
	b    *Batch
	res  *SettleResult
	plan *settlePlan
	// cross: the batch's charges whose event id has a row in the
	// neighbouring month and none in their own, by seq (pgCrossMonthSQL).
	cross map[uint64]origin
	// dupSeqs: the seqs of res.Duplicates' charges, to put them in log
	// order, as SQLite reports them, when settleMixed decided some later.
	dupSeqs []uint64
	// touched is touchedIDs(b), made when first needed.
	touched map[eventKey]bool
}

// queueCrossMonth queues pgCrossMonthSQL for the batch's client-id charges
// near a month's edge, if any (only in the first and last day of a month,
// in normal running; no extra round trip: it rides with the mark).
func (s *pgSettle) queueCrossMonth(q *pgx.Batch) {
	// Nearly every batch has no client id near a month's edge: it pays
	// one pass, not the maps below.
	if !slices.ContainsFunc(s.b.Charges, func(c Charge) bool {
		_, near := neighbourMonth(c.Period, c.Wall)
		return c.ClientID && near
	}) {
		return
	}
	var seqs []int64
	var accounts, events []string
	var starts, walls, owns []time.Time
	// The batch itself may hold the neighbouring month's charge: a node
	// that charged an event, then (its clock jumped into the next month,
	// its own dedup window passed) its retry, and settled both together
	// after a ledger outage. The query below runs before the batch writes
	// anything, so it cannot see that one.
	type monthKey struct {
		account, event string
		period         shard.Period
	}
	first := map[monthKey]uint64{}
	refunded := map[[2]string]bool{} // a refund in the batch: the retry may be the next generation
	for i := range s.b.Refunds {
		refunded[[2]string{s.b.Refunds[i].Account, s.b.Refunds[i].EventID}] = true
	}
	for i := range s.b.Charges {
		c := &s.b.Charges[i]
		if !c.ClientID {
			continue // an id the owner made is never retried
		}
		if p, ok := neighbourMonth(c.Period, c.Wall); ok {
			if seq, in := first[monthKey{c.Account, c.EventID, p}]; in && !refunded[[2]string{c.Account, c.EventID}] {
				start, eseq := periodDate(p), int64(seq)
				if s.cross == nil {
					s.cross = make(map[uint64]origin)
				}
				s.cross[c.Seq] = origin{node: &s.b.Node, incarnation: &s.b.Incarnation, seq: &eseq, start: &start}
				continue
			}
			seqs, accounts, events, starts = append(seqs, int64(c.Seq)), append(accounts, c.Account), append(events, c.EventID), append(starts, periodDate(p))
			walls, owns = append(walls, time.Unix(0, c.Wall).UTC()), append(owns, periodDate(c.Period))
		}
		if _, in := first[monthKey{c.Account, c.EventID, c.Period}]; !in {
			first[monthKey{c.Account, c.EventID, c.Period}] = c.Seq
		}
	}
	if len(seqs) == 0 {
		return
	}
	if s.cross == nil {
		s.cross = make(map[uint64]origin)
	}
	neighbour := make(map[int64]*time.Time, len(seqs))
	for i, q := range seqs {
		neighbour[q] = &starts[i]
	}
	// Only a row charged within the window of this charge: the lookup is
	// one-sided (a charge looks across only near its own month's edge), so
	// a row moved into this month by a retry 30 h after it was charged
	// would be found by that retry, and missed by its late attempt, which
	// went in fresh and billed the event twice.
	window := float64(crossMonthWindow()) / 1e9
	q.Queue(pgCrossMonthSQL, s.b.Node, seqs, accounts, events, starts, walls, owns, window).Query(func(rows pgx.Rows) error {
		var seq int64
		var o origin
		_, err := pgx.ForEachRow(rows, []any{&seq, &o.node, &o.incarnation, &o.seq, &o.refunded, &o.takeOver}, func() error {
			o.start = neighbour[seq]
			s.cross[uint64(seq)] = o
			o = origin{}
			return nil
		})
		return err
	})
}

func (s *pgSettle) run(ctx context.Context) error {
	b := s.b
	withLog := b.Events && len(b.Charges)+len(b.Refunds)+len(b.Replays) > 0
	first := &pgx.Batch{}
	first.BeginTx(pgx.TxOptions{})
	first.Queue(pgMarkSQL, b.Node, b.Incarnation, int64(b.Prev), int64(b.Next), nullTime(b.DrainedAt), b.Process).QueryRow(s.readMark)
	if withLog && len(b.Charges) > 0 {
		first.Queue(`SAVEPOINT settle_events`).Exec(nop)
		s.queueCrossMonth(first)
	}
	if !withLog {
		s.planWithoutLog()
		s.queueApply(first)
	}
	s.res.RoundTrips += first.Len()
	tx, err := s.p.sendTx(ctx, first)
	defer tx.Rollback(ctx)
	if errors.Is(err, errAppliedBefore) {
		return nil
	}
	if err != nil {
		return err
	}
	s.res.Applied = true
	if withLog {
		if err := s.settleLog(ctx, tx); err != nil {
			return err
		}
	}
	s.res.RoundTrips++
	if err := tx.Commit(ctx); err != nil {
		// The outcome is unknown (see the package notes): the caller
		// retries this batch, and the mark makes a committed one a no-op.
		level := slog.LevelWarn
		if ctx.Err() != nil {
			level = slog.LevelDebug // the caller stopped it (a node's drain stops its settle loop; the final settle follows)
		}
		s.p.log.Log(ctx, level, "flush: settle commit failed, outcome unknown; the batch will be retried",
			"node", b.Node, "incarnation", b.Incarnation, "prev", b.Prev, "next", b.Next, "err", err)
		return fmt.Errorf("commit (outcome unknown: retry the same batch): %w", err)
	}
	return nil
}

// readMark reads the mark statement: applied, applied before, or conflict.
func (s *pgSettle) readMark(r pgx.Row) error {
	var moved int64
	var mark *int64
	var process *string
	if err := r.Scan(&moved, &mark, &process); err != nil {
		return err
	}
	if moved == 1 {
		return nil
	}
	return markOutcome(s.b, mark, process, true)
}

// markOutcome decides what a mark that did not move means. mark is nil
// when the node is not registered; process is the process last recorded
// as started for it (nil: none recorded). racy says the reading may
// predate a concurrent move (then a mark still at Prev is a race, not a
// conflict).
func markOutcome(b *Batch, mark *int64, process *string, racy bool) error {
	switch {
	case mark != nil && uint64(*mark) >= b.Prev && b.Process != "" && process != nil && *process != b.Process:
		// NB: before the mark's own cases: at or past Next it is the other
		// process's settle of its own records, not this batch's. Behind
		// Prev, the ledger went back (a restore, which may lose starts
		// too): that error says so, below.
		return fmt.Errorf("%w: %w: node %q incarnation %q: process %s started as it after this process (%s), on a copy of this data dir; "+
			"the ledger's mark (%d) counts that process's records, not this one's from %d on",
			ErrMarkConflict, ErrOtherProcess, b.Node, b.Incarnation, *process, b.Process, *mark, b.Prev+1)
	case mark == nil:
		return fmt.Errorf("%w: node %q incarnation %q is not registered (call RegisterNode before settling batch (%d, %d])",
			ErrNotFound, b.Node, b.Incarnation, b.Prev, b.Next)
	case uint64(*mark) >= b.Next:
		return errAppliedBefore
	case uint64(*mark) == b.Prev && racy:
		return errMarkRace
	}
	if uint64(*mark) < b.Prev {
		return fmt.Errorf("%w: node %q incarnation %q: the ledger has it settled only to %d, but its log settled to %d (the batch is (%d, %d]): "+
			"the ledger is behind the log. Either --ledger names another ledger than the one this node settled into (check it against "+
			"the other nodes'), or the ledger was restored from a backup older than this log, and the records it lacks (%d to %d) have "+
			"left this data dir and cannot be sent again. Nothing is marked settled, and nothing more is settled until --ledger is right; "+
			"after a restore, those charges are in no ledger: bill them by hand from what is left of the ledger before the restore",
			ErrMarkConflict, b.Node, b.Incarnation, *mark, b.Prev, b.Prev, b.Next, *mark+1, b.Prev)
	}
	return fmt.Errorf("%w: node %q incarnation %q: the ledger's mark is %d, the batch is (%d, %d]: another process settles as this node "+
		"(two processes with one --node-id and a copy of one data dir)",
		ErrMarkConflict, b.Node, b.Incarnation, *mark, b.Prev, b.Next)
}

// recheckMark reads the mark afresh after errMarkRace.
func (p *Postgres) recheckMark(ctx context.Context, b *Batch, res *SettleResult) error {
	var mark *int64
	var process *string
	res.RoundTrips++
	err := p.pool.QueryRow(ctx, `SELECT settled_seq, process FROM nodes WHERE node_id = $1 AND incarnation = $2`, b.Node, b.Incarnation).Scan(&mark, &process)
	if errors.Is(err, pgx.ErrNoRows) {
		mark, process, err = nil, nil, nil
	}
	if err != nil {
		return err
	}
	switch err := markOutcome(b, mark, process, false); {
	case errors.Is(err, errAppliedBefore):
		return nil
	case err != nil:
		return err
	}
	return fmt.Errorf("the settled mark of %s/%s moved and moved back under a concurrent settle: retry the batch", b.Node, b.Incarnation)
}

// planWithoutLog plans a batch with the event log off: no dedup, every
// charge is billed and every refund applies.
func (s *pgSettle) planWithoutLog() {
	for i := range s.b.Charges {
		s.plan.billCharge(&s.b.Charges[i])
	}
	for i := range s.b.Refunds {
		r := &s.b.Refunds[i]
		s.plan.applyRefund(r, eventOfRefund(r))
	}
}

// settleLog writes the event log (steps 2 and 3 of the file comment), plans
// the aggregates from what it found, and applies them (step 4).
func (s *pgSettle) settleLog(ctx context.Context, tx pgx.Tx) error {
	b := s.b
	charges := b.Charges
	if len(s.cross) > 0 {
		charges = slices.DeleteFunc(slices.Clone(b.Charges), func(c Charge) bool { _, ok := s.cross[c.Seq]; return ok })
	}
	dups, err := s.logCharges(ctx, tx, charges)
	if err != nil {
		return err
	}
	for seq, o := range s.cross {
		dups[seq] = o
	}
	// An event with replays and refunds, or replays and charges found in
	// the log already, in the batch has them decided one by one in log
	// order, as SQLite does (below: a refund logged before a replay's
	// take-back sees the replay standing and is kept; decided after it, it
	// applied and un-billed the event served elsewhere; and a take-back
	// that releases the event's pending refund before a retry's charge
	// lets that retry take the event over, billed).
	mixed := s.mixedEvents(dups)
	// The other duplicates first: a retry's served_again count must be in
	// place before a refund in the same batch reads it (a stale owner's
	// unbilled retry and its attempt's refund, settled together, must not
	// un-bill the charge that was served elsewhere).
	for i := range b.Charges {
		c := &b.Charges[i]
		o, dup := dups[c.Seq]
		if !dup {
			s.plan.billCharge(c)
			continue
		}
		if mixed[refundKey{account: c.Account, event: c.EventID}] {
			continue // settleMixed
		}
		if err := s.decideCharge(ctx, tx, c, o, false); err != nil {
			return err
		}
	}
	// The others' replays, then their refunds in rounds.
	outcomes := make([]refundOutcome, len(b.Refunds))
	if err := s.settleReplays(ctx, tx, func(r *Replay) bool { return !mixed[refundKey{account: r.Account, event: r.EventID}] }); err != nil {
		return err
	}
	if err := s.settleMixed(ctx, tx, mixed, dups, outcomes); err != nil {
		return err
	}
	s.dupsInLogOrder()
	for _, send := range s.refundRounds(mixed) {
		q := &pgx.Batch{}
		s.queueRefunds(q, send, outcomes)
		s.res.RoundTrips++
		if err := tx.SendBatch(ctx, q).Close(); err != nil {
			return err
		}
	}
	for i := range b.Refunds {
		r := &b.Refunds[i]
		switch o := outcomes[i]; o.kind {
		case refundApplied:
			s.plan.applyRefund(r, o.event)
		case refundTombstone:
			s.plan.reservedRefund(r)
		case refundDuplicate:
			s.res.DuplicateRefunds = append(s.res.DuplicateRefunds, refundRef(r))
		default:
			return fmt.Errorf("refund of %s/%s: the event changed under a concurrent settle: retry the batch", r.Account, r.EventID)
		}
	}

	third := &pgx.Batch{}
	s.queueApply(third)
	if third.Len() == 0 {
		return nil
	}
	s.res.RoundTrips += third.Len()
	return tx.SendBatch(ctx, third).Close()
}

// decideCharge settles charge c, whose event id has a row already (origin
// o): billed again, taking the event over, or a duplicate. A take-over that
// finds the row changed by this batch (an earlier retry of the event in it
// took the event over) reads the row again and decides once more; again
// says this is that second time.
func (s *pgSettle) decideCharge(ctx context.Context, tx pgx.Tx, c *Charge, o origin, again bool) error {
	b := s.b
	from := periodDate(c.Period)
	if o.start != nil {
		from = *o.start
	}
	var query string
	switch {
	case o.node != nil && *o.node == b.Node && *o.incarnation == b.Incarnation && uint64(*o.seq) == c.Seq:
		// This very record is in the log already (settled in another
		// batch range): it was billed then.
		return nil
	case o.takeOver != nil && *o.takeOver:
		// Another node's attempt's refund left the tombstone; this
		// attempt was served: it takes the event over and is billed.
		query = pgTakeOverTombstoneSQL
	case o.refunded != nil && *o.refunded:
		// A retry served, the event refunded (an attempt's refund, or
		// the event's own decided before this charge): it takes the
		// event over and is billed. Not a retry of a later generation
		// of the id that stands billed (laterGenerations): a duplicate.
		switch stands, err := s.laterGenerationBilled(ctx, tx, c); {
		case err != nil:
			return err
		case stands:
			s.duplicate(c)
			return nil
		}
		query = pgTakeOverSQL
	default:
		if o.node != nil {
			s.res.RoundTrips++
			if _, err := tx.Exec(ctx, pgServedAgainSQL, c.Account, c.EventID, from, b.Node, b.Incarnation, int64(c.Seq)); err != nil {
				return err
			}
		}
		s.duplicate(c)
		return nil
	}
	switch took, err := s.takeOver(ctx, tx, query, c, from); {
	case err != nil || took:
		return err
	case again:
		return fmt.Errorf("charge %s/%s (seq %d): its event's row changed under a concurrent settle: retry the batch", c.Account, c.EventID, c.Seq)
	}
	o, err := s.probe(ctx, tx, c)
	if err != nil {
		return err
	}
	return s.decideCharge(ctx, tx, c, o, true)
}

// duplicate counts charge c a duplicate: not billed, its reserved units
// off the node's reservation.
func (s *pgSettle) duplicate(c *Charge) {
	s.res.Duplicates, s.dupSeqs = append(s.res.Duplicates, chargeRef(c)), append(s.dupSeqs, c.Seq)
	s.plan.reservedCharge(c)
}

// laterGenerationBilled says a later generation of c's client id stands
// billed (see laterGenerations).
func (s *pgSettle) laterGenerationBilled(ctx context.Context, tx pgx.Tx, c *Charge) (bool, error) {
	lo, hi, ok := laterGenerations(c.EventID)
	if !ok || !c.ClientID {
		return false, nil
	}
	var starts []time.Time
	for _, p := range chargeMonths(c) {
		starts = append(starts, periodDate(p))
	}
	if s.touched == nil {
		s.touched = touchedIDs(s.b)
	}
	s.res.RoundTrips++
	rows, err := tx.Query(ctx, `SELECT event_id FROM events WHERE account_id = $1 AND event_id >= $2 AND event_id < $3
		AND period_start = ANY($4::timestamptz[]) AND NOT refunded AND NOT tombstone`, c.Account, lo, hi, starts)
	if err != nil {
		return false, err
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	return slices.ContainsFunc(ids, func(id string) bool { return !s.touched[eventKey{c.Account, id}] }), err
}

// probe reads the origin of c's event row afresh: in c's month, else (near
// an edge) in the neighbouring one.
func (s *pgSettle) probe(ctx context.Context, tx pgx.Tx, c *Charge) (origin, error) {
	for _, p := range chargeMonths(c) {
		dups := map[uint64]origin{}
		s.res.RoundTrips++
		rows, _ := tx.Query(ctx, pgReprobeSQL, s.b.Node, []int64{int64(c.Seq)}, []string{c.Account}, []string{c.EventID},
			[]time.Time{periodDate(p)}, []time.Time{time.Unix(0, c.Wall).UTC()})
		if _, err := collectOrigins(rows, dups); err != nil {
			return origin{}, err
		}
		if o := dups[c.Seq]; o.node != nil {
			if p != c.Period {
				start := periodDate(p)
				o.start = &start
			}
			return o, nil
		}
	}
	return origin{}, fmt.Errorf("charge %s/%s (seq %d): its event's row is gone under a concurrent settle: retry the batch", c.Account, c.EventID, c.Seq)
}

// pgReplayRowSQL reads and locks the event a replay counts on (servedAgain:
// the retries served under it, againRow.standing).
const pgReplayRowSQL = `SELECT refunded, tombstone, refund_pending, served_again + cardinality(owed), replays, replayed_by, node_id, refund_wall,
	key_id, route, charged_at, units, grant_ids, grant_units
FROM events WHERE account_id = $1 AND event_id = $2 AND period_start = $3 FOR UPDATE`

// pgReplayWriteSQL writes decideReplay's state back; $9: the row is billed
// in a tombstone's place, and takes this replay's origin ($10-$12).
const pgReplayWriteSQL = `UPDATE events SET refunded = $4,
	refunded_at = CASE WHEN NOT $4 THEN NULL WHEN refunded THEN refunded_at ELSE now() END,
	tombstone = $5, refund_pending = $6, replays = $7, refund_wall = CASE WHEN $8 THEN refund_wall END,
	node_id = CASE WHEN $9 THEN $10 ELSE node_id END, incarnation = CASE WHEN $9 THEN $11 ELSE incarnation END,
	seq = CASE WHEN $9 THEN $12 ELSE seq END, replayed_by = $13
WHERE account_id = $1 AND event_id = $2 AND period_start = $3`

// pgTakeBackLaterSQL keeps a take-back whose replay has not settled yet.
const pgTakeBackLaterSQL = `INSERT INTO replay_takebacks AS t (account_id, event_id, period_start, node_id, count)
VALUES ($1, $2, $3, $4, 1)
ON CONFLICT (account_id, event_id, period_start, node_id) DO UPDATE SET count = t.count + 1`

// pgTakeBackNameSQL records a take-back's name (Replay.ReplaySeq); no row
// affected: taken back before.
const pgTakeBackNameSQL = `INSERT INTO takeback_names (account_id, event_id, period_start, node_id, replay_seq)
	VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING`

// pgTakenBackSQL cancels a replay by a take-back that settled before it;
// no row: none waits. (A row spent to 0 stays: rare, and small.)
const pgTakenBackSQL = `UPDATE replay_takebacks SET count = count - 1
WHERE account_id = $1 AND event_id = $2 AND period_start = $3 AND node_id = $4 AND count > 0
RETURNING count`

// settleReplays counts the batch's replays on their events (see
// replay.go), in (account, event) order, each event's in log order.
// mixedEvents names the events with replays and refunds, or replays and
// duplicate charges (dups), in the batch.
func (s *pgSettle) mixedEvents(dups map[uint64]origin) map[refundKey]bool {
	if len(s.b.Replays) == 0 || len(s.b.Refunds) == 0 && len(dups) == 0 {
		return nil
	}
	replayed := make(map[refundKey]bool, len(s.b.Replays))
	for i := range s.b.Replays {
		replayed[refundKey{account: s.b.Replays[i].Account, event: s.b.Replays[i].EventID}] = true
	}
	var mixed map[refundKey]bool
	for i := range s.b.Refunds {
		if k := (refundKey{account: s.b.Refunds[i].Account, event: s.b.Refunds[i].EventID}); replayed[k] {
			if mixed == nil {
				mixed = make(map[refundKey]bool)
			}
			mixed[k] = true
		}
	}
	for i := range s.b.Charges {
		c := &s.b.Charges[i]
		if _, dup := dups[c.Seq]; !dup {
			continue
		}
		if k := (refundKey{account: c.Account, event: c.EventID}); replayed[k] {
			if mixed == nil {
				mixed = make(map[refundKey]bool)
			}
			mixed[k] = true
		}
	}
	return mixed
}

// dupsInLogOrder sorts res.Duplicates by their charges' seqs.
func (s *pgSettle) dupsInLogOrder() {
	if slices.IsSorted(s.dupSeqs) {
		return
	}
	idx := make([]int, len(s.dupSeqs))
	for i := range idx {
		idx[i] = i
	}
	slices.SortStableFunc(idx, func(a, b int) int { return cmp.Compare(s.dupSeqs[a], s.dupSeqs[b]) })
	dups, seqs := make([]EventRef, len(idx)), make([]uint64, len(idx))
	for i, j := range idx {
		dups[i], seqs[i] = s.res.Duplicates[j], s.dupSeqs[j]
	}
	s.res.Duplicates, s.dupSeqs = dups, seqs
}

// settleMixed decides the duplicate charges (dups), replays and refunds of
// the mixed events one at a time, in log order (a refund in a round of its
// own).
func (s *pgSettle) settleMixed(ctx context.Context, tx pgx.Tx, mixed map[refundKey]bool, dups map[uint64]origin, outcomes []refundOutcome) error {
	if len(mixed) == 0 {
		return nil
	}
	type step struct {
		seq    uint64
		charge *Charge
		replay *Replay
		refund int
	}
	var steps []step
	for i := range s.b.Charges {
		c := &s.b.Charges[i]
		if _, dup := dups[c.Seq]; dup && mixed[refundKey{account: c.Account, event: c.EventID}] {
			steps = append(steps, step{seq: c.Seq, charge: c})
		}
	}
	for i := range s.b.Replays {
		if r := &s.b.Replays[i]; mixed[refundKey{account: r.Account, event: r.EventID}] {
			steps = append(steps, step{seq: r.Seq, replay: r})
		}
	}
	for i := range s.b.Refunds {
		if r := &s.b.Refunds[i]; mixed[refundKey{account: r.Account, event: r.EventID}] {
			steps = append(steps, step{seq: r.Seq, refund: i})
		}
	}
	// Stable: a released refund shares its seq with the take-back logged
	// with it (appended first), which counts off before the refund.
	slices.SortStableFunc(steps, func(a, b step) int { return cmp.Compare(a.seq, b.seq) })
	for _, st := range steps {
		if st.charge != nil {
			// Its row as the steps before left it.
			o, err := s.probe(ctx, tx, st.charge)
			if err != nil {
				return err
			}
			if err := s.decideCharge(ctx, tx, st.charge, o, false); err != nil {
				return err
			}
			continue
		}
		if st.replay != nil {
			if err := s.settleReplay(ctx, tx, st.replay); err != nil {
				return fmt.Errorf("replay of %s/%s: %w", st.replay.Account, st.replay.EventID, err)
			}
			continue
		}
		q := &pgx.Batch{}
		s.queueRefunds(q, []int{st.refund}, outcomes)
		s.res.RoundTrips++
		if err := tx.SendBatch(ctx, q).Close(); err != nil {
			return err
		}
	}
	return nil
}

// settleReplays settles the batch's replays that want says, one by one.
func (s *pgSettle) settleReplays(ctx context.Context, tx pgx.Tx, want func(*Replay) bool) error {
	rs := slices.DeleteFunc(slices.Clone(s.b.Replays), func(r Replay) bool { return !want(&r) })
	slices.SortStableFunc(rs, func(a, b Replay) int {
		return cmp.Or(cmp.Compare(a.Account, b.Account), cmp.Compare(a.EventID, b.EventID))
	})
	for i := range rs {
		if err := s.settleReplay(ctx, tx, &rs[i]); err != nil {
			return fmt.Errorf("replay of %s/%s: %w", rs[i].Account, rs[i].EventID, err)
		}
	}
	return nil
}

func (s *pgSettle) settleReplay(ctx context.Context, tx pgx.Tx, r *Replay) error {
	start := periodDate(r.Period)
	node := r.replayNode(s.b.Node)
	if r.Delta < 0 && r.ReplaySeq != 0 {
		s.res.RoundTrips++
		tag, err := tx.Exec(ctx, pgTakeBackNameSQL, r.Account, r.EventID, start, node, int64(r.ReplaySeq))
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			return nil // this replay was taken back before: the same take-back asked again
		}
	}
	if r.Delta > 0 {
		var left int32
		s.res.RoundTrips++
		err := tx.QueryRow(ctx, pgTakenBackSQL, r.Account, r.EventID, start, node).Scan(&left)
		if err == nil {
			return nil // taken back before it settled
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
	}
	var row replayRow
	var ev refundedEvent
	var refundWall *time.Time
	var chargedAt time.Time
	var ids []string
	var units []int64
	// The event's row: in the charge's month, or, near its edge, in the
	// neighbouring month a retry's take-over moved it into (pgTakeOverWhere),
	// as refunds find it (pgRefundsSQL). Waiting take-backs stay keyed by the
	// charge's month (start): a replay and its take-back both carry it.
	rowStart := start
	read := func() error {
		s.res.RoundTrips++
		return tx.QueryRow(ctx, pgReplayRowSQL, r.Account, r.EventID, rowStart).Scan(&row.refunded, &row.tombstone, &row.pending, &row.servedAgain,
			&row.replays, &row.replayedBy, &row.node, &refundWall, &ev.key, &ev.route, &chargedAt, &ev.units, &ids, &units)
	}
	err := read()
	if p, near := neighbourMonth(r.Period, r.Wall); errors.Is(err, pgx.ErrNoRows) && near {
		rowStart = periodDate(p)
		err = read()
		if d := chargedAt.UnixNano() - r.Wall; err == nil && max(d, -d) > crossMonthWindow() {
			// Another use of the id there (a client id used again after
			// its dedup window), as pgCrossMonthSQL tells them apart.
			row, ev, refundWall, ids, units = replayRow{}, refundedEvent{}, nil, nil, nil
			rowStart, err = start, pgx.ErrNoRows
		}
	}
	switch {
	case errors.Is(err, pgx.ErrNoRows) && r.Delta > 0:
		return nil // its charge is not in the log near its month (events were off): nothing to count on
	case errors.Is(err, pgx.ErrNoRows):
		row.replays = 0
	case err != nil:
		return err
	}
	names, counts := countOn(row, r, node)
	if r.Delta < 0 && !counts {
		s.res.RoundTrips++
		_, err := tx.Exec(ctx, pgTakeBackLaterSQL, r.Account, r.EventID, start, node)
		return err
	}
	if refundWall != nil {
		w := refundWall.UnixNano()
		row.refundWall = &w
	}
	ev.chargeWall, ev.allocs = chargedAt.UnixNano(), rowAllocs(ids, units)
	next, out := decideReplay(row, r, s.b.Node)
	if out == replayBilled {
		room, err := s.grantRoom(ctx, tx, r.Account, ev.allocs)
		if err != nil {
			return err
		}
		if !s.plan.replayFits(r.Account, ev.allocs, room) {
			next, out = unbilled(row, next), replayCounted
			s.res.UnbilledReplays = append(s.res.UnbilledReplays, EventRef{Account: r.Account, EventID: r.EventID})
		}
	}
	retomb := row.tombstone && !next.tombstone
	s.res.RoundTrips++
	if _, err := tx.Exec(ctx, pgReplayWriteSQL, r.Account, r.EventID, rowStart, next.refunded, next.tombstone, next.pending, next.replays,
		next.refundWall != nil, retomb, s.b.Node, s.b.Incarnation, int64(r.Seq), names); err != nil {
		return err
	}
	s.plan.replayed(r.Account, out, ev, retomb)
	return nil
}

// logCharges writes charges (the batch's, less those the neighbouring month
// bills) into the event log and returns the ones that were there already,
// by seq, with the origin of the row found. It tries the direct COPY first
// and falls back to staging with ON CONFLICT when the COPY hits the unique
// key.
func (s *pgSettle) logCharges(ctx context.Context, tx pgx.Tx, charges []Charge) (map[uint64]origin, error) {
	b := s.b
	dups := make(map[uint64]origin)
	if len(charges) == 0 {
		return dups, nil
	}
	s.res.RoundTrips++
	_, err := tx.CopyFrom(ctx, pgx.Identifier{"events"}, pgEventColumns,
		&chargeRows{charges: charges, node: b.Node, incarnation: b.Incarnation})
	if err == nil {
		return dups, nil
	}
	if pgCode(err) != sqlUniqueViolation {
		return nil, fmt.Errorf("copy charges into events: %w", err)
	}
	// No pipelining here: in the aborted transaction the server refuses to
	// prepare anything but the rollback, and Exec without arguments sends it
	// as a simple query.
	s.res.RoundTrips += 4
	if _, err := tx.Exec(ctx, `ROLLBACK TO SAVEPOINT settle_events`); err != nil {
		return nil, err
	}
	if _, err := tx.Exec(ctx, pgStagingSQL); err != nil {
		return nil, err
	}
	if _, err := tx.CopyFrom(ctx, pgx.Identifier{"settle_charges"}, pgStagingColumns, &chargeRows{charges: charges, staging: true}); err != nil {
		return nil, fmt.Errorf("copy charges into staging: %w", err)
	}
	rows, _ := tx.Query(ctx, pgInsertChargesSQL, b.Node, b.Incarnation)
	unseen, err := collectOrigins(rows, dups)
	if err != nil || len(unseen) == 0 {
		return dups, err
	}
	return dups, s.reprobe(ctx, tx, charges, dups, unseen)
}

// collectOrigins reads rows of pgOriginSelect into dups, by seq, and returns
// the seqs whose row it did not see.
func collectOrigins(rows pgx.Rows, dups map[uint64]origin) ([]uint64, error) {
	var seq int64
	var o origin
	var unseen []uint64
	_, err := pgx.ForEachRow(rows, []any{&seq, &o.node, &o.incarnation, &o.seq, &o.refunded, &o.takeOver}, func() error {
		dups[uint64(seq)] = o
		if o.node == nil {
			unseen = append(unseen, uint64(seq))
		}
		return nil
	})
	return unseen, err
}

// pgReprobeSQL looks again, in a statement of its own, for the rows of
// charges whose insert found a row it could not see: see reprobe. $1: the
// batch's node (pgOriginSelect); $2-$6: the charges.
const pgReprobeSQL = pgOriginSelect + `unnest($2::bigint[], $3::text[], $4::text[], $5::date[], $6::timestamptz[])
	AS d(seq, account_id, event_id, period_start, charged_at)` + pgOriginJoin

// reprobe reads again the rows of the charges at seqs, which the insert
// statement found in the way but did not see: rows a concurrent settle (a
// handoff: two owners settling one event id) committed while the insert
// waited on their unique key, after the statement's snapshot was taken. Left
// unseen, such a charge was a plain duplicate, not billed: and when the
// other settle had refunded its own attempt, the served charge was lost
// (G4). A statement of its own sees them. A row this batch inserted (the
// same event id twice in it: a node whose dedup forgot the key charged a
// client's retry again) is seen too, so the retry counts as served again,
// as it does when the two settle in two batches and on SQLite; it was a
// plain duplicate, and a refund of the first attempt then un-billed the
// served retry.
func (s *pgSettle) reprobe(ctx context.Context, tx pgx.Tx, charges []Charge, dups map[uint64]origin, seqs []uint64) error {
	want := make(map[uint64]bool, len(seqs))
	for _, q := range seqs {
		want[q] = true
	}
	n := len(seqs)
	qs, accounts, events, starts, walls := make([]int64, 0, n), make([]string, 0, n), make([]string, 0, n), make([]time.Time, 0, n), make([]time.Time, 0, n)
	for i := range charges {
		if c := &charges[i]; want[c.Seq] {
			qs, accounts, events = append(qs, int64(c.Seq)), append(accounts, c.Account), append(events, c.EventID)
			starts, walls = append(starts, periodDate(c.Period)), append(walls, time.Unix(0, c.Wall).UTC())
		}
	}
	s.res.RoundTrips++
	rows, _ := tx.Query(ctx, pgReprobeSQL, s.b.Node, qs, accounts, events, starts, walls)
	_, err := collectOrigins(rows, dups) // rows still not seen stay plain duplicates
	return err
}

// origin is where an event row came from; nil fields: no row visible.
type origin struct {
	node, incarnation *string
	seq               *int64
	// refunded: refunded, not a tombstone, this node's late charge not
	// owed (owed), no unnamed debts (owed.go), and not by the event's own
	// refund decided after this charge (refund_wall): this charge takes
	// the event over.
	refunded *bool
	// takeOver: the row is the tombstone of another node's attempt's
	// refund, which this charge (another attempt, served) takes over.
	takeOver *bool
	// start: the row is in another month's partition (pgCrossMonthSQL),
	// this one's start; nil: the charge's own month.
	start *time.Time
}

type refundKind uint8

const (
	refundPending refundKind = iota // not decided: a concurrent settle interfered
	refundApplied
	refundTombstone
	refundDuplicate
)

type refundOutcome struct {
	kind  refundKind
	event refundedEvent // refundApplied: the event as the log has it
}

// refundRounds splits the batch's refunds into rounds that each hold at
// most one refund of an event, in log order: round k holds each event's
// k-th refund. One statement decides a round, and the next sees what it
// did, so an event's refunds apply in log order as SQLite's do. (A later
// refund of an event in the batch was marked a duplicate unread, though an
// attempt's refund that the first kept pending is released by the next:
// the event stayed billed.) Nearly always there is one round.
func (s *pgSettle) refundRounds(skip map[refundKey]bool) [][]int {
	var rounds [][]int
	count := make(map[refundKey]int, len(s.b.Refunds))
	for i := range s.b.Refunds {
		r := &s.b.Refunds[i]
		k := refundKey{account: r.Account, event: r.EventID} // any month: near an edge two months' refunds can find one row
		if skip[k] {
			continue // decided in log order with its replays (settleMixed)
		}
		n := count[k]
		count[k] = n + 1
		if n == len(rounds) {
			rounds = append(rounds, nil)
		}
		rounds[n] = append(rounds[n], i)
	}
	return rounds
}

// queueRefunds queues pgRefundsSQL for the refunds at the given indexes; its
// callback fills their outcomes.
func (s *pgSettle) queueRefunds(q *pgx.Batch, send []int, outcomes []refundOutcome) {
	n := len(send)
	ords, accounts, events, starts := make([]int32, n), make([]string, n), make([]string, n), make([]time.Time, n)
	keys, routes, units, charged := make([]string, n), make([]string, n), make([]int64, n), make([]time.Time, n)
	periods, seqs, attempts, origins := make([]string, n), make([]int64, n), make([]bool, n), make([]string, n)
	others, walls, released := make([]time.Time, n), make([]time.Time, n), make([]bool, n)
	var aOrd []int32
	var aGrant []string
	var aUnits []int64
	for j, i := range send {
		r := &s.b.Refunds[i]
		ords[j], accounts[j], events[j], starts[j] = int32(i), r.Account, r.EventID, periodDate(r.Period)
		keys[j], routes[j], units[j], charged[j] = r.Key, r.Route, r.Units, time.Unix(0, r.ChargeWall).UTC()
		periods[j], seqs[j], attempts[j], origins[j], released[j] = r.Period.String(), int64(r.Seq), r.Attempt, r.Origin, r.Released
		if r.Origin == "" {
			origins[j] = s.b.Node
		}
		others[j], walls[j] = starts[j], time.Unix(0, r.Wall).UTC()
		if p, ok := neighbourMonth(r.Period, r.ChargeWall); ok {
			others[j] = periodDate(p)
		}
		for _, a := range r.Allocs {
			aOrd, aGrant, aUnits = append(aOrd, int32(i)), append(aGrant, a.Grant), append(aUnits, a.Units)
		}
	}
	q.Queue(pgRefundsSQL, s.b.Node, s.b.Incarnation, ords, accounts, events, starts, keys, routes, units, charged, periods, seqs,
		aOrd, aGrant, aUnits, attempts, origins, others, walls, released).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var ord int32
			var wasRefunded *bool
			var applied, tombstoned bool
			var key, route *string
			var chargedAt *time.Time
			var evUnits *int64
			var grantIDs []string
			var grantUnits []int64
			if err := rows.Scan(&ord, &wasRefunded, &applied, &tombstoned, &key, &route, &chargedAt, &evUnits, &grantIDs, &grantUnits); err != nil {
				return err
			}
			o := &outcomes[ord]
			switch {
			case applied:
				o.kind = refundApplied
				o.event = refundedEvent{key: *key, route: *route, chargeWall: chargedAt.UnixNano(), units: *evUnits}
				o.event.allocs = rowAllocs(grantIDs, grantUnits)
			case tombstoned:
				o.kind = refundTombstone
			case wasRefunded != nil && *wasRefunded:
				o.kind = refundDuplicate // refunded before, or kept (retries were served under it)
			}
		}
		return rows.Err()
	})
}

// queueApply queues step 4: usage, monthly grants, grant locks,
// reservations, grants. The lock statement checks that every grant the
// batch names exists.
func (s *pgSettle) queueApply(q *pgx.Batch) {
	usage := s.plan.usageRows()
	if len(usage) > 0 {
		n := len(usage)
		accounts, keys, routes, days, units, requests := make([]string, n), make([]string, n), make([]string, n), make([]int32, n), make([]int64, n), make([]int64, n)
		for i, u := range usage {
			accounts[i], keys[i], routes[i], days[i], units[i], requests[i] = u.account, u.key, u.route, u.day, u.units, u.requests
		}
		q.Queue(pgUsageSQL, accounts, keys, routes, days, units, requests).Exec(nop)
	}
	grants := s.plan.grantRows()
	if len(grants) == 0 {
		return
	}
	queueMonthly(q, grantKeysOf(grants))
	n := len(grants)
	accounts, ids, used := make([]string, n), make([]string, n), make([]int64, n)
	var rAccounts, rIDs []string
	var rDelta []int64
	grows := false
	for i, g := range grants {
		accounts[i], ids[i], used[i] = g.account, g.grant, g.used
		if g.reserved != 0 {
			rAccounts, rIDs, rDelta = append(rAccounts, g.account), append(rIDs, g.grant), append(rDelta, g.reserved)
			grows = grows || g.reserved > 0
		}
	}
	if grows {
		// A positive delta may insert the node's first reservation row on
		// a grant, which a ReleaseNode running meanwhile would not see
		// (READ COMMITTED) and would leave behind: take the node's
		// reservation lock shared, as Reserve does, before any grant.
		q.Queue(`SELECT pg_advisory_xact_lock_shared($1, hashtext($2))`, reserveLockClass, s.b.Node).Exec(nop)
	}
	queueLockGrants(q, accounts, ids)
	if len(rAccounts) > 0 {
		q.Queue(pgReservationsSQL, s.b.Node, rAccounts, rIDs, rDelta).Exec(nop)
	}
	q.Queue(pgGrantsSQL, accounts, ids, used).Exec(nop)
}

func grantKeysOf(rows []grantRow) []grantKey {
	keys := make([]grantKey, len(rows))
	for i, r := range rows {
		keys[i] = r.grantKey
	}
	return keys
}

// queueMonthly queues the creation of the monthly grants among keys
// (sorted) that do not exist yet.
func queueMonthly(q *pgx.Batch, keys []grantKey) {
	var accounts, ids, periods []string
	var starts, ends []time.Time
	for _, k := range keys {
		if per, ok := shard.MonthlyPeriod(k.grant); ok {
			accounts, ids, periods = append(accounts, k.account), append(ids, k.grant), append(periods, per.String())
			starts, ends = append(starts, time.Unix(0, per.Start()).UTC()), append(ends, time.Unix(0, per.End()).UTC())
		}
	}
	if len(accounts) > 0 {
		q.Queue(pgMonthlySQL, accounts, ids, periods, starts, ends).Exec(nop)
	}
}

// queueLockGrants locks the grants (sorted, distinct) and fails if any is
// missing: settling units into a grant the ledger does not have would lose
// them.
func queueLockGrants(q *pgx.Batch, accounts, ids []string) {
	q.Queue(pgLockGrantsSQL, accounts, ids).Query(func(rows pgx.Rows) error {
		found := make(map[grantKey]bool, len(accounts))
		var k grantKey
		if _, err := pgx.ForEachRow(rows, []any{&k.account, &k.grant}, func() error {
			found[k] = true
			return nil
		}); err != nil {
			return err
		}
		for i := range accounts {
			if !found[grantKey{accounts[i], ids[i]}] {
				return fmt.Errorf("%w: grant %q of account %q (no such account, or a grant that was never added)", ErrNotFound, ids[i], accounts[i])
			}
		}
		return nil
	})
}

// periodDate is the first day of a period, as a date.
func periodDate(p shard.Period) time.Time { return time.Unix(0, p.Start()).UTC() }

// chargeRows feeds the charges to CopyFrom, in the layout of
// pgEventColumns (straight into events) or of pgStagingColumns (staging),
// reusing one row buffer (pgx encodes each row before asking for the next).
type chargeRows struct {
	charges           []Charge
	staging           bool
	node, incarnation string // events layout
	i                 int
	row               [14]any
	ids               []string
	units             []int64
}

func (c *chargeRows) Next() bool { c.i++; return c.i <= len(c.charges) }
func (c *chargeRows) Err() error { return nil }

func (c *chargeRows) Values() ([]any, error) {
	ch := &c.charges[c.i-1]
	c.ids, c.units = c.ids[:0], c.units[:0]
	for _, a := range ch.Allocs {
		c.ids, c.units = append(c.ids, a.Grant), append(c.units, a.Units)
	}
	c.row = [14]any{ch.Account, ch.EventID, ch.ClientID, ch.Key, ch.Route, ch.Units,
		time.Unix(0, ch.Wall).UTC(), ch.Period.String(), periodDate(ch.Period), int64(ch.Seq), c.ids, c.units,
		c.node, c.incarnation}
	if c.staging {
		return c.row[:12], nil
	}
	return c.row[:], nil
}

// ensurePartitions creates the event partitions of the batch's months that
// this process has not seen yet, each in its own short transaction under an
// advisory lock (so two nodes creating the same month do not collide). It
// runs before the settle transaction: DDL inside it would hold a lock on
// the events table until commit. It returns the statements sent.
func (p *Postgres) ensurePartitions(ctx context.Context, b *Batch) (int, error) {
	var missing []shard.Period
	p.mu.Lock()
	add := func(per shard.Period) {
		if !p.partitions[per] && !slices.Contains(missing, per) {
			missing = append(missing, per)
		}
	}
	for i := range b.Charges {
		add(b.Charges[i].Period)
	}
	for i := range b.Refunds {
		add(b.Refunds[i].Period)
	}
	p.mu.Unlock()
	if len(missing) == 0 {
		return 0, nil
	}
	slices.Sort(missing)
	return p.createPartitions(ctx, missing)
}

// partitionsAhead is how many months after the current one quotad migrate
// creates event partitions for, so that nodes whose role may write rows
// but not own tables settle all year (and no month's first settle takes
// the events table's lock to create one).
const partitionsAhead = 12

// createPartitions makes sure the event partitions of pers exist. It looks
// them up first: a role that may write rows but does not own the events
// table cannot create one, and settles into those quotad migrate made (it
// failed on every month's first settle with "must be owner of table
// events"). The missing ones are created in one short transaction under an
// advisory lock (so two nodes creating the same month do not collide) and
// a lock timeout (creating one locks the events table: waiting behind a
// long reader, such as an export, it stalled every node's settles). It
// returns the statements sent.
func (p *Postgres) createPartitions(ctx context.Context, pers []shard.Period) (int, error) {
	names := make([]string, len(pers))
	for i, per := range pers {
		names[i] = partitionName(per)
	}
	rows, _ := p.pool.Query(ctx, `SELECT n FROM unnest($1::text[]) AS n WHERE to_regclass(quote_ident(n)) IS NULL`, names)
	absent, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return 1, err
	}
	n := 1
	var created []shard.Period
	if len(absent) > 0 {
		q := &pgx.Batch{}
		q.BeginTx(pgx.TxOptions{})
		q.Queue(`SELECT pg_advisory_xact_lock($1)`, partitionLockKey).Exec(nop)
		q.Queue(`SET LOCAL lock_timeout = '5s'`).Exec(nop)
		for i, per := range pers {
			if slices.Contains(absent, names[i]) {
				q.Queue(partitionDDL(per)).Exec(nop)
				created = append(created, per)
			}
		}
		n += q.Len() + 1
		if err := p.inTx(ctx, q); err != nil {
			if pgCode(err) == sqlInsufficientPrivilege {
				err = fmt.Errorf("%w: this role may not create the event partition of %v (it must own the events table): "+
					"run quotad migrate as the ledger's owner, which creates the partitions of the next %d months", err, created, partitionsAhead)
			}
			return n, err
		}
	}
	p.mu.Lock()
	for _, per := range pers {
		p.partitions[per] = true
	}
	p.mu.Unlock()
	if len(created) > 0 {
		p.log.Info("flush: event partitions created", "periods", fmt.Sprint(created))
	}
	return n, nil
}

// partitionName is the name of the event partition of one month.
func partitionName(per shard.Period) string {
	return fmt.Sprintf("events_p%04d_%02d", int(per)/12, int(per)%12+1)
}

// partitionDDL creates the event partition of one month if it is missing.
func partitionDDL(per shard.Period) string {
	name := pgx.Identifier{partitionName(per)}.Sanitize()
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s PARTITION OF events FOR VALUES FROM ('%s') TO ('%s')`,
		name, periodDate(per).Format(time.DateOnly), periodDate(per+1).Format(time.DateOnly))
}

// rowAllocs is allocArrays backwards: the allocations of an event row's
// grant and units arrays.
func rowAllocs(ids []string, units []int64) []shard.Alloc {
	var allocs []shard.Alloc
	for k := range min(len(ids), len(units)) {
		allocs = append(allocs, shard.Alloc{Grant: ids[k], Units: units[k]})
	}
	return allocs
}

// allocArrays splits allocations into the grant and units arrays of an
// event row, in order.
func allocArrays(allocs []shard.Alloc) ([]string, []int64) {
	ids, units := make([]string, len(allocs)), make([]int64, len(allocs))
	for i, a := range allocs {
		ids[i], units[i] = a.Grant, a.Units
	}
	return ids, units
}
