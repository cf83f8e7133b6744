package router

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/shard"
)

// Server returns the gRPC service of this node: register it on a
// grpc.Server. It decides for the accounts this node owns and answers
// WrongOwner for the others. It forwards only a client's call marked Route
// (hops 0: "decide wherever the owner is", what router.Client with
// DialOptions.Gateway, quotad bench cluster --mode routed and the chaos
// harness send: charges, refunds and usage reads alike), once, with hops 1;
// a call with hops 1 is never forwarded again, so a request takes at most
// one hop.
func (r *Router) Server() pb.QuotaServer { return &server{r: r} }

type server struct {
	pb.UnimplementedQuotaServer
	r *Router
}

// wrongOwner names who owns account in this node's view, or nil if it is us.
func (s *server) wrongOwner(account string) *pb.WrongOwner {
	rg := s.r.cfg.Ring
	owner, ok := rg.Owner(account)
	if ok && owner.ID == s.r.self {
		return nil
	}
	return &pb.WrongOwner{Epoch: rg.Epoch(), OwnerId: owner.ID, OwnerRpc: owner.RPCAddr}
}

func (s *server) Charge(ctx context.Context, b *pb.ChargeBatch) (*pb.ChargeReplies, error) {
	out := &pb.ChargeReplies{Replies: make([]*pb.ChargeReply, len(b.Charges)), Epoch: s.r.cfg.Ring.Epoch()}
	var reqs []engine.Request
	var idx []int
	var routed []int
	for i, c := range b.Charges {
		if wo := s.wrongOwner(c.Account); wo != nil {
			if b.Route && b.Hops == 0 {
				routed = append(routed, i)
				continue
			}
			out.Replies[i] = &pb.ChargeReply{WrongOwner: wo, Node: s.r.self}
			continue
		}
		reqs = append(reqs, chargeFromPB(c))
		idx = append(idx, i)
	}
	for j, o := range s.r.cfg.Engine.ChargeMany(ctx, reqs) {
		i := idx[j]
		if o.Err != nil {
			out.Replies[i] = s.errorReply(reqs[j].Account, o.Err)
			continue
		}
		s.r.stats.Local.Add(1)
		out.Replies[i] = &pb.ChargeReply{Decision: decisionToPB(&o.Decision), EventId: o.EventID, Receipt: receiptToPB(o.Receipt), Node: s.r.self}
	}
	s.route(ctx, b.Charges, routed, out.Replies)
	return out, nil
}

// route forwards the charges at idx to their owners, one hop: one batch
// per owner, the owners concurrently. A charge whose owner answers
// WrongOwner (the ring moved) goes through Router.Charge, which follows it a
// bounded number of times.
func (s *server) route(ctx context.Context, charges []*pb.ChargeRequest, idx []int, replies []*pb.ChargeReply) {
	byOwner := map[string][]int{}
	var single []int
	for _, i := range idx {
		owner, ok := s.r.cfg.Ring.Owner(charges[i].Account)
		if !ok || owner.ID == s.r.self {
			single = append(single, i)
			continue
		}
		byOwner[owner.RPCAddr] = append(byOwner[owner.RPCAddr], i)
	}
	tasks := make([]func(), 0, len(byOwner)+len(single))
	for addr, ids := range byOwner {
		tasks = append(tasks, func() {
			for _, rd := range s.forwardBatch(ctx, addr, charges, ids, replies) {
				s.routeOne(ctx, charges[rd.i], rd.i, replies, rd.target)
			}
		})
	}
	for _, i := range single {
		tasks = append(tasks, func() { s.routeOne(ctx, charges[i], i, replies, "") })
	}
	// The tasks run at once, the first on this goroutine: a batch of one
	// charge (the usual routed call) then starts no goroutine, whose stack
	// would grow again through the gRPC client on every call (a tenth of
	// the routing node's CPU in a profile at 64 callers).
	var wg sync.WaitGroup
	for _, task := range tasks[min(1, len(tasks)):] {
		wg.Add(1)
		go func() {
			defer wg.Done()
			task()
		}()
	}
	if len(tasks) > 0 {
		tasks[0]()
	}
	wg.Wait()
}

// redirect is a charge of a forwarded batch that the node it went to did
// not take (WrongOwner: the ring moved), and the owner that node named.
type redirect struct {
	i      int
	target string // RPC address; "": nobody in that node's view
}

