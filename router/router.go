package router

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// Errors callers act on. Every error comes with a zero ChargeResult (or
// Decision), whose Reason is shard.Undecided: never Accepted.
var (
	// ErrUnavailable: the charge could not be decided now (no serving owner,
	// the owner unreachable, the ledger unable to reserve, ownership moving).
	// Answer quota-unavailable (503) and retry; nothing was charged, or the
	// outcome is unknown: then a retry is safe with the same event id as a
	// client id (ChargeRequest.ClientID), while a charge without one sent
	// again is a new charge (the error says which).
	ErrUnavailable = errors.New("router: quota unavailable")
	// ErrInternal: the owner failed (its log, its shutdown), or answered
	// something this build cannot read.
	ErrInternal = errors.New("router: internal error at the owner")
	// ErrClosed: the Client was closed (Client.Close) before the call was
	// sent: nothing was applied. It does not match ErrUnavailable: retrying
	// on this Client cannot help; Dial a new one. A call Close cut after it
	// was sent is not ErrClosed but ErrUnavailable, its outcome unknown
	// (retry it with the same event id on a new Client).
	ErrClosed = errors.New("router: the client is closed (Close was called); Dial a new one")
	// ErrInvalidRequest: the Client refused a request before sending it
	// (an empty Account, Units out of range, an EventID without ClientID or
	// longer than MaxEventID, ClientID without an EventID, a Replay refund
	// without its Receipt, an Account, Route or Key longer than MaxField,
	// a string that is not valid UTF-8 or holds a NUL byte, a nil context,
	// a zero Client not made by Dial),
	// or Dial refused its options; the error names the field. Retrying the
	// same request cannot help.
	ErrInvalidRequest = errors.New("router: invalid request")
	// ErrRejected: the node turned the call away before handling it: a
	// wrong or missing RPC token (gRPC Unauthenticated, PermissionDenied),
	// a call it does not serve (Unimplemented: a node of another version),
	// a message over its size limit (ResourceExhausted), a malformed call
	// (InvalidArgument). Nothing was applied, and retrying cannot help until
	// the setup is fixed. The gRPC status stays in the chain:
	// status.Code(err) reads it. The HTTP front answers it 503
	// quota-unavailable, with Retry-After: between nodes it is an operator's
	// to fix, not the client's, whose retry succeeds once that is done.
	ErrRejected = errors.New("router: the node rejected the call")
	// ErrOutcomeUnknown marks an ErrUnavailable whose call was sent and got
	// no answer (a deadline, an owner that died or hung, a Close that cut
	// it): the owner may have applied it. errors.Is(err, ErrUnavailable)
	// holds for it too. An ErrUnavailable without it was not applied (not
	// sent, turned away, refused for now). A charge with a ClientID is
	// safe to retry with its event id either way; one without cannot be
	// told apart from a new charge, and one its caller's deadline cut is
	// refunded by the client when the owner's answer arrives.
	ErrOutcomeUnknown = errors.New("router: the outcome is unknown")
)

// errUnknownOutcome is ErrUnavailable with ErrOutcomeUnknown, in a chain
// whose text is ErrUnavailable's: the errors of calls that got no answer
// wrap it.
var errUnknownOutcome error = unknownOutcome{}

type unknownOutcome struct{}

func (unknownOutcome) Error() string { return ErrUnavailable.Error() }
func (unknownOutcome) Is(target error) bool {
	return target == ErrUnavailable || target == ErrOutcomeUnknown
}

var (
	// errClosed is what peers answer once closed: the Client's Close
	// (ErrClosed), or the Router's at a node's shutdown (ErrUnavailable:
	// another node can answer).
	errClosed = errors.New("router: closed")
	// errNotDialed is what a Client not made by Dial answers.
	errNotDialed = fmt.Errorf("%w: this Client was not made by Dial (a zero Client): use router.Dial or DialOptions.Dial", ErrInvalidRequest)
)

// Ring is what the router needs of the ring (ring.Ring implements it).
type Ring interface {
	Owner(account string) (ring.Meta, bool)
	Epoch() uint64
	Self() ring.Meta
	View() ring.View
	Layout() ring.Layout
}

