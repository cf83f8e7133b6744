package cluster

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/snapshot"
)

// Three nodes, a hard quota of 20, 100 concurrent one-unit charges spread
// over all nodes: exactly 20 succeed. Twenty accounts, twenty times.
func TestExactQuotaAcrossNodes(t *testing.T) {
	tc := newTestCluster(t, 3)
	var ids []string
	for i := 1; i <= 20; i++ {
		ids = append(ids, fmt.Sprint("acct-", i))
	}
	tc.hardAccounts(snapshot.Plan{ID: "q20", MonthlyQuota: 20, Hard: true}, ids...)
	ctx := context.Background()
	for _, id := range ids {
		var ok atomic.Int64
		var wg sync.WaitGroup
		for i := 0; i < 100; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				o, _, err := tc.charge(ctx, tc.Nodes[i%3], id, "", 1)
				if o == acked {
					ok.Add(1)
				} else if o == unavailable {
					t.Errorf("%s: %v", id, err)
				}
			}()
		}
		wg.Wait()
		if ok.Load() != 20 {
			t.Fatalf("%s: %d charges acknowledged against a hard quota of 20", id, ok.Load())
		}
	}
	tc.settleAll(20 * time.Second)
	for _, id := range ids {
		if u := tc.used(id); u != 20 {
			t.Fatalf("%s: ledger used %d, want 20", id, u)
		}
	}
}

// The rate limit holds across the cluster: an account with rate r and burst
// b gets at most b + r*t through in a window t, whatever node requests enter.
func TestRateLimitAcrossNodes(t *testing.T) {
	tc := newTestCluster(t, 3)
	const r, b = 20, 5
	tc.hardAccounts(snapshot.Plan{ID: "rl", Rate: fmt.Sprintf("%d/s", r), Burst: b, MonthlyQuota: 1 << 40, Hard: false}, "limited")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	var ok atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < 12; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				if o, _, _ := tc.charge(context.Background(), tc.Nodes[w%3], "limited", "", 1); o == acked {
					ok.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	bound := b + int64(float64(r)*elapsed.Seconds())
	t.Logf("%d admitted in %s through 3 nodes; bound b + r*t = %d", ok.Load(), elapsed.Round(time.Millisecond), bound)
	if ok.Load() > bound {
		t.Fatalf("%d admitted, more than b + r*t = %d", ok.Load(), bound)
	}
	if ok.Load() < bound*8/10 {
		t.Fatalf("only %d admitted of a bound of %d: the limiter is too strict", ok.Load(), bound)
	}
}

// A request never takes more than one forwarding hop; a stale caller gets
// WrongOwner and lands on the true owner.
func TestOneHopAndWrongOwner(t *testing.T) {
	tc := newTestCluster(t, 3)
	tc.hardAccounts(snapshot.Plan{ID: "p", MonthlyQuota: 100, Hard: true}, "hop")
	ctx := context.Background()
	v, err := tc.Nodes[0].RingView(ctx)
	if err != nil {
		t.Fatal(err)
	}
	owner := ownerOf(v, "hop")
	var other *Node
	for _, n := range tc.Nodes {
		if n.ID != owner {
			other = n
			break
		}
	}
	// A caller that thinks `other` owns the account gets told who does.
	rep, err := tc.client(other).Charge(ctx, &pb.ChargeBatch{Charges: []*pb.ChargeRequest{{Account: "hop", Units: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	wo := rep.Replies[0].WrongOwner
	if wo == nil || wo.OwnerId != owner {
		t.Fatalf("a non-owner answered %+v, want WrongOwner naming %s", rep.Replies[0], owner)
	}
	rep, err = tc.client(tc.nodeByID(wo.OwnerId)).Charge(ctx, &pb.ChargeBatch{Charges: []*pb.ChargeRequest{{Account: "hop", Units: 1}}})
	if err != nil || rep.Replies[0].Decision.GetReason() != pb.Reason_OK || rep.Replies[0].Node != owner {
		t.Fatalf("at the owner: %+v %v", rep, err)
	}
	// Routed through a non-owner: decided by the owner, one hop.
	_, r, err := tc.charge(ctx, other, "hop", "", 1)
	if err != nil || r.Node != owner {
		t.Fatalf("routed: decided by %q (%v), want the owner %s", r.GetNode(), err, owner)
	}
	// A call that was already forwarded once is never forwarded again.
	rep, err = tc.client(other).Charge(ctx, &pb.ChargeBatch{Route: true, Hops: 1, Charges: []*pb.ChargeRequest{{Account: "hop", Units: 1}}})
	if err != nil || rep.Replies[0].WrongOwner == nil {
		t.Fatalf("a forwarded call was forwarded again: %+v %v", rep, err)
	}
}

func ownerOf(v *pb.RingViewReply, account string) string {
	p := partitionOf(account, int(v.PartitionCount))
	return v.Members[v.Owners[p]].Id
}
