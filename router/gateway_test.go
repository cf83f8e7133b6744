package router_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/shard"
)

// onlyDialer connects to the addresses in allowed and refuses the others,
// recording them: a program that reaches the cluster through one address
// (a load balancer) and not the nodes' own.
type onlyDialer struct {
	allowed []string
	mu      sync.Mutex // protects refused
	refused []string
}

func (d *onlyDialer) dial(ctx context.Context, addr string) (net.Conn, error) {
	if !slices.Contains(d.allowed, addr) {
		d.mu.Lock()
		d.refused = append(d.refused, addr)
		d.mu.Unlock()
		return nil, fmt.Errorf("%s: out of this program's reach (the test's dialer)", addr)
	}
	var nd net.Dialer
	return nd.DialContext(ctx, "tcp", addr)
}

func (d *onlyDialer) refusedAddrs() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.refused)
}

// A client that can reach one node only: without Gateway, charges of the
// accounts other nodes own fail (their owners are out of reach); with it,
// every call goes to that node, which forwards it to the owner, and
// charges, refunds, client ids, usage reads and the middleware all work,
// decided at the owners, without the client ever dialling another node.
func TestGatewayClientReachesEveryOwnerThroughOneAddress(t *testing.T) {
	var accounts []account
	for i := 0; i < 9; i++ {
		id := fmt.Sprint("gw-", i)
		accounts = append(accounts, account{id: id, key: keyOf(id), plan: monthly("m100", 100)})
	}
	c := startCluster(t, accounts, clusterOptions{nodes: 3, clock: engine.NewManualClock(june28)})
	// The last node: a ring view lists the others first, which a client
	// asking the members would dial.
	seedNode := c.nodes[len(c.nodes)-1]
	var foreign []string // accounts the seed does not own
	for _, a := range accounts {
		if c.owner(t, a.id) != seedNode {
			foreign = append(foreign, a.id)
		}
	}
	if len(foreign) == 0 {
		t.Fatal("the seed owns every account: the test would forward nothing")
	}
	ctx := context.Background()

	direct := dial(t, router.DialOptions{RefreshInterval: -1, CallTimeout: time.Second, Dialer: (&onlyDialer{allowed: []string{seedNode.RPCAddr()}}).dial},
		seedNode.RPCAddr())
	if _, err := direct.Charge(ctx, router.ChargeRequest{Account: foreign[0], Units: 1}); !errors.Is(err, router.ErrUnavailable) ||
		!strings.Contains(err.Error(), "dial with DialOptions.Gateway") {
		t.Fatalf("without Gateway, a charge whose owner is out of reach: %v, want ErrUnavailable naming Gateway", err)
	}

	d := &onlyDialer{allowed: []string{seedNode.RPCAddr()}}
	client := dial(t, router.DialOptions{Gateway: true, Dialer: d.dial}, seedNode.RPCAddr())
	for _, a := range accounts {
		res, err := client.Charge(ctx, router.ChargeRequest{Account: a.id, Route: "GET /v1/tasks", Units: 3})
		if err != nil || res.Reason != shard.OK || res.Remaining != 97 || res.Node != c.owner(t, a.id).ID() {
			t.Fatalf("charge of %s: %+v, %v; want OK, 97 left, decided at its owner %s", a.id, res, err, c.owner(t, a.id).ID())
		}
	}
	target := foreign[0]
	res, err := client.Charge(ctx, router.ChargeRequest{Account: target, Units: 10})
	if err != nil || res.Reason != shard.OK || res.Receipt == nil {
		t.Fatalf("charge to refund: %+v, %v", res, err)
	}
	for i, want := range []shard.Reason{shard.Refunded, shard.AlreadyRefunded} {
		d, err := client.Refund(ctx, router.RefundRequest{Account: target, EventID: res.EventID, Receipt: res.Receipt})
		if err != nil || d.Reason != want {
			t.Fatalf("refund %d through the gateway: %+v, %v; want %s", i+1, d, err, want)
		}
	}
	for i, want := range []shard.Reason{shard.OK, shard.Replayed} {
		res, err := client.Charge(ctx, router.ChargeRequest{Account: target, EventID: "once", ClientID: true, Units: 5})
		if err != nil || res.Reason != want || res.Remaining != 92 {
			t.Fatalf("charge %d with a client id: %+v, %v; want %s and 92 left", i+1, res, err, want)
		}
	}
	u, err := client.Usage(ctx, target)
	if err != nil || !u.Known || u.Used != 8 || u.Node != c.owner(t, target).ID() {
		t.Fatalf("usage through the gateway: %+v, %v; want 8 used, read at the owner %s", u, err, c.owner(t, target).ID())
	}

	// The middleware on it: the HTTP front inside a program that reaches
	// one address.
	mw, err := router.Middleware(router.FrontOptions{Charger: client, Config: client,
		Now: func() time.Time { return time.Unix(0, c.clock.Now().Wall) }})
	if err != nil {
		t.Fatal(err)
	}
	local := httptest.NewServer(mw(newUpstream(t)))
	defer local.Close()
	key := accounts[slices.IndexFunc(accounts, func(a account) bool { return a.id == target })].key
	expect(t, "a read through the middleware", do(t, local.URL, "GET", "/v1/tasks", key, nil), 200, "91")

	if err := client.Refresh(ctx); err != nil { // the ring view and config, from the seed only
		t.Fatal(err)
	}
	if refused := d.refusedAddrs(); len(refused) != 0 {
		t.Fatalf("the gateway client dialled %v: it must call its seeds only", refused)
	}
	if n := client.Stats().WrongOwner.Load(); n != 0 {
		t.Fatalf("%d WrongOwner answers through the gateway in a stable ring", n)
	}
}