// Config configures a Router.
type Config struct {
	Engine *engine.Engine // required
	Ring   Ring           // required
	// MaxBatch bounds the charges of one forwarded call (default 512).
	MaxBatch int
	// MaxInflight bounds the calls in flight to one peer (default 4).
	MaxInflight int
	// CallTimeout bounds one forwarded call (default 5 s).
	CallTimeout time.Duration
	// Faults, when set, cuts RPC traffic for partition tests.
	Faults *Faults
	// Token is sent with every forwarded call: the cluster's RPC token
	// (auth.go); empty sends none.
	Token string
	// TLS, when set, is the client side of forwarded calls (tls.go:
	// TLSFiles.ClientConfig); nil forwards in plaintext.
	TLS    *tls.Config
	Logger *slog.Logger
	// OnForward, when set, hears the outcome of every call forwarded to a
	// peer (a charge, a batch of charges, a refund, a usage read): the
	// peer's RPC address and the call's error, nil when the peer answered.
	// It runs on the caller's goroutine and must not block. The node
	// watches it for peers that refuse its credentials (CredentialsRefused).
	OnForward func(addr string, err error)
	// LedgerStart, when set, answers the LedgerStart RPC: the process
	// recorded at a node id's latest start in this node's ledger ("" for
	// none). Nil answers Unimplemented.
	LedgerStart func(ctx context.Context, node string) (process string, err error)
}

// ChargeRequest is one charge.
type ChargeRequest struct {
	// Account is the account to charge (required).
	Account string
	// EventID names the charge; ClientID marks it as the caller's own
	// idempotency key (the HTTP front's Idempotency-Key): the owner
	// remembers it for a day, a retry with it is charged once and billed
	// once (answered Replayed), and reusing it for another Route is refused
	// (IDReused). A retry is served again, so the owner answers Replayed
	// at most its replay bound's times (quotad serve --dedup-max-replays,
	// 10 by default; replays taken back with RefundReplay do not count)
	// and ReplayLimit after that. The same id charged again after the
	// owner forgot it (a day later) is new work, charged and billed apart
	// from its earlier use, except at an owner that got the account after
	// that use, which cannot tell it from a retry and has the ledger bill
	// it once (README, "A key used again after 24 hours"): give each
	// operation an id of its own.
	//
	// Leave EventID empty for a charge that needs no idempotency:
	// Client.Charge then makes a unique id itself (so that its own retry at
	// another owner carries the same id, which the ledger bills once), and
	// Router.Charge lets the owner make one. Either way ClientID is false and
	// the id comes back in ChargeResult.EventID; refunding it needs the
	// Receipt.
	//
	// An EventID without ClientID is how such a generated id travels to the
	// owner (the internal RPC); it is not remembered by the owner, so two
	// charges with it are both charged, and billed once. Client.Charge
	// refuses it (ErrInvalidRequest): set ClientID too, or leave EventID
	// empty.
	EventID  string
	ClientID bool
	Key      string // API key id
	Route    string
	// Units to charge: 0 (rate limited, not billed) to shard.MaxUnits.
	Units int64
	// Target is an optional digest of the request a ClientID names (the
	// HTTP front hashes the method and request target; see
	// RequestTarget). A ClientID reused with another non-zero Target is
	// refused IDReused, as one reused for another Route is: otherwise one
	// idempotency key would serve every request under one route for a
	// single charge. The owner remembers it with the ClientID, across its
	// restarts; the account's next owner knows neither and charges the
	// ClientID again (the ledger bills the event once).
	Target uint64
}

// ChargeResult is the owner's decision.
type ChargeResult struct {
	shard.Decision
	EventID string
	// Receipt refunds the charge (set when units were charged).
	Receipt *shard.Receipt
	// Node is the node that decided.
	Node string
}

// RefundRequest refunds one event.
type RefundRequest struct {
	Account string
	EventID string
	// Receipt is the charge's ChargeResult.Receipt. It is required for an
	// id the client or the owner made (a ChargeRequest without ClientID):
	// the owner remembers only client ids, and refunding a generated id
	// without its receipt answers shard.UnknownEvent although the charge
	// stands. A client id (ClientID) can be refunded by id alone within the
	// owner's dedup window (24 h).
	Receipt *shard.Receipt
	// Attempt refunds only the charge this caller's attempt made: the owner
	// keeps it (answering Kept) when a retry with the same client id was
	// served under it since. The HTTP front refunds this way.
	Attempt bool
	// Replay takes back an attempt that was answered Replayed and then not
	// served: one retry fewer relies on the charge (the HTTP front). Send it
	// for such answers only: the owner counts them, and one too many would
	// let a retry that was served lose its charge. With the Replayed
	// answer's Receipt, which names the replay (Receipt.ReplaySeq), it may
	// be sent again (its answer was lost) and counts once, and a replay
	// taken back after the account moved to another owner reaches the
	// ledger too. Client.Refund refuses it without the receipt
	// (ErrInvalidRequest): it retries a refund whose owner was silent, and
	// a take-back without a receipt cannot be told from another one.
	// Router.Refund (at a node) takes it, for callers older than receipts:
	// send it once per answer.
	Replay bool
}

