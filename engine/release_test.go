package engine

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
)

// fakeLedger grants what is asked and records what is handed back.
type fakeLedger struct {
	mu                 sync.Mutex // protects reserved and released
	reserved, released map[string]int64
}

func (f *fakeLedger) Reserve(_ context.Context, req ReserveRequest) (ReserveResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reserved[req.Account] += req.Need
	return ReserveResult{Granted: []shard.Alloc{{Grant: shard.MonthlyGrantID(shard.PeriodOf(req.Wall)), Units: req.Need}}}, nil
}

func (f *fakeLedger) Release(_ context.Context, account string, allocs []shard.Alloc) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, a := range allocs {
		f.released[account] += a.Units
	}
	return nil
}

// A release whose caller's context ends after the allowance was zeroed in
// the log still hands the units back to the ledger: otherwise they stay
// reserved there for nobody. (Found by the chaos harness: a node sent
// SIGTERM while it handed back the accounts a ring change took from it
// left their reservations in the ledger after it exited.)
func TestReleaseFinishesWhenTheCallerGivesUp(t *testing.T) {
	ledger := &fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}
	l := openLog(t, t.TempDir())
	e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Reserver: ledger})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	if err := e.SetSnapshot(testSnapshot(t, map[string]int64{"acme": 1000})); err != nil {
		t.Fatal(err)
	}
	if res, err := e.Charge(context.Background(), "acme", shard.Charge{EventID: "e1", ClientID: true, Units: 1}); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}
	ledger.mu.Lock()
	held := ledger.reserved["acme"] - 1 // what the node holds after one charge of 1
	ledger.mu.Unlock()
	if held <= 0 {
		t.Fatal("the charge reserved nothing ahead; the test needs an allowance to hand back")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the node is shutting down
	e.Release(ctx, "acme")
	ledger.mu.Lock()
	defer ledger.mu.Unlock()
	if ledger.released["acme"] != held {
		t.Fatalf("the ledger got %d units back of the %d the node zeroed locally", ledger.released["acme"], held)
	}
}