// forwardBatch sends the charges at ids to the owner at addr through its
// coalescing batcher, so they share RPCs with other callers' charges to that
// owner and at most MaxInflight RPCs go to it at once (BENCHMARKS.md: more
// charges/s with many callers), and fills their replies; it returns the ones the owner
// did not take (WrongOwner: the ring moved), to route one by one from the
// owner the answer named. A failed call is not retried: the owner may have
// applied it, so its charges answer quota-unavailable (outcome unknown; a
// retry with an event id is safe).
func (s *server) forwardBatch(ctx context.Context, addr string, charges []*pb.ChargeRequest, ids []int, replies []*pb.ChargeReply) (again []redirect) {
	fail := func(i int, err error) {
		replies[i] = &pb.ChargeReply{Node: s.r.self, Error: &pb.Error{Code: pb.Error_QUOTA_UNAVAILABLE,
			Message: fmt.Sprintf("the owner at %s did not answer (%v); the outcome is unknown, retry with the same event id", addr, err)}}
	}
	p, err := s.r.peers.get(addr)
	if err != nil {
		s.r.stats.ForwardErrors.Add(1)
		for _, i := range ids {
			fail(i, err)
		}
		return nil
	}
	batch := make([]*pb.ChargeRequest, len(ids))
	for j, i := range ids {
		batch[j] = charges[i]
	}
	s.r.stats.Forwarded.Add(int64(len(ids)))
	cctx, cancel := context.WithTimeout(ctx, s.r.cfg.CallTimeout)
	defer cancel()
	reps, errs := p.charges.doMany(cctx, batch)
	var failed error
	for j, i := range ids {
		switch {
		case errs[j] != nil:
			failed = errs[j]
			fail(i, errs[j])
		case reps[j].WrongOwner != nil:
			s.r.stats.WrongOwner.Add(1)
			again = append(again, redirect{i: i, target: reps[j].WrongOwner.OwnerRpc})
		default:
			replies[i] = reps[j]
		}
	}
	s.r.heard(addr, failed)
	if failed != nil {
		s.r.forwardFailed(failed)
	}
	return again
}

// routeOne decides one charge through Router.Charge (local, or forwarded
// with WrongOwner followed), starting at target when a WrongOwner answer
// named one.
func (s *server) routeOne(ctx context.Context, c *pb.ChargeRequest, i int, replies []*pb.ChargeReply, target string) {
	res, err := s.r.chargeVia(ctx, chargeRequestFromPB(c), target)
	if err != nil {
		code := pb.Error_INTERNAL
		msg := err.Error()
		switch {
		case errors.Is(err, ErrUnavailable), errors.Is(err, ErrRejected):
			// A rejection between nodes (their RPC tokens differ) is the
			// operator's to fix, not the caller's: as forwardBatch's.
			code = pb.Error_QUOTA_UNAVAILABLE
		case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
			// The owner may have applied it: the outcome is unknown, and a
			// retry with the same event id is safe.
			code = pb.Error_QUOTA_UNAVAILABLE
			msg = fmt.Sprintf("forwarding the charge of account %q timed out (%v); the outcome is unknown, retry with the same event id", c.Account, err)
		}
		replies[i] = &pb.ChargeReply{Error: &pb.Error{Code: code, Message: msg}, Node: s.r.self}
		return
	}
	replies[i] = &pb.ChargeReply{Decision: decisionToPB(&res.Decision), EventId: res.EventID, Receipt: receiptToPB(res.Receipt), Node: res.Node}
}

func (s *server) errorReply(account string, err error) *pb.ChargeReply {
	if errors.Is(err, engine.ErrNotOwner) {
		wo, e := s.notOwner(account)
		return &pb.ChargeReply{WrongOwner: wo, Error: e, Node: s.r.self}
	}
	return &pb.ChargeReply{Error: errorToPB(err), Node: s.r.self}
}

// notOwner answers the engine's ErrNotOwner: WrongOwner naming the owner in
// this node's ring view, or, when that view still names this node (it is
// draining, or the ring moved between the two looks), quota-unavailable:
// an answer with neither would read as a decision with no reason.
func (s *server) notOwner(account string) (*pb.WrongOwner, *pb.Error) {
	if wo := s.wrongOwner(account); wo != nil {
		return wo, nil
	}
	return nil, &pb.Error{Code: pb.Error_QUOTA_UNAVAILABLE, Message: fmt.Sprintf(
		"node %s is handing account %q over (draining, or its ring view is changing); retry with the same event id", s.r.self, account)}
}