// UsageResult is an account's current period at its owner.
type UsageResult struct {
	shard.Usage
	// Known is false when the owner's config has no such account
	// (mistyped, or created in the last seconds and not loaded at the
	// owner yet): every other field but Node is then zero, Period
	// included, and means nothing.
	Known bool
	Node  string
}

// Stats are counters for metrics. Refused counts the forwarded calls
// (among ForwardErrors) that the node called turned away for this node's
// credentials (CredentialsRefused: its RPC token or certificate).
type Stats struct {
	Local, Forwarded, WrongOwner, ForwardErrors, Refused atomic.Int64
}

// heard passes a forwarded call's outcome to Config.OnForward.
func (r *Router) heard(addr string, err error) {
	if r.cfg.OnForward != nil {
		r.cfg.OnForward(addr, err)
	}
}

// forwardFailed counts a forwarded call that failed with err.
func (r *Router) forwardFailed(err error) {
	r.stats.ForwardErrors.Add(1)
	if CredentialsRefused(err, r.cfg.TLS != nil) {
		r.stats.Refused.Add(1)
	}
}

// Router sends each charge to its account's owner: decided here when this
// node owns the account, forwarded once otherwise. It also serves the
// internal gRPC API (Server) that other nodes and embedded clients call.
type Router struct {
	cfg    Config
	self   string
	peers  *peers
	stats  Stats
	cancel context.CancelFunc
	// forgot is closed when forgetLoop has returned: Close waits for it,
	// so that no forget runs beside or after the peers' close.
	forgot chan struct{}

	// encMu protects encSnap and encData, the config snapshot last encoded
	// for an embedded client (server.Config) and its bytes; it is held
	// while one is encoded, so that callers asking at once share it.
	encMu   sync.Mutex
	encSnap *snapshot.Snapshot
	encData []byte
}

// New makes a router.
func New(cfg Config) (*Router, error) {
	if cfg.Engine == nil || cfg.Ring == nil {
		return nil, errors.New("router: Config.Engine and Config.Ring are required")
	}
	if cfg.MaxBatch <= 0 {
		cfg.MaxBatch = 512
	}
	if cfg.MaxInflight <= 0 {
		cfg.MaxInflight = 4
	}
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &Router{cfg: cfg, self: cfg.Ring.Self().ID, cancel: cancel, forgot: make(chan struct{})}
	opts := peerOptions{maxInflight: cfg.MaxInflight, maxBatch: cfg.MaxBatch, callTimeout: cfg.CallTimeout, epoch: cfg.Ring.Epoch, hops: 1, token: cfg.Token, tls: cfg.TLS}
	if cfg.Faults != nil {
		opts.dialer = cfg.Faults.dial
	}
	r.peers = newPeers(ctx, opts)
	go r.forgetLoop(ctx)
	return r, nil
}

// forgetLoop closes, every quarter of peerGrace until ctx ends, the
// connections to addresses that are no longer ring members (peers.forget).
func (r *Router) forgetLoop(ctx context.Context) {
	defer close(r.forgot)
	t := time.NewTicker(peerGrace / 4)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			r.forgetPeers(now)
		}
	}
}

// forgetPeers tells the peers which addresses the ring still has.
func (r *Router) forgetPeers(now time.Time) {
	members := r.cfg.Ring.View().Members
	r.peers.forget(func(addr string) bool {
		return slices.ContainsFunc(members, func(m ring.Meta) bool { return m.RPCAddr == addr })
	}, now)
}

// PeerEpoch asks the node at addr for the epoch of its ring view
// (RingView, over this router's connection to it, as Probe). A node back
// from a pause compares it with its own before it decides again.
func (r *Router) PeerEpoch(ctx context.Context, addr string) (uint64, error) {
	p, err := r.peers.get(addr)
	if err != nil {
		return 0, err
	}
	rep, err := p.client.RingView(ctx, &pb.RingViewRequest{})
	if err != nil {
		return 0, err
	}
	return rep.Epoch, nil
}

