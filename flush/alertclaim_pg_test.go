package flush

import (
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/waitfor"
)

// A claim whose first attempt's INSERT commits while the retry (its reply
// was lost) waits on the row's key is still the caller's: RecordAlert
// reports true. Postgres read the row with the retry's snapshot, from
// before the commit, and reported false: the node dropped the alert as
// claimed by another, and it waited a whole lease for a takeover.
func TestPostgresRecordAlertRetryWaitingOnItsOwnClaim(t *testing.T) {
	l := migratedPG(t)
	ctx := t.Context()
	a := confAlert("acct-1", confPeriod, 80, "c1")
	first, err := l.pool.Begin(ctx) // the first attempt, not committed yet
	if err != nil {
		t.Fatal(err)
	}
	defer first.Rollback(ctx)
	if _, err := first.Exec(ctx, `INSERT INTO alerts (account_id, period, threshold, crossed_at, claim, used, limit_units, state)
		VALUES ($1, $2, $3, $4, $5, $6, $7, 'pending')`, a.Account, a.Period.String(), a.Threshold, a.CrossedAt, a.Claim, a.Used, a.Limit); err != nil {
		t.Fatal(err)
	}
	type result struct {
		won bool
		err error
	}
	done := make(chan result, 1)
	go func() {
		won, err := l.RecordAlert(ctx, a) // the retry
		done <- result{won, err}
	}()
	waitfor.Cond(t, 10*time.Second, "the retry waiting on the first attempt's row", func() bool {
		var n int
		err := l.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO alerts%'`).Scan(&n)
		return err == nil && n == 1
	})
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil || !r.won {
		t.Fatalf("the retry of a claim whose first attempt committed meanwhile: %v, %v; want true (the caller's own claim)", r.won, r.err)
	}
	if won, err := l.RecordAlert(ctx, confAlert("acct-1", confPeriod, 80, "c2")); err != nil || won {
		t.Fatalf("another claim: %v, %v; want false", won, err)
	}
}
