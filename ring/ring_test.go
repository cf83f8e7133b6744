package ring

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestClusterLifecycle runs three real memberlist nodes on 127.0.0.1:
// they agree on one ring, a draining node stops owning accounts, a leaving
// node and a crashed one shrink the membership, and subscribers follow.
func TestClusterLifecycle(t *testing.T) {
	n1 := startNode(t, "node-1")
	n2 := startNode(t, "node-2", withJoin(n1.Self().GossipAddr))
	n3 := startNode(t, "node-3", withJoin(n1.Self().GossipAddr))
	all := []*node{n1, n2, n3}

	// Nobody serves yet: alive members own nothing.
	eventually(t, 10*time.Second, func() error {
		for _, n := range all {
			if got := len(n.View().Members); got != 3 {
				return fmt.Errorf("%s sees %d members", n.cfg.NodeID, got)
			}
		}
		return nil
	})
	if _, ok := n1.Owner("acct-1"); ok {
		t.Fatal("Owner answered with no serving member")
	}
	if e := n1.Epoch(); e != 0 {
		t.Fatalf("epoch with nobody serving = %x, want 0", e)
	}

	for _, n := range all {
		n.serve(t)
	}
	eventually(t, 10*time.Second, func() error { return agree(all, "node-1", "node-2", "node-3") })
	e1 := n1.Epoch()
	before := n1.View().Owners
	for _, n := range all {
		if len(n.owned) == 0 {
			t.Fatalf("%s owns no partition in a ring of 3", n.cfg.NodeID)
		}
	}

	// Draining: node-3 stays alive but the others stop assigning to it.
	if err := n3.SetState(testCtx(t, 5*time.Second), StateDraining); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, func() error { return agree(all, "node-1", "node-2") })
	e2 := n1.Epoch()
	if e2 == e1 {
		t.Fatal("epoch did not change when node-3 drained")
	}
	if len(n3.owned) != 0 {
		t.Fatalf("draining node-3 still tracks %d partitions", len(n3.owned))
	}
	if got := len(n1.View().Members); got != 3 {
		t.Fatalf("draining member left the member list: %d members", got)
	}
	after := n1.View().Owners
	for p, was := range before {
		if was == "node-3" && (after[p] != "node-1" && after[p] != "node-2") {
			t.Fatalf("partition %d of node-3 went to %q", p, after[p])
		}
	}

	// Leave: node-2 goes; node-1 owns everything.
	if err := n2.Leave(testCtx(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	if len(n2.Table().PartitionsOf("node-2")) != 0 {
		t.Fatal("node-2 still owns partitions after Leave returned")
	}
	if err := n2.sync(); err != nil {
		t.Fatal(err)
	}
	if err := n2.SetState(testCtx(t, time.Second), StateServing); !errors.Is(err, ErrLeft) {
		t.Fatalf("SetState after Leave: %v, want ErrLeft", err)
	}
	eventually(t, 10*time.Second, func() error { return agree([]*node{n1, n3}, "node-1") })
	e3 := n1.Epoch()
	if e3 == e2 {
		t.Fatal("epoch did not change when node-2 left")
	}
	if got := len(n1.owned); got != n1.Layout().PartitionCount {
		t.Fatalf("sole server tracks %d partitions, want all", got)
	}
	if err := n2.Close(testCtx(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}

	// Crash (Close without Leave) of a non-serving member: membership
	// shrinks after failure detection, the ring and its epoch do not move.
	start := time.Now()
	if err := n3.Close(testCtx(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, func() error {
		if m := n1.View().Members; len(m) != 1 {
			return fmt.Errorf("node-1 still sees %d members", len(m))
		}
		return nil
	})
	t.Logf("local preset: node-1 declared a silent node-3 dead after %v", time.Since(start).Round(10*time.Millisecond))
	if n1.Epoch() != e3 {
		t.Fatal("epoch changed when a non-serving member died")
	}
}

// TestSingleNode covers the first node of a cluster: Owner is false until
// it serves, then every account is its own, and Subscribe starts with the
// current ownership.
func TestSingleNode(t *testing.T) {
	n := startNode(t, "solo")
	if _, ok := n.Owner("acct-1"); ok {
		t.Fatal("Owner answered while joining")
	}
	if v := n.View(); len(v.Owners) != 0 || len(v.Serving) != 0 || v.Epoch != 0 || len(v.Members) != 1 {
		t.Fatalf("view while joining = %+v", v)
	}
	n.serve(t)
	m, ok := n.Owner("acct-1")
	if !ok || m.ID != "solo" || m.RPCAddr != "rpc-solo" || m.State != StateServing {
		t.Fatalf("Owner = %+v, %v", m, ok)
	}
	if self := n.Self(); self.GossipAddr == "" || self.State != StateServing {
		t.Fatalf("Self = %+v", self)
	}
	late, cancel := n.Subscribe(1)
	c := <-late
	if len(c.Gained) != n.Layout().PartitionCount || len(c.Lost) != 0 || c.Epoch != n.Epoch() {
		t.Fatalf("first Change: %d gained, %d lost, epoch %x", len(c.Gained), len(c.Lost), c.Epoch)
	}
	cancel()
	if _, open := <-late; open {
		t.Fatal("cancel did not close the channel")
	}
	cancel() // idempotent
}

// TestTooManyMembersKeepsRing: a third serving member does not fit two
// partitions. Every node must refuse it with an error, keep the last ring,
// and recover when the member stops serving; nothing panics.
func TestTooManyMembersKeepsRing(t *testing.T) {
	small := func(c *Config) { c.PartitionCount = 2 }
	n1 := startNode(t, "node-1", small)
	n2 := startNode(t, "node-2", small, withJoin(n1.Self().GossipAddr))
	n3 := startNode(t, "node-3", small, withJoin(n1.Self().GossipAddr))
	all := []*node{n1, n2, n3}
	n1.serve(t)
	n2.serve(t)
	eventually(t, 10*time.Second, func() error { return agree(all, "node-1", "node-2") })
	kept := n1.Epoch()

	n3.serve(t)
	eventually(t, 10*time.Second, func() error {
		for _, n := range all {
			if err := n.Err(); !errors.Is(err, ErrTooManyMembers) {
				return fmt.Errorf("%s: Err() = %v", n.cfg.NodeID, err)
			}
		}
		return nil
	})
	if err := agree(all, "node-1", "node-2"); err != nil {
		t.Fatalf("last ring not kept: %v", err)
	}
	if n1.Epoch() != kept {
		t.Fatal("epoch moved although the ring was kept")
	}

	if err := n3.SetState(testCtx(t, 5*time.Second), StateDraining); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, func() error {
		for _, n := range all {
			if err := n.Err(); err != nil {
				return fmt.Errorf("%s: Err() = %v", n.cfg.NodeID, err)
			}
		}
		return agree(all, "node-1", "node-2")
	})
}

// TestJoinByName joins through "localhost:PORT", resolved by the system
// resolver (/etc/hosts).
func TestJoinByName(t *testing.T) {
	n1 := startNode(t, "node-1")
	_, port, _ := net.SplitHostPort(n1.Self().GossipAddr)
	n2 := startNode(t, "node-2", withJoin("localhost:"+port))
	n1.serve(t)
	n2.serve(t)
	eventually(t, 10*time.Second, func() error { return agree([]*node{n1, n2}, "node-1", "node-2") })
}

// fakeResolver stands in for DNS: a headless Service name with one A record
// per pod.
type fakeResolver map[string][]string

func (f fakeResolver) LookupHost(_ context.Context, host string) ([]string, error) {
	if addrs, ok := f[host]; ok {
		return addrs, nil
	}
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

// TestJoinHeadlessService: three pods share one gossip port on their own
// IPs (127.0.0.2-4 here) and all join one name with no port, whose A records
// include themselves, as with a Kubernetes headless Service.
func TestJoinHeadlessService(t *testing.T) {
	const svc = "quotad-gossip.quotaring.svc.cluster.local"
	ips := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}
	res := fakeResolver{svc: ips}
	var nodes []*node
	for attempt := 0; ; attempt++ {
		port := freePort(t, ips[0])
		nodes = nodes[:0]
		var err error
		for i, ip := range ips {
			var r *Ring
			cfg := LocalConfig()
			cfg.NodeID = fmt.Sprintf("pod-%d", i)
			cfg.BindAddr, cfg.BindPort = ip, port
			cfg.Join = []string{svc}
			cfg.Resolver = res
			cfg.Logger = testLogger()
			if r, err = New(cfg); err != nil {
				break
			}
			t.Cleanup(func() { _ = r.Close(context.Background()) })
			ch, _ := r.Subscribe(4)
			nodes = append(nodes, &node{Ring: r, t: t, changes: ch, owned: map[int]bool{}})
		}
		if err == nil {
			break
		}
		if attempt == 4 || !strings.Contains(err.Error(), "address already in use") {
			t.Fatalf("start pods: %v", err)
		}
		for _, n := range nodes {
			_ = n.Close(context.Background())
		}
	}
	for _, n := range nodes {
		n.serve(t)
	}
	eventually(t, 10*time.Second, func() error { return agree(nodes, "pod-0", "pod-1", "pod-2") })
}

// freePort returns a port that was free for TCP and UDP on ip.
func freePort(t *testing.T, ip string) int {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Skipf("cannot listen on %s: %v", ip, err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// TestPartitionHeal isolates one node of three with FaultTransport (blocked
// on its side only), waits until each side declares the other dead, heals,
// and requires one ring again within a bound: the rejoin loop's job, since
// memberlist stops contacting members it declared dead.
func TestPartitionHeal(t *testing.T) {
	n1 := startNode(t, "node-1", withFault(t))
	n2 := startNode(t, "node-2", withFault(t), withJoin(n1.Self().GossipAddr))
	n3 := startNode(t, "node-3", withFault(t), withJoin(n1.Self().GossipAddr))
	all := []*node{n1, n2, n3}
	for _, n := range all {
		n.serve(t)
	}
	eventually(t, 10*time.Second, func() error { return agree(all, "node-1", "node-2", "node-3") })

	start := time.Now()
	if err := n3.fault.Block(n1.Self().GossipAddr, n2.Self().GossipAddr); err != nil {
		t.Fatal(err)
	}
	var majority, isolated time.Duration
	eventually(t, 15*time.Second, func() error {
		if majority == 0 && agree([]*node{n1, n2}, "node-1", "node-2") == nil {
			majority = time.Since(start)
		}
		if isolated == 0 && agree([]*node{n3}, "node-3") == nil {
			isolated = time.Since(start)
		}
		if majority == 0 || isolated == 0 {
			return fmt.Errorf("majority after %v, isolated after %v", majority, isolated)
		}
		return nil
	})
	// Split brain: alone in its ring, node-3 owns every partition, as the
	// majority does (quotas rest on reservations; README, Failure detection).
	if len(n3.owned) != n3.Layout().PartitionCount {
		t.Fatalf("isolated node tracks %d partitions, want all", len(n3.owned))
	}
	packets, streams := n3.fault.Dropped()
	if packets == 0 || streams == 0 {
		t.Fatalf("fault layer dropped %d packets and %d streams; want both", packets, streams)
	}

	healStart := time.Now()
	n3.fault.UnblockAll()
	eventually(t, 20*time.Second, func() error { return agree(all, "node-1", "node-2", "node-3") })
	heal := time.Since(healStart)
	t.Logf("local preset: majority took over in %v, isolated node alone after %v, healed in %v",
		majority.Round(10*time.Millisecond), isolated.Round(10*time.Millisecond), heal.Round(10*time.Millisecond))
}

// A member that died without leaving comes back under its id on another
// address (a pod recreated with a new IP): the others take it at once.
// memberlist refused the name a new address until the dead entry was
// dropped (GossipToTheDeadTime: 5 s here, 30 s with lan), while the node
// back served a ring of its own with itself in it.
func TestAMemberBackOnANewAddressIsTakenAtOnce(t *testing.T) {
	n1 := startNode(t, "node-1", withFault(t)) // NB: fault transports speak only to their kind
	n2 := startNode(t, "node-2", withFault(t), withJoin(n1.Self().GossipAddr))
	for _, n := range []*node{n1, n2} {
		n.serve(t)
	}
	eventually(t, 10*time.Second, func() error { return agree([]*node{n1, n2}, "node-1", "node-2") })
	// node-2 dies without a word: cut off both ways, as a killed process.
	if err := n2.fault.Block(n1.Self().GossipAddr); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, func() error { return agree([]*node{n1}, "node-1") })
	back := startNode(t, "node-2", withJoin(n1.Self().GossipAddr), withFaultOn(t, "127.0.0.2"))
	back.serve(t)
	// Well under GossipToTheDeadTime (5 s), after which the old entry
	// would be gone anyway.
	eventually(t, 3*time.Second, func() error {
		if err := agree([]*node{n1, back}, "node-1", "node-2"); err != nil {
			return err
		}
		for _, m := range n1.View().Members {
			if m.ID == "node-2" && !strings.HasPrefix(m.GossipAddr, "127.0.0.2:") {
				return fmt.Errorf("node-1 has node-2 at %s", m.GossipAddr)
			}
		}
		return nil
	})
}

// TestFaultTransportBlocksBothWays: a block on one side alone cuts streams
// in both directions (the preamble attributes inbound streams).
func TestFaultTransportBlocksBothWays(t *testing.T) {
	a, err := NewFaultNetTransport("127.0.0.1", 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Shutdown()
	b, err := NewFaultNetTransport("127.0.0.1", 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Shutdown()
	aIP, aPort, _ := a.FinalAdvertiseAddr("", 0)
	bIP, bPort, _ := b.FinalAdvertiseAddr("", 0)
	aAddr := net.JoinHostPort(aIP.String(), fmt.Sprint(aPort))
	bAddr := net.JoinHostPort(bIP.String(), fmt.Sprint(bPort))

	// Open: a stream from b reaches a without the preamble bytes.
	c, err := b.DialTimeout(aAddr, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte{7}); err != nil {
		t.Fatal(err)
	}
	in := <-a.StreamCh()
	var got [1]byte
	if _, err := in.Read(got[:]); err != nil || got[0] != 7 {
		t.Fatalf("read %v, %v; want 7", got, err)
	}
	in.Close()
	c.Close()

	// a blocks b: a refuses to dial b, and closes b's streams on arrival.
	if err := a.Block(bAddr); err != nil {
		t.Fatal(err)
	}
	if _, err := a.DialTimeout(bAddr, time.Second); err == nil {
		t.Fatal("dial to a blocked peer succeeded")
	}
	c, err = b.DialTimeout(aAddr, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(got[:]); err == nil {
		t.Fatal("blocked peer's stream was not closed")
	}
	if _, streams := a.Dropped(); streams != 2 {
		t.Fatalf("dropped streams = %d, want 2", streams)
	}
	if err := a.Block("not-an-address"); err == nil {
		t.Fatal("Block accepted a host name")
	}
	if got := a.Blocked(); !slices.Equal(got, []string{bAddr}) {
		t.Fatalf("Blocked() = %v", got)
	}
}

// TestCloseStopsEverything: after Close every goroutine of the package has
// exited and the Ring refuses further use.
func TestCloseStopsEverything(t *testing.T) {
	n1 := startNode(t, "node-1", withFault(t))
	n2 := startNode(t, "node-2", withFault(t), withJoin(n1.Self().GossipAddr))
	n1.serve(t)
	n2.serve(t)
	eventually(t, 10*time.Second, func() error { return agree([]*node{n1, n2}, "node-1", "node-2") })
	e := n2.Epoch()

	// Close without Leave is a crash to the others: node-2 takes over every
	// partition once it declares node-1 dead.
	if err := n1.Close(testCtx(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, func() error { return agree([]*node{n2}, "node-2") })
	if n2.Epoch() == e {
		t.Fatal("epoch did not change when a serving member crashed")
	}
	if got := len(n2.owned); got != n2.Layout().PartitionCount {
		t.Fatalf("survivor tracks %d partitions, want all", got)
	}

	for _, n := range []*node{n1, n2} {
		if err := n.Close(testCtx(t, 5*time.Second)); err != nil {
			t.Fatal(err)
		}
		if _, open := <-n.changes; open {
			// Drain what was queued before Close; the channel must end.
			for range n.changes {
			}
		}
	}
	if err := n1.Close(context.Background()); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := n1.SetState(context.Background(), StateDraining); !errors.Is(err, ErrClosed) {
		t.Fatalf("SetState after Close: %v", err)
	}
	if err := n1.Leave(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Leave after Close: %v", err)
	}
	if _, err := n1.Rejoin(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Rejoin after Close: %v", err)
	}
	ch, _ := n1.Subscribe(1)
	if _, open := <-ch; open {
		t.Fatal("Subscribe after Close returned an open channel")
	}
	// A goroutine that closed its exit channel may still be on its way out
	// of the runtime for a moment, hence a short condition wait.
	eventually(t, time.Second, func() error {
		if stacks := ringGoroutines(); stacks != "" {
			return fmt.Errorf("goroutines started by the ring still running after Close:\n%s", stacks)
		}
		return nil
	})
}

// ringGoroutines returns the stacks of goroutines that this package's
// non-test code started. (memberlist's own goroutines, such as its
// suspicion timers, may still call into the ring's callbacks after
// Shutdown; they are not the ring's to stop.)
func ringGoroutines() string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "created by github.com/quotaring/quotaring/ring.") &&
			!strings.Contains(g, "created by github.com/quotaring/quotaring/ring.Test") {
			out = append(out, g)
		}
	}
	return strings.Join(out, "\n\n")
}

// TestNewRefusesBadConfig: New validates and never panics, even on layouts
// consistent would panic on.
func TestNewRefusesBadConfig(t *testing.T) {
	for name, mutate := range map[string]func(*Config){
		"load 1.0":     func(c *Config) { c.Load = 1.0 },
		"0 partitions": func(c *Config) { c.PartitionCount = 0 },
		"no node id":   func(c *Config) { c.NodeID = "" },
	} {
		t.Run(name, func(t *testing.T) {
			cfg := LocalConfig()
			cfg.NodeID = "x"
			mutate(&cfg)
			ft, err := NewFaultNetTransport("127.0.0.1", 0, nil)
			if err != nil {
				t.Fatal(err)
			}
			cfg.Transport = ft
			if r, err := New(cfg); err == nil {
				_ = r.Close(context.Background())
				t.Fatal("New accepted a bad config")
			}
			select {
			case <-ft.done:
			default:
				t.Fatal("New failed but left its transport running")
			}
		})
	}
}

// With a SecretKey, nodes that share it form one ring; a node with another
// key, or none, cannot join it: its joins fail, and nobody lists it.
func TestGossipKey(t *testing.T) {
	key := []byte("0123456789abcdef0123456789abcdef")
	withKey := func(k []byte) nodeOpt { return func(c *Config) { c.SecretKey = k } }
	n1 := startNode(t, "node-1", withKey(key))
	n2 := startNode(t, "node-2", withKey(key), withJoin(n1.Self().GossipAddr))
	n1.serve(t)
	n2.serve(t)
	eventually(t, 10*time.Second, func() error { return agree([]*node{n1, n2}, "node-1", "node-2") })

	for name, k := range map[string][]byte{"another key": []byte("fedcba9876543210"), "no key": nil} {
		t.Run(name, func(t *testing.T) {
			// No join address: the node would retry in the background;
			// this test joins once, by hand, and looks at the answer.
			stranger := startNode(t, "stranger", withKey(k))
			_, err := stranger.joinOne(n1.Self().GossipAddr)
			if err == nil {
				t.Fatal("a node without the cluster's gossip key joined it")
			}
			t.Logf("join without the key: %v", err)
			if addr, rerr := stranger.Refusal(); addr != n1.Self().GossipAddr || rerr == nil {
				t.Fatalf("Refusal() = %q, %v after a join the keys refused; want %s and the error", addr, rerr, n1.Self().GossipAddr)
			}
			for _, n := range []*node{n1, n2} {
				if slices.ContainsFunc(n.View().Members, func(m Meta) bool { return m.ID == "stranger" }) {
					t.Fatalf("%s lists the stranger as a member", n.cfg.NodeID)
				}
			}
		})
	}
}

func TestNewRefusesABadSecretKey(t *testing.T) {
	cfg := LocalConfig()
	cfg.NodeID = "x"
	cfg.SecretKey = []byte("short")
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "SecretKey is 5 bytes: want 16, 24 or 32") {
		t.Fatalf("Validate with a 5-byte key: %v", err)
	}
}

// A gossip key rotates with rolling restarts: a node that sends with the
// old key and accepts the new one, and a node that sends with the new key
// and accepts the old one, form one ring; a node with the new key alone
// cannot join a node with the old key alone.
func TestGossipKeyRotation(t *testing.T) {
	oldKey, newKey := []byte("old-key-0123456789abcdefghijklmn"), []byte("new-key-0123456789abcdefghijklmn")
	keys := func(send []byte, accept ...[]byte) nodeOpt {
		return func(c *Config) { c.SecretKey, c.OtherKeys = send, accept }
	}
	n1 := startNode(t, "node-1", keys(oldKey, newKey))
	n2 := startNode(t, "node-2", keys(newKey, oldKey), withJoin(n1.Self().GossipAddr))
	n1.serve(t)
	n2.serve(t)
	eventually(t, 10*time.Second, func() error { return agree([]*node{n1, n2}, "node-1", "node-2") })

	onlyOld := startNode(t, "only-old", keys(oldKey))
	onlyNew := startNode(t, "only-new", keys(newKey))
	if _, err := onlyNew.joinOne(onlyOld.Self().GossipAddr); err == nil || !strings.Contains(err.Error(), "no installed keys could decrypt") {
		t.Fatalf("a node with only the new key joined one with only the old key: %v", err)
	}

	cfg := LocalConfig()
	cfg.NodeID = "x"
	cfg.OtherKeys = [][]byte{oldKey}
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "OtherKeys without a SecretKey") {
		t.Fatalf("Validate with OtherKeys and no SecretKey: %v", err)
	}
}

// A member's clock verdict reaches the others without moving the ring: the
// epoch stays, since only the serving set names it.
func TestSetClockReachesPeersAndKeepsTheEpoch(t *testing.T) {
	n1 := startNode(t, "node-1")
	n2 := startNode(t, "node-2", withJoin(n1.Self().GossipAddr))
	all := []*node{n1, n2}
	for _, n := range all {
		n.serve(t)
	}
	eventually(t, 10*time.Second, func() error { return agree(all, "node-1", "node-2") })
	e := n1.Epoch()
	for _, v := range []ClockVerdict{ClockOff, ClockAgrees} {
		if err := n2.SetClock(testCtx(t, 5*time.Second), v); err != nil {
			t.Fatal(err)
		}
		eventually(t, 10*time.Second, func() error {
			for _, m := range n1.View().Members {
				if m.ID == "node-2" && m.Clock == v {
					return nil
				}
			}
			return fmt.Errorf("node-1 does not see node-2's clock %v: %+v", v, n1.View().Members)
		})
		if n1.Epoch() != e || n2.Epoch() != e {
			t.Fatalf("a clock verdict moved the ring: epochs %x and %x, want %x", n1.Epoch(), n2.Epoch(), e)
		}
		if n2.Self().Clock != v {
			t.Fatalf("Self().Clock = %v, want %v", n2.Self().Clock, v)
		}
	}
}

// TestJoinNotAGossipPort: --join given a node's HTTP port (or RPC, admin)
// failed with memberlist's "received invalid msgType (72), expected
// pushPullMsg (6)". The error now says what --join takes.
func TestJoinNotAGossipPort(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	defer srv.Close()
	n := startNode(t, "node-1", withJoin(srv.Listener.Addr().String()))
	_, err := n.Rejoin(testCtx(t, 10*time.Second))
	if err == nil || !strings.Contains(err.Error(), "not as a gossip port") || !strings.Contains(err.Error(), "--gossip-addr") {
		t.Fatalf("Rejoin through an HTTP port: %v, want an error saying --join takes gossip addresses", err)
	}
}
