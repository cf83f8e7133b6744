package engine_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
)

// lostReply commits a settle in the ledger and loses its answer.
type lostReply struct{ flush.Ledger }

func (l lostReply) Settle(ctx context.Context, b *flush.Batch) (flush.SettleResult, error) {
	if _, err := l.Ledger.Settle(ctx, b); err != nil {
		return flush.SettleResult{}, err
	}
	return flush.SettleResult{}, errors.New("reply lost")
}

// The settled mark kept beside the snapshot is read before the ledger:
// the snapshot's settled use may include records above it (a settle the
// ledger committed whose local half had not run). A restart that counts
// the snapshot's use for an account (its checkpoint at or below the mark)
// and then replays those records counted them twice.
func TestRestartCountsRecordsAboveTheKeptMarkOnce(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	r := &restartRig{t: t, l: hardLedger(t, dir, "a1"), clock: engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), dir: dir, node: "n1"}
	r.open()
	r.refresh()
	r.charge("a1", 10)
	r.settle()
	r.settle() // a1's checkpoint: used 10, at or below the settled mark
	r.charge("a1", 20)
	lost, err := flush.NewSettler(flush.SettlerOptions{Ledger: lostReply{r.l}, Engine: r.e, Events: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := lost.Register(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := lost.SettleOnce(ctx); err == nil {
		t.Fatal("settle: want the lost reply")
	} // the ledger: used 30; the log: the 20 not settled
	bumpConfig(t, r.l, "other")
	r.refresh() // kept: used 30, with the mark before the 20
	r.close()   // crash before the settle's retry
	r.open()
	defer r.close()
	if u, _, _ := r.e.Usage("a1"); u.Used != 30 {
		t.Errorf("after the restart a1 uses %d, want 30", u.Used)
	}
	r.settle()
	r.refresh()
	if u, _, _ := r.e.Usage("a1"); u.Used != 30 {
		t.Errorf("after the restart's settle and refresh a1 uses %d, want 30", u.Used)
	}
	r.charge("a1", 70) // a hard quota of 100
}
