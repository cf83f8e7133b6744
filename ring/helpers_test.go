package ring

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"testing"
	"time"
)

var verbose = flag.Bool("ring.log", false, "log ring and memberlist output (debug level) to stderr")

// testLogger returns nil (discard) unless -ring.log is given.
func testLogger() *slog.Logger {
	if !*verbose {
		return nil
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// eventually polls cond every 10 ms until it returns nil, and fails the test
// with cond's last error after timeout. It waits for a condition, never for
// a fixed time.
func eventually(t testing.TB, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		err := cond()
		if err == nil {
			return
		}
		select {
		case <-deadline.C:
			t.Fatalf("condition not met after %v: %v", timeout, err)
		case <-tick.C:
		}
	}
}

// testCtx returns a context that ends with the test or after d.
func testCtx(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// node is a ring under test with a subscriber that tracks its partitions.
type node struct {
	*Ring
	t       *testing.T
	fault   *FaultTransport
	changes <-chan Change
	owned   map[int]bool
}

type nodeOpt func(*Config)

func withJoin(addrs ...string) nodeOpt { return func(c *Config) { c.Join = addrs } }

// startNode starts a ring named id on 127.0.0.1 with LocalConfig, subscribes
// to it, and closes it when the test ends.
func startNode(t *testing.T, id string, opts ...nodeOpt) *node {
	t.Helper()
	cfg := LocalConfig()
	cfg.NodeID = id
	cfg.Meta = Meta{RPCAddr: "rpc-" + id, HTTPAddr: "http-" + id, AdminAddr: "admin-" + id}
	cfg.Logger = testLogger()
	for _, o := range opts {
		o(&cfg)
	}
	r, err := New(cfg)
	if err != nil {
		t.Fatalf("New(%s): %v", id, err)
	}
	t.Cleanup(func() {
		if err := r.Close(context.Background()); err != nil {
			t.Errorf("Close(%s): %v", id, err)
		}
	})
	ch, _ := r.Subscribe(4)
	n := &node{Ring: r, t: t, changes: ch, owned: map[int]bool{}}
	if ft, ok := cfg.Transport.(*FaultTransport); ok {
		n.fault = ft
	}
	return n
}

// withFault gives the node a FaultTransport on 127.0.0.1.
func withFault(t *testing.T) nodeOpt { return withFaultOn(t, "127.0.0.1") }

// withFaultOn gives the node a FaultTransport on host, its bind address.
func withFaultOn(t *testing.T, host string) nodeOpt {
	ft, err := NewFaultNetTransport(host, 0, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	return func(c *Config) { c.BindAddr, c.Transport = host, ft }
}

// sync applies every Change queued for n, checking the Change contract, and
// reports whether the tracked set equals what n's current table gives it.
func (n *node) sync() error {
drain:
	for {
		select {
		case c, ok := <-n.changes:
			if !ok {
				return fmt.Errorf("%s: subscription closed", n.cfg.NodeID)
			}
			if err := n.applyChange(c); err != nil {
				n.t.Fatalf("subscriber contract broken: %v", err)
			}
		default:
			break drain
		}
	}
	want := n.Table().PartitionsOf(n.cfg.NodeID)
	var got []int
	for p := range n.owned {
		got = append(got, p)
	}
	slices.Sort(got)
	if !slices.Equal(got, want) {
		return fmt.Errorf("%s: subscriber tracks %d partitions, ring gives it %d", n.cfg.NodeID, len(got), len(want))
	}
	return nil
}

func (n *node) applyChange(c Change) error {
	for _, p := range c.Lost {
		if !n.owned[p] {
			return fmt.Errorf("%s: Lost %d, which it did not own", n.cfg.NodeID, p)
		}
		delete(n.owned, p)
	}
	for _, p := range c.Gained {
		if n.owned[p] {
			return fmt.Errorf("%s: Gained %d, which it already owned", n.cfg.NodeID, p)
		}
		n.owned[p] = true
	}
	return nil
}

func (n *node) serve(t *testing.T) {
	t.Helper()
	err := n.SetState(testCtx(t, 5*time.Second), StateServing)
	if errors.Is(err, ErrUnconfirmed) {
		// A loaded machine: the callers' agree() checks that it spread.
		t.Logf("%s: %v", n.cfg.NodeID, err)
		return
	}
	if err != nil {
		t.Fatalf("%s: SetState(serving): %v", n.cfg.NodeID, err)
	}
}

// accounts are the ids the cluster tests compare owners for.
func accounts(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("acct-%d", i+1)
	}
	return out
}

// agree checks that every node serves exactly ids (sorted), with one epoch,
// the same owner for 1,000 accounts, and subscribers in step.
func agree(nodes []*node, ids ...string) error {
	slices.Sort(ids)
	first := nodes[0].View()
	for _, n := range nodes {
		v := n.View()
		if !slices.Equal(v.Serving, ids) {
			return fmt.Errorf("%s serves %v, want %v", n.cfg.NodeID, v.Serving, ids)
		}
		if v.Epoch != first.Epoch {
			return fmt.Errorf("%s epoch %x, %s epoch %x", n.cfg.NodeID, v.Epoch, nodes[0].cfg.NodeID, first.Epoch)
		}
		if err := n.sync(); err != nil {
			return err
		}
	}
	for _, a := range accounts(1000) {
		want, ok := nodes[0].Owner(a)
		if !ok {
			return fmt.Errorf("%s: no owner for %s", nodes[0].cfg.NodeID, a)
		}
		if !slices.Contains(ids, want.ID) {
			return fmt.Errorf("owner of %s is %s, not serving", a, want.ID)
		}
		for _, n := range nodes[1:] {
			if got, _ := n.Owner(a); got.ID != want.ID {
				return fmt.Errorf("owner of %s: %s says %s, %s says %s", a, nodes[0].cfg.NodeID, want.ID, n.cfg.NodeID, got.ID)
			}
		}
	}
	return nil
}
