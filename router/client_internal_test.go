package router

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/quotaring/quotaring/internal/waitfor"
	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// hangingNode is a gRPC node on loopback whose ring view names it the owner
// of every account and whose Charge never answers (until the call ends).
type hangingNode struct {
	pb.UnimplementedQuotaServer
	addr string
}

func (h *hangingNode) RingView(context.Context, *pb.RingViewRequest) (*pb.RingViewReply, error) {
	owners := make([]int32, 8)
	return &pb.RingViewReply{Epoch: 1, Hash: ringHash, PartitionCount: 8, Owners: owners,
		Members: []*pb.Member{{Id: "hang", RpcAddr: h.addr, State: "serving"}}}, nil
}

func (h *hangingNode) Charge(ctx context.Context, _ *pb.ChargeBatch) (*pb.ChargeReplies, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

// dialHanging starts a hanging node and a client of it (no background
// refresh); it returns the client and the node's address.
func dialHanging(t *testing.T) (*Client, string) {
	t.Helper()
	addr := startHangingNode(t)
	c, err := DialOptions{RefreshInterval: -1}.Dial(context.Background(), addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, addr
}

func startHangingNode(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := &hangingNode{addr: lis.Addr().String()}
	srv := grpc.NewServer()
	pb.RegisterQuotaServer(srv, h)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return h.addr
}

// A charge whose owner does not answer before the caller's deadline is
// ErrUnavailable (outcome unknown: retry with the same event id) and names
// the owner, so callers that switch on ErrUnavailable retry.
func TestClientDeadlineIsUnavailable(t *testing.T) {
	c, addr := dialHanging(t)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	res, err := c.Charge(ctx, ChargeRequest{Account: "acme", Units: 1})
	if res.Reason.Accepted() {
		t.Fatalf("the result that came with the error reads %s, accepted", res.Reason)
	}
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, ErrOutcomeUnknown) || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), addr) {
		t.Fatalf("charge past the deadline: %v; want ErrUnavailable, ErrOutcomeUnknown and DeadlineExceeded, naming %s", err, addr)
	}
}

// A caller waiting for the ring view refresh another call holds stops
// waiting when its own context ends.
func TestRefreshWaitHonoursTheCallersContext(t *testing.T) {
	c, _ := dialHanging(t)
	if !c.lockRefresh(context.Background()) { // another refresh, stuck on unreachable nodes
		t.Fatal("could not take the refresh token")
	}
	defer c.unlockRefresh()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	done := make(chan struct{})
	go func() { c.refreshAfter(ctx, c.view.Load(), "", ""); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("refreshAfter waited for the refresh token past its caller's deadline")
	}
}

// Connections to addresses no longer wanted are closed after the grace,
// and an address wanted again within it keeps its connection.
func TestPeersForgetLeftNodes(t *testing.T) {
	ps := newPeers(context.Background(), peerOptions{maxInflight: 1, maxBatch: 1, callTimeout: time.Second, epoch: func() uint64 { return 0 }})
	defer ps.close()
	for _, a := range []string{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"} {
		if _, err := ps.get(a); err != nil {
			t.Fatal(err)
		}
	}
	t0 := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	only1 := func(a string) bool { return a == "127.0.0.1:1" }
	ps.forget(only1, t0) // 2 and 3 are gone from now
	if n := ps.count(); n != 3 {
		t.Fatalf("%d peers right after they left, want 3 (the grace)", n)
	}
	ps.forget(func(a string) bool { return a != "127.0.0.1:3" }, t0.Add(peerGrace/2)) // 2 is back
	ps.forget(only1, t0.Add(peerGrace))
	if n := ps.count(); n != 2 {
		t.Fatalf("%d peers a grace after 3 left, want 2 (1, and 2 which came back)", n)
	}
	ps.forget(only1, t0.Add(2*peerGrace))
	if n := ps.count(); n != 1 {
		t.Fatalf("%d peers, want 1", n)
	}
}

// A reply without a decision, or with a reason this build does not know (a
// newer node's), is an error, never a decision: it used to read as OK.
func TestUnreadableDecisionIsAnError(t *testing.T) {
	for _, rep := range []*pb.ChargeReply{
		{Node: "n1"},
		{Node: "n1", Decision: &pb.Decision{}},
		{Node: "n1", Decision: &pb.Decision{Reason: pb.Reason(99)}},
	} {
		res, err := resultFromPB(rep)
		if !errors.Is(err, ErrInternal) || res.Reason.Accepted() {
			t.Errorf("reply %v: %s, %v; want ErrInternal, not accepted", rep, res.Reason, err)
		}
	}
	if res, err := resultFromPB(&pb.ChargeReply{Node: "n1", Decision: &pb.Decision{Reason: pb.Reason_OK}}); err != nil || res.Reason != shard.OK {
		t.Errorf("an ok reply: %s, %v", res.Reason, err)
	}
}

