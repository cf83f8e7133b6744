package flush

// Reservations on Postgres. Every method locks the grants it touches with
// SELECT ... ORDER BY grant_id FOR UPDATE first (the order Settle uses), and
// keeps grants.reserved equal to the sum of the grant's reservations.
// Reserve and ReleaseNode take the node's reservation lock (reserveLockClass)
// before any grant, shared and exclusive, so a release cannot miss a
// reservation still being made. A settle that gives units back to a
// reservation (which may create the row) takes it shared too.

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/shard"
)

// pgActiveGrantsSQL locks the account's grants active at $2, or at the
// start of its latest monthly grant when that is later (see
// Ledger.Reserve). They are locked in grant id order, like everywhere else,
// in one statement; Go sorts them into spending order afterwards.
const pgActiveGrantsSQL = `WITH w AS (
	SELECT greatest($2::timestamptz, coalesce(
		(SELECT max(starts_at) FROM grants WHERE account_id = $1 AND kind = 'monthly' AND starts_at > $2), $2)) AS at
)
SELECT g.grant_id, g.units, g.used, g.reserved, g.expires_at, coalesce(r.units, 0) FROM grants g
CROSS JOIN w
LEFT JOIN reservations r ON r.account_id = g.account_id AND r.grant_id = g.grant_id AND r.node_id = $3
WHERE g.account_id = $1 AND g.starts_at <= w.at AND (g.expires_at IS NULL OR g.expires_at > w.at)
ORDER BY g.grant_id
FOR UPDATE OF g`

// pgReserveSQL is the conditional update that keeps used + reserved <=
// units: a grant that would go over is not updated (and Reserve fails
// rather than hand out units it does not have).
const pgReserveSQL = `UPDATE grants g SET reserved = g.reserved + d.units
FROM unnest($2::text[], $3::bigint[]) AS d(grant_id, units)
WHERE g.account_id = $1 AND g.grant_id = d.grant_id AND g.used + g.reserved + d.units <= g.units`

const pgAddReservationSQL = `INSERT INTO reservations (account_id, grant_id, node_id, units)
SELECT $1, d.grant_id, $4, d.units FROM unnest($2::text[], $3::bigint[]) AS d(grant_id, units)
ON CONFLICT (account_id, grant_id, node_id) DO UPDATE SET units = reservations.units + excluded.units`

// pgSumReservedSQL sets the grants' reserved totals from their reservations.
const pgSumReservedSQL = `UPDATE grants g
SET reserved = (SELECT coalesce(sum(r.units), 0) FROM reservations r WHERE r.account_id = g.account_id AND r.grant_id = g.grant_id)
WHERE g.account_id = $1 AND g.grant_id = ANY($2::text[])`

// Reserve reserves up to req.Need units for node from the account's active
// grants, soonest-expiring first.
func (p *Postgres) Reserve(ctx context.Context, node string, req ReserveRequest) (ReserveResult, error) {
	var res ReserveResult
	if node == "" || req.Account == "" {
		return res, fmt.Errorf("%w: reserve: node and account must be set", ErrInvalid)
	}
	op := fmt.Sprintf("reserve %d units of %s for %s", req.Need, req.Account, node)
	wall := req.Wall.UTC()
	per := shard.PeriodOf(wall.UnixNano())
	var active []activeGrant

	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	if !p.noReserveLock {
		b.Queue(`SELECT pg_advisory_xact_lock_shared($1, hashtext($2))`, reserveLockClass, node).Exec(nop)
	}
	queueAccountExists(b, req.Account)
	queueMonthly(b, []grantKey{{req.Account, shard.MonthlyGrantID(per)}})
	b.Queue(pgActiveGrantsSQL, req.Account, wall, node).Query(func(rows pgx.Rows) error {
		var g activeGrant
		var expires *time.Time
		_, err := pgx.ForEachRow(rows, []any{&g.id, &g.units, &g.used, &g.reserved, &expires, &g.mine}, func() error {
			g.expires = 0
			if expires != nil {
				g.expires = expires.UnixNano()
			}
			active = append(active, g)
			return nil
		})
		return err
	})
	tx, err := p.sendTx(ctx, b)
	defer tx.Rollback(ctx)
	if err != nil {
		return res, p.fail(op, err)
	}
	sortSpending(active)
	res = reserveTake(active, req.Need)
	if len(res.Granted) > 0 {
		ids, units := allocColumns(res.Granted)
		q := &pgx.Batch{}
		q.Queue(pgReserveSQL, req.Account, ids, units).Exec(func(ct pgconn.CommandTag) error {
			if int(ct.RowsAffected()) != len(ids) {
				// Cannot happen under the row locks; refuse rather than overshoot.
				return fmt.Errorf("a grant of %s changed under its row lock", req.Account)
			}
			return nil
		})
		q.Queue(pgAddReservationSQL, req.Account, ids, units, node).Exec(nop)
		if err := tx.SendBatch(ctx, q).Close(); err != nil {
			return ReserveResult{}, p.fail(op, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		err = p.fail(op+": commit (outcome unknown: the units may be reserved; ReleaseNode frees them)", err)
		var units int64
		for _, a := range res.Granted {
			units += a.Units
		}
		if units > 0 {
			err = &engine.ReserveUncertainError{Units: units, Err: err}
		}
		return ReserveResult{}, err
	}
	return res, nil
}

// allocColumns turns allocations into the grant and units arrays of an
// UNNEST, merging repeated grants, in grant order.
func allocColumns(allocs []shard.Alloc) (ids []string, units []int64) {
	sum := make(map[string]int64, len(allocs))
	for _, a := range allocs {
		sum[a.Grant] += a.Units
	}
	ids = slices.Sorted(maps.Keys(sum))
	units = make([]int64, len(ids))
	for i, id := range ids {
		units[i] = sum[id]
	}
	return ids, units
}

// Release hands units of node's reservations on an account's grants back,
// never below zero, once per key (ReleaseKey).
func (p *Postgres) Release(ctx context.Context, node, account string, allocs []shard.Alloc, key ReleaseKey) error {
	if err := validRelease(node, account, allocs); err != nil || len(allocs) == 0 {
		return err
	}
	ids, units := allocColumns(allocs)
	accounts := make([]string, len(ids))
	for i := range accounts {
		accounts[i] = account
	}
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(pgLockGrantsSQL, accounts, ids).Exec(nop)
	b.Queue(`UPDATE reservations r SET units = GREATEST(r.units - d.units, 0),
			released_inc = CASE WHEN $6::bigint = 0 THEN r.released_inc ELSE $5::text END,
			released_seq = CASE WHEN $6::bigint = 0 THEN r.released_seq ELSE $6::bigint END
		FROM unnest($3::text[], $4::bigint[]) AS d(grant_id, units)
		WHERE r.account_id = $1 AND r.node_id = $2 AND r.grant_id = d.grant_id
			AND ($6::bigint = 0 OR r.released_inc <> $5::text OR r.released_seq < $6::bigint)`, account, node, ids, units, key.Incarnation, int64(key.Seq)).Exec(nop)
	b.Queue(pgSumReservedSQL, account, ids).Exec(nop)
	b.Queue(`INSERT INTO handoffs (account_id, units, released_at) VALUES ($1, $2, now())
		ON CONFLICT (account_id) DO UPDATE SET units = excluded.units, released_at = excluded.released_at`, account, sumUnits(units)).Exec(nop)
	return p.fail(fmt.Sprintf("release %s's reservations of %s", node, account), p.inTx(ctx, b))
}

// validRelease refuses a release of a negative count: the statements
// subtract it from the reservation (floored at zero), so a negative one
// would reserve units for a node that does not hold them.
func validRelease(node, account string, allocs []shard.Alloc) error {
	for _, a := range allocs {
		if a.Units < 0 {
			return fmt.Errorf("%w: release of %s's reservation of %s, grant %q: %d units; want zero or more", ErrInvalid, node, account, a.Grant, a.Units)
		}
	}
	return nil
}

// Handoffs lists the accounts released since the given time, with the units
// released.
func (p *Postgres) Handoffs(ctx context.Context, since time.Time) ([]Handoff, error) {
	rows, _ := p.pool.Query(ctx, `SELECT account_id, units FROM handoffs WHERE released_at >= $1 ORDER BY account_id`, since)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Handoff, error) {
		var h Handoff
		err := r.Scan(&h.Account, &h.Units)
		return h, err
	})
	return out, p.fail("list handoffs", err)
}

