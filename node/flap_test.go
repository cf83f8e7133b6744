package node

import (
	"context"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
)

// An account that leaves a node and comes back with a refund in between,
// on a real ring: n3 joins and takes the account over from its owner,
// refunds the attempt that owner charged (the upstream failed), and leaves
// again. Back at its first owner, a retry with the same idempotency key is
// a new request: charged (not answered Replayed from the owner's memory of
// before the move, which would serve it for nothing), and the ledger bills
// the event once, for the retry. The engine's tests drive the same through
// its ownership hook; this one through memberlist, the ring's changes and
// the node's hand-backs.
func TestAccountComesBackAfterARefundElsewhere(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	dsn := "sqlite:" + filepath.Join(dir, "ledger.db")
	accounts := twentyAccounts(100)
	seedLedger(t, dsn, accounts)
	nodes := startNodes(t, dsn, 2)

	// The first attempt of every account, charged at its owner.
	type first struct {
		node    string
		receipt *shard.Receipt
	}
	firsts := map[string]first{}
	for acct := range accounts {
		res, err := nodes[0].Router().Charge(ctx, router.ChargeRequest{Account: acct, EventID: "k1", ClientID: true, Route: "GET /x", Units: 1})
		if err != nil || res.Reason != shard.OK || res.Receipt == nil {
			t.Fatalf("first attempt of %s: %+v, %v", acct, res, err)
		}
		firsts[acct] = first{res.Node, res.Receipt}
	}

	n3, err := Start(ctx, func() Config {
		cfg := startConfig(dsn, dir, "n3")
		cfg.Join = []string{nodes[0].GossipAddr()}
		return cfg
	}())
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			n3.Shutdown(context.Background())
		}
	})
	all := []*Node{nodes[0], nodes[1], n3}
	waitFor(t, 20*time.Second, "one ring of three nodes", func() bool {
		for _, nd := range all {
			if nd.Ring().Epoch() != n3.Ring().Epoch() || len(nd.Ring().View().Serving) != 3 {
				return false
			}
		}
		return true
	})
	var moved []string
	for acct := range accounts {
		if m, ok := n3.Ring().Owner(acct); ok && m.ID == "n3" {
			moved = append(moved, acct)
		}
	}
	if len(moved) == 0 {
		t.Fatal("n3 owns none of the twenty accounts")
	}
	slices.Sort(moved)

	// Every first attempt of the moved accounts failed: refunded at n3.
	for _, acct := range moved {
		d, err := n3.Router().Refund(ctx, router.RefundRequest{Account: acct, EventID: "k1", Receipt: firsts[acct].receipt, Attempt: true})
		if err != nil || d.Reason != shard.Refunded {
			t.Fatalf("refund of %s's first attempt at n3: %+v, %v; want Refunded", acct, d, err)
		}
	}

	// n3 leaves: the accounts go back to their first owners.
	if err := n3.Shutdown(ctx); err != nil {
		t.Fatalf("n3's shutdown: %v", err)
	}
	stopped = true
	waitFor(t, 20*time.Second, "the two nodes' ring without n3", func() bool {
		for _, nd := range nodes {
			if len(nd.Ring().View().Serving) != 2 {
				return false
			}
		}
		for _, acct := range moved {
			if m, ok := nodes[0].Ring().Owner(acct); !ok || m.ID != firsts[acct].node {
				return false
			}
		}
		return true
	})

	// The retries, through either node: charged afresh at the first owner.
	for i, acct := range moved {
		res, err := nodes[i%2].Router().Charge(ctx, router.ChargeRequest{Account: acct, EventID: "k1", ClientID: true, Route: "GET /x", Units: 1})
		if err != nil || res.Reason != shard.OK || res.Node != firsts[acct].node {
			t.Fatalf("retry of %s's refunded attempt, back at %s: %+v, %v; want OK at %s (charged: its first attempt was refunded)",
				acct, firsts[acct].node, res, err, firsts[acct].node)
		}
	}
	for _, nd := range nodes {
		if _, err := nd.SettleNow(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, acct := range moved {
		events, err := nodes[0].Ledger().Events(ctx, acct)
		if err != nil {
			t.Fatal(err)
		}
		billed := int64(0)
		for _, e := range events {
			if e.EventID != "" && !e.Refunded {
				billed += e.Units
			}
		}
		grants, err := nodes[0].Ledger().Grants(ctx, acct)
		if err != nil {
			t.Fatal(err)
		}
		used := int64(0)
		for _, g := range grants {
			used += g.Used
		}
		if billed != 1 || used != 1 {
			t.Errorf("%s: the ledger bills %d units and counts %d used, want 1 and 1 (the retry, served; the first attempt refunded): %+v", acct, billed, used, events)
		}
		// The owner's own count, once a refresh has read the ledger.
		var u router.UsageResult
		waitFor(t, 10*time.Second, acct+"'s usage at its owner: 1 used", func() bool {
			u, err = nodes[0].Router().Usage(ctx, acct)
			return err == nil && u.Used == 1
		})
	}
}