// rejectingNode names itself the owner of every account and turns every
// Charge, Refund and Usage away with code, as a node does before any
// handler runs (a wrong RPC token, a method it does not serve).
type rejectingNode struct {
	pb.UnimplementedQuotaServer
	addr string
	code codes.Code
}

func (n *rejectingNode) RingView(context.Context, *pb.RingViewRequest) (*pb.RingViewReply, error) {
	return &pb.RingViewReply{Epoch: 1, Hash: ringHash, PartitionCount: 8, Owners: make([]int32, 8),
		Members: []*pb.Member{{Id: "rejecting", RpcAddr: n.addr, State: "serving"}}}, nil
}

func (n *rejectingNode) Charge(context.Context, *pb.ChargeBatch) (*pb.ChargeReplies, error) {
	return nil, status.Error(n.code, "turned away by the test")
}

func (n *rejectingNode) Refund(context.Context, *pb.RefundBatch) (*pb.RefundReplies, error) {
	return nil, status.Error(n.code, "turned away by the test")
}

func (n *rejectingNode) Usage(context.Context, *pb.UsageRequest) (*pb.UsageReply, error) {
	return nil, status.Error(n.code, "turned away by the test")
}

// A node that turns a call away (say, after the cluster's RPC token was
// rotated without this client) answered: the error is ErrRejected with the
// gRPC code in its chain, not ErrUnavailable, which callers retry forever,
// and the owner is not counted unreachable.
func TestClientRejectedCallIsNotUnavailable(t *testing.T) {
	for _, code := range []codes.Code{codes.Unauthenticated, codes.Unimplemented, codes.ResourceExhausted} {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		n := &rejectingNode{addr: lis.Addr().String(), code: code}
		srv := grpc.NewServer()
		pb.RegisterQuotaServer(srv, n)
		go srv.Serve(lis)
		c, err := DialOptions{RefreshInterval: -1}.Dial(context.Background(), n.addr)
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		_, cerr := c.Charge(ctx, ChargeRequest{Account: "acme", Units: 1})
		_, rerr := c.Refund(ctx, RefundRequest{Account: "acme", EventID: "e1"})
		_, uerr := c.Usage(ctx, "acme")
		for what, err := range map[string]error{"charge": cerr, "refund": rerr, "usage": uerr} {
			if !errors.Is(err, ErrRejected) || errors.Is(err, ErrUnavailable) || status.Code(err) != code || !strings.Contains(err.Error(), n.addr) {
				t.Errorf("%s answered %v: %v; want ErrRejected (not ErrUnavailable) with code %v, naming %s", what, code, err, code, n.addr)
			}
		}
		if u := c.Stats().Unreachable.Load(); u != 0 {
			t.Errorf("%v: Unreachable %d, want 0 (the node answered)", code, u)
		}
		c.Close()
		srv.Stop()
	}
}

// A usage read the owner answers with a failure of its own (gRPC
// Internal) is ErrInternal, as a charge's is: not ErrUnavailable "did not
// answer", and the owner is not counted unreachable.
func TestClientUsageFailureAtTheOwnerIsInternal(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	n := &rejectingNode{addr: lis.Addr().String(), code: codes.Internal}
	srv := grpc.NewServer()
	pb.RegisterQuotaServer(srv, n)
	go srv.Serve(lis)
	defer srv.Stop()
	c, err := DialOptions{RefreshInterval: -1}.Dial(context.Background(), n.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = c.Usage(context.Background(), "acme")
	if !errors.Is(err, ErrInternal) || errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), n.addr) || !strings.Contains(err.Error(), "turned away by the test") {
		t.Errorf("usage the owner failed: %v; want ErrInternal naming %s and its message", err, n.addr)
	}
	if u := c.Stats().Unreachable.Load(); u != 0 {
		t.Errorf("Unreachable %d, want 0 (the owner answered)", u)
	}
}

// A node forwarding to an owner that turns the call away says so
// (ErrRejected, the code kept), rather than "did not answer".
func TestOwnerSilentKeepsARejection(t *testing.T) {
	err := ownerSilent(context.Background(), "acme", "127.0.0.1:7400", status.Error(codes.Unauthenticated, "wrong RPC token"))
	if !errors.Is(err, ErrRejected) || errors.Is(err, ErrUnavailable) || status.Code(err) != codes.Unauthenticated {
		t.Fatalf("forwarded charge turned away: %v; want ErrRejected with Unauthenticated", err)
	}
	err = ownerSilent(context.Background(), "acme", "127.0.0.1:7400", status.Error(codes.Unavailable, "connection reset"))
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("forwarded charge cut off: %v; want ErrUnavailable", err)
	}
}