// errorToPB is the answer for an engine error. The call's deadline (the
// caller's, which gRPC carries here) passing while the charge waited (for a
// reservation another charge of the account had in flight, say) is
// quota-unavailable with the outcome unknown, not INTERNAL: it answered the
// caller's clients 500 "internal-error", which clients that retry only 503
// dropped, for a charge a retry decides.
func errorToPB(err error) *pb.Error {
	switch {
	case errors.Is(err, engine.ErrQuotaUnavailable):
		return &pb.Error{Code: pb.Error_QUOTA_UNAVAILABLE, Message: err.Error()}
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return &pb.Error{Code: pb.Error_QUOTA_UNAVAILABLE, Message: fmt.Sprintf(
			"the call's deadline passed before the owner decided (%v); the outcome is unknown, retry with the same event id", err)}
	}
	return &pb.Error{Code: pb.Error_INTERNAL, Message: err.Error()}
}

func (s *server) Refund(ctx context.Context, b *pb.RefundBatch) (*pb.RefundReplies, error) {
	out := &pb.RefundReplies{Replies: make([]*pb.RefundReply, len(b.Refunds)), Epoch: s.r.cfg.Ring.Epoch()}
	var routed sync.WaitGroup
	defer routed.Wait() // NB: before out is returned; each fills its own reply
	for i, rf := range b.Refunds {
		if wo := s.wrongOwner(rf.Account); wo != nil {
			if b.Route && b.Hops == 0 {
				routed.Add(1)
				go func() {
					defer routed.Done()
					out.Replies[i] = s.routeRefund(ctx, rf)
				}()
				continue
			}
			out.Replies[i] = &pb.RefundReply{WrongOwner: wo, Node: s.r.self}
			continue
		}
		d, err := engineRefund(ctx, s.r.cfg.Engine, RefundRequest{Account: rf.Account, EventID: rf.EventId,
			Receipt: receiptFromPB(rf.Receipt), Attempt: rf.Attempt, Replay: rf.Replay})
		switch {
		case errors.Is(err, engine.ErrNotOwner):
			wo, e := s.notOwner(rf.Account)
			out.Replies[i] = &pb.RefundReply{WrongOwner: wo, Error: e, Node: s.r.self}
		case err != nil:
			out.Replies[i] = &pb.RefundReply{Error: errorToPB(err), Node: s.r.self}
		default:
			out.Replies[i] = &pb.RefundReply{Decision: decisionToPB(&d), Node: s.r.self}
		}
	}
	return out, nil
}

// routeRefund refunds rf at its owner for a routed batch, through
// Router.Refund (one hop, WrongOwner followed a bounded number of times).
func (s *server) routeRefund(ctx context.Context, rf *pb.RefundRequest) *pb.RefundReply {
	d, err := s.r.Refund(ctx, RefundRequest{Account: rf.Account, EventID: rf.EventId,
		Receipt: receiptFromPB(rf.Receipt), Attempt: rf.Attempt, Replay: rf.Replay})
	if err != nil {
		return &pb.RefundReply{Error: routedError(err), Node: s.r.self}
	}
	return &pb.RefundReply{Decision: decisionToPB(&d), Node: s.r.self}
}

// routedError is the answer for a call this node failed to forward: the
// caller may retry (quota-unavailable) unless it is this node's own fault.
// A rejection between nodes (their RPC tokens differ) is the operator's to
// fix, not the caller's, as forwardBatch's; a deadline that passed left the
// outcome unknown.
func routedError(err error) *pb.Error {
	switch {
	case errors.Is(err, ErrUnavailable), errors.Is(err, ErrRejected),
		errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return &pb.Error{Code: pb.Error_QUOTA_UNAVAILABLE, Message: err.Error()}
	}
	return &pb.Error{Code: pb.Error_INTERNAL, Message: err.Error()}
}

// nodeAnswered starts the message of a Usage call's Unavailable status the
// node itself gave (held after a pause, handing the account over, a
// forward that failed), so that a client tells it from its own transport's
// Unavailable (no connection, a connection lost mid-call): the node
// answered, and is neither unreachable nor a reason to read the ring again.
const nodeAnswered = "the node answered: "

