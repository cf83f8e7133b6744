package router

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/quotaring/quotaring/router/pb"
)

var errShortReply = errors.New("router: a node answered a batch with the wrong number of replies")

// peer is the connection to one node's RPC address, with one coalescing
// batcher per call kind.
type peer struct {
	addr    string
	conn    *grpc.ClientConn
	client  pb.QuotaClient
	charges *batcher[*pb.ChargeRequest, *pb.ChargeReply]
	refunds *batcher[*pb.RefundRequest, *pb.RefundReply]
}

// peers holds one peer per address. Connections are made lazily and kept.
type peers struct {
	opts    peerOptions
	ctx     context.Context
	mu      sync.Mutex // protects byAddr
	byAddr  map[string]*peer
	closing bool
}

type peerOptions struct {
	maxInflight, maxBatch int
	callTimeout           time.Duration
	dialer                func(ctx context.Context, addr string) (net.Conn, error)
	epoch                 func() uint64
	// hops is 1 for a node forwarding, 0 for an embedded client.
	hops uint32
}

func newPeers(ctx context.Context, opts peerOptions) *peers {
	return &peers{opts: opts, ctx: ctx, byAddr: make(map[string]*peer)}
}

func (ps *peers) get(addr string) (*peer, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.closing {
		return nil, errClosed
	}
	if p, ok := ps.byAddr[addr]; ok {
		return p, nil
	}
	dialOpts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if ps.opts.dialer != nil {
		dialOpts = append(dialOpts, grpc.WithContextDialer(ps.opts.dialer))
	}
	conn, err := grpc.NewClient("passthrough:///"+addr, dialOpts...)
	if err != nil {
		return nil, fmt.Errorf("router: connect to %s: %w", addr, err)
	}
	p := &peer{addr: addr, conn: conn, client: pb.NewQuotaClient(conn)}
	timeout, hops, epoch := ps.opts.callTimeout, ps.opts.hops, ps.opts.epoch
	p.charges = newBatcher(ps.ctx, ps.opts.maxInflight, ps.opts.maxBatch, func(ctx context.Context, reqs []*pb.ChargeRequest) ([]*pb.ChargeReply, error) {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		rep, err := p.client.Charge(ctx, &pb.ChargeBatch{Epoch: epoch(), Charges: reqs, Hops: hops})
		if err != nil {
			return nil, err
		}
		return rep.Replies, nil
	})
	p.refunds = newBatcher(ps.ctx, ps.opts.maxInflight, ps.opts.maxBatch, func(ctx context.Context, reqs []*pb.RefundRequest) ([]*pb.RefundReply, error) {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		rep, err := p.client.Refund(ctx, &pb.RefundBatch{Epoch: epoch(), Refunds: reqs, Hops: hops})
		if err != nil {
			return nil, err
		}
		return rep.Replies, nil
	})
	ps.byAddr[addr] = p
	return p, nil
}

// close closes every connection. The batchers stop with ps.ctx.
func (ps *peers) close() error {
	ps.mu.Lock()
	ps.closing = true
	all := ps.byAddr
	ps.byAddr = map[string]*peer{}
	ps.mu.Unlock()
	var errs []error
	for _, p := range all {
		errs = append(errs, p.conn.Close())
	}
	return errors.Join(errs...)
}