// slowConfigNode answers the first Config (Dial's) with version 1 at once,
// and the next ones with version 3 once release is closed.
type slowConfigNode struct {
	hangingNode
	calls          atomic.Int32
	asked, release chan struct{}
}

func (n *slowConfigNode) Config(ctx context.Context, _ *pb.ConfigRequest) (*pb.ConfigReply, error) {
	if n.calls.Add(1) == 1 {
		return &pb.ConfigReply{Version: 1, Snapshot: []byte(`{"version":1}`), Node: "slow"}, nil
	}
	n.asked <- struct{}{}
	select {
	case <-n.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return &pb.ConfigReply{Version: 3, Snapshot: []byte(`{"version":3}`), Node: "slow"}, nil
}

// A config read that answers after another Refresh stored a newer snapshot
// does not put the older one back.
func TestConfigRefreshDoesNotUndoANewerOne(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	n := &slowConfigNode{hangingNode: hangingNode{addr: lis.Addr().String()}, asked: make(chan struct{}, 1), release: make(chan struct{})}
	serveFake(t, lis, n)
	c, err := DialOptions{RefreshInterval: -1}.Dial(context.Background(), n.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	done := make(chan error, 1)
	go func() { done <- c.refreshConfig(context.Background()) }()
	select {
	case <-n.asked:
	case <-time.After(10 * time.Second):
		t.Fatal("the config read never reached the node")
	}
	newer, err := snapshot.Decode([]byte(`{"version":5}`))
	if err != nil {
		t.Fatal(err)
	}
	c.snap.Store(newer) // another Refresh, done meanwhile
	close(n.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if v := c.Snapshot().Version; v != 5 {
		t.Fatalf("config version %d after the late answer, want 5 (the newer one kept)", v)
	}
}

// configlessNode answers the ring view and never the config: it holds a
// Config call until the caller gives up.
type configlessNode struct{ rejectingNode }

func (n *configlessNode) Config(ctx context.Context, _ *pb.ConfigRequest) (*pb.ConfigReply, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

// Dial whose context ends after the ring view and before the config is a
// failed Dial, with the context's error: it returned a client without a
// config, which the middleware answered 503 with for seconds.
func TestDialEndsBeforeTheConfig(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	n := &configlessNode{rejectingNode{addr: lis.Addr().String(), code: codes.Unavailable}}
	srv := grpc.NewServer()
	pb.RegisterQuotaServer(srv, n)
	go srv.Serve(lis)
	defer srv.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	c, err := DialOptions{RefreshInterval: -1}.Dial(ctx, n.addr)
	if err == nil {
		c.Close()
		t.Fatal("Dial succeeded without a config though its context ended first")
	}
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "config") {
		t.Fatalf("Dial: %v; want DeadlineExceeded, naming the config read", err)
	}
}

// holdingNode is a hangingNode that says when a Charge reached it.
type holdingNode struct {
	hangingNode
	arrived chan string // the event id of each Charge that reached it
}

func (h *holdingNode) Charge(ctx context.Context, b *pb.ChargeBatch) (*pb.ChargeReplies, error) {
	for _, c := range b.Charges {
		h.arrived <- c.EventId
	}
	<-ctx.Done()
	return nil, ctx.Err()
}

// A charge Close cuts after it reached its owner has an unknown outcome:
// ErrUnavailable (the owner may have applied it; retry with the same id on
// a new client), not ErrClosed, which reads as nothing applied and which
// the middleware answers 500 without a refund. A charge still queued when
// Close ran was never sent: ErrClosed.
func TestClientCloseCutsASentCall(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := &holdingNode{hangingNode: hangingNode{addr: lis.Addr().String()}, arrived: make(chan string, 8)}
	srv := grpc.NewServer()
	pb.RegisterQuotaServer(srv, h)
	go srv.Serve(lis)
	defer srv.Stop()
	c, err := DialOptions{RefreshInterval: -1, MaxInflight: 1}.Dial(context.Background(), h.addr)
	if err != nil {
		t.Fatal(err)
	}
	charge := func(id string, out chan<- error) {
		_, err := c.Charge(context.Background(), ChargeRequest{Account: "acme", Units: 1, EventID: id, ClientID: true})
		out <- err
	}
	sent, queued := make(chan error, 1), make(chan error, 1)
	go charge("sent-1", sent)
	select {
	case <-h.arrived:
	case <-time.After(10 * time.Second):
		t.Fatal("the first charge never reached the owner")
	}
	go charge("queued-1", queued)
	p, err := c.peers.get(h.addr)
	if err != nil {
		t.Fatal(err)
	}
	waitfor.Cond(t, 10*time.Second, "the second charge queued behind the first", func() bool {
		p.charges.mu.Lock()
		defer p.charges.mu.Unlock()
		return len(p.charges.queue) == 1
	})
	c.Close()
	if err := <-sent; !errors.Is(err, ErrUnavailable) || !errors.Is(err, ErrOutcomeUnknown) || errors.Is(err, ErrClosed) ||
		!strings.Contains(err.Error(), `outcome is unknown: retry with the same event id "sent-1" on a new client`) {
		t.Errorf("a charge the owner had when Close ran: %v; want ErrUnavailable (not ErrClosed), the outcome unknown, retry with the same id on a new client", err)
	}
	if err := <-queued; !errors.Is(err, ErrClosed) || errors.Is(err, ErrUnavailable) || errors.Is(err, ErrOutcomeUnknown) || !strings.Contains(err.Error(), "not sent") {
		t.Errorf("a charge still queued when Close ran: %v; want ErrClosed, not sent", err)
	}
	select {
	case id := <-h.arrived:
		t.Errorf("the queued charge %s reached the owner after Close", id)
	default:
	}
}

// movingRing is the ring two test nodes answer: members hung (whose Charge
// never answers) and good (which accepts every charge), and the owner of
// every account, which the test moves.
type movingRing struct {
	hung, good string
	// dead, when set, is a third member nothing listens at.
	dead  string
	epoch atomic.Uint64
	owner atomic.Int32 // index into [hung, good, dead]
}

func (r *movingRing) view() *pb.RingViewReply {
	owner := r.owner.Load()
	owners := make([]int32, 8)
	for i := range owners {
		owners[i] = owner
	}
	members := []*pb.Member{{Id: "hung", RpcAddr: r.hung, State: "serving"}, {Id: "good", RpcAddr: r.good, State: "serving"}}
	if r.dead != "" {
		members = append(members, &pb.Member{Id: "dead", RpcAddr: r.dead, State: "serving"})
	}
	return &pb.RingViewReply{Epoch: r.epoch.Load(), Hash: ringHash, PartitionCount: 8, Owners: owners, Members: members}
}

// moveTo makes the node at index owner the owner of every account.
func (r *movingRing) moveTo(owner int32) {
	r.owner.Store(owner)
	r.epoch.Add(1)
}

type movingNode struct {
	pb.UnimplementedQuotaServer
	ring *movingRing
	hung bool
	// viewAsked, when set, is held by RingView until released closes (or
	// the call ends).
	viewAsked chan struct{}
	released  chan struct{}
}

func (n *movingNode) RingView(ctx context.Context, _ *pb.RingViewRequest) (*pb.RingViewReply, error) {
	if n.viewAsked != nil {
		select {
		case n.viewAsked <- struct{}{}:
		default:
		}
		select {
		case <-n.released:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return n.ring.view(), nil
}

func (n *movingNode) Charge(ctx context.Context, b *pb.ChargeBatch) (*pb.ChargeReplies, error) {
	if n.hung {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	out := &pb.ChargeReplies{}
	for _, c := range b.Charges {
		out.Replies = append(out.Replies, &pb.ChargeReply{Decision: &pb.Decision{Reason: pb.Reason_OK}, EventId: c.EventId, Node: "good"})
	}
	return out, nil
}

// startMovingRing starts the hung node and the good one, the hung one
// owning every account; good is the good node (to set its RingView hook
// before the first call).
func startMovingRing(t *testing.T) (r *movingRing, good *movingNode) {
	t.Helper()
	r = &movingRing{}
	r.epoch.Store(1)
	var addrs [2]string
	nodes := [2]*movingNode{{ring: r, hung: true}, {ring: r}}
	for i, n := range nodes {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addrs[i] = lis.Addr().String()
		srv := grpc.NewServer()
		pb.RegisterQuotaServer(srv, n)
		go srv.Serve(lis)
		t.Cleanup(srv.Stop)
	}
	r.hung, r.good = addrs[0], addrs[1]
	return r, nodes[1]
}

// A call whose owner hangs and whose caller's deadline is shorter than
// CallTimeout still makes the client read the ring (in the background), so
// the next call goes to the owner the ring now names: it used to return
// before the refresh, and with RefreshInterval < 0 every call waited its
// whole deadline at the hung owner until it came back.
func TestClientShortDeadlineRoutesAroundAHungOwner(t *testing.T) {
	r, _ := startMovingRing(t)
	c, err := DialOptions{RefreshInterval: -1}.Dial(context.Background(), r.hung, r.good)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r.moveTo(1) // the ring declared the hung node dead; the client does not know yet
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := c.Charge(ctx, ChargeRequest{Account: "acme", Units: 1}); !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), r.hung) {
		t.Fatalf("charge at the hung owner: %v; want ErrUnavailable naming %s", err, r.hung)
	}
	waitfor.Cond(t, 10*time.Second, "the client to read the ring after the caller left", func() bool { return c.Epoch() == 2 })
	ctx, cancel = context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if res, err := c.Charge(ctx, ChargeRequest{Account: "acme", Units: 1}); err != nil || res.Node != "good" {
		t.Fatalf("the next charge: %+v, %v; want ok at the new owner", res, err)
	}
}

// Close stops a background ring read that is stuck on a node that does not
// answer, and waits for it.
func TestClientCloseStopsABackgroundRefresh(t *testing.T) {
	r, good := startMovingRing(t)
	c, err := DialOptions{RefreshInterval: -1, CallTimeout: time.Minute}.Dial(context.Background(), r.hung, r.good)
	if err != nil {
		t.Fatal(err)
	}
	good.viewAsked, good.released = make(chan struct{}, 1), make(chan struct{})
	defer close(good.released)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := c.Charge(ctx, ChargeRequest{Account: "acme", Units: 1}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("charge at the hung owner: %v; want ErrUnavailable", err)
	}
	select {
	case <-good.viewAsked:
	case <-time.After(10 * time.Second):
		t.Fatal("no ring read after the caller left")
	}
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close waited for a stuck background ring read")
	}
	if !c.behindOn.CompareAndSwap(false, false) {
		t.Fatal("the background ring read still runs after Close returned")
	}
}

// A string field that is not valid UTF-8 (which gRPC cannot marshal), or an
// EventID longer than MaxEventID, is ErrInvalidRequest naming the field,
// and nothing is sent: it was ErrUnavailable with an unknown outcome, on
// every retry, each counted Unreachable and forcing a ring read.
func TestClientRefusesWhatTheRPCCannotCarry(t *testing.T) {
	c, _ := dialHanging(t)
	refreshes := c.Stats().Refreshes.Load()
	ctx := context.Background()
	bad := "caf\xe9"
	charge := func(req ChargeRequest) error { _, err := c.Charge(ctx, req); return err }
	for field, err := range map[string]error{
		"ChargeRequest.Account": charge(ChargeRequest{Account: bad, Units: 1}),
		"ChargeRequest.EventID": charge(ChargeRequest{Account: "acme", Units: 1, EventID: bad, ClientID: true}),
		"ChargeRequest.Route":   charge(ChargeRequest{Account: "acme", Units: 1, Route: "GET /" + bad}),
		"ChargeRequest.Key":     charge(ChargeRequest{Account: "acme", Units: 1, Key: bad}),
		"ChargeRequest.EventID is 256 bytes, more than 255": charge(ChargeRequest{Account: "acme", Units: 1,
			EventID: strings.Repeat("e", MaxEventID+1), ClientID: true}),
		"RefundRequest.Account": func() error { _, err := c.Refund(ctx, RefundRequest{Account: bad, EventID: "e1"}); return err }(),
		"RefundRequest.EventID": func() error { _, err := c.Refund(ctx, RefundRequest{Account: "acme", EventID: bad}); return err }(),
		"Usage.account":         func() error { _, err := c.Usage(ctx, bad); return err }(),
	} {
		if !errors.Is(err, ErrInvalidRequest) || errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), field) {
			t.Errorf("%s: %v; want ErrInvalidRequest naming it", field, err)
		}
	}
	if u, r := c.Stats().Unreachable.Load(), c.Stats().Refreshes.Load(); u != 0 || r != refreshes {
		t.Errorf("Unreachable %d, %d ring reads; want 0 and none (nothing was sent)", u, r-refreshes)
	}
}

// A charge whose owner did not answer within CallTimeout, retried at the
// owner a fresh ring names and failing there without being sent (that
// owner cannot be reached), has an unknown outcome naming the first owner,
// which may have applied it: it said "not sent", so a caller could give up
// on a charge that stood.
func TestClientRetryNotSentAfterNoAnswerIsUnknown(t *testing.T) {
	r, _ := startMovingRing(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r.dead = lis.Addr().String()
	lis.Close()
	c, err := DialOptions{RefreshInterval: -1, CallTimeout: 300 * time.Millisecond}.Dial(context.Background(), r.hung, r.good)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r.moveTo(2) // the hung node's accounts moved to one this client cannot reach
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = c.Charge(ctx, ChargeRequest{Account: "acme", Units: 1, EventID: "e1", ClientID: true})
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, ErrOutcomeUnknown) || !strings.Contains(err.Error(), r.hung+" did not answer the charge") ||
		!strings.Contains(err.Error(), r.dead) || !strings.Contains(err.Error(), `the outcome is unknown: retry with the same event id "e1"`) {
		t.Fatalf("charge unanswered at %s, then not sent to %s: %v; want ErrUnavailable, the outcome unknown, naming %s", r.hung, r.dead, err, r.hung)
	}
	// The next charge goes straight to the owner it cannot reach: not
	// sent, so nothing was applied, and ErrOutcomeUnknown says so (a
	// review: the two could be told apart in the text only).
	_, err = c.Charge(ctx, ChargeRequest{Account: "acme", Units: 1, EventID: "e2", ClientID: true})
	if !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrOutcomeUnknown) || !strings.Contains(err.Error(), "was not sent") {
		t.Fatalf("charge to an owner that cannot be reached: %v; want ErrUnavailable, not ErrOutcomeUnknown, not sent", err)
	}
}