// Probe calls RingView, the cheapest call, on the node at addr over this
// router's connection to it, with its token and TLS, as a forwarded charge
// would go: nil when the node answered. A node checks its serving peers so
// before it takes accounts (CredentialsRefused says whether an error is
// theirs refusing it). tokenless is set when the node answered that it
// takes calls without a token (HeaderRPCAuth): it has none, so it sends
// none, and a node that requires one would refuse every call it forwards.
// A node of an earlier version does not say; tokenless is false then.
func (r *Router) Probe(ctx context.Context, addr string) (tokenless bool, err error) {
	p, err := r.peers.get(addr)
	if err != nil {
		return false, err
	}
	var header metadata.MD
	if _, err := p.client.RingView(ctx, &pb.RingViewRequest{}, grpc.Header(&header)); err != nil {
		return false, err
	}
	return slices.Contains(header.Get(HeaderRPCAuth), "none"), nil
}

// Close stops forwarding and closes peer connections.
func (r *Router) Close() error {
	r.cancel()
	<-r.forgot
	return r.peers.close()
}

// Stats are the router's counters.
func (r *Router) Stats() *Stats { return &r.stats }

// maxAttempts bounds how often one charge looks for its owner: the local
// view, then at most two WrongOwner redirections. Never a loop.
const maxAttempts = 3

// Charge decides req at its owner.
func (r *Router) Charge(ctx context.Context, req ChargeRequest) (ChargeResult, error) {
	return r.chargeVia(ctx, req, "")
}

// chargeVia is Charge starting at target, the RPC address a WrongOwner
// answer named ("": the owner in this node's view).
func (r *Router) chargeVia(ctx context.Context, req ChargeRequest, target string) (ChargeResult, error) {
	if target == r.cfg.Ring.Self().RPCAddr {
		target = ""
	}
	for attempt := 0; attempt < maxAttempts; attempt++ {
		if target == "" {
			owner, ok := r.cfg.Ring.Owner(req.Account)
			if !ok {
				return ChargeResult{}, fmt.Errorf("%w: no serving node owns account %q (the cluster is starting or has no serving members)", ErrUnavailable, req.Account)
			}
			if owner.ID == r.self {
				res, err := r.chargeLocal(ctx, req)
				if errors.Is(err, engine.ErrNotOwner) {
					continue // the ring moved under us: look again
				}
				return res, err
			}
			target = owner.RPCAddr
		}
		rep, err := r.forwardCharge(ctx, target, req)
		if err != nil {
			return ChargeResult{}, err
		}
		if wo := rep.WrongOwner; wo != nil {
			r.stats.WrongOwner.Add(1)
			target = wo.OwnerRpc
			if wo.OwnerId == r.self || target == "" {
				target = ""
			}
			continue
		}
		return resultFromPB(rep)
	}
	return ChargeResult{}, fmt.Errorf("%w: ownership of account %q is moving; retry", ErrUnavailable, req.Account)
}

// ChargeEarly is Charge for callers that can overlap durability with their
// own work (the HTTP front runs the upstream meanwhile). When this node owns
// the account it answers before the record is durable and returns wait,
// which must return nil before the charge is acknowledged to anyone; for a
// forwarded charge the owner has already waited, and wait is nil.
func (r *Router) ChargeEarly(ctx context.Context, req ChargeRequest) (ChargeResult, func(context.Context) error, error) {
	if owner, ok := r.cfg.Ring.Owner(req.Account); ok && owner.ID == r.self {
		res, wait, err := r.cfg.Engine.ChargeEarly(ctx, req.Account, shard.Charge{EventID: req.EventID, ClientID: req.ClientID,
			Key: req.Key, Route: req.Route, Units: req.Units, Target: req.Target})
		if !errors.Is(err, engine.ErrNotOwner) {
			if err != nil {
				return ChargeResult{}, nil, mapEngineErr(err)
			}
			r.stats.Local.Add(1)
			return ChargeResult{Decision: res.Decision, EventID: res.EventID, Receipt: res.Receipt, Node: r.self}, wait, nil
		}
	}
	res, err := r.Charge(ctx, req)
	return res, nil, err
}

