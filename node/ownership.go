package node

import (
	"context"

	"github.com/quotaring/quotaring/ring"
)

// followRing applies ownership changes. On losing partitions the node stops
// deciding for their accounts at once (the engine checks the ring under each
// account's lock, so in-flight charges finish and new ones are refused),
// then hands their reservations back and settles, so the new owner finds
// the units free. Gained partitions need nothing up front: the first charge
// of an account reserves (one ledger round trip), and the engine tops up in
// the background from then on.
func (n *Node) followRing(ctx context.Context, changes <-chan ring.Change) {
	for {
		select {
		case <-ctx.Done():
			return
		case c, ok := <-changes:
			if !ok {
				return
			}
			n.metrics.ringChange(c)
			if len(c.Lost) > 0 {
				n.releaseLost(ctx, c.Lost)
			}
		}
	}
}

func (n *Node) releaseLost(ctx context.Context, lost []int) {
	r := n.Ring()
	set := make(map[int]bool, len(lost))
	for _, p := range lost {
		set[p] = true
	}
	released := 0
	for _, id := range n.eng.AccountIDs() {
		if !set[r.Partition(id)] || n.owns(id) {
			continue
		}
		if err := n.eng.Release(ctx, id); err != nil {
			n.log.Warn("handing back the reservation of a lost account failed", "account", id, "err", err)
			continue
		}
		released++
	}
	if s := n.Settler(); s != nil {
		s.Kick()
	}
	if released > 0 {
		n.log.Info("lost partitions: reservations handed back", "partitions", len(lost), "accounts", released)
	}
}
