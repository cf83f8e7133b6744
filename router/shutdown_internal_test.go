package router

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/quotaring/quotaring/internal/waitfor"
	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/shard"
)

// ownerOfAll is a slowOwner that names itself the owner of every account,
// so that a Client can dial it.
type ownerOfAll struct {
	*slowOwner
	addr string
}

func (o *ownerOfAll) RingView(context.Context, *pb.RingViewRequest) (*pb.RingViewReply, error) {
	return &pb.RingViewReply{Epoch: 1, Hash: ringHash, PartitionCount: 8, Owners: make([]int32, 8),
		Members: []*pb.Member{{Id: "owner", RpcAddr: o.addr, State: "serving"}}}, nil
}

// dialSlowOwner starts a slowOwner and a Client of it with one call in
// flight at a time.
func dialSlowOwner(t *testing.T) (*Client, *slowOwner, string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o := &slowOwner{entered: make(chan struct{}, 4), release: make(chan struct{}), refunded: make(chan struct{}, 4)}
	srv := grpc.NewServer()
	pb.RegisterQuotaServer(srv, &ownerOfAll{slowOwner: o, addr: lis.Addr().String()})
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	c, err := DialOptions{RefreshInterval: -1, MaxInflight: 1}.Dial(context.Background(), lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, o, lis.Addr().String()
}

// Shutdown lets the calls in flight have their answers, and the client's
// own refund of a charge applied after its caller left reach the owner,
// before it closes; calls begun meanwhile answer ErrClosed. Close alone
// cut both: the refund was never sent and the charge stood, billed.
func TestShutdownWaitsForCallsAndRefunds(t *testing.T) {
	c, o, addr := dialSlowOwner(t)
	ctx := context.Background()
	first := make(chan error, 1)
	go func() {
		res, err := c.Charge(ctx, ChargeRequest{Account: "stays", Units: 1})
		if err == nil && res.Reason != shard.OK {
			err = errors.New("not OK: " + res.Reason.String())
		}
		first <- err
	}()
	<-o.entered // the only slot is busy
	p, err := c.peers.get(addr)
	if err != nil {
		t.Fatal(err)
	}
	gone, leave := context.WithCancel(ctx)
	left := make(chan error, 1)
	go func() {
		_, err := c.Charge(gone, ChargeRequest{Account: "left", Units: 2})
		left <- err
	}()
	waitfor.Cond(t, 10*time.Second, "the second charge queued", func() bool {
		p.charges.mu.Lock()
		defer p.charges.mu.Unlock()
		return len(p.charges.queue) == 1
	})
	o.release <- struct{}{} // the first answers; the queued charge goes out in a batch
	<-o.entered             // and is on its way
	leave()                 // its caller leaves: its reply will come for nobody
	if err := <-left; !errors.Is(err, ErrUnavailable) {
		t.Fatalf("the charge whose caller left: %v, want ErrUnavailable (outcome unknown)", err)
	}
	if err := <-first; err != nil {
		t.Fatalf("the first charge: %v", err)
	}

	shut := make(chan error, 1)
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	go func() { shut <- c.Shutdown(sctx) }()
	waitfor.Cond(t, 10*time.Second, "Shutdown draining", func() bool {
		c.calls.mu.Lock()
		defer c.calls.mu.Unlock()
		return c.calls.closed
	})
	if _, err := c.Charge(ctx, ChargeRequest{Account: "late", Units: 1}); !errors.Is(err, ErrClosed) {
		t.Fatalf("a charge begun during Shutdown: %v, want ErrClosed", err)
	}
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned (%v) while the left charge's batch was still at the owner", err)
	default:
	}
	close(o.release) // the owner applies it; the client refunds it
	if err := <-shut; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	o.mu.Lock()
	n := len(o.refunds)
	o.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d refunds had reached the owner when Shutdown returned, want 1 (the charge whose caller left)", n)
	}
	if _, err := c.Usage(ctx, "stays"); !errors.Is(err, ErrClosed) {
		t.Fatalf("a call after Shutdown: %v, want ErrClosed", err)
	}
	if err := c.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown again: %v", err)
	}
}

// A Shutdown whose context ends first says how many calls are still in
// flight and leaves them be; Close then cuts them.
func TestShutdownContextEndsFirst(t *testing.T) {
	c, o, _ := dialSlowOwner(t)
	held := make(chan error, 1)
	go func() {
		_, err := c.Charge(context.Background(), ChargeRequest{Account: "held", Units: 1})
		held <- err
	}()
	<-o.entered
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := c.Shutdown(ctx)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "1 calls still in flight") {
		t.Fatalf("Shutdown with a call held at the owner: %v, want DeadlineExceeded naming 1 call in flight", err)
	}
	select {
	case err := <-held:
		t.Fatalf("the held call ended (%v) when Shutdown gave up: want it left in flight", err)
	default:
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-held; !errors.Is(err, ErrUnavailable) {
		t.Fatalf("the held call after Close: %v, want ErrUnavailable (sent: outcome unknown)", err)
	}
	close(o.release)
	var zero Client
	if err := zero.Shutdown(context.Background()); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("Shutdown of a zero Client: %v", err)
	}
}
