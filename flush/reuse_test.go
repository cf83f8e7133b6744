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

// reuseRig is one node, q1, on a real log, engine and settler, settling to
// ledger l; acct-1 has 100 units a month. restart closes and opens it again
// on the same data dir.
type reuseRig struct {
	l     Ledger
	dir   string
	clock *engine.ManualClock
	e     *engine.Engine
	s     *Settler
	stop  func()
}

func newReuseRig(t *testing.T, l Ledger, start time.Time) *reuseRig {
	t.Helper()
	ctx := context.Background()
	if err := l.UpsertPlan(ctx, snapshot.Plan{ID: "basic", MonthlyQuota: 100}); err != nil {
		t.Fatal(err)
	}
	if err := l.UpsertAccount(ctx, "acct-1", "basic"); err != nil {
		t.Fatal(err)
	}
	r := &reuseRig{l: l, dir: filepath.Join(t.TempDir(), "q1"), clock: engine.NewManualClock(start)}
	r.start(t)
	t.Cleanup(func() { r.stop() })
	return r
}

func (r *reuseRig) start(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	log, err := wal.Open(wal.Options{Dir: r.dir, NodeID: "q1"})
	if err != nil {
		t.Fatal(err)
	}
	if r.e, err = engine.Open(engine.Options{Log: log, Clock: r.clock}); err != nil {
		t.Fatal(err)
	}
	r.stop = func() { r.e.Close(); log.Close() }
	snap, err := r.l.Snapshot(ctx, time.Unix(0, r.clock.Now().Wall))
	if err != nil {
		t.Fatal(err)
	}
	if err := r.e.SetSnapshot(snap, engine.AllSettled); err != nil {
		t.Fatal(err)
	}
	if r.s, err = NewSettler(SettlerOptions{Ledger: r.l, Engine: r.e, Events: true}); err != nil {
		t.Fatal(err)
	}
	if err := r.s.Register(ctx); err != nil {
		t.Fatal(err)
	}
}

func (r *reuseRig) restart(t *testing.T) {
	t.Helper()
	r.stop()
	r.start(t)
}

func (r *reuseRig) charge(t *testing.T, id string, units int64, want shard.Reason) *shard.Receipt {
	t.Helper()
	res, err := r.e.Charge(context.Background(), "acct-1", shard.Charge{EventID: id, ClientID: true, Key: "k1", Route: "POST /v1/x", Units: units})
	if err != nil || res.Reason != want {
		t.Fatalf("charge %s on %v: %v, %v; want %v", id, time.Unix(0, r.clock.Now().Wall).UTC(), res.Reason, err, want)
	}
	return res.Receipt
}

