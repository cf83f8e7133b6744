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

// twoOwners is n1 and n2 on one hard ledger and clock: n1 open, owning a1;
// n2 made, not open, owning a1 once it opens (see refundAtN2).
type twoOwners struct {
	n1, n2       *restartRig
	owns1, owns2 atomic.Bool
}

func newTwoOwners(t *testing.T, accounts ...string) *twoOwners {
	dir := t.TempDir()
	l := hardLedger(t, dir, accounts...)
	clock := engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	o := &twoOwners{n1: &restartRig{t: t, l: l, clock: clock, dir: dir, node: "n1"}, n2: &restartRig{t: t, l: l, clock: clock, dir: dir, node: "n2"}}
	o.owns1.Store(true)
	o.n1.openOwning(&o.owns1)
	o.n1.refresh()
	return o
}

// refundAtN2 opens n2, the owner of a1 now, refunds a1's event by its
// receipt there, settles and closes it.
func (o *twoOwners) refundAtN2(t *testing.T, event string, receipt *shard.Receipt) {
	t.Helper()
	o.owns2.Store(true)
	o.n2.openOwning(&o.owns2)
	o.n2.refresh()
	if d, err := o.n2.e.Refund(context.Background(), "a1", event, receipt); err != nil || d.Reason != shard.Refunded {
		t.Fatalf("refund %s at n2: %s, %v", event, d.Reason, err)
	}
	o.n2.settle()
	o.n2.close()
}

// backToN1 gives a1 back to n1, opened again (closed at the test's end),
// settled and refreshed.
func (o *twoOwners) backToN1(t *testing.T) {
	o.owns1.Store(true)
	o.n1.openOwning(&o.owns1)
	t.Cleanup(o.n1.close)
	o.n1.settle()
	o.n1.refresh()
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
			o := newTwoOwners(t, "a1", "a2")
			n1 := o.n1
			k := shard.Charge{Route: "r", Units: 10, EventID: "K", ClientID: true}
			res, err := n1.e.Charge(ctx, "a1", k)
			if err != nil || res.Reason != shard.OK {
				t.Fatalf("charge K: %s, %v", res.Reason, err)
			}
			n1.settle()
			// a1 moves to n2: n1 hands back, settles, refreshes, forgets.
			o.owns1.Store(false)
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
			o.refundAtN2(t, "K", res.Receipt)
			o.backToN1(t)
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
	o := newTwoOwners(t, "a1")
	n1 := o.n1
	res := n1.charge("a1", 10)
	n1.settle()
	o.owns1.Store(false) // a1 moves to n2
	if err := n1.e.LetGo(ctx, "a1"); err != nil {
		t.Fatal(err)
	}
	n1.settle()
	n1.refresh()
	n1.e.Forget("a1")
	n1.close()
	o.refundAtN2(t, res.EventID, res.Receipt)
	o.backToN1(t) // restarted
	if u, ok, err := n1.e.Usage("a1"); err != nil || !ok || u.Remaining != 100 {
		t.Errorf("a1 at n1 after its restart and a refresh: %+v, %v; want 100 left, as the ledger has it (n2 refunded the charge)", u, err)
	}
	n1.charge("a1", 95)
}
