package engine_test

import (
	"context"
	"errors"
	"math"
	"path/filepath"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
)

// A charge near the int64 limit on an account that holds no reservation
// yet, against a real (SQLite) ledger, is answered: Invalid above
// shard.MaxUnits, QuotaExceeded at it. It used to end ErrQuotaUnavailable
// after five reservation rounds ("units reserved were taken by concurrent
// charges"), which callers retry forever: the reservation's Need wrapped
// around to a negative number.
func TestChargeNearTheInt64LimitIsAnswered(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	l := hardLedger(t, dir, "big1", "big2")
	clock := engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	snap, err := l.Snapshot(ctx, time.Unix(0, clock.Now().Wall))
	if err != nil {
		t.Fatal(err)
	}
	log, err := wal.Open(wal.Options{Dir: filepath.Join(dir, "n1"), NodeID: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	e, err := engine.Open(engine.Options{Log: log, Clock: clock, Reserver: &flush.Reserver{Ledger: l, Node: "n1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := e.SetSnapshot(snap, engine.AllSettled); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		account string
		units   int64
		want    shard.Reason
	}{
		{"big1", math.MaxInt64, shard.Invalid},
		{"big1", shard.MaxUnits + 1, shard.Invalid},
		{"big2", shard.MaxUnits, shard.QuotaExceeded}, // a fresh account: the first charge reserves
		{"big2", 1, shard.OK},
	} {
		res, err := e.Charge(ctx, tc.account, shard.Charge{Units: tc.units})
		if err != nil || res.Reason != tc.want {
			t.Fatalf("charge of %d units on %s: %s, %v; want %s (ErrQuotaUnavailable: %v)", tc.units, tc.account, res.Reason, err, tc.want,
				errors.Is(err, engine.ErrQuotaUnavailable))
		}
	}
}

// hardLedger is a migrated SQLite ledger in dir, closed when the test ends,
// with the plan m100 (a hard monthly quota of 100) and accounts on it.
func hardLedger(t *testing.T, dir string, accounts ...string) flush.Ledger {
	t.Helper()
	ctx := context.Background()
	l, err := flush.Open(ctx, "sqlite:"+filepath.Join(dir, "ledger.db"), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.UpsertPlan(ctx, snapshot.Plan{ID: "m100", MonthlyQuota: 100, Hard: true}); err != nil {
		t.Fatal(err)
	}
	for _, a := range accounts {
		if err := l.UpsertAccount(ctx, a, "m100"); err != nil {
			t.Fatal(err)
		}
	}
	return l
}
