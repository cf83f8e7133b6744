package engine_test

import (
	"context"
	"errors"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/wal"
)

// lostAnswers is a ledger whose next Release commits and then reports an
// error, as when the connection drops after the COMMIT went out.
type lostAnswers struct {
	flush.Ledger
	lose   atomic.Bool
	refuse atomic.Bool // the next Release fails before it reaches the ledger
}

func (l *lostAnswers) Release(ctx context.Context, node, account string, allocs []shard.Alloc, key flush.ReleaseKey) error {
	if l.refuse.Swap(false) {
		return errors.New("connection refused")
	}
	err := l.Ledger.Release(ctx, node, account, allocs, key)
	if err == nil && l.lose.Swap(false) {
		return errors.New("connection reset after COMMIT: outcome unknown")
	}
	return err
}

// A hand-back whose answer was lost is retried, and must apply once: a
// second application took the units off the reservation that backs the
// node's spent, unsettled charges, and another node reserved and spent
// them (a review found 120 acknowledged on a hard quota of 100). The node
// also hands back twice in a row (the account moved away, came back, moved
// away again) with the first retry still pending: the two are retried in
// order, each once.
func TestReleaseWithALostAnswerAppliesOnce(t *testing.T) {
	t.Run("answer lost", func(t *testing.T) { testReleaseRetried(t, false) })
	// The first release never reached the ledger; the second, sent
	// straight away, applied before it, and the first's retry was then
	// skipped as applied (its key older than the row's): its units stayed
	// reserved for nobody. Now the second waits behind the first.
	t.Run("refused, then a newer release", func(t *testing.T) { testReleaseRetried(t, true) })
}

func testReleaseRetried(t *testing.T, refuseFirst bool) {
	ctx := context.Background()
	dir := t.TempDir()
	base := hardLedger(t, dir, "acme")
	l := &lostAnswers{Ledger: base}
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
	e, err := engine.Open(engine.Options{Log: log, Clock: clock, Reserver: &flush.Reserver{Ledger: l, Node: "n1", Incarnation: log.Incarnation()}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := e.SetSnapshot(snap, engine.AllSettled); err != nil {
		t.Fatal(err)
	}
	reservedInLedger := func() int64 {
		rs, err := base.Reservations(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var n int64
		for _, r := range rs {
			n += r.Units
		}
		return n
	}
	// What the ledger reserves for n1 must cover what n1 spent and has not
	// settled plus the allowance it holds (more is only stranded units).
	// The top-up loop may reserve more at any time; it never lowers either.
	var spent int64
	check := func(when string) {
		t.Helper()
		if got, want := reservedInLedger(), spent+e.AllowanceHeld(); got < want {
			t.Fatalf("%s: the ledger reserves %d for n1, less than the %d it spent unsettled plus the %d it holds: a release applied twice",
				when, got, spent, e.AllowanceHeld())
		}
	}
	for round := range 2 {
		res, err := e.Charge(ctx, "acme", shard.Charge{Units: 20})
		if err != nil || res.Reason != shard.OK {
			t.Fatalf("round %d: charge: %s, %v", round, res.Reason, err)
		}
		spent += 20 // acknowledged, not settled: the ledger's reservation backs it
		switch {
		case refuseFirst && round == 0:
			l.refuse.Store(true)
		case refuseFirst:
			// the ledger answers again
		default:
			l.lose.Store(true)
		}
		err = e.Release(ctx, "acme")
		if wantErr := !refuseFirst || round == 0; (err != nil) != wantErr {
			t.Fatalf("round %d: Release: %v, want an error: %v", round, err, wantErr)
		}
		check("after a hand-back")
	}
	e.Close() // no more top-ups
	if err := e.RetryReleases(ctx); err != nil {
		t.Fatal(err)
	}
	check("after the retries")
	if got, want := reservedInLedger(), spent+e.AllowanceHeld(); got != want {
		t.Fatalf("after the retries the ledger reserves %d for n1, want %d (spent %d, held %d)", got, want, spent, e.AllowanceHeld())
	}
}
