package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/pgtest"
	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/snapshot"
)

// testCluster is a cluster of real quotad processes on a fresh Postgres
// database, with a ledger connection for seeding and checking.
type testCluster struct {
	*Cluster
	t      *testing.T
	dsn    string
	ledger flush.Ledger
	mu     sync.Mutex // protects clients
	// clients holds one gRPC client per node RPC address.
	clients map[string]pb.QuotaClient
}

func newTestCluster(t *testing.T, nodes int, args ...string) *testCluster {
	t.Helper()
	dsn := pgtest.NewDB(t)
	ctx := context.Background()
	l, err := flush.Open(ctx, dsn, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	args = append([]string{"--snapshot-interval", "200ms"}, args...)
	c, err := Start(ctx, Options{Binary: binary, Nodes: nodes, Ledger: dsn, Dir: t.TempDir(), Args: args, TestFaults: true})
	if err != nil {
		t.Fatal(err)
	}
	tc := &testCluster{Cluster: c, t: t, dsn: dsn, ledger: l, clients: map[string]pb.QuotaClient{}}
	t.Cleanup(func() {
		if t.Failed() {
			for _, n := range c.Nodes {
				t.Logf("--- log of %s (last lines):\n%s", n.ID, n.LogTail(40))
			}
		}
		c.Stop(context.Background())
	})
	tc.converge(30 * time.Second)
	return tc
}

func (tc *testCluster) converge(timeout time.Duration) {
	tc.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := tc.WaitConverged(ctx); err != nil {
		tc.t.Fatal(err)
	}
}

// hardAccounts creates accounts on one hard plan and waits until every
// running node's config knows the last of them.
func (tc *testCluster) hardAccounts(plan snapshot.Plan, ids ...string) {
	tc.t.Helper()
	ctx := context.Background()
	if err := tc.ledger.UpsertPlan(ctx, plan); err != nil {
		tc.t.Fatal(err)
	}
	for _, id := range ids {
		if err := tc.ledger.UpsertAccount(ctx, id, plan.ID); err != nil {
			tc.t.Fatal(err)
		}
	}
	last := ids[len(ids)-1]
	tc.eventually(20*time.Second, "every node knows account "+last, func() bool {
		for _, n := range tc.Nodes {
			if !n.Running() {
				continue
			}
			rep, err := tc.client(n).Usage(ctx, &pb.UsageRequest{Account: last})
			if err != nil {
				return false
			}
			if rep.WrongOwner == nil && !rep.Known {
				return false
			}
			if rep.WrongOwner != nil {
				// ask the owner
				o := tc.nodeByID(rep.WrongOwner.OwnerId)
				if o == nil {
					return false
				}
				r2, err := tc.client(o).Usage(ctx, &pb.UsageRequest{Account: last})
				if err != nil || !r2.Known {
					return false
				}
			}
		}
		return true
	})
}

func (tc *testCluster) nodeByID(id string) *Node {
	for _, n := range tc.Nodes {
		if n.ID == id {
			return n
		}
	}
	return nil
}

func (tc *testCluster) client(n *Node) pb.QuotaClient {
	tc.mu.Lock()
	defer tc.mu.Unlock()
	if c, ok := tc.clients[n.RPC]; ok {
		return c
	}
	conn, c, err := n.Dial()
	if err != nil {
		tc.t.Fatal(err)
	}
	tc.t.Cleanup(func() { conn.Close() })
	tc.clients[n.RPC] = c
	return c
}

// outcome of one charge as a client saw it.
type outcome int

const (
	acked outcome = iota
	refused
	unavailable // quota-unavailable, a node unreachable, a timeout: not charged, or unknown
)

// charge sends one charge through node n, which routes it to the owner.
func (tc *testCluster) charge(ctx context.Context, n *Node, account, eventID string, units int64) (outcome, *pb.ChargeReply, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	rep, err := tc.client(n).Charge(ctx, &pb.ChargeBatch{Route: true, Charges: []*pb.ChargeRequest{
		{Account: account, EventId: eventID, ClientId: eventID != "", Route: "POST /test", Units: units}}})
	if err != nil {
		return unavailable, nil, err
	}
	r := rep.Replies[0]
	switch {
	case r.Error != nil:
		return unavailable, r, errors.New(r.Error.Message)
	case r.WrongOwner != nil:
		return unavailable, r, fmt.Errorf("wrong owner %s", r.WrongOwner.OwnerId)
	case r.Decision.Reason == pb.Reason_OK || r.Decision.Reason == pb.Reason_REPLAYED:
		return acked, r, nil
	}
	return refused, r, nil
}

// settleAll waits until every running node's log is settled.
func (tc *testCluster) settleAll(timeout time.Duration) {
	tc.t.Helper()
	tc.eventually(timeout, "every running node's log settled", func() bool {
		for _, n := range tc.Nodes {
			if !n.Running() {
				continue
			}
			_, body, err := n.AdminGet(context.Background(), "/metrics")
			if err != nil || !metricIs(body, "quotaring_unsettled_records", 0) {
				return false
			}
		}
		return true
	})
}

// used is the ledger's used units over the account's grants.
func (tc *testCluster) used(account string) int64 {
	tc.t.Helper()
	gs, err := tc.ledger.Grants(context.Background(), account)
	if err != nil { // a pooled connection broken by a Postgres restart fails once
		gs, err = tc.ledger.Grants(context.Background(), account)
	}
	if err != nil {
		tc.t.Fatal(err)
	}
	var u int64
	for _, g := range gs {
		u += g.Used
	}
	return u
}

func (tc *testCluster) eventually(timeout time.Duration, what string, cond func() bool) {
	tc.t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			tc.t.Fatalf("timed out after %s waiting for: %s", timeout, what)
		}
		<-tick.C
	}
}

// metricIs reports whether an exposition has the sample name with value v.
func metricIs(body, name string, v float64) bool {
	var got float64
	for _, line := range splitLines(body) {
		if n, err := fmt.Sscanf(line, name+" %g", &got); n == 1 && err == nil {
			return got == v
		}
	}
	return false
}

func splitLines(s string) []string {
	var out []string
	start := 0
	for i := 0; i < len(s); i++ {
		if s[i] == '\n' {
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return append(out, s[start:])
}

// tcServer is the package's Postgres (for tests that stop and start it).
func tcServer(t *testing.T) *pgtest.Server { return pgtest.PackageServer(t) }
