package ring

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestRejoinTargets checks, without a network, whom Rejoin contacts: every
// address of every seed and the known members that are not alive, never
// itself or an alive member, and no member forgotten after ForgetAfter.
func TestRejoinTargets(t *testing.T) {
	now := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	cfg := LocalConfig()
	cfg.NodeID = "self"
	cfg.Join = []string{"svc.local", "10.0.0.9:7000", "[fd00::1]:7000", "10.0.0.1"}
	cfg.ForgetAfter = time.Hour
	tbl, _ := NewTable(DefaultLayout(), nil)
	r := &Ring{
		cfg:      cfg,
		log:      slog.New(slog.DiscardHandler),
		resolver: fakeResolver{"svc.local": {"10.0.0.1", "10.0.0.2", "10.0.0.3"}},
		now:      func() time.Time { return now },
		self:     Meta{ID: "self", GossipAddr: "10.0.0.1:7946"},
		known: map[string]knownMember{
			"alive":     {addr: "10.0.0.2:7946", lastAlive: now.Add(-2 * time.Hour)},
			"dead":      {addr: "10.0.0.5:7946", lastAlive: now.Add(-time.Minute)},
			"long-dead": {addr: "10.0.0.6:7946", lastAlive: now.Add(-2 * time.Hour)},
		},
	}
	r.state.Store(&snapshot{table: tbl, members: []Meta{
		{ID: "alive", GossipAddr: "10.0.0.2:7946"},
		{ID: "self", GossipAddr: "10.0.0.1:7946"},
	}})
	got, errs := r.rejoinTargets(context.Background())
	if len(errs) != 0 {
		t.Fatal(errs)
	}
	want := []string{"10.0.0.5:7946", "10.0.0.3:7946", "10.0.0.9:7000", "[fd00::1]:7000"} // former members first: they need no DNS
	if !slices.Equal(got, want) {
		t.Fatalf("targets = %v, want %v", got, want)
	}
	if _, ok := r.known["long-dead"]; ok {
		t.Fatal("a member dead for longer than ForgetAfter was kept")
	}
	if _, ok := r.known["alive"]; !ok {
		t.Fatal("an alive member was forgotten")
	}

	r.resolver = fakeResolver{}
	if _, errs := r.rejoinTargets(context.Background()); len(errs) != 1 {
		t.Fatalf("unresolvable seed gave errors %v, want one", errs)
	}
}

func TestSplitSeed(t *testing.T) {
	for _, tc := range []struct{ in, host, port string }{
		{"10.0.0.1:7000", "10.0.0.1", "7000"},
		{"10.0.0.1", "10.0.0.1", "7946"},
		{"localhost:7000", "localhost", "7000"},
		{"quotad-gossip.default.svc", "quotad-gossip.default.svc", "7946"},
		{"[::1]:7000", "::1", "7000"},
		{"::1", "::1", "7946"},
		{"[::1]", "::1", "7946"},
	} {
		h, p, err := splitSeed(tc.in, 7946)
		if err != nil || h != tc.host || p != tc.port {
			t.Errorf("splitSeed(%q) = %q, %q, %v; want %q, %q", tc.in, h, p, err, tc.host, tc.port)
		}
	}
	for _, bad := range []string{"host:http", "host:0", ":7000", "a:b:c", "garbage!!", "bad host:7000", "a..b", "quotad gossip"} {
		if _, _, err := splitSeed(bad, 7946); err == nil {
			t.Errorf("splitSeed(%q) accepted", bad)
		}
	}
}

// hangingResolver is a DNS server that does not answer: every lookup
// waits until its context ends.
type hangingResolver struct{ calls atomic.Int64 }

func (h *hangingResolver) LookupHost(ctx context.Context, _ string) ([]string, error) {
	h.calls.Add(1)
	<-ctx.Done()
	return nil, ctx.Err()
}

// A rejoin reaches a former member while DNS hangs: the seeds' names were
// resolved first and the lookup used the whole budget every round, so no
// former member was ever dialled and a healed partition stayed split for as
// long as DNS was out (likely the same outage).
func TestRejoinReachesFormerMembersWhileDNSHangs(t *testing.T) {
	n1 := startNode(t, "node-1")
	dns := &hangingResolver{}
	n2 := startNode(t, "node-2", func(c *Config) { c.RejoinInterval = c.ForgetAfter }) // the loop stays out of the way
	n2.cfg.Join, n2.resolver = []string{"quotad-gossip.invalid"}, dns                  // its seed: a name DNS does not answer for
	n1.serve(t)
	n2.serve(t)
	// node-2 knew node-1 (a member before the partition), alive a minute ago.
	n2.knownMu.Lock()
	n2.known["node-1"] = knownMember{addr: n1.Self().GossipAddr, lastAlive: time.Now().Add(-time.Minute), gone: true}
	n2.knownMu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	n, err := n2.Rejoin(ctx)
	if n < 1 {
		t.Fatalf("Rejoin with DNS hanging contacted %d (%v); want node-1, a former member, reached without DNS", n, err)
	}
	eventually(t, 10*time.Second, func() error { return agree([]*node{n1, n2}, "node-1", "node-2") })
}

