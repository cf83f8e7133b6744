package cluster

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/pgtest"
	"github.com/quotaring/quotaring/internal/waitfor"
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
	conns  *Conns
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
	tc := &testCluster{Cluster: c, t: t, dsn: dsn, ledger: l, conns: &Conns{}}
	t.Cleanup(tc.conns.Close)
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
	tc.waitConfig()
}

// waitConfig waits until every running node serves (and keeps in its data
// dir) the ledger's current config version: each node's own snapshot, not
// just the owners' (a node restarted while the ledger is down serves the
// snapshot it kept).
func (tc *testCluster) waitConfig() {
	tc.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	snap, err := tc.ledger.Snapshot(ctx, time.Now())
	if err != nil {
		tc.t.Fatal(err)
	}
	if err := tc.WaitConfig(ctx, tc.conns, snap.Version); err != nil {
		tc.t.Fatalf("waiting for every node to serve config version %d: %v", snap.Version, err)
	}
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
	c, err := tc.conns.Client(n.RPC)
	if err != nil {
		tc.t.Fatal(err)
	}
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
	op := tc.chargeOp(ctx, n, account, eventID, units)
	switch op.Status {
	case StatusOK:
		return acked, op.reply, nil
	case StatusRefused:
		return refused, op.reply, nil
	}
	return unavailable, op.reply, errors.New(op.Reason + ": " + op.Err)
}

// chargeOp is charge as a history records it.
func (tc *testCluster) chargeOp(ctx context.Context, n *Node, account, eventID string, units int64) chargedOp {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var op Op
	rep := tc.conns.ChargeRouted(ctx, n, &pb.ChargeRequest{Account: account, EventId: eventID, ClientId: eventID != "",
		Route: "POST /test", Units: units}, &op)
	return chargedOp{Op: op, reply: rep}
}

type chargedOp struct {
	Op
	reply *pb.ChargeReply
}

// settleAll waits until every running node's log is settled.
func (tc *testCluster) settleAll(timeout time.Duration) {
	tc.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := tc.WaitSettled(ctx); err != nil {
		tc.t.Fatalf("waiting for every running node's log to be settled: %v", err)
	}
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
	waitfor.Cond(tc.t, timeout, what, cond)
}
