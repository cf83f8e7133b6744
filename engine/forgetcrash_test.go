package engine_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/shard"
)

// openOwning is restartRig.open with an ownership switch for a1.
func (r *restartRig) openOwning(owns *atomic.Bool) {
	r.owns = func(a string) bool { return a != "a1" || owns.Load() }
	r.open()
}

// Forget drops an account's client ids (a restart must not bring them
// back: another owner may refund or replay them meanwhile); the drop is
// stored at the next settle. A crash before it brought the ids back, and
// the account, back at this node, answered a retry of an id its other
// owner had refunded Replayed (served for nothing) instead of charging it
// again as the id's next generation.
func TestForgottenIDsStayForgottenAfterACrash(t *testing.T) {
	for _, idle := range []bool{false, true} {
		name := map[bool]string{false: "crash before the next settle", true: "idle log: a settle moves nothing"}[idle]
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			dir := t.TempDir()
			l := hardLedger(t, dir, "a1", "a2")
			clock := engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
			var owns1, owns2 atomic.Bool
			owns1.Store(true)
			n1 := &restartRig{t: t, l: l, clock: clock, dir: dir, node: "n1"}
			n1.openOwning(&owns1)
			n1.refresh()
			k := shard.Charge{Route: "r", Units: 10, EventID: "K", ClientID: true}
			res, err := n1.e.Charge(ctx, "a1", k)
			if err != nil || res.Reason != shard.OK {
				t.Fatalf("charge K: %s, %v", res.Reason, err)
			}
			n1.settle()
			// a1 moves to n2: n1 hands back, settles, refreshes, forgets.
			owns1.Store(false)
			if err := n1.e.Release(ctx, "a1"); err != nil {
				t.Fatal(err)
			}
			n1.settle()
			n1.refresh()
			if !n1.e.Forget("a1") {
				t.Fatal("Forget kept a1")
			}
			if idle {
				n1.settle() // nothing to move: the drop stays in memory
			} else {
				n1.charge("a2", 1) // other traffic, whose settle a crash cuts off
			}
			n1.close() // kill -9
			owns2.Store(true)
			n2 := &restartRig{t: t, l: l, clock: clock, dir: dir, node: "n2"}
			n2.openOwning(&owns2)
			n2.refresh()
			if d, err := n2.e.Refund(ctx, "a1", "K", res.Receipt); err != nil || d.Reason != shard.Refunded {
				t.Fatalf("refund K at n2: %s, %v", d.Reason, err)
			}
			n2.settle()
			n2.close()
			// a1 comes back to n1.
			owns1.Store(true)
			n1.openOwning(&owns1)
			defer n1.close()
			n1.settle()
			n1.refresh()
			again, err := n1.e.Charge(ctx, "a1", k)
			if err != nil || again.Reason != shard.OK {
				t.Errorf("a retry of K, refunded at n2, at n1: %s, %v; want a new charge (OK)", again.Reason, err)
			}
		})
	}
}

// An account forgotten keeps its checkpoint's use on disk (only its ids
// go); a restart restored that use and a refresh only raises use, so a
// refund its other owner settled meanwhile stayed counted here for the
// month after the account came back: a hard quota of 100 with nothing
// used in the ledger refused 95. A restored account's use is set to the
// ledger's by the first snapshot that includes all its records.
func TestRestartedAccountTakesTheLedgersUse(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	l := hardLedger(t, dir, "a1")
	clock := engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	var owns1, owns2 atomic.Bool
	owns1.Store(true)
	n1 := &restartRig{t: t, l: l, clock: clock, dir: dir, node: "n1"}
	n1.openOwning(&owns1)
	n1.refresh()
	res := n1.charge("a1", 10)
	n1.settle()
	owns1.Store(false) // a1 moves to n2
	if err := n1.e.LetGo(ctx, "a1"); err != nil {
		t.Fatal(err)
	}
	n1.settle()
	n1.refresh()
	n1.e.Forget("a1")
	n1.close()
	owns2.Store(true)
	n2 := &restartRig{t: t, l: l, clock: clock, dir: dir, node: "n2"}
	n2.openOwning(&owns2)
	n2.refresh()
	if d, err := n2.e.Refund(ctx, "a1", res.EventID, res.Receipt); err != nil || d.Reason != shard.Refunded {
		t.Fatalf("refund at n2: %s, %v", d.Reason, err)
	}
	n2.settle()
	n2.close()
	owns1.Store(true) // a1 comes back to n1, restarted
	n1.openOwning(&owns1)
	defer n1.close()
	n1.settle()
	n1.refresh()
	if u, ok, err := n1.e.Usage("a1"); err != nil || !ok || u.Remaining != 100 {
		t.Errorf("a1 at n1 after its restart and a refresh: %+v, %v; want 100 left, as the ledger has it (n2 refunded the charge)", u, err)
	}
	n1.charge("a1", 95)
}
