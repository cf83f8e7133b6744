package flush

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/quotaring/quotaring/shard"
)

// PruneEvents implements Ledger (see prune.go): each month's events are
// deleted in a write transaction of their own, after their allocations are
// added to pruned_allocations. SQLite has one writer: settles wait for each
// month's delete.
func (s *SQLite) PruneEvents(ctx context.Context, o PruneOptions) (PruneResult, error) {
	return pruneEvents(ctx, s, o)
}

// eventMonths lists the months with events before before.
func (s *SQLite) eventMonths(ctx context.Context, before shard.Period) ([]shard.Period, error) {
	var months []shard.Period
	err := s.read(ctx, func(tx *sql.Tx) error {
		return queryEach(ctx, tx, `SELECT DISTINCT period FROM events WHERE period < ?`, []any{before.String()}, func(scan func(...any) error) error {
			var str string
			if err := scan(&str); err != nil {
				return err
			}
			per, ok := shard.ParsePeriod(str)
			if !ok {
				return fmt.Errorf("an event's period %q is not a month such as 2026-06", str)
			}
			months = append(months, per)
			return nil
		})
	})
	return months, err
}

// countMonth counts the events of per.
func (s *SQLite) countMonth(ctx context.Context, per shard.Period) (n int64, err error) {
	err = s.read(ctx, func(tx *sql.Tx) error { n, err = sqliteCountMonth(ctx, tx, per); return err })
	return n, err
}

func sqliteCountMonth(ctx context.Context, tx *sql.Tx, per shard.Period) (n int64, err error) {
	err = tx.QueryRowContext(ctx, `SELECT count(*) FROM events WHERE period = ?`, per.String()).Scan(&n)
	return n, err
}

// dropMonth deletes the events of per and counts them.
func (s *SQLite) dropMonth(ctx context.Context, per shard.Period) (n int64, err error) {
	err = s.write(ctx, func(tx *sql.Tx) error {
		if n, err = sqliteCountMonth(ctx, tx, per); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO pruned_allocations (account_id, period, grant_id, units)
			SELECT e.account_id, e.period, json_extract(a.value, '$.grant'), sum(json_extract(a.value, '$.units'))
			FROM events e, json_each(e.allocations) a
			WHERE e.period = ? AND NOT e.refunded GROUP BY 1, 2, 3
			ON CONFLICT (account_id, period, grant_id) DO UPDATE SET units = units + excluded.units`, per.String()); err != nil {
			return err
		}
		// The take-backs waiting for replays of the month's events go with
		// them (SQLite's table has no period, Postgres's does).
		if _, err := tx.ExecContext(ctx, `DELETE FROM replay_takebacks WHERE (account_id, event_id) IN
			(SELECT account_id, event_id FROM events WHERE period = ?)`, per.String()); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM takeback_names WHERE period = ?`, per.String()); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM events WHERE period = ?`, per.String()); err != nil {
			return err
		}
		return s.markPruned(ctx, tx, per+1)
	})
	return n, err
}

// markPrunedBefore moves the mark to before in a transaction of its own.
func (s *SQLite) markPrunedBefore(ctx context.Context, before shard.Period) error {
	return s.write(ctx, func(tx *sql.Tx) error { return s.markPruned(ctx, tx, before) })
}

// markPruned moves event_retention's mark to before, never back.
func (s *SQLite) markPruned(ctx context.Context, tx *sql.Tx, before shard.Period) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO event_retention (id, pruned_before) VALUES (1, ?)
		ON CONFLICT (id) DO UPDATE SET pruned_before = max(pruned_before, excluded.pruned_before)`, before.String())
	return err
}

// EventsPrunedBefore implements Ledger.
func (s *SQLite) EventsPrunedBefore(ctx context.Context) (shard.Period, error) {
	var str sql.NullString
	if err := s.db.QueryRowContext(ctx, `SELECT max(pruned_before) FROM event_retention`).Scan(&str); err != nil {
		return 0, s.fail("read the event log's retention mark", err)
	}
	if !str.Valid {
		return 0, nil
	}
	return parsePrunedBefore(&str.String)
}