func (s *server) Usage(ctx context.Context, req *pb.UsageRequest) (*pb.UsageReply, error) {
	if wo := s.wrongOwner(req.Account); wo != nil {
		if req.Route && req.Hops == 0 {
			u, err := s.r.Usage(ctx, req.Account)
			if err != nil {
				if e := routedError(err); e.Code == pb.Error_QUOTA_UNAVAILABLE {
					return nil, status.Error(codes.Unavailable, nodeAnswered+e.Message)
				}
				return nil, status.Error(codes.Internal, err.Error())
			}
			return usageToPB(u.Usage, u.Known, u.Node), nil
		}
		return &pb.UsageReply{WrongOwner: wo, Node: s.r.self}, nil
	}
	u, known, err := s.r.cfg.Engine.Usage(req.Account)
	if errors.Is(err, engine.ErrNotOwner) {
		wo, e := s.notOwner(req.Account)
		if wo == nil {
			return nil, status.Error(codes.Unavailable, nodeAnswered+e.Message)
		}
		return &pb.UsageReply{WrongOwner: wo, Node: s.r.self}, nil
	}
	if errors.Is(err, engine.ErrQuotaUnavailable) {
		return nil, status.Error(codes.Unavailable, nodeAnswered+err.Error()) // a pause's hold: retry, as for a charge
	}
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return usageToPB(u, known, s.r.self), nil
}

// usageToPB is the answer for usage read at node.
func usageToPB(u shard.Usage, known bool, node string) *pb.UsageReply {
	return &pb.UsageReply{Known: known, Period: u.Period.String(), Limit: u.Limit, Used: u.Used, Remaining: u.Remaining,
		Reset_: u.Reset, Routes: u.Routes, Node: node}
}

// LedgerStart reads a node id's latest start from this node's ledger
// (Config.LedgerStart), within ledgerStartTimeout.
func (s *server) LedgerStart(ctx context.Context, req *pb.LedgerStartRequest) (*pb.LedgerStartReply, error) {
	if s.r.cfg.LedgerStart == nil {
		return nil, status.Error(codes.Unimplemented, "router: this node does not read its ledger for peers")
	}
	if req.Node == "" {
		return nil, status.Error(codes.InvalidArgument, "router: LedgerStart needs a node id")
	}
	ctx, cancel := context.WithTimeout(ctx, ledgerStartTimeout)
	defer cancel()
	process, err := s.r.cfg.LedgerStart(ctx, req.Node)
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "router: read node %s's latest start from the ledger: %v", req.Node, err)
	}
	return &pb.LedgerStartReply{Process: process, Node: s.r.self}, nil
}

// ledgerStartTimeout bounds the ledger read LedgerStart does for a peer.
const ledgerStartTimeout = 5 * time.Second

// PeerLedgerStart asks the node at addr (its RPC address) which process
// its ledger recorded at node's latest start, and returns the process and
// the id of the node that answered.
func (r *Router) PeerLedgerStart(ctx context.Context, addr, node string) (process, answered string, err error) {
	p, err := r.peers.get(addr)
	if err != nil {
		return "", "", err
	}
	rep, err := p.client.LedgerStart(ctx, &pb.LedgerStartRequest{Node: node})
	if err != nil {
		return "", "", err
	}
	return rep.Process, rep.Node, nil
}

// HeaderRPCAuth is the response header of RingView that says whether the
// node requires the RPC token: "token", or "none" (it takes any caller, and
// sends no token when it forwards). A node that requires one reads it
// before it takes accounts (Router.Probe), without a call that the peer
// would refuse and log.
const HeaderRPCAuth = "x-quotaring-rpc-auth"

func (s *server) RingView(ctx context.Context, _ *pb.RingViewRequest) (*pb.RingViewReply, error) {
	auth := "none"
	if s.r.cfg.Token != "" { // a node sends the first of the tokens it requires (auth.go)
		auth = "token"
	}
	_ = grpc.SetHeader(ctx, metadata.Pairs(HeaderRPCAuth, auth)) // NB: only fails outside a call (tests call it directly)
	v := s.r.cfg.Ring.View()
	rep := &pb.RingViewReply{Epoch: v.Epoch, PartitionCount: uint32(s.r.cfg.Ring.Layout().PartitionCount), Hash: "xxhash64 % partition_count"}
	index := map[string]int32{}
	for i, m := range v.Members {
		index[m.ID] = int32(i)
		rep.Members = append(rep.Members, &pb.Member{Id: m.ID, RpcAddr: m.RPCAddr, HttpAddr: m.HTTPAddr, AdminAddr: m.AdminAddr, State: string(m.State)})
	}
	rep.Owners = make([]int32, len(v.Owners))
	for p, id := range v.Owners {
		if i, ok := index[id]; ok {
			rep.Owners[p] = i
		} else {
			rep.Owners[p] = -1
		}
	}
	return rep, nil
}