// The former members' order turns every round: addresses that hang (pods
// long gone) were tried first, in sorted order, every round, and used the
// budget before a live one came up.
func TestFormerTargetsTurn(t *testing.T) {
	now := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	tbl, _ := NewTable(DefaultLayout(), nil)
	r := &Ring{cfg: Config{ForgetAfter: time.Hour}, log: slog.New(slog.DiscardHandler), now: func() time.Time { return now },
		self: Meta{ID: "self", GossipAddr: "10.0.0.1:7946"},
		known: map[string]knownMember{
			"a": {addr: "10.0.0.2:7946", lastAlive: now},
			"b": {addr: "10.0.0.3:7946", lastAlive: now},
			"c": {addr: "10.0.0.4:7946", lastAlive: now},
		}}
	r.state.Store(&snapshot{table: tbl})
	firsts := map[string]bool{}
	for range 3 {
		got := r.formerTargets(map[string]bool{})
		if len(got) != 3 {
			t.Fatalf("targets %v, want the three former members", got)
		}
		firsts[got[0]] = true
	}
	if len(firsts) != 3 {
		t.Fatalf("three rounds started with %v; want each former member first once", firsts)
	}
}

// A member that drained and left is not a rejoin target: its address may
// soon be another process's (a pod IP reused), maybe another cluster's
// node, whose ring the rejoin merged with this one for the hour a gone
// member is remembered. One that died is, as before.
func TestALeftMemberIsNoRejoinTarget(t *testing.T) {
	n1 := startNode(t, "node-1", withFault(t)) // NB: fault transports speak only to their kind
	n2 := startNode(t, "node-2", withFault(t), withJoin(n1.Self().GossipAddr))
	n3 := startNode(t, "node-3", withFault(t), withJoin(n1.Self().GossipAddr))
	for _, n := range []*node{n1, n2} {
		n.serve(t)
	}
	n3.serve(t)
	eventually(t, 10*time.Second, func() error { return agree([]*node{n1, n2, n3}, "node-1", "node-2", "node-3") })
	// node-2 stops as quotad does: draining, then leave.
	if err := n2.SetState(testCtx(t, 5*time.Second), StateDraining); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, func() error { return agree([]*node{n1}, "node-1", "node-3") })
	if err := n2.Leave(testCtx(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	// node-3 dies without a word.
	if err := n3.fault.Block(n1.Self().GossipAddr, n2.Self().GossipAddr); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, func() error {
		var gone []string
		for _, g := range n1.Gone() {
			gone = append(gone, g.ID)
		}
		if slices.Sort(gone); !slices.Equal(gone, []string{"node-2", "node-3"}) {
			return fmt.Errorf("node-1's gone members %v; want node-2 (left) and node-3 (died)", gone)
		}
		return nil
	})
	targets, _ := n1.rejoinTargets(context.Background())
	if slices.Contains(targets, n2.Self().GossipAddr) || !slices.Contains(targets, n3.Self().GossipAddr) {
		t.Fatalf("rejoin targets %v; want node-3's %s and not node-2's %s", targets, n3.Self().GossipAddr, n2.Self().GossipAddr)
	}
}

// Validate measures the node meta as New sends it, preset included: meta
// within the limit without it passed Validate (the node's check before it
// touches the ledger) and New refused it.
func TestValidateMeasuresMetaWithThePreset(t *testing.T) {
	cfg := LocalConfig()
	cfg.NodeID = "n1"
	long := strings.Repeat("a", 163)
	cfg.Meta = Meta{RPCAddr: long + ":1", HTTPAddr: long + ":2", AdminAddr: long + ":3"}
	bare, err := encodeMeta(Meta{State: StateJoining, RPCAddr: cfg.Meta.RPCAddr, HTTPAddr: cfg.Meta.HTTPAddr, AdminAddr: cfg.Meta.AdminAddr}, 0)
	if err != nil || len(bare) > MaxMetaSize {
		t.Fatalf("the meta without a preset is %d bytes (%v); the test wants it within %d", len(bare), err, MaxMetaSize)
	}
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "meta") {
		t.Fatalf("Validate: %v; want the meta refused, as New refuses it", err)
	}
}
