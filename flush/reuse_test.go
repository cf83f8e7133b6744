package flush

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
)

// An Idempotency-Key used again ten days after its first use is new work,
// served and counted by the owner, and billed by the ledger, which bills an
// event id once a month: the owner names the second use apart (the id's
// next generation), also after a restart between the two, from the ids it
// stored apart. Named alike, the ledger took the second use for a retry and
// billed 2 units of 5. Real engine, log and settler, on both ledgers.
func TestAKeyUsedAgainAfterADayIsBilledAgain(t *testing.T) {
	for name, open := range map[string]func(t *testing.T) Ledger{
		"sqlite":   func(t *testing.T) Ledger { return migratedSQLite(t, nil) },
		"postgres": func(t *testing.T) Ledger { return migratedPG(t) },
	} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			l := open(t)
			if err := l.UpsertPlan(ctx, snapshot.Plan{ID: "basic", MonthlyQuota: 100}); err != nil {
				t.Fatal(err)
			}
			if err := l.UpsertAccount(ctx, "acct-1", "basic"); err != nil {
				t.Fatal(err)
			}
			dir := filepath.Join(t.TempDir(), "q1")
			clock := engine.NewManualClock(time.Date(2026, 6, 2, 12, 0, 0, 0, time.UTC))
			var e *engine.Engine
			var s *Settler
			var stop func()
			start := func() {
				log, err := wal.Open(wal.Options{Dir: dir, NodeID: "q1"})
				if err != nil {
					t.Fatal(err)
				}
				e, err = engine.Open(engine.Options{Log: log, Clock: clock})
				if err != nil {
					t.Fatal(err)
				}
				stop = func() { e.Close(); log.Close() }
				snap, err := l.Snapshot(ctx, time.Unix(0, clock.Now().Wall))
				if err != nil {
					t.Fatal(err)
				}
				if err := e.SetSnapshot(snap, engine.AllSettled); err != nil {
					t.Fatal(err)
				}
				if s, err = NewSettler(SettlerOptions{Ledger: l, Engine: e, Events: true}); err != nil {
					t.Fatal(err)
				}
				if err := s.Register(ctx); err != nil {
					t.Fatal(err)
				}
			}
			charge := func(id string, units int64, want shard.Reason) {
				t.Helper()
				res, err := e.Charge(ctx, "acct-1", shard.Charge{EventID: id, ClientID: true, Key: "k1", Route: "POST /v1/x", Units: units})
				if err != nil || res.Reason != want {
					t.Fatalf("charge %s on %v: %v, %v; want %v", id, time.Unix(0, clock.Now().Wall).UTC(), res.Reason, err, want)
				}
			}
			settle := func() {
				t.Helper()
				if _, err := s.SettleOnce(ctx); err != nil {
					t.Fatal(err)
				}
			}
			start()
			defer func() { stop() }()
			charge("order-1", 2, shard.OK)
			clock.Advance(time.Hour)
			charge("order-1", 2, shard.Replayed) // a retry: billed once
			clock.SetWall(time.Date(2026, 6, 4, 12, 0, 0, 0, time.UTC))
			charge("order-2", 1, shard.OK) // order-1 is let go, its generation kept
			settle()                       // and stored apart with the checkpoint
			stop()
			start() // a restart: the generation comes back from the store
			clock.SetWall(time.Date(2026, 6, 12, 12, 0, 0, 0, time.UTC))
			charge("order-1", 3, shard.OK)
			settle()
			u, err := l.Usage(ctx, "acct-1", shard.PeriodOf(clock.Now().Wall))
			if err != nil {
				t.Fatal(err)
			}
			if u.Units != 6 {
				t.Fatalf("billed %d units, want 6 (order-1: 2, order-2: 1, order-1 used again: 3)", u.Units)
			}
			rows, err := l.Events(ctx, "acct-1")
			if err != nil {
				t.Fatal(err)
			}
			if len(rows) != 3 {
				t.Fatalf("%d events in the ledger, want 3: %+v", len(rows), rows)
			}
		})
	}
}
