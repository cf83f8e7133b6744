package router

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/shard"
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
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), addr) {
		t.Fatalf("charge past the deadline: %v; want ErrUnavailable and DeadlineExceeded, naming %s", err, addr)
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