func (r *Router) chargeLocal(ctx context.Context, req ChargeRequest) (ChargeResult, error) {
	r.stats.Local.Add(1)
	res, err := r.cfg.Engine.Charge(ctx, req.Account, shard.Charge{EventID: req.EventID, ClientID: req.ClientID, Key: req.Key, Route: req.Route, Units: req.Units, Target: req.Target})
	if err != nil {
		return ChargeResult{}, mapEngineErr(err)
	}
	return ChargeResult{Decision: res.Decision, EventID: res.EventID, Receipt: res.Receipt, Node: r.self}, nil
}

func mapEngineErr(err error) error {
	switch {
	case errors.Is(err, engine.ErrNotOwner):
		return err
	case errors.Is(err, engine.ErrQuotaUnavailable):
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return err
	}
	return fmt.Errorf("%w: %v", ErrInternal, err)
}

func (r *Router) forwardCharge(ctx context.Context, addr string, req ChargeRequest) (*pb.ChargeReply, error) {
	p, err := r.peers.get(addr)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	r.stats.Forwarded.Add(1)
	rep, err := p.charges.do(ctx, chargeToPB(&req))
	r.heard(addr, err)
	if err != nil {
		r.forwardFailed(err)
		return nil, ownerSilent(ctx, req.Account, addr, err)
	}
	return rep, nil
}

// ownerSilent is the error for a call to the owner of account at addr that
// got no answer (err): ErrUnavailable, the outcome unknown. When ctx's
// deadline passed it wraps ctx's error too, since that is why.
func ownerSilent(ctx context.Context, account, addr string, err error) error {
	if rejected(err) {
		return rejectedError(account, addr, "charge", err)
	}
	if cerr := ctxEnded(ctx); cerr != nil {
		return fmt.Errorf("%w: the owner of account %q at %s did not answer before the caller's deadline (%w); the outcome is unknown, retry with the same event id",
			errUnknownOutcome, account, addr, cerr)
	}
	return fmt.Errorf("%w: the owner of account %q at %s did not answer (%v); the outcome is unknown, retry with the same event id", errUnknownOutcome, account, addr, err)
}

func resultFromPB(rep *pb.ChargeReply) (ChargeResult, error) {
	if e := rep.Error; e != nil {
		if e.Code == pb.Error_QUOTA_UNAVAILABLE {
			return ChargeResult{}, fmt.Errorf("%w: %s (at %s)", ErrUnavailable, e.Message, rep.Node)
		}
		return ChargeResult{}, fmt.Errorf("%w: %s (at %s)", ErrInternal, e.Message, rep.Node)
	}
	d, err := checkedDecisionFromPB(rep.Decision, rep.Node)
	if err != nil {
		return ChargeResult{}, err
	}
	return ChargeResult{Decision: d, EventID: rep.EventId, Receipt: receiptFromPB(rep.Receipt), Node: rep.Node}, nil
}

// checkedDecisionFromPB is decisionFromPB for a reply that must hold a
// decision: a missing one, or a reason this build does not know (a newer
// node's), is ErrInternal rather than a decision nobody made.
func checkedDecisionFromPB(d *pb.Decision, node string) (shard.Decision, error) {
	out := decisionFromPB(d)
	if d == nil || out.Reason == shard.Undecided {
		return shard.Decision{}, fmt.Errorf("%w: %s answered no decision this client can read (reason %v): are the nodes a newer version?",
			ErrInternal, node, d.GetReason())
	}
	return out, nil
}

