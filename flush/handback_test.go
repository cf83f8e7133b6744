package flush

import (
	"context"
	"testing"

	"github.com/quotaring/quotaring/shard"
)

// A hand-back of an allowance that holds units a refund gave back, sent
// while that refund was not settled yet, was floored at zero in the ledger
// (the reservation there did not have the refund's units yet); the refund
// then settled and put its units on the reservation of a node that held
// none. They stayed reserved for nobody until that node drained or
// restarted, so the account's new owner could not have them (held
// elsewhere: quota-unavailable). The hand-back now waits for the refund to
// settle.
func TestHandBackAfterAnUnsettledRefundFreesItsUnits(t *testing.T) {
	ctx := context.Background()
	l, snap, clock := hardAcme(t, 100)
	n1 := openTBNode(t, "n1", l, snap, clock)
	reservedInLedger := func() int64 {
		rs, err := l.Reservations(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var n int64
		for _, r := range rs {
			if r.Node == "n1" {
				n += r.Units
			}
		}
		return n
	}

	res, err := n1.e.Charge(ctx, "acme", shard.Charge{EventID: "e1", ClientID: true, Units: 10})
	if err != nil || res.Reason != shard.OK || res.Receipt == nil {
		t.Fatalf("charge: %+v, %v", res, err)
	}
	if _, err := n1.s.SettleOnce(ctx); err != nil { // the charge settles: the reservation goes down by 10
		t.Fatal(err)
	}
	if d, err := n1.e.Refund(ctx, "acme", "e1", res.Receipt); err != nil || d.Reason != shard.Refunded {
		t.Fatalf("refund: %+v, %v", d, err)
	}
	// The account moves away before the refund settles.
	if err := n1.e.Release(ctx, "acme"); err != nil {
		t.Fatalf("hand-back: %v", err)
	}
	if _, err := n1.s.SettleOnce(ctx); err != nil {
		t.Fatal(err)
	}
	n1.e.Close() // no more top-ups
	if err := n1.e.RetryReleases(ctx); err != nil {
		t.Fatal(err)
	}
	if got, held := reservedInLedger(), n1.e.AllowanceHeld(); got != held {
		t.Fatalf("with every record settled and the allowance handed back, the ledger reserves %d units for n1, which holds %d: %d stranded",
			got, held, got-held)
	}
	if g := grantOf(t, l, "acme", shard.MonthlyGrantID(shard.PeriodOf(clock.Now().Wall))); g.Used != 0 {
		t.Fatalf("grant used %d after the charge's refund, want 0", g.Used)
	}
}