func (r *reuseRig) settle(t *testing.T) {
	t.Helper()
	if _, err := r.s.SettleOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func (r *reuseRig) billed(t *testing.T, month time.Month) int64 {
	t.Helper()
	u, err := r.l.Usage(context.Background(), "acct-1", shard.PeriodOf(time.Date(2026, month, 1, 0, 0, 0, 0, time.UTC).UnixNano()))
	if err != nil {
		t.Fatal(err)
	}
	return u.Units
}

func eachLedger(t *testing.T, test func(t *testing.T, l Ledger)) {
	for name, open := range map[string]func(t *testing.T) Ledger{
		"sqlite":   func(t *testing.T) Ledger { return migratedSQLite(t, nil) },
		"postgres": func(t *testing.T) Ledger { return migratedPG(t) },
	} {
		t.Run(name, func(t *testing.T) { test(t, open(t)) })
	}
}

// An Idempotency-Key used again ten days after its first use is new work,
// served and counted by the owner, and billed by the ledger, which bills an
// event id once a month: the owner names the second use apart (the id's
// next generation), also after a restart between the two, from the ids it
// stored apart. Named alike, the ledger took the second use for a retry and
// billed 2 units of 5. Real engine, log and settler, on both ledgers.
func TestAKeyUsedAgainAfterADayIsBilledAgain(t *testing.T) {
	eachLedger(t, func(t *testing.T, l Ledger) {
		r := newReuseRig(t, l, time.Date(2026, 6, 2, 12, 0, 0, 0, time.UTC))
		r.charge(t, "order-1", 2, shard.OK)
		r.clock.Advance(time.Hour)
		r.charge(t, "order-1", 2, shard.Replayed) // a retry: billed once
		r.clock.SetWall(time.Date(2026, 6, 4, 12, 0, 0, 0, time.UTC))
		r.charge(t, "order-2", 1, shard.OK) // order-1 is let go, its generation kept
		r.settle(t)                         // and stored apart with the checkpoint
		r.restart(t)                        // the generation comes back from the store
		r.clock.SetWall(time.Date(2026, 6, 12, 12, 0, 0, 0, time.UTC))
		r.charge(t, "order-1", 3, shard.OK)
		r.settle(t)
		if got := r.billed(t, time.June); got != 6 {
			t.Fatalf("billed %d units, want 6 (order-1: 2, order-2: 1, order-1 used again: 3)", got)
		}
		rows, err := l.Events(context.Background(), "acct-1")
		if err != nil {
			t.Fatal(err)
		}
		if len(rows) != 3 {
			t.Fatalf("%d events in the ledger, want 3: %+v", len(rows), rows)
		}
	})
}

// A key used in June and again in July is billed in both months, and a
// refund of either use returns that use's units, on both ledgers. The
// owner's generations start again each month, as Postgres keys its event
// log by month; SQLite's has one row per id, where the July use was taken
// for a retry of June's and billed nothing (now June's row moves aside).
func TestAKeyUsedAgainNextMonthIsBilledAgain(t *testing.T) {
	eachLedger(t, func(t *testing.T, l Ledger) {
		r := newReuseRig(t, l, time.Date(2026, 6, 20, 12, 0, 0, 0, time.UTC))
		june := r.charge(t, "order-1", 2, shard.OK)
		r.settle(t)
		r.clock.SetWall(time.Date(2026, 7, 12, 12, 0, 0, 0, time.UTC))
		r.charge(t, "order-1", 3, shard.OK)
		r.settle(t)
		if j, k := r.billed(t, time.June), r.billed(t, time.July); j != 2 || k != 3 {
			t.Fatalf("billed %d in June and %d in July, want 2 and 3", j, k)
		}
		rows, err := l.Events(context.Background(), "acct-1")
		if err != nil {
			t.Fatal(err)
		}
		if len(rows) != 2 || rows[0].EventID != "order-1" || rows[0].Period != "2026-06" || rows[1].EventID != "order-1" || rows[1].Period != "2026-07" {
			t.Fatalf("the event log lists %+v, want order-1 in June and in July", rows)
		}
		// June's use refunded by its receipt, in July: June's units only.
		if d, err := r.e.Refund(context.Background(), "acct-1", "order-1", june); err != nil || d.Reason != shard.Refunded {
			t.Fatalf("refund of June's use: %v, %v", d.Reason, err)
		}
		r.settle(t)
		if j, k := r.billed(t, time.June), r.billed(t, time.July); j != 0 || k != 3 {
			t.Fatalf("after June's refund: billed %d in June and %d in July, want 0 and 3", j, k)
		}
		// July's by its id.
		if d, err := r.e.Refund(context.Background(), "acct-1", "order-1", nil); err != nil || d.Reason != shard.Refunded {
			t.Fatalf("refund of July's use: %v, %v", d.Reason, err)
		}
		r.settle(t)
		if j, k := r.billed(t, time.June), r.billed(t, time.July); j != 0 || k != 0 {
			t.Fatalf("after both refunds: billed %d in June and %d in July, want 0 and 0", j, k)
		}
		wantReconciled(t, l)
	})
}