// bigConfigNode answers Config with a snapshot larger than gRPC's default
// 4 MiB limit on a received message.
type bigConfigNode struct{ hangingNode }

func (n *bigConfigNode) Config(ctx context.Context, _ *pb.ConfigRequest) (*pb.ConfigReply, error) {
	pad := strings.Repeat("x", 5<<20)
	return &pb.ConfigReply{Version: 7, Snapshot: []byte(`{"version":7,"pad":"` + pad + `"}`), Node: "big"}, nil
}

// A cluster's config past 4 MiB (some 20,000 accounts with a key each)
// reaches the client: gRPC's default limit refused it, and the client
// answered every request 503 with "no config snapshot yet".
func TestLargeConfigReachesTheClient(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	serveFake(t, lis, &bigConfigNode{hangingNode{addr: lis.Addr().String()}})
	c, err := DialOptions{RefreshInterval: -1}.Dial(context.Background(), lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if s := c.Snapshot(); s == nil || s.Version != 7 {
		t.Fatalf("config after Dial: %+v; want version 7", s)
	}
}

// A field no owner needs that long is refused before it is sent: a 5 MiB
// Route or Key made its whole batch, other callers' charges with it, pass
// gRPC's 4 MiB limit and come back ErrRejected.
func TestOversizedFieldsAreRefused(t *testing.T) {
	long := strings.Repeat("k", MaxField+1)
	for name, req := range map[string]ChargeRequest{
		"Account": {Account: long, Units: 1},
		"Route":   {Account: "acme", Route: long, Units: 1},
		"Key":     {Account: "acme", Key: long, Units: 1},
	} {
		if err := checkCharge(&req); !errors.Is(err, ErrInvalidRequest) || !strings.Contains(err.Error(), "ChargeRequest."+name) {
			t.Errorf("a %d-byte %s: %v; want ErrInvalidRequest naming it", len(long), name, err)
		}
	}
	if err := checkCharge(&ChargeRequest{Account: "acme", Route: "GET /x\x00", Units: 1}); !errors.Is(err, ErrInvalidRequest) || !strings.Contains(err.Error(), "holds a NUL byte") {
		t.Errorf("a Route with a NUL byte: %v; want ErrInvalidRequest", err)
	}
	if err := checkCharge(&ChargeRequest{Account: "acme", Route: strings.Repeat("r", MaxField), Units: 1}); err != nil {
		t.Errorf("a Route of MaxField bytes: %v", err)
	}
	if err := checkRefund(&RefundRequest{Account: long, EventID: "e1"}); !errors.Is(err, ErrInvalidRequest) {
		t.Errorf("a refund of a %d-byte account: %v", len(long), err)
	}
	if _, err := (DialOptions{MaxBatch: MaxMaxBatch + 1}).Dial(context.Background(), "127.0.0.1:7400"); !errors.Is(err, ErrInvalidRequest) || !strings.Contains(err.Error(), "MaxBatch") {
		t.Errorf("MaxBatch %d: %v; want ErrInvalidRequest", MaxMaxBatch+1, err)
	}
}

// serveFake serves n, a fake node, on lis until the test ends.
func serveFake(t *testing.T, lis net.Listener, n pb.QuotaServer) {
	t.Helper()
	srv := grpc.NewServer()
	pb.RegisterQuotaServer(srv, n)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
}

// versionNode serves a config of a fixed version, in a ring view that names
// members (in that order).
type versionNode struct {
	hangingNode
	version int64
	members []string
}

func (n *versionNode) RingView(ctx context.Context, req *pb.RingViewRequest) (*pb.RingViewReply, error) {
	rep, _ := n.hangingNode.RingView(ctx, req)
	rep.Members = nil
	for _, m := range n.members {
		rep.Members = append(rep.Members, &pb.Member{Id: m, RpcAddr: m, State: "serving"})
	}
	return rep, nil
}

func (n *versionNode) Config(_ context.Context, req *pb.ConfigRequest) (*pb.ConfigReply, error) {
	if req.KnownVersion == n.version {
		return &pb.ConfigReply{Version: n.version, Unchanged: true, Node: n.addr}, nil
	}
	return &pb.ConfigReply{Version: n.version, Snapshot: fmt.Appendf(nil, `{"version":%d}`, n.version), Node: n.addr}, nil
}

// startVersionNodes starts one node per version, each naming all of them
// (in the order given) in its ring view.
func startVersionNodes(t *testing.T, versions ...int64) []string {
	t.Helper()
	var addrs []string
	var liss []net.Listener
	for range versions {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		liss = append(liss, lis)
		addrs = append(addrs, lis.Addr().String())
	}
	for i, v := range versions {
		serveFake(t, liss[i], &versionNode{hangingNode: hangingNode{addr: addrs[i]}, version: v, members: addrs})
	}
	return addrs
}

// dialHolding dials a client (no background refresh) through addr, closed
// when the test ends, and has it hold an empty config of version.
func dialHolding(t *testing.T, addr string, version int64) *Client {
	t.Helper()
	c, err := DialOptions{RefreshInterval: -1}.Dial(context.Background(), addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	held, err := snapshot.Decode([]byte(fmt.Sprintf(`{"version":%d}`, version)))
	if err != nil {
		t.Fatal(err)
	}
	c.snap.Store(held)
	return c
}

// A node whose ledger is down serves the config it last read: a client
// that asked it took that older version over the newer one it held, and a
// key it had seen revoked worked through it again. An older version is
// taken only when no node has the one held (a ledger rebuilt from scratch).
func TestConfigRefreshKeepsANewerOneThanALaggingNodes(t *testing.T) {
	addrs := startVersionNodes(t, 1, 3) // the lagging node first: asked first
	c := dialHolding(t, addrs[1], 3)
	for i := 0; i < 3; i++ {
		if err := c.refreshConfig(context.Background()); err != nil {
			t.Fatal(err)
		}
		if v := c.Snapshot().Version; v != 3 {
			t.Fatalf("config version %d after a refresh that asked a lagging node first, want 3 (the newer one kept)", v)
		}
	}

	rebuilt := startVersionNodes(t, 1, 1)
	c2 := dialHolding(t, rebuilt[0], 3)
	if err := c2.refreshConfig(context.Background()); err != nil {
		t.Fatal(err)
	}
	if v := c2.Snapshot().Version; v != 1 {
		t.Fatalf("config version %d when every node serves version 1, want 1 (a ledger rebuilt from scratch)", v)
	}
}

// notSent counts this client's own failed connection, not a node's answer
// that quotes one (a seed forwarding a Gateway client's usage read to an
// owner it could not reach).
func TestNotSentIsTheClientsOwnDialError(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close() // nothing listens: the connection is refused
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_, own := pb.NewQuotaClient(conn).Usage(ctx, &pb.UsageRequest{Account: "a"})
	if !notSent(own) {
		t.Fatalf("this client's refused connection %v: want it taken as not sent", own)
	}
	quoted := status.Error(codes.Unavailable, "router: quota unavailable: the owner of account \"a\" at 10.0.0.2:7400 did not answer: "+own.Error())
	if notSent(quoted) {
		t.Fatalf("a node's answer quoting a dial error %v: want it taken as sent (the node took the call)", quoted)
	}
}

// turningNode is a gRPC node on loopback whose ring view names owner (an
// address) the owner of every account. Its Charge answers WrongOwner(to)
// when to is set, else applies every charge (counted). With viewHeld set,
// every RingView after the first waits until the call ends.
type turningNode struct {
	pb.UnimplementedQuotaServer
	owner, to string
	viewHeld  bool
	views     atomic.Int64
	applied   atomic.Int64
}

func (m *turningNode) RingView(ctx context.Context, _ *pb.RingViewRequest) (*pb.RingViewReply, error) {
	if m.views.Add(1) > 1 && m.viewHeld {
		<-ctx.Done() // a refresh slow enough to use up the caller's deadline
		return nil, ctx.Err()
	}
	return &pb.RingViewReply{Epoch: 1, Hash: ringHash, PartitionCount: 8, Owners: make([]int32, 8),
		Members: []*pb.Member{{Id: "owner", RpcAddr: m.owner, State: "serving"}}}, nil
}

func (m *turningNode) Charge(_ context.Context, b *pb.ChargeBatch) (*pb.ChargeReplies, error) {
	out := &pb.ChargeReplies{}
	for _, c := range b.Charges {
		if m.to != "" {
			out.Replies = append(out.Replies, &pb.ChargeReply{WrongOwner: &pb.WrongOwner{Epoch: 2, OwnerId: "b", OwnerRpc: m.to}, Node: "a"})
			continue
		}
		m.applied.Add(1)
		out.Replies = append(out.Replies, &pb.ChargeReply{Decision: &pb.Decision{Reason: pb.Reason_OK, Units: c.Units}, EventId: c.EventId,
			Receipt: &pb.Receipt{EventId: c.EventId, Units: c.Units, Node: "b"}, Node: "b"})
	}
	return out, nil
}

func (m *turningNode) Refund(context.Context, *pb.RefundBatch) (*pb.RefundReplies, error) {
	return &pb.RefundReplies{Replies: []*pb.RefundReply{{Decision: &pb.Decision{Reason: pb.Reason_REFUNDED}, Node: "b"}}}, nil
}

func serveTurning(t *testing.T, lis net.Listener, m *turningNode) {
	srv := grpc.NewServer()
	pb.RegisterQuotaServer(srv, m)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
}

// A WrongOwner answer whose ring refresh used up the caller's deadline is
// not followed: the charge was sent to the next owner after the deadline,
// applied for a caller gone and taken back by the client (a rate-limit
// token spent, and the charge standing if that refund failed), with an
// error saying the owner did not answer although it was asked too late.
func TestClientFollowsNoOwnerChangeAfterTheDeadline(t *testing.T) {
	la, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lb, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a := &turningNode{owner: la.Addr().String(), to: lb.Addr().String(), viewHeld: true}
	b := &turningNode{owner: lb.Addr().String()}
	serveTurning(t, la, a)
	serveTurning(t, lb, b)
	c, err := DialOptions{RefreshInterval: -1}.Dial(context.Background(), a.owner)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = c.Charge(ctx, ChargeRequest{Account: "acme", Units: 7})
	c.Close() // waits for its batches and its own take-backs
	if n := b.applied.Load(); n != 0 {
		t.Fatalf("the next owner applied %d charges for a caller whose deadline had passed (%v)", n, err)
	}
	if err == nil || !strings.Contains(err.Error(), "not sent") || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("charge: %v; want not sent, deadline exceeded", err)
	}
}

// heldNode owns every account and answers every usage read Unavailable, as
// a node holding its decisions after a pause does.
type heldNode struct {
	pb.UnimplementedQuotaServer
	addr  string
	views atomic.Int64
}

func (h *heldNode) RingView(context.Context, *pb.RingViewRequest) (*pb.RingViewReply, error) {
	h.views.Add(1)
	return &pb.RingViewReply{Epoch: 1, Hash: ringHash, PartitionCount: 8, Owners: make([]int32, 8),
		Members: []*pb.Member{{Id: "held", RpcAddr: h.addr, State: "serving"}}}, nil
}

func (h *heldNode) Usage(context.Context, *pb.UsageRequest) (*pb.UsageReply, error) {
	return nil, status.Error(codes.Unavailable, nodeAnswered+"engine: quota unavailable: node q1 is paused; retry")
}

// A usage read the owner answers Unavailable itself is ErrUnavailable that
// says the owner answered: it said the owner "did not answer", counted it
// unreachable and read the ring again.
func TestUsageAnsweredUnavailableIsNoSilence(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := &heldNode{addr: lis.Addr().String()}
	srv := grpc.NewServer()
	pb.RegisterQuotaServer(srv, h)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	c, err := DialOptions{RefreshInterval: -1}.Dial(context.Background(), h.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	views := h.views.Load()
	_, err = c.Usage(context.Background(), "acme")
	if !errors.Is(err, ErrUnavailable) || strings.Contains(err.Error(), "did not answer") || !strings.Contains(err.Error(), "is paused") {
		t.Fatalf("usage at a held owner: %v; want ErrUnavailable with the owner's answer, not \"did not answer\"", err)
	}
	if n := c.Stats().Unreachable.Load(); n != 0 || h.views.Load() != views {
		t.Fatalf("usage at a held owner: %d unreachable, %d ring reads; want none", n, h.views.Load()-views)
	}
}

// A node cut off from its ledger answers "unchanged" to the version it last
// read; every client asked it first (the members in order) and kept a key
// revoked since working for the whole outage. Each read starts at the next
// node, so the newer version comes within as many reads as there are nodes.
func TestConfigRefreshLeavesAStaleFirstNode(t *testing.T) {
	addrs := startVersionNodes(t, 3, 4, 4) // the stale node first
	c := dialHolding(t, addrs[0], 3)
	for range len(addrs) {
		if err := c.refreshConfig(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if v := c.Snapshot().Version; v != 4 {
		t.Fatalf("config version %d after %d reads with nodes at 3, 4 and 4; want 4", v, len(addrs))
	}
}