// ReleaseNode frees every reservation node holds.
//
// It first waits for node's Reserves in flight, on the node's reservation
// lock. Without that, a Reserve that had inserted node's first reservation
// row on a grant, not committed yet and waiting for the grant's row lock,
// was invisible to both statements below (READ COMMITTED snapshots), and
// committed after the release: its units stayed reserved for a node that
// had given everything back (quotad chaos --seed 11). A Reserve that starts
// after the release is the caller's to prevent: the node's own release
// stops its top-ups first, and quotad revoke is for a node that is gone.
func (p *Postgres) ReleaseNode(ctx context.Context, node string) ([]Released, error) {
	var out []Released
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(`SELECT pg_advisory_xact_lock($1, hashtext($2))`, reserveLockClass, node).Exec(nop)
	b.Queue(`SELECT 1 FROM grants WHERE (account_id, grant_id) IN (SELECT account_id, grant_id FROM reservations WHERE node_id = $1)
		ORDER BY account_id, grant_id FOR UPDATE`, node).Exec(nop)
	b.Queue(`WITH del AS (
			DELETE FROM reservations WHERE node_id = $1 RETURNING account_id, grant_id, units
		), upd AS (
			UPDATE grants g SET reserved = GREATEST(g.reserved - del.units, 0)
			FROM del WHERE g.account_id = del.account_id AND g.grant_id = del.grant_id
		)
		SELECT account_id, grant_id, units FROM del WHERE units > 0 ORDER BY account_id, grant_id`, node).Query(func(rows pgx.Rows) error {
		var r Released
		_, err := pgx.ForEachRow(rows, []any{&r.Account, &r.Grant, &r.Units}, func() error {
			out = append(out, r)
			return nil
		})
		return err
	})
	if err := p.inTx(ctx, b); err != nil {
		return nil, p.fail("release the reservations of "+node, err)
	}
	return out, nil
}

// Reservations lists the reservations held (units > 0).
func (p *Postgres) Reservations(ctx context.Context) ([]Reservation, error) {
	return p.reservations(ctx, "list reservations", `SELECT node_id, account_id, grant_id, units FROM reservations WHERE units > 0
		ORDER BY node_id, account_id, grant_id`)
}

// ReservationsOf lists the reservations node holds (units > 0).
func (p *Postgres) ReservationsOf(ctx context.Context, node string) ([]Reservation, error) {
	return p.reservations(ctx, "list the reservations of "+node, `SELECT node_id, account_id, grant_id, units FROM reservations WHERE units > 0 AND node_id = $1
		ORDER BY account_id, grant_id`, node)
}

func (p *Postgres) reservations(ctx context.Context, op, query string, args ...any) ([]Reservation, error) {
	rows, _ := p.pool.Query(ctx, query, args...)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Reservation, error) {
		var v Reservation
		err := r.Scan(&v.Node, &v.Account, &v.Grant, &v.Units)
		return v, err
	})
	return out, p.fail(op, err)
}
