package router

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/shard"
)

// slowOwner is a gRPC node that holds each Charge batch until released,
// then answers OK with a receipt for each charge, and records refunds.
type slowOwner struct {
	pb.UnimplementedQuotaServer
	entered chan struct{}
	release chan struct{}

	mu       sync.Mutex // protects refunds
	refunds  []*pb.RefundRequest
	refunded chan struct{}
}

func (o *slowOwner) Charge(_ context.Context, b *pb.ChargeBatch) (*pb.ChargeReplies, error) {
	o.entered <- struct{}{}
	<-o.release // NB: not the call's context: the owner applies what it was sent
	out := &pb.ChargeReplies{}
	for _, c := range b.Charges {
		ok := shard.Decision{Reason: shard.OK, Units: c.Units}
		out.Replies = append(out.Replies, &pb.ChargeReply{Decision: decisionToPB(&ok), EventId: "ev-" + c.Account,
			Receipt: &pb.Receipt{EventId: "ev-" + c.Account, Node: "owner", Units: c.Units}, Node: "owner"})
	}
	return out, nil
}

func (o *slowOwner) Refund(_ context.Context, b *pb.RefundBatch) (*pb.RefundReplies, error) {
	o.mu.Lock()
	o.refunds = append(o.refunds, b.Refunds...)
	o.mu.Unlock()
	out := &pb.RefundReplies{}
	for range b.Refunds {
		d := shard.Decision{Reason: shard.Refunded}
		out.Replies = append(out.Replies, &pb.RefundReply{Decision: decisionToPB(&d)})
	}
	o.refunded <- struct{}{}
	return out, nil
}

// A charge queued behind a busy slot is sent in a batch under the router's
// context; when its caller's deadline passes while it is on its way, the
// caller is told it failed, and the owner applies it anyway. The peer then
// refunds it as an attempt's, with the receipt of the reply that came for
// nobody; the charge whose caller waited is left alone.
func TestPeerRefundsAChargeItsCallerLeft(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o := &slowOwner{entered: make(chan struct{}, 4), release: make(chan struct{}), refunded: make(chan struct{}, 4)}
	srv := grpc.NewServer()
	pb.RegisterQuotaServer(srv, o)
	go srv.Serve(lis)
	defer srv.Stop()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ps := newPeers(ctx, peerOptions{maxInflight: 1, maxBatch: 8, callTimeout: 10 * time.Second, epoch: func() uint64 { return 1 }, hops: 1})
	p, err := ps.get(lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer p.conn.Close()

	first := make(chan error, 1)
	go func() {
		_, err := p.charges.do(context.Background(), &pb.ChargeRequest{Account: "stays", Units: 1})
		first <- err
	}()
	<-o.entered // the only slot is busy
	gone, leave := context.WithCancel(context.Background())
	left := make(chan error, 1)
	go func() {
		_, err := p.charges.do(gone, &pb.ChargeRequest{Account: "left", Units: 2})
		left <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		p.charges.mu.Lock()
		queued := len(p.charges.queue)
		p.charges.mu.Unlock()
		if queued == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the second charge never queued")
		}
		time.Sleep(time.Millisecond)
	}
	o.release <- struct{}{} // the first batch answers; the queued charge goes out
	<-o.entered             // and is on its way
	leave()                 // its caller leaves
	if err := <-left; !errors.Is(err, context.Canceled) {
		t.Fatalf("the caller that left: %v, want context.Canceled", err)
	}
	close(o.release) // the owner applies it, for nobody
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	select {
	case <-o.refunded:
	case <-time.After(10 * time.Second):
		t.Fatal("no refund for the charge whose caller left")
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.refunds) != 1 {
		t.Fatalf("refunds %v, want one", o.refunds)
	}
	r := o.refunds[0]
	if r.Account != "left" || r.EventId != "ev-left" || !r.Attempt || r.Replay || r.Receipt == nil || r.Receipt.Units != 2 {
		t.Fatalf("refund %+v, want an attempt's refund of ev-left with its receipt", r)
	}
}
