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

// A node killed while it owned a1 comes back with its data dir, and with
// it its memory of client id K, charged there (60 of a hard 100). Meanwhile
// n2 owned a1, refunded K's attempt (its upstream failed) and charged the
// freed units. A retry of K at the restarted n1 is answered Replayed from
// that memory, spending nothing; the ledger billed the replay again, and
// the account stood at 120 used of 100. It is served, but billed again
// only within the limit: here not at all (G1).
func TestAStaleReplayAfterARestartStaysWithinTheHardLimit(t *testing.T) {
	ctx := context.Background()
	o := newTwoOwners(t, "a1")
	n1, n2 := o.n1, o.n2
	k := shard.Charge{Route: "r", Units: 60, EventID: "K", ClientID: true}
	res, err := n1.e.Charge(ctx, "a1", k)
	if err != nil || res.Reason != shard.OK {
		t.Fatalf("charge K: %s, %v", res.Reason, err)
	}
	n1.settle()
	n1.close() // killed while it owns a1
	o.owns1.Store(false)

	o.owns2.Store(true)
	n2.openOwning(&o.owns2)
	n2.refresh()
	n1.clock.Advance(time.Minute)
	if d, err := n2.e.Refund(ctx, "a1", "K", res.Receipt); err != nil || d.Reason != shard.Refunded {
		t.Fatalf("refund K at n2: %s, %v", d.Reason, err)
	}
	n2.settle()
	n2.refresh()
	gs, err := n2.l.Grants(ctx, "a1")
	if err != nil || len(gs) != 1 {
		t.Fatalf("grants of a1: %+v, %v", gs, err)
	}
	free := gs[0].Units - gs[0].Used - gs[0].Reserved // n1's frozen reservation aside
	if free < 60 {
		t.Fatalf("%d units free after K's refund, want its 60 at least: %+v", free, gs[0])
	}
	if r, err := n2.e.Charge(ctx, "a1", shard.Charge{Route: "r", Units: free}); err != nil || r.Reason != shard.OK {
		t.Fatalf("n2 charging the %d free units: %s, %v", free, r.Reason, err)
	}
	n2.settle()
	o.owns2.Store(false)
	if err := n2.e.Release(ctx, "a1"); err != nil {
		t.Fatal(err)
	}
	n2.settle()
	n2.close()

	// n1 restarts with its data dir, as a node does: settle, zero, free,
	// refresh; then a retry of K reaches it.
	o.owns1.Store(true)
	n1.openOwning(&o.owns1)
	t.Cleanup(n1.close)
	n1.settle()
	if err := n1.e.ZeroAllowances(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := n1.l.ReleaseNode(ctx, "n1"); err != nil {
		t.Fatal(err)
	}
	n1.refresh()
	n1.clock.Advance(time.Minute)
	if again, err := n1.e.Charge(ctx, "a1", k); err != nil || again.Reason != shard.Replayed {
		t.Logf("retry of K at the restarted n1: %s, %v (the test expects the stale Replayed it guards against)", again.Reason, err)
	}
	n1.settle()
	gs, err = n1.l.Grants(ctx, "a1")
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range gs {
		if g.Used+g.Reserved > g.Units {
			t.Errorf("grant %s: used %d + reserved %d over its %d units: the stale replay was billed past the hard limit", g.Grant, g.Used, g.Reserved, g.Units)
		}
	}
}

// The ids the engine makes for charges without a client id have the shape
// shard.MadeIDShape refuses as client ids: a client could otherwise send
// one (the HTTP front passes it to the upstream as X-Quota-Event) as its
// Idempotency-Key and have its charge taken for that event by the ledger.
func TestMadeEventIDsHaveTheShapeClientIDsMayNotHave(t *testing.T) {
	ctx := context.Background()
	o := newTwoOwners(t, "a1")
	t.Cleanup(o.n1.close)
	for range 50 {
		res, err := o.n1.e.Charge(ctx, "a1", shard.Charge{Route: "r", Units: 1})
		if err != nil || res.Reason != shard.OK || res.Receipt == nil {
			t.Fatalf("charge: %s, %v", res.Reason, err)
		}
		if id := res.Receipt.EventID; !shard.MadeIDShape(id) {
			t.Fatalf("made event id %q does not have shard.MadeIDShape", id)
		}
	}
}