// Refund refunds an event at its owner.
func (r *Router) Refund(ctx context.Context, req RefundRequest) (shard.Decision, error) {
	target := ""
	for attempt := 0; attempt < maxAttempts; attempt++ {
		if target == "" {
			owner, ok := r.cfg.Ring.Owner(req.Account)
			if !ok {
				// Nobody serves it: the whole cluster draining. This node
				// refunds its own accounts then (engine.Options.MayRefund).
				d, err := engineRefund(ctx, r.cfg.Engine, req)
				if err == nil {
					return d, nil
				}
				if !errors.Is(err, engine.ErrNotOwner) {
					return d, mapEngineErr(err)
				}
				return shard.Decision{}, fmt.Errorf("%w: no serving node owns account %q", ErrUnavailable, req.Account)
			}
			if owner.ID == r.self {
				d, err := engineRefund(ctx, r.cfg.Engine, req)
				if errors.Is(err, engine.ErrNotOwner) {
					continue
				}
				if err != nil {
					return d, mapEngineErr(err)
				}
				return d, nil
			}
			target = owner.RPCAddr
		}
		p, err := r.peers.get(target)
		if err != nil {
			return shard.Decision{}, fmt.Errorf("%w: %v", ErrUnavailable, err)
		}
		r.stats.Forwarded.Add(1)
		rep, err := p.refunds.do(ctx, &pb.RefundRequest{Account: req.Account, EventId: req.EventID, Receipt: receiptToPB(req.Receipt),
			Attempt: req.Attempt, Replay: req.Replay})
		r.heard(target, err)
		if err != nil {
			r.forwardFailed(err)
			if rejected(err) {
				return shard.Decision{}, rejectedError(req.Account, target, "refund", err)
			}
			return shard.Decision{}, fmt.Errorf("%w: the owner of account %q at %s did not answer: %v", ErrUnavailable, req.Account, target, err)
		}
		if wo := rep.WrongOwner; wo != nil {
			r.stats.WrongOwner.Add(1)
			target = wo.OwnerRpc
			if wo.OwnerId == r.self {
				target = ""
			}
			continue
		}
		if e := rep.Error; e != nil {
			kind := ErrInternal
			if e.Code == pb.Error_QUOTA_UNAVAILABLE {
				kind = ErrUnavailable // a draining owner, a ledger error: retry
			}
			return shard.Decision{}, fmt.Errorf("%w: %s (at %s)", kind, e.Message, rep.Node)
		}
		return checkedDecisionFromPB(rep.Decision, rep.Node)
	}
	return shard.Decision{}, fmt.Errorf("%w: ownership of account %q is moving; retry", ErrUnavailable, req.Account)
}

// engineRefund applies the kind of refund req asks for at this node.
func engineRefund(ctx context.Context, e *engine.Engine, req RefundRequest) (shard.Decision, error) {
	switch {
	case req.Replay:
		return e.RefundReplay(ctx, req.Account, req.EventID, req.Receipt)
	case req.Attempt:
		return e.RefundAttempt(ctx, req.Account, req.EventID, req.Receipt)
	}
	return e.Refund(ctx, req.Account, req.EventID, req.Receipt)
}

// Usage reads an account's current period at its owner.
func (r *Router) Usage(ctx context.Context, account string) (UsageResult, error) {
	target := ""
	for attempt := 0; attempt < maxAttempts; attempt++ {
		if target == "" {
			owner, ok := r.cfg.Ring.Owner(account)
			if !ok {
				return UsageResult{}, fmt.Errorf("%w: no serving node owns account %q", ErrUnavailable, account)
			}
			if owner.ID == r.self {
				u, known, err := r.cfg.Engine.Usage(account)
				if errors.Is(err, engine.ErrNotOwner) {
					continue
				}
				if err != nil {
					return UsageResult{}, mapEngineErr(err) // a pause's hold: quota-unavailable, not a 500
				}
				return UsageResult{Usage: u, Known: known, Node: r.self}, nil
			}
			target = owner.RPCAddr
		}
		p, err := r.peers.get(target)
		if err != nil {
			return UsageResult{}, fmt.Errorf("%w: %v", ErrUnavailable, err)
		}
		ctx, cancel := context.WithTimeout(ctx, r.cfg.CallTimeout)
		rep, err := p.client.Usage(ctx, &pb.UsageRequest{Epoch: r.cfg.Ring.Epoch(), Account: account, Hops: 1})
		cancel()
		r.heard(target, err)
		if err != nil {
			if rejected(err) {
				return UsageResult{}, rejectedError(account, target, "usage read", err)
			}
			if ierr := usageFailed(account, target, err); ierr != nil {
				return UsageResult{}, ierr
			}
			return UsageResult{}, fmt.Errorf("%w: the owner of account %q at %s did not answer: %v", ErrUnavailable, account, target, err)
		}
		if wo := rep.WrongOwner; wo != nil {
			target = wo.OwnerRpc
			if wo.OwnerId == r.self {
				target = ""
			}
			continue
		}
		return usageFromPB(rep), nil
	}
	return UsageResult{}, fmt.Errorf("%w: ownership of account %q is moving; retry", ErrUnavailable, account)
}

func usageFromPB(rep *pb.UsageReply) UsageResult {
	u := UsageResult{Known: rep.Known, Node: rep.Node}
	u.Period, _ = shard.ParsePeriod(rep.Period)
	u.Limit, u.Used, u.Remaining, u.Reset, u.Routes = rep.Limit, rep.Used, rep.Remaining, rep.Reset_, rep.Routes
	return u
}
