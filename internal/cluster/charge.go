package cluster

import (
	"context"
	"crypto/tls"
	"errors"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/router/pb"
)

// Conns keeps one gRPC connection per node RPC address. Its methods are
// safe for concurrent use.
type Conns struct {
	// Token, when set, is sent with every call (the nodes' --rpc-token);
	// set it before the first Client.
	Token string
	// TLS, when set, dials with it (Options.RPCTLS's client side, NewTLS).
	TLS *tls.Config

	mu sync.Mutex // protects m
	m  map[string]*grpc.ClientConn
}

// Client returns a client for the RPC address addr, dialling it the first
// time (grpc.NewClient connects lazily and reconnects by itself).
func (cs *Conns) Client(addr string) (pb.QuotaClient, error) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if c, ok := cs.m[addr]; ok {
		return pb.NewQuotaClient(c), nil
	}
	c, err := grpc.NewClient("passthrough:///"+addr, router.NodeDialOptions(cs.Token, cs.TLS)...)
	if err != nil {
		return nil, err
	}
	if cs.m == nil {
		cs.m = map[string]*grpc.ClientConn{}
	}
	cs.m[addr] = c
	return pb.NewQuotaClient(c), nil
}

// Close closes every connection.
func (cs *Conns) Close() {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	for _, c := range cs.m {
		c.Close()
	}
	cs.m = nil
}

// WaitConfig waits until every running node serves config version v or a
// later one (each node's own snapshot, not just the owners': a node
// restarted while the ledger is down serves the one it kept), or ctx ends.
func (c *Cluster) WaitConfig(ctx context.Context, conns *Conns, v int64) error {
	return Poll(ctx, 100*time.Millisecond, func() (bool, error) {
		for _, n := range c.List() {
			if !n.Running() {
				continue
			}
			cl, err := conns.Client(n.RPC)
			if err != nil {
				return false, err
			}
			rep, err := cl.Config(ctx, &pb.ConfigRequest{KnownVersion: v})
			if err != nil || (!rep.Unchanged && rep.Version < v) {
				return false, nil
			}
		}
		return true, nil
	})
}

// ChargeRouted sends one charge through node n with Route set (n forwards
// it to the owner, one hop) and fills op's outcome from the answer.
func (cs *Conns) ChargeRouted(ctx context.Context, n *Node, req *pb.ChargeRequest, op *Op) *pb.ChargeReply {
	op.Kind, op.Via, op.Node, op.Account, op.EventID, op.Units = OpCharge, "grpc", n.ID, req.Account, req.EventId, req.Units
	cl, err := cs.Client(n.RPC)
	if err != nil {
		ClassifyCharge(op, nil, err)
		return nil
	}
	rep, err := cl.Charge(ctx, &pb.ChargeBatch{Route: true, Charges: []*pb.ChargeRequest{req}})
	var r *pb.ChargeReply
	if err == nil {
		r = rep.Replies[0]
	}
	ClassifyCharge(op, r, err)
	return r
}

// ClassifyCharge fills op's Status, Reason, Decider, Remaining, Reset and
// Err from a charge's answer or error. Only a decision says what happened:
// an error of any kind, WrongOwner and quota-unavailable (which a node that
// forwarded says when the owner did not answer) are unknown outcomes.
func ClassifyCharge(op *Op, r *pb.ChargeReply, err error) {
	if classifyUndecided(op, err, r.GetError(), r.GetWrongOwner()) {
		return
	}
	d := r.Decision
	op.Decider, op.Remaining, op.Reset = r.Node, d.GetRemaining(), d.GetReset_()
	op.Reason = strings.ToLower(d.GetReason().String())
	if r.EventId != "" && op.EventID == "" {
		op.EventID = r.EventId
	}
	op.Status = StatusRefused
	if d.GetReason() == pb.Reason_OK || d.GetReason() == pb.Reason_REPLAYED {
		op.Status = StatusOK
	}
}

// ClassifyRefund fills op's outcome from a refund's answer or error.
func ClassifyRefund(op *Op, r *pb.RefundReply, err error) {
	if classifyUndecided(op, err, r.GetError(), r.GetWrongOwner()) {
		return
	}
	d := r.Decision
	op.Decider, op.Reason = r.Node, strings.ToLower(d.GetReason().String())
	op.Remaining, op.Reset = d.GetRemaining(), d.GetReset_()
	op.Status = StatusRefused
	if d.GetReason() == pb.Reason_REFUNDED {
		op.Status = StatusOK
	}
}

// classifyUndecided marks op unknown when the call failed, the node
// answered an error, or it was not the owner, and reports whether it did.
func classifyUndecided(op *Op, err error, e *pb.Error, wo *pb.WrongOwner) bool {
	switch {
	case err != nil:
		op.Status, op.Reason, op.Err = StatusUnknown, transportReason(err), err.Error()
	case e != nil:
		op.Status, op.Reason, op.Err = StatusUnknown, strings.ToLower(e.Code.String()), e.Message
	case wo != nil:
		op.Status, op.Reason, op.Err = StatusUnknown, "wrong_owner", "owner "+wo.OwnerId
	default:
		return false
	}
	return true
}

// transportReason names a call's failure: timeout or transport.
func transportReason(err error) string {
	if errors.Is(err, context.DeadlineExceeded) || status.Code(err) == codes.DeadlineExceeded {
		return "timeout"
	}
	return "transport"
}
