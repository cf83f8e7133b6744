package router

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"

	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/shard"
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
	// gone is when the address stopped being wanted (forget); zero while it
	// is. Guarded by peers.mu.
	gone time.Time
}

// peers holds one peer per address. Connections are made lazily and kept
// while the address is wanted (forget closes the others).
type peers struct {
	opts    peerOptions
	ctx     context.Context
	mu      sync.Mutex // protects byAddr, closing and each peer's gone
	byAddr  map[string]*peer
	closing bool
	// senders runs the batchers' goroutines; close waits for them.
	senders goroutines
}

// peerGrace is how long an address stays connected after it stopped being
// wanted: longer than any call in flight to it (CallTimeout) and than a
// short partition, after which the peer would be dialled again anyway.
const peerGrace = time.Minute

type peerOptions struct {
	maxInflight, maxBatch int
	callTimeout           time.Duration
	dialer                func(ctx context.Context, addr string) (net.Conn, error)
	epoch                 func() uint64
	// hops is 1 for a node forwarding, 0 for an embedded client.
	hops uint32
	// route marks every batch Route: the node that gets it forwards what
	// it does not own (an embedded client with DialOptions.Gateway).
	route bool
	// token, when set, goes with every call (the cluster's RPC token).
	token string
	// tls, when set, makes every connection TLS (tls.go); nil is plaintext.
	tls *tls.Config
}

func newPeers(ctx context.Context, opts peerOptions) *peers {
	return &peers{opts: opts, ctx: ctx, byAddr: make(map[string]*peer)}
}

// peerMaxBackoff caps the wait between two tries to reconnect to a peer
// that was unreachable: a node back serves its accounts within it.
const peerMaxBackoff = 2 * time.Second

func (ps *peers) get(addr string) (*peer, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.closing {
		return nil, errClosed
	}
	if p, ok := ps.byAddr[addr]; ok {
		return p, nil
	}
	dialOpts := NodeDialOptions(ps.opts.token, ps.opts.tls)
	// A node that was down and serves again: gRPC's reconnect backoff,
	// grown through the outage (1 s x 1.6 a try, up to 120 s), kept failing
	// calls to it at once with the old dial error long after it was back
	// (a review: 15-20 s after a 45 s outage, for every embedded client
	// and forwarding node), while a new connection would have worked.
	dialOpts = append(dialOpts, grpc.WithConnectParams(grpc.ConnectParams{
		Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: peerMaxBackoff},
		MinConnectTimeout: 5 * time.Second,
	}))
	if ps.opts.dialer != nil {
		dialOpts = append(dialOpts, grpc.WithContextDialer(ps.opts.dialer))
	}
	conn, err := grpc.NewClient("passthrough:///"+addr, dialOpts...)
	if err != nil {
		return nil, fmt.Errorf("router: connect to %s: %w", addr, err)
	}
	p := &peer{addr: addr, conn: conn, client: pb.NewQuotaClient(conn)}
	timeout, hops, epoch, route := ps.opts.callTimeout, ps.opts.hops, ps.opts.epoch, ps.opts.route
	p.charges = newBatcher(ps.ctx, &ps.senders, ps.opts.maxInflight, ps.opts.maxBatch, func(ctx context.Context, reqs []*pb.ChargeRequest) ([]*pb.ChargeReply, error) {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		rep, err := p.client.Charge(ctx, &pb.ChargeBatch{Epoch: epoch(), Charges: reqs, Hops: hops, Route: route})
		if err != nil {
			return nil, err
		}
		return rep.Replies, nil
	})
	p.refunds = newBatcher(ps.ctx, &ps.senders, ps.opts.maxInflight, ps.opts.maxBatch, func(ctx context.Context, reqs []*pb.RefundRequest) ([]*pb.RefundReply, error) {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		rep, err := p.client.Refund(ctx, &pb.RefundBatch{Epoch: epoch(), Refunds: reqs, Hops: hops, Route: route})
		if err != nil {
			return nil, err
		}
		return rep.Replies, nil
	})
	p.charges.orphan = func(req *pb.ChargeRequest, rep *pb.ChargeReply) {
		ps.takeBack(p, req, rep)
	}
	ps.byAddr[addr] = p
	return p, nil
}

// forget closes the connections to addresses that wanted has not named
// for peerGrace up to now: a node that left the cluster, or a pod that came
// back under another address. Without it each such address would keep a
// connection open until Close.
func (ps *peers) forget(wanted func(addr string) bool, now time.Time) {
	ps.mu.Lock()
	var drop []*peer
	for addr, p := range ps.byAddr {
		switch {
		case wanted(addr):
			p.gone = time.Time{}
		case p.gone.IsZero():
			p.gone = now
		case now.Sub(p.gone) >= max(peerGrace, 2*ps.opts.callTimeout):
			drop = append(drop, p)
			delete(ps.byAddr, addr)
		}
	}
	ps.mu.Unlock()
	for _, p := range drop {
		_ = p.conn.Close() // NB: nothing to do about a failed close of a connection nobody uses
	}
}

// count is the number of open peers.
func (ps *peers) count() int {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	return len(ps.byAddr)
}

// close closes every connection and waits for the batchers' goroutines,
// which stop with ps.ctx.
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
	ps.senders.wait() // they end now: ps.ctx is canceled (Router.Close) and the connections are closed
	return errors.Join(errs...)
}

// takeBack returns a charge that its owner applied after the caller left
// (its ctx ended while the charge was on its way in a batch, sent under the
// batcher's context): the caller was told it failed, with an unknown
// outcome, and served nothing, so the charge is refunded as an attempt's
// (an Attempt refund with its receipt: kept if a retry with the same
// Idempotency-Key was served under it meanwhile), or, for a Replayed
// answer, the replay is taken back. Without it the charge stood, billed;
// a client without an Idempotency-Key that retried was billed twice for
// one request. Best effort, in a sender goroutine: an owner that moved
// meanwhile answers WrongOwner, and the charge stands as before.
func (ps *peers) takeBack(p *peer, req *pb.ChargeRequest, rep *pb.ChargeReply) {
	d := decisionFromPB(rep.GetDecision())
	if rep.GetReceipt() == nil || d.Reason != shard.OK && d.Reason != shard.Replayed {
		return
	}
	ref := &pb.RefundRequest{Account: req.GetAccount(), EventId: rep.GetEventId(), Receipt: rep.GetReceipt(),
		Attempt: d.Reason == shard.OK, Replay: d.Reason == shard.Replayed}
	ps.senders.start(func() {
		ctx, cancel := context.WithTimeout(ps.ctx, ps.opts.callTimeout)
		defer cancel()
		_, _ = p.refunds.do(ctx, ref) // NB: best effort; the charge stands if it fails
	})
}