// A seed that cannot be reached gives way to the next one; later calls
// start there.
func TestGatewayClientSkipsAnUnreachableSeed(t *testing.T) {
	acct := account{id: "gw", key: keyOf("gw"), plan: monthly("m100", 100)}
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 2, clock: engine.NewManualClock(june28)})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := lis.Addr().String()
	lis.Close() // nothing listens there now: connections are refused
	ctx := context.Background()
	live := c.notOwner(t, acct.id).RPCAddr()
	client := dial(t, router.DialOptions{Gateway: true, RefreshInterval: -1, CallTimeout: time.Second}, dead, live)
	for i := 0; i < 3; i++ {
		res, err := client.Charge(ctx, router.ChargeRequest{Account: acct.id, Units: 1})
		if err != nil || res.Reason != shard.OK || res.Node != c.owner(t, acct.id).ID() {
			t.Fatalf("charge %d with the first seed down: %+v, %v", i+1, res, err)
		}
	}
	if n := client.Stats().Unreachable.Load(); n != 1 {
		t.Fatalf("Unreachable %d: want the first call's failed connection only, later calls starting at the live seed", n)
	}

	// Its only seed down: ErrUnavailable, though the owner is up (the
	// client does not call it).
	only := dial(t, router.DialOptions{Gateway: true, RefreshInterval: -1, CallTimeout: time.Second}, live)
	c.stop(t, c.notOwner(t, acct.id))
	_, err = only.Charge(ctx, router.ChargeRequest{Account: acct.id, Units: 1})
	if !errors.Is(err, router.ErrUnavailable) || !strings.Contains(err.Error(), "not sent") {
		t.Fatalf("charge with its only seed down: %v, want ErrUnavailable saying it was not sent", err)
	}
	t.Log(err)
}

// A seed that takes the TCP connection and never answers (a hung process,
// a load balancer with no backend) fails the call at CallTimeout while it
// waits for the connection: gRPC opened no stream, so the call was not
// sent, and it goes to the next seed, charged once, not answered
// "outcome unknown".
func TestGatewayClientSkipsAHungSeed(t *testing.T) {
	acct := account{id: "gw-hung", key: keyOf("gw-hung"), plan: monthly("m100", 100)}
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 1, clock: engine.NewManualClock(june28)})
	hung := hungSeed(t)
	client := dial(t, router.DialOptions{Gateway: true, RefreshInterval: -1, CallTimeout: 500 * time.Millisecond}, hung, c.nodes[0].RPCAddr())
	ctx := context.Background()
	for i := 0; i < 2; i++ {
		res, err := client.Charge(ctx, router.ChargeRequest{Account: acct.id, Units: 1})
		if err != nil || res.Reason != shard.OK {
			t.Fatalf("charge %d with the first seed hung: %+v, %v; want it sent to the second seed", i+1, res, err)
		}
	}
	if n := client.Stats().Unreachable.Load(); n != 1 {
		t.Fatalf("Unreachable %d: want the first call's wait for the hung seed only", n)
	}
	u, err := client.Usage(ctx, acct.id)
	if err != nil || u.Used != 2 {
		t.Fatalf("usage: %+v, %v; want 2 units used (each charge applied once)", u, err)
	}
}

// A node forwards a routed refund or usage read once: marked Route with
// hops 1 (a node's own forwarding) it answers WrongOwner, never forwards
// again; with hops 0 it forwards to the owner.
func TestRoutedRefundAndUsageTakeOneHop(t *testing.T) {
	acct := account{id: "hop", key: keyOf("hop"), plan: monthly("m100", 100)}
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 3, clock: engine.NewManualClock(june28)})
	other := c.notOwner(t, acct.id)
	conn, err := grpc.NewClient("passthrough:///"+other.RPCAddr(), router.NodeDialOptions("", nil)...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	api := pb.NewQuotaClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	ch, err := api.Charge(ctx, &pb.ChargeBatch{Charges: []*pb.ChargeRequest{{Account: acct.id, EventId: "k", ClientId: true, Units: 4}}, Route: true})
	if err != nil || ch.Replies[0].GetDecision().GetReason() != pb.Reason_OK {
		t.Fatalf("routed charge: %v, %v", ch, err)
	}
	refund := &pb.RefundRequest{Account: acct.id, EventId: "k"}
	for _, hops := range []uint32{1, 0} {
		rep, err := api.Refund(ctx, &pb.RefundBatch{Refunds: []*pb.RefundRequest{refund}, Route: true, Hops: hops})
		if err != nil {
			t.Fatal(err)
		}
		r := rep.Replies[0]
		if hops == 1 && (r.WrongOwner == nil || r.WrongOwner.OwnerId != c.owner(t, acct.id).ID() || r.Decision != nil) {
			t.Fatalf("routed refund with hops 1: %v; want WrongOwner naming the owner, not forwarded", r)
		}
		if hops == 0 && r.GetDecision().GetReason() != pb.Reason_REFUNDED {
			t.Fatalf("routed refund with hops 0: %v; want it refunded at the owner", r)
		}
	}
	for _, hops := range []uint32{1, 0} {
		u, err := api.Usage(ctx, &pb.UsageRequest{Account: acct.id, Route: true, Hops: hops})
		if err != nil {
			t.Fatal(err)
		}
		if hops == 1 && (u.WrongOwner == nil || u.Known) {
			t.Fatalf("routed usage read with hops 1: %v; want WrongOwner, not forwarded", u)
		}
		if hops == 0 && (!u.Known || u.Used != 0 || u.Node != c.owner(t, acct.id).ID()) {
			t.Fatalf("routed usage read with hops 0: %v; want it read at the owner: 0 used after the refund", u)
		}
	}
}
