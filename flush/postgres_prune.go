package flush

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/quotaring/quotaring/shard"
)

// PruneEvents implements Ledger (see prune.go): each month's partition is
// dropped in a transaction of its own, after the partition is locked
// against writes (SHARE: a late settle into it waits, then fails and is
// retried into a partition created again) and its allocations are added
// to pruned_allocations. Dropping a partition locks the events table for
// a moment: settles of other months wait for it, not for the sums.
func (p *Postgres) PruneEvents(ctx context.Context, o PruneOptions) (PruneResult, error) {
	return pruneEvents(ctx, p, o)
}

// eventMonths lists the months with an event partition before before.
func (p *Postgres) eventMonths(ctx context.Context, before shard.Period) ([]shard.Period, error) {
	rows, _ := p.pool.Query(ctx, `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = 'events'::regclass`)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	var months []shard.Period
	for _, n := range names {
		if per, ok := partitionPeriod(n); ok && per < before {
			months = append(months, per)
		}
	}
	return months, err
}

// countMonth counts the rows of per's partition.
func (p *Postgres) countMonth(ctx context.Context, per shard.Period) (n int64, err error) {
	err = p.pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{partitionName(per)}.Sanitize()).Scan(&n)
	return n, err
}

// dropMonth drops per's partition and counts its rows.
func (p *Postgres) dropMonth(ctx context.Context, per shard.Period) (n int64, err error) {
	name := pgx.Identifier{partitionName(per)}.Sanitize()
	err = pgx.BeginTxFunc(ctx, p.pool, pgx.TxOptions{}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, partitionLockKey); err != nil {
			return err
		}
		// NB: as for creating a partition, waiting behind a long reader of
		// the events table (an export) for its lock would stall every
		// node's settles queued behind us.
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '5s'`); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `LOCK TABLE `+name+` IN SHARE MODE`); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM `+name).Scan(&n); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO pruned_allocations (account_id, period, grant_id, units)
			SELECT e.account_id, $1, a.grant_id, sum(a.units) FROM `+name+` e, unnest(e.grant_ids, e.grant_units) AS a(grant_id, units)
			WHERE NOT e.refunded GROUP BY e.account_id, a.grant_id
			ON CONFLICT (account_id, period, grant_id) DO UPDATE SET units = pruned_allocations.units + excluded.units`, per.String()); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `DELETE FROM replay_takebacks WHERE period_start = $1`, periodDate(per)); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `DELETE FROM takeback_names WHERE period_start = $1`, periodDate(per)); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `DROP TABLE `+name); err != nil {
			return err
		}
		return p.markPruned(ctx, tx, per+1)
	})
	p.mu.Lock()
	delete(p.partitions, per)
	p.mu.Unlock()
	if pgCode(err) == sqlLockNotAvailable {
		err = fmt.Errorf("%w: a long query held the event log for more than 5 s; run quotad prune again (the months before %v are done)", err, per)
	}
	return n, err
}

// markPrunedBefore moves the mark to before in a transaction of its own.
func (p *Postgres) markPrunedBefore(ctx context.Context, before shard.Period) error {
	return pgx.BeginTxFunc(ctx, p.pool, pgx.TxOptions{}, func(tx pgx.Tx) error { return p.markPruned(ctx, tx, before) })
}

// markPruned moves event_retention's mark to before, never back.
func (p *Postgres) markPruned(ctx context.Context, tx pgx.Tx, before shard.Period) error {
	_, err := tx.Exec(ctx, `INSERT INTO event_retention (id, pruned_before) VALUES (1, $1)
		ON CONFLICT (id) DO UPDATE SET pruned_before = greatest(event_retention.pruned_before, excluded.pruned_before)`, before.String())
	return err
}

// EventsPrunedBefore implements Ledger.
func (p *Postgres) EventsPrunedBefore(ctx context.Context) (shard.Period, error) {
	var s *string
	err := p.pool.QueryRow(ctx, `SELECT max(pruned_before) FROM event_retention`).Scan(&s)
	if err != nil {
		return 0, p.fail("read the event log's retention mark", err)
	}
	return parsePrunedBefore(s)
}

// parsePrunedBefore reads event_retention's mark (NULL: never pruned).
func parsePrunedBefore(s *string) (shard.Period, error) {
	if s == nil {
		return 0, nil
	}
	per, ok := shard.ParsePeriod(*s)
	if !ok {
		return 0, fmt.Errorf("flush: event_retention.pruned_before %q is not a month such as 2026-06: set it by hand to the month the last prune named", *s)
	}
	return per, nil
}

// partitionPeriod is partitionName backwards.
func partitionPeriod(name string) (shard.Period, bool) {
	rest, ok := strings.CutPrefix(name, "events_p")
	if !ok || len(rest) != 7 || rest[4] != '_' {
		return 0, false
	}
	per, ok := shard.ParsePeriod(rest[:4] + "-" + rest[5:])
	return per, ok && partitionName(per) == name
}
