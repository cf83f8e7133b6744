package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/waitfor"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// stallReserver answers nothing while stalled, until unstall is closed,
// then grants what is asked. It counts the calls made for a waiting charge
// (a deadline within a minute: ReserveTimeout) apart from the background
// ones (LedgerTimeout, an hour in the test).
type stallReserver struct {
	fakeLedger
	stalled     atomic.Bool
	unstall     chan struct{}
	chargeCalls atomic.Int64
}

func (s *stallReserver) Reserve(ctx context.Context, req ReserveRequest) (ReserveResult, error) {
	if d, ok := ctx.Deadline(); ok && time.Until(d) < time.Minute {
		s.chargeCalls.Add(1)
	}
	if s.stalled.Load() {
		select {
		case <-ctx.Done():
			return ReserveResult{}, ctx.Err()
		case <-s.unstall:
		}
	}
	return s.fakeLedger.Reserve(ctx, req)
}

// While the ledger leaves a charge's reservation unanswered, the next
// charges that need one are refused at once (quota-unavailable), not after
// ReserveTimeout each: a forwarded batch waits for its slowest reservation,
// so every soft charge batched with a hard one waited too, and callers
// queued behind such batches ran out of time (the SRE review's F5: soft
// accounts answered 503 while Postgres was frozen). The background top-up
// asks the ledger meanwhile, one call at a time, and its answer ends the
// stall.
func TestStalledLedgerRefusesReservationsAtOnce(t *testing.T) {
	r := &stallReserver{fakeLedger: fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}, unstall: make(chan struct{})}
	r.stalled.Store(true)
	l := openLog(t, t.TempDir())
	e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Reserver: r,
		LedgerTimeout: time.Hour, ReserveTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	s := &snapshot.Snapshot{Version: 1, Routes: snapshot.Routes{Default: 1}, Plans: []snapshot.Plan{
		{ID: "hard", MonthlyQuota: 1000, Hard: true}, {ID: "soft", MonthlyQuota: 1000},
	}, Accounts: []snapshot.Account{{ID: "acme", Plan: "hard"}, {ID: "globex", Plan: "soft"}}}
	if err := s.Build(); err != nil {
		t.Fatal(err)
	}
	if err := e.SetSnapshot(s, AllSettled); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	n := 0
	batch := func() []Outcome {
		n++
		return e.ChargeMany(ctx, []Request{
			{Account: "acme", Charge: shard.Charge{EventID: fmt.Sprint("h", n), ClientID: true, Units: 1}},
			{Account: "globex", Charge: shard.Charge{EventID: fmt.Sprint("s", n), ClientID: true, Units: 1}},
		})
	}
	// The first waits its ReserveTimeout: that is how the stall is found.
	out := batch()
	if !errors.Is(out[0].Err, ErrQuotaUnavailable) || out[1].Err != nil || out[1].Reason != shard.OK {
		t.Fatalf("first batch: hard %v, soft %v %v; want quota-unavailable and OK", out[0].Err, out[1].Reason, out[1].Err)
	}
	if got := r.chargeCalls.Load(); got != 1 {
		t.Fatalf("%d reservations for waiting charges, want 1", got)
	}
	// The next ones do not wait for the ledger.
	for range 3 {
		out = batch()
		if !errors.Is(out[0].Err, ErrQuotaUnavailable) || !strings.Contains(out[0].Err.Error(), "left a reservation unanswered") || out[1].Err != nil || out[1].Reason != shard.OK {
			t.Fatalf("batch during the stall: hard %v, soft %v %v; want quota-unavailable naming the stall, and OK", out[0].Err, out[1].Reason, out[1].Err)
		}
	}
	if got := r.chargeCalls.Load(); got != 1 {
		t.Fatalf("%d reservations for waiting charges during the stall, want still 1: each waited ReserveTimeout for a ledger known not to answer", got)
	}
	// The ledger answers the background call: charges reserve again.
	close(r.unstall)
	waitfor.Cond(t, 10*time.Second, "a hard charge reserves again after the ledger answered", func() bool {
		return batch()[0].Err == nil
	})
}
