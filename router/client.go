package router

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// DialOptions configure a Client. Zero values take the defaults in brackets.
type DialOptions struct {
	// CallTimeout bounds one RPC [5s]; at least MinCallTimeout.
	CallTimeout time.Duration
	// RefreshInterval is how often the client reads the ring view and the
	// config snapshot [3s]; at least MinRefreshInterval. Negative: never in
	// the background (call Client.Refresh).
	RefreshInterval time.Duration
	// MaxBatch bounds the charges of one call to an owner [512], at most
	// MaxMaxBatch; MaxInflight the calls of one kind (charges, refunds) in
	// flight to one owner [4]. Calls beyond it are coalesced into the next
	// batch.
	MaxBatch, MaxInflight int
	// Dialer, when set, opens connections to nodes (tests, custom networks).
	Dialer func(ctx context.Context, addr string) (net.Conn, error)
	// Token is the cluster's RPC token (the nodes' --rpc-token), sent with
	// every call; required when the nodes have one.
	Token string
	// TLS, when set, dials nodes with TLS; required when the nodes run with
	// --rpc-tls-*, and then it must present a client certificate from the
	// cluster's CA: TLSFiles.ClientConfig builds it from PEM files. Nil
	// dials in plaintext.
	TLS    *tls.Config
	Logger *slog.Logger
	// Gateway sends every call to the seeds (a load balancer's address, a
	// Kubernetes Service), whose node forwards it to the account's owner,
	// instead of to the owner itself: for a program that can reach the
	// cluster only through that address, not the nodes' own RPC addresses
	// (another network, another Kubernetes cluster). Each call takes one
	// more hop (the node that answers forwards it once, never more), and
	// the ring view and the config are read from the seeds only. A call
	// the seed did not answer is not retried at another seed (its outcome
	// is unknown: ErrUnavailable); the next call starts at the next seed.
	// Needs nodes of this build or later: older ones answer WrongOwner to
	// a forwarded refund or usage read, which is ErrUnavailable naming it.
	Gateway bool
}

// ClientStats are a Client's counters.
type ClientStats struct {
	// WrongOwner counts answers naming another owner; Unreachable calls to
	// an owner (with Gateway: to a seed) that failed; Refreshes ring views
	// read.
	WrongOwner, Unreachable, Refreshes atomic.Int64
}

// Client is the embedded client: it learns the ring from any node, picks
// each account's owner itself, and calls the owner directly over gRPC with
// the same coalescing as nodes (so a charge takes one hop, not two). It
// follows WrongOwner answers and never decides anything itself: when no
// owner answers, the error is ErrUnavailable.
//
// It implements Charger and ConfigSource, so Middleware(FrontOptions{Charger:
// c, Config: c}) runs the HTTP front inside a Go program. Its methods are
// safe for concurrent use.
//
// With DialOptions.Gateway it sends every call to a seed instead, whose
// node forwards it to the owner.
//
// Make it with Dial: a zero Client answers every call with an error that
// says so. After Close, calls answer ErrClosed.
type Client struct {
	opts  DialOptions
	seeds []string
	peers *peers
	stats ClientStats
	// gateway is the index in seeds of the seed calls go to, with
	// DialOptions.Gateway: moved on when one does not answer.
	gateway atomic.Uint32
	// configTurn turns the order in which config reads ask the nodes
	// (refreshConfig).
	configTurn atomic.Uint32

	view atomic.Pointer[clientView]
	snap atomic.Pointer[snapshot.Snapshot]
	// refreshing holds a token while the ring view is being read (a lock a
	// caller can stop waiting for when its context ends): many calls that
	// fail together cause one refresh.
	refreshing chan struct{}

	// bg lives until Close. behind runs the ring view refreshes a call
	// leaves behind when its caller's context ended before its owner
	// answered (refreshBehind), one at a time (behindOn); Close waits for
	// them.
	bg       context.Context
	behind   goroutines
	behindOn atomic.Bool

	cancel context.CancelFunc
	done   chan struct{}
	closed atomic.Bool

	// calls counts the Charge, Refund and Usage calls in flight, for
	// Shutdown, which closes it: no call begins then.
	calls counter
}

// clientView is one ring view, as a node answered it (immutable).
type clientView struct {
	epoch   uint64
	layout  ring.Layout // only PartitionCount is used
	members []*pb.Member
	owners  []int32 // partition -> index into members, -1: none
}

// owner returns the RPC address of account's owner in v.
func (v *clientView) owner(account string) (string, bool) {
	if v == nil || len(v.owners) == 0 {
		return "", false
	}
	i := v.owners[v.layout.Partition(account)]
	if i < 0 || int(i) >= len(v.members) {
		return "", false
	}
	return v.members[i].RpcAddr, true
}

// Dial connects to a cluster with default options: see DialOptions.Dial.
func Dial(ctx context.Context, seeds ...string) (*Client, error) {
	return DialOptions{}.Dial(ctx, seeds...)
}

// Dial learns the ring from the first seed (RPC address, host:port) that
// answers and reads the config snapshot; ctx bounds only that. No seeds, an
// empty one, one that is not host:port with a port from 1 to 65535 (unless
// a Dialer is set), negative options (but RefreshInterval), durations
// under MinCallTimeout and MinRefreshInterval, a Token with spaces or
// non-ASCII characters, or a nil ctx are ErrInvalidRequest, naming what is
// wrong. Seeds are
// asked in turn, the next one as soon as the one before fails or has not
// answered within a fraction of a second, so a hung seed does not use up
// ctx; the first answer wins. When ctx ends first, the error wraps ctx's
// (errors.Is(err, context.DeadlineExceeded)); when a node turned the
// client away (a wrong Token, nodes of another version) it wraps
// ErrRejected, and when no node answered, ErrUnavailable. When the nodes
// answer but none has a config yet (none has reached the ledger), Dial
// succeeds: Charge, Refund and Usage work, Snapshot is nil and the
// middleware answers quota-unavailable until a refresh finds one.
// Afterwards the client refreshes both every RefreshInterval, from any
// node it knows.
func (o DialOptions) Dial(ctx context.Context, seeds ...string) (*Client, error) {
	if ctx == nil {
		return nil, errNilContext
	}
	if len(seeds) == 0 {
		return nil, fmt.Errorf("%w: Dial needs at least one seed (a node's RPC address, host:port, its --rpc-addr)", ErrInvalidRequest)
	}
	for _, s := range seeds {
		if err := checkSeed(s, o.Dialer != nil); err != nil {
			return nil, err
		}
	}
	if o.CallTimeout < 0 || o.MaxBatch < 0 || o.MaxInflight < 0 {
		return nil, fmt.Errorf("%w: DialOptions must not be negative (but RefreshInterval): CallTimeout %s, MaxBatch %d, MaxInflight %d; 0 takes the default",
			ErrInvalidRequest, o.CallTimeout, o.MaxBatch, o.MaxInflight)
	}
	if o.MaxBatch > MaxMaxBatch {
		return nil, fmt.Errorf("%w: DialOptions.MaxBatch %d: want at most %d (router.MaxMaxBatch): a larger batch may pass gRPC's 4 MiB message limit", ErrInvalidRequest, o.MaxBatch, MaxMaxBatch)
	}
	if (o.CallTimeout > 0 && o.CallTimeout < MinCallTimeout) || (o.RefreshInterval > 0 && o.RefreshInterval < MinRefreshInterval) {
		// 5 is 5ns, not 5s: every call would time out, and a refresh loop
		// would spin on the nodes.
		return nil, fmt.Errorf("%w: DialOptions.CallTimeout %s and RefreshInterval %s: want at least %s and %s (0 takes the defaults, 5s and 3s); durations are time.Duration, so 5 is 5ns: write 5 * time.Second",
			ErrInvalidRequest, o.CallTimeout, o.RefreshInterval, MinCallTimeout, MinRefreshInterval)
	}
	if o.Token != "" && strings.ContainsFunc(o.Token, func(r rune) bool { return r <= ' ' || r > '~' }) {
		// gRPC sends only printable ASCII in metadata: every call would
		// fail as if the node were down.
		return nil, fmt.Errorf("%w: DialOptions.Token holds spaces, a line break or characters outside printable ASCII (a file read with its final newline? strings.TrimSpace it): the nodes' --rpc-token is sent as it is", ErrInvalidRequest)
	}
	setDefaultDuration(&o.CallTimeout, 5*time.Second)
	setDefaultDuration(&o.RefreshInterval, 3*time.Second)
	if o.MaxBatch == 0 {
		o.MaxBatch = 512
	}
	if o.MaxInflight == 0 {
		o.MaxInflight = 4
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	bg, cancel := context.WithCancel(context.Background())
	c := &Client{opts: o, seeds: slices.Clone(seeds), bg: bg, cancel: cancel, done: make(chan struct{}), refreshing: make(chan struct{}, 1)}
	c.peers = newPeers(bg, peerOptions{maxInflight: o.MaxInflight, maxBatch: o.MaxBatch, callTimeout: o.CallTimeout,
		dialer: o.Dialer, epoch: c.epoch, hops: 0, route: o.Gateway, token: o.Token, tls: o.TLS})
	if err := c.refreshView(ctx, ""); err != nil {
		close(c.done)
		c.Close()
		return nil, dialError(ctx, ExplainTLSMismatch(err, o.TLS != nil))
	}
	if err := c.refreshConfig(ctx); err != nil {
		if ctxEnded(ctx) != nil { // NB: not ctx.Err(): its deadline may have passed before its timer fired
			// ctx ended between the ring view and the config: Dial did not
			// do what it says.
			close(c.done)
			c.Close()
			return nil, dialError(ctx, err)
		}
		// The nodes answered the ring view but gave no config (none has
		// reached the ledger yet; a node too old to serve it): Charge,
		// Refund and Usage work, and Snapshot is nil until a refresh finds
		// one.
		c.opts.Logger.Warn("no config snapshot yet; the middleware answers quota-unavailable until one arrives", "err", err)
	}
	if o.RefreshInterval > 0 {
		go c.loop(bg)
	} else {
		close(c.done)
	}
	return c, nil
}

// checkSeed refuses a seed no node can be at: empty, or (without a custom
// Dialer, which gets seeds as they are) not host:port. Retrying cannot fix
// it, so it is ErrInvalidRequest, not ErrUnavailable.
func checkSeed(seed string, customDialer bool) error {
	const want = "want a node's RPC address, host:port (its --rpc-addr, such as quotad-0.quotad:7400)"
	switch {
	case strings.TrimSpace(seed) == "":
		return fmt.Errorf("%w: Dial seed %q is empty: %s", ErrInvalidRequest, seed, want)
	case customDialer:
		return nil
	case strings.Contains(seed, "://"):
		return fmt.Errorf("%w: Dial seed %q is a URL: %s", ErrInvalidRequest, seed, want)
	}
	if strings.TrimSpace(seed) != seed {
		return fmt.Errorf("%w: Dial seed %q has spaces around it: %s", ErrInvalidRequest, seed, want)
	}
	if _, port, err := net.SplitHostPort(seed); err != nil || port == "" {
		return fmt.Errorf("%w: Dial seed %q: %s", ErrInvalidRequest, seed, want)
	} else if !validPort(port) {
		return fmt.Errorf("%w: Dial seed %q: port %q is not a number from 1 to 65535: %s", ErrInvalidRequest, seed, port, want)
	}
	return nil
}

// errNilContext answers a call made with a nil context.Context, as net/http
// refuses one.
var errNilContext = fmt.Errorf("%w: a nil Context: pass context.Background() or a request's context", ErrInvalidRequest)

// The least DialOptions.CallTimeout and RefreshInterval Dial takes.
const (
	MinCallTimeout     = 10 * time.Millisecond
	MinRefreshInterval = 100 * time.Millisecond
)

// Close stops the refresh loop and closes the connections. Later calls, and
// calls in flight that were not sent yet (queued behind others to their
// owner), answer ErrClosed: nothing was applied. A call already sent when
// Close cut it got no answer, so its owner may have applied it: it answers
// ErrUnavailable, the outcome unknown, as any call its owner did not answer
// (retry it on a new Client, with the same event id when it has ClientID).
// Closing again does nothing. Shutdown closes without cutting calls.
func (c *Client) Close() error {
	if c.peers == nil {
		return errNotDialed
	}
	if c.closed.Swap(true) {
		return nil
	}
	c.cancel()
	<-c.done
	c.behind.wait() // they end now: c.bg is canceled
	return c.peers.close()
}

// Shutdown closes c gracefully, as http.Server's Shutdown closes a server:
// calls begun from now on answer ErrClosed (nothing was applied), and it
// waits until every Charge, Refund and Usage in flight has its answer, and
// until the refunds the client sends by itself are done (a charge its
// owner applied after the caller's context had ended: see Charge), then
// closes as Close does. A program stopping calls it after its HTTP
// server's Shutdown, so that the middleware's refunds of requests served
// meanwhile are sent. If ctx ends first, Shutdown returns its error and
// leaves the calls in flight to go on; Close then cuts them (those already
// sent answer ErrUnavailable, their outcome unknown).
func (c *Client) Shutdown(ctx context.Context) error {
	if err := c.usable(ctx); err != nil {
		if errors.Is(err, ErrClosed) {
			return nil // closed already
		}
		return err
	}
	c.calls.close()
	if n, err := c.calls.wait(ctx); err != nil {
		return fmt.Errorf("router: Shutdown: %d calls still in flight when the context ended (%w); Close cuts them", n, err)
	}
	if err := c.peers.senders.waitIdle(ctx); err != nil {
		return fmt.Errorf("router: Shutdown: the client's own refunds of charges whose callers left were still on their way when the context ended (%w); Close cuts them", err)
	}
	return c.Close()
}

// begin is usable, and counts the call in flight for Shutdown: a nil error
// must be paired with c.calls.done().
func (c *Client) begin(ctx context.Context) error {
	if err := c.usable(ctx); err != nil {
		return err
	}
	if !c.calls.add() {
		return ErrClosed
	}
	return nil
}

// usable is nil when c can call nodes (made by Dial and not closed) with
// ctx.
func (c *Client) usable(ctx context.Context) error {
	switch {
	case ctx == nil:
		return errNilContext
	case c.peers == nil:
		return errNotDialed
	case c.closed.Load():
		return ErrClosed
	}
	return nil
}

// Stats are the client's counters.
func (c *Client) Stats() *ClientStats { return &c.stats }

// Snapshot is the last config snapshot read from a node, or nil (ConfigSource).
func (c *Client) Snapshot() *snapshot.Snapshot { return c.snap.Load() }

// Epoch is the epoch of the client's ring view.
func (c *Client) Epoch() uint64 { return c.epoch() }

func (c *Client) epoch() uint64 {
	if v := c.view.Load(); v != nil {
		return v.epoch
	}
	return 0
}

// Refresh reads the ring view and the config snapshot once; the background
// loop calls it every RefreshInterval.
func (c *Client) Refresh(ctx context.Context) error {
	if err := c.usable(ctx); err != nil {
		return err
	}
	err := errors.Join(c.refreshView(ctx, ""), c.refreshConfig(ctx))
	if err != nil && c.closed.Load() {
		return ErrClosed // Close ran meanwhile: that is why, not the nodes
	}
	return err
}

func (c *Client) loop(ctx context.Context) {
	defer close(c.done)
	t := time.NewTicker(c.opts.RefreshInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := c.Refresh(ctx); err != nil && ctx.Err() == nil {
				c.opts.Logger.Warn("refresh failed; keeping the last ring view and config", "err", err)
			}
		}
	}
}

// Charge decides req at its account's owner.
//
// An empty EventID gets a random one here (not at the owner), so that the
// one retry the client makes when an owner stops answering and the ring
// names another carries the same id, and the ledger bills the event once
// even if both owners applied it. An EventID without ClientID is refused:
// see ChargeRequest.
//
// Check err before the result: with an error the result is zero and its
// Reason is shard.Undecided (never Accepted). Errors are ErrUnavailable
// (not decided now, or the outcome unknown: retry; with ClientID, with the
// same EventID, which is charged once; without, a retry is a new charge),
// ErrInternal, ErrInvalidRequest (an empty Account, Units < 0 or above
// shard.MaxUnits, an EventID without ClientID or longer than MaxEventID,
// an Account, EventID, Route or Key that is not valid UTF-8: nothing was
// sent),
// ErrRejected (the owner turned the call away: a wrong RPC token, say;
// nothing was applied, and retrying cannot help), ErrClosed (the client was
// closed before the charge was sent: nothing was applied; one Close cut
// after it was sent is ErrUnavailable, see Close), and ctx's error when ctx
// ended before anything was sent.
//
// Without an error the owner decided: Reason.Accepted, or a refusal. A
// refusal is final (Reason.Final: invalid, id_reused, replay_limit), passes with time
// (rate_limited, and quota_exceeded until the period renews:
// Decision.RetryIn says when), needs more units than time brings
// (quota_exceeded on used-up credits: RetryIn's ok is false, and so is
// Final), or is unknown_account (the owner's config lacks the account; one
// created seconds ago is loaded within a few seconds; not Final).
func (c *Client) Charge(ctx context.Context, req ChargeRequest) (ChargeResult, error) {
	if err := c.begin(ctx); err != nil {
		return ChargeResult{}, err
	}
	defer c.calls.done()
	if err := checkCharge(&req); err != nil {
		return ChargeResult{}, err
	}
	if req.EventID == "" {
		req.EventID, req.ClientID = madeEventID(), false
	}
	in := chargeToPB(&req)
	var res ChargeResult
	err := c.route(ctx, chargeOp(&req), req.Account, func(ctx context.Context, p *peer) (*pb.WrongOwner, error) {
		rep, err := p.charges.do(ctx, in)
		if err != nil {
			return nil, &rpcError{err}
		}
		if rep.WrongOwner != nil {
			return rep.WrongOwner, nil
		}
		res, err = resultFromPB(rep)
		return nil, err
	})
	if err != nil {
		return ChargeResult{}, err
	}
	return res, nil
}

// MaxEventID is the longest EventID Client.Charge sends, in bytes: as long
// as the HTTP front's longest Idempotency-Key (255), which becomes the event
// id. A longer one is ErrInvalidRequest.
const MaxEventID = 255

// MaxField is the longest Account, Route or Key Client.Charge sends, in
// bytes (accounts are at most 200, snapshot.MaxIDLen; routes are patterns;
// keys are key ids). With MaxBatch at most MaxMaxBatch, a batch stays
// under gRPC's 4 MiB message limit, past which the whole batch, other
// callers' charges with it, would be turned away.
const MaxField = 1024

// MaxMaxBatch is the largest DialOptions.MaxBatch.
const MaxMaxBatch = 1024

// checkCharge refuses what no owner could charge, before it is sent.
func checkCharge(req *ChargeRequest) error {
	switch {
	case req.Account == "":
		return fmt.Errorf("%w: ChargeRequest.Account is empty: name the account to charge", ErrInvalidRequest)
	case len(req.EventID) > MaxEventID:
		return fmt.Errorf("%w: ChargeRequest.EventID is %d bytes, more than %d (router.MaxEventID): use a shorter id (a hash of a longer one)",
			ErrInvalidRequest, len(req.EventID), MaxEventID)
	}
	if err := checkUTF8("ChargeRequest", "Account", req.Account, "EventID", req.EventID, "Route", req.Route, "Key", req.Key); err != nil {
		return err
	}
	for _, f := range []struct{ name, v string }{{"Account", req.Account}, {"Route", req.Route}, {"Key", req.Key}} {
		if len(f.v) > MaxField {
			return fmt.Errorf("%w: ChargeRequest.%s is %d bytes, more than %d (router.MaxField)", ErrInvalidRequest, f.name, len(f.v), MaxField)
		}
	}
	switch {
	case req.Units < 0 || req.Units > shard.MaxUnits:
		return fmt.Errorf("%w: ChargeRequest.Units is %d: it must be 0 (rate limited, not billed) to %d (shard.MaxUnits)",
			ErrInvalidRequest, req.Units, int64(shard.MaxUnits))
	case req.EventID != "" && !req.ClientID:
		return fmt.Errorf("%w: ChargeRequest.EventID %q is set without ClientID: set ClientID: true to make it an idempotency key "+
			"(a retry with it is charged and billed once), or leave EventID empty and the client makes a unique id", ErrInvalidRequest, req.EventID)
	case req.ClientID && req.EventID == "":
		return fmt.Errorf("%w: ChargeRequest.ClientID is set with an empty EventID: a retry could not be told from a new charge; "+
			"set EventID to the operation's idempotency key, or leave ClientID false and the client makes a unique id", ErrInvalidRequest)
	case req.ClientID && shard.ClientIDProblem(req.EventID) != "":
		return fmt.Errorf("%w: ChargeRequest.EventID %q cannot be an idempotency key: %s", ErrInvalidRequest, req.EventID, shard.ClientIDProblem(req.EventID))
	}
	return nil
}

// madeEventID is the id Charge makes for a request without one: "c" and
// 26 base32 letters, which shard.MadeIDShape refuses as a client id, so no
// idempotency key can name the charge.
func madeEventID() string { return "c" + rand.Text() }

// checkUTF8 refuses a string field of what (name, value pairs) that is not
// valid UTF-8, which gRPC cannot send (it failed as an unknown outcome at
// the owner, ErrUnavailable, on every retry), or that holds a NUL byte,
// which the ledger cannot store (the owner answers invalid).
func checkUTF8(what string, fields ...string) error {
	for i := 0; i+1 < len(fields); i += 2 {
		if !utf8.ValidString(fields[i+1]) {
			return fmt.Errorf("%w: %s.%s %q is not valid UTF-8, which the RPC cannot carry: send it as UTF-8 (or encode the bytes, in hex or base64)",
				ErrInvalidRequest, what, fields[i], fields[i+1])
		}
		if strings.IndexByte(fields[i+1], 0) >= 0 {
			return fmt.Errorf("%w: %s.%s %q holds a NUL byte, which the ledger cannot store: leave it out (or encode the bytes, in hex or base64)",
				ErrInvalidRequest, what, fields[i], fields[i+1])
		}
	}
	return nil
}

// checkRefund refuses what no owner could refund, before it is sent.
func checkRefund(req *RefundRequest) error {
	switch {
	case req.Account == "":
		return fmt.Errorf("%w: RefundRequest.Account is empty: name the account of the charge", ErrInvalidRequest)
	case req.EventID == "":
		return fmt.Errorf("%w: RefundRequest.EventID is empty: use the charge's ChargeResult.EventID (and its Receipt)", ErrInvalidRequest)
	case req.Replay && req.Receipt == nil:
		// Without the receipt a take-back cannot be told from another one,
		// so the retry this client makes after a silent owner (or a
		// caller's after ErrUnavailable) would take back a second replay,
		// and a retry that was served could lose its charge.
		return fmt.Errorf("%w: RefundRequest.Replay without a Receipt: send the Replayed answer's ChargeResult.Receipt with it (which makes it safe to retry)", ErrInvalidRequest)
	}
	if len(req.Account) > MaxField || len(req.EventID) > MaxEventID {
		return fmt.Errorf("%w: RefundRequest.Account is %d bytes and EventID %d: want at most %d and %d (router.MaxField, MaxEventID)",
			ErrInvalidRequest, len(req.Account), len(req.EventID), MaxField, MaxEventID)
	}
	return checkUTF8("RefundRequest", "Account", req.Account, "EventID", req.EventID)
}

// Refund refunds an event at its account's owner, once: a second refund
// answers shard.AlreadyRefunded. A generated id (a charge without ClientID)
// needs its Receipt: without it the owner answers shard.UnknownEvent
// although the charge stands (see RefundRequest). A receipt is refunded in
// its charge's month and the next only (shard.Refundable): later the owner
// answers shard.UnknownEvent, since the ledger may have pruned the event log
// of that month (quotad prune). Errors are as for Charge;
// after ErrUnavailable a retry of the same refund is safe.
func (c *Client) Refund(ctx context.Context, req RefundRequest) (shard.Decision, error) {
	if err := c.begin(ctx); err != nil {
		return shard.Decision{}, err
	}
	defer c.calls.done()
	if err := checkRefund(&req); err != nil {
		return shard.Decision{}, err
	}
	in := &pb.RefundRequest{Account: req.Account, EventId: req.EventID, Receipt: receiptToPB(req.Receipt), Attempt: req.Attempt, Replay: req.Replay}
	var d shard.Decision
	err := c.route(ctx, opRefund, req.Account, func(ctx context.Context, p *peer) (*pb.WrongOwner, error) {
		rep, err := p.refunds.do(ctx, in)
		if err != nil {
			return nil, &rpcError{err}
		}
		if rep.WrongOwner != nil {
			return rep.WrongOwner, nil
		}
		if e := rep.Error; e != nil {
			if e.Code == pb.Error_QUOTA_UNAVAILABLE {
				return nil, fmt.Errorf("%w: %s (at %s)", ErrUnavailable, e.Message, rep.Node)
			}
			return nil, fmt.Errorf("%w: %s (at %s)", ErrInternal, e.Message, rep.Node)
		}
		d, err = checkedDecisionFromPB(rep.Decision, rep.Node)
		return nil, err
	})
	if err != nil {
		return shard.Decision{}, err
	}
	return d, nil
}

// Usage reads an account's current period at its owner. An account the
// owner's config lacks answers Known false and no error (see UsageResult).
func (c *Client) Usage(ctx context.Context, account string) (UsageResult, error) {
	if err := c.begin(ctx); err != nil {
		return UsageResult{}, err
	}
	defer c.calls.done()
	if account == "" {
		return UsageResult{}, fmt.Errorf("%w: Usage needs an account", ErrInvalidRequest)
	}
	if err := checkUTF8("Usage", "account", account); err != nil {
		return UsageResult{}, err
	}
	var u UsageResult
	err := c.route(ctx, opUsage, account, func(ctx context.Context, p *peer) (*pb.WrongOwner, error) {
		ctx, cancel := context.WithTimeout(ctx, c.opts.CallTimeout)
		defer cancel()
		rep, err := p.client.Usage(ctx, &pb.UsageRequest{Epoch: c.epoch(), Account: account, Route: c.opts.Gateway})
		if err != nil {
			if ierr := usageFailed(account, p.addr, err); ierr != nil {
				return nil, ierr
			}
			return nil, &rpcError{err}
		}
		if rep.WrongOwner != nil {
			return rep.WrongOwner, nil
		}
		u = usageFromPB(rep)
		return nil, nil
	})
	if err != nil {
		return UsageResult{}, err
	}
	return u, nil
}

// op names a call in errors, with what the caller can do when its owner
// did not answer (silent), and when Close cut it after it was sent (closed).
type op struct{ name, silent, closed string }

// unanswered is the error a call sent that got no answer wraps:
// ErrUnavailable with ErrOutcomeUnknown (ErrUnavailable alone for a usage
// read, which changes nothing).
func (o op) unanswered() error {
	if o == opUsage {
		return ErrUnavailable
	}
	return errUnknownOutcome
}

const onNewClient = "on a new client (Dial one: this one is closed)"

var (
	opRefund = op{"refund", "the outcome is unknown: retrying the same refund is safe (a refund applies once)",
		"the outcome is unknown: retry the same refund " + onNewClient + "; a refund applies once"}
	opUsage = op{"usage", "retry", "retry " + onNewClient}
)

// chargeOp is the op of req (its EventID set).
func chargeOp(req *ChargeRequest) op {
	if req.ClientID {
		return op{"charge", fmt.Sprintf("the outcome is unknown: retry with the same event id %q", req.EventID),
			fmt.Sprintf("the outcome is unknown: retry with the same event id %q %s", req.EventID, onNewClient)}
	}
	return op{"charge", fmt.Sprintf("the outcome is unknown (the client's id for it was %q): another Charge is a new charge; "+
		"to retry safely, send an EventID with ClientID", req.EventID),
		fmt.Sprintf("the outcome is unknown (the client's id for it was %q): another Charge, %s, is a new charge; "+
			"to retry safely, send an EventID with ClientID", req.EventID, onNewClient)}
}

// rpcError marks a call that got no answer (the owner may or may not have
// applied it).
type rpcError struct{ err error }

func (e *rpcError) Error() string { return e.err.Error() }
func (e *rpcError) Unwrap() error { return e.err }

// route runs call at account's owner: the owner in the client's view; after
// WrongOwner, the owner that answer names (having refreshed the view from
// the node that answered); after no answer, once more at the owner a fresh
// view names if it is another node. At most maxAttempts calls, never a loop.
//
// When an attempt got no answer and the one after it at the new owner
// failed in any way (not sent, turned away, cut by Close), the first owner
// may still have applied the call: the error is ErrUnavailable, the outcome
// unknown, naming the first owner, never "not sent" or ErrClosed.
func (c *Client) route(ctx context.Context, o op, account string, call func(context.Context, *peer) (*pb.WrongOwner, error)) error {
	if c.opts.Gateway {
		return c.viaGateway(ctx, o, account, call)
	}
	sentTo := ""
	err := c.attempts(ctx, o, account, call, &sentTo)
	if err == nil || sentTo == "" {
		return err
	}
	then := o.silent
	if c.closed.Load() {
		then = o.closed
	}
	if cerr := ctxEnded(ctx); cerr != nil {
		return fmt.Errorf("%w: the owner of account %q at %s did not answer the %s, and the retry at the owner the ring names now failed (%v; %w); %s",
			o.unanswered(), account, sentTo, o.name, err, cerr, then)
	}
	return fmt.Errorf("%w: the owner of account %q at %s did not answer the %s, and the retry at the owner the ring names now failed (%v); %s",
		o.unanswered(), account, sentTo, o.name, err, then)
}

// attempts is route's loop. *sentTo is set to an owner it left without
// an answer, for another one the ring names.
func (c *Client) attempts(ctx context.Context, o op, account string, call func(context.Context, *peer) (*pb.WrongOwner, error), sentTo *string) error {
	if cerr := ctxEnded(ctx); cerr != nil {
		return fmt.Errorf("router: %s for account %q not sent: %w", o.name, account, cerr)
	}
	v := c.view.Load()
	target := ""
	refreshed := false
	for attempt := 0; attempt < maxAttempts; attempt++ {
		if cerr := ctxEnded(ctx); cerr != nil && attempt > 0 {
			// Following ownership (a refresh) used up the caller's time:
			// the next owner is not asked. Sent after the deadline, the call
			// was applied for a caller gone (a rate-limit token spent, the
			// charge taken back by this client only if that refund worked).
			// (route says the outcome is unknown when an earlier owner did
			// not answer: *sentTo.)
			return fmt.Errorf("router: %s for account %q not sent to the next owner: the caller's context ended while the client followed a change of owner (%w)", o.name, account, cerr)
		}
		if target == "" {
			addr, ok := v.owner(account)
			if !ok && !refreshed {
				refreshed = true
				c.refreshAfter(ctx, v, "", "")
				v = c.view.Load()
				addr, ok = v.owner(account)
			}
			if !ok {
				return fmt.Errorf("%w: no serving node owns account %q in the client's view (epoch %d); retry", ErrUnavailable, account, v.epoch)
			}
			target = addr
		}
		p, err := c.peers.get(target)
		if err != nil {
			return c.peerError(err)
		}
		wo, err := call(ctx, p)
		var rpcErr *rpcError
		switch {
		case err == nil && wo == nil:
			return nil
		case err != nil && !errors.As(err, &rpcErr):
			return err // the owner answered with an error
		case err != nil && c.closed.Load():
			return closedError(o, account, target, rpcErr.err)
		case c.closed.Load():
			return ErrClosed // WrongOwner answered: nothing was applied
		case err != nil && rejected(rpcErr.err):
			return rejectedError(account, target, o.name, rpcErr.err)
		case err != nil:
			var ns *notSentError
			if errors.As(err, &ns) {
				// Still queued when ctx ended: never sent, so not applied.
				return fmt.Errorf("router: %s for account %q not sent: %w", o.name, account, ns.err)
			}
			c.stats.Unreachable.Add(1)
			if cerr := ctxEnded(ctx); cerr != nil {
				// The caller left before the owner answered: read the ring
				// anyway, or calls with deadlines shorter than CallTimeout
				// would go to a hung owner until the next refresh (never,
				// with RefreshInterval < 0), each waiting its whole deadline.
				c.refreshBehind(v, target)
				return fmt.Errorf("%w: the owner of account %q at %s did not answer the %s before the caller's context ended (%w); %s",
					o.unanswered(), account, target, o.name, cerr, o.silent)
			}
			if !refreshed {
				refreshed = true
				c.refreshAfter(ctx, v, "", target)
				if c.view.Load() == v && ctxEnded(ctx) != nil {
					c.refreshBehind(v, target) // the caller's context ended before the refresh could
				}
				v = c.view.Load()
				if addr, ok := v.owner(account); ok && addr != target {
					if !notSent(rpcErr.err) {
						*sentTo = target // it may have applied the call
					}
					target = addr
					continue
				}
			}
			if notSent(rpcErr.err) {
				hint := ""
				if !slices.Contains(c.seeds, target) {
					// The seeds answered: a program that reaches the
					// cluster only through them (a load balancer) fails
					// like this for every account another node owns.
					hint = "; if this program cannot reach the nodes' own addresses, only the seeds (a load balancer), dial with DialOptions.Gateway"
				}
				return fmt.Errorf("%w: the owner of account %q at %s could not be reached (%v); the %s was not sent to it: retry%s",
					ErrUnavailable, account, target, rpcErr.err, o.name, hint)
			}
			return fmt.Errorf("%w: the owner of account %q at %s did not answer the %s (%v); %s",
				o.unanswered(), account, target, o.name, rpcErr.err, o.silent)
		default:
			c.stats.WrongOwner.Add(1)
			c.refreshAfter(ctx, v, target, "")
			v = c.view.Load()
			target = wo.OwnerRpc // empty: nobody serves it in that node's view; look in the fresh one
		}
	}
	return fmt.Errorf("%w: ownership of account %q is moving; retry", ErrUnavailable, account)
}

// viaGateway is route with DialOptions.Gateway: call runs at a seed, whose
// node forwards it to account's owner (the batch is marked Route). A seed
// that could not be reached, or whose connection was not made within the
// call's deadline (the call certainly not sent), gives way to the
// next one, each seed once. A seed that took the call and did not answer
// may have forwarded it: the error is ErrUnavailable with the outcome
// unknown, and the next call starts at the next seed. A WrongOwner answer
// (the ring moved under the node as it decided, or a node older than
// Route for refunds and usage reads) is asked again at the same seed, at
// most maxAttempts times.
func (c *Client) viaGateway(ctx context.Context, o op, account string, call func(context.Context, *peer) (*pb.WrongOwner, error)) error {
	if cerr := ctxEnded(ctx); cerr != nil {
		return fmt.Errorf("router: %s for account %q not sent: %w", o.name, account, cerr)
	}
	first := c.gateway.Load()
	n := uint32(len(c.seeds))
	next := func(i uint32) { c.gateway.CompareAndSwap(i, (i+1)%n) }
	var unreached []error
	var wrong *pb.WrongOwner
	for i, tried, wrongs := first%n, uint32(0), 0; tried < n && wrongs < maxAttempts; {
		if cerr := ctxEnded(ctx); cerr != nil && (tried > 0 || wrongs > 0) {
			// Every earlier try was not sent or answered WrongOwner: none applied.
			return fmt.Errorf("router: %s for account %q not sent: the caller's context ended before the next try (%w)", o.name, account, cerr)
		}
		seed := c.seeds[i]
		p, err := c.peers.get(seed)
		if err != nil {
			return c.peerError(err)
		}
		wo, err := call(ctx, p)
		var rpcErr *rpcError
		var ns *notSentError
		switch {
		case err == nil && wo == nil:
			return nil
		case err != nil && !errors.As(err, &rpcErr):
			return err // the owner (or the seed forwarding) answered with an error
		case err != nil && c.closed.Load():
			return closedError(o, account, seed, rpcErr.err)
		case c.closed.Load():
			return ErrClosed // WrongOwner answered: nothing was applied
		case err != nil && rejected(rpcErr.err):
			return rejectedError(account, seed, o.name, rpcErr.err)
		case err != nil && errors.As(err, &ns):
			return fmt.Errorf("router: %s for account %q not sent: %w", o.name, account, ns.err)
		case err != nil && notSent(rpcErr.err):
			c.stats.Unreachable.Add(1)
			unreached = append(unreached, fmt.Errorf("%s: %w", seed, rpcErr.err))
			next(i)
			i, tried = (i+1)%n, tried+1
			continue
		case err != nil:
			c.stats.Unreachable.Add(1)
			next(i)
			if cerr := ctxEnded(ctx); cerr != nil {
				return fmt.Errorf("%w: the seed %s did not answer the %s for account %q before the caller's context ended (%w); %s",
					o.unanswered(), seed, o.name, account, cerr, o.silent)
			}
			return fmt.Errorf("%w: the seed %s did not answer the %s for account %q (%v); %s",
				o.unanswered(), seed, o.name, account, rpcErr.err, o.silent)
		default:
			c.stats.WrongOwner.Add(1)
			wrong, wrongs = wo, wrongs+1
		}
	}
	if wrong == nil {
		return fmt.Errorf("%w: no seed could be reached, so the %s for account %q was not sent: retry (%w)",
			ErrUnavailable, o.name, account, errors.Join(unreached...))
	}
	return fmt.Errorf("%w: the seed answered the %s for account %q with WrongOwner (owner %q at %q) although the call asked it to forward: "+
		"ownership is moving (retry), or the nodes run a build older than this client's that does not forward it (upgrade them, or dial without Gateway)",
		ErrUnavailable, o.name, account, wrong.GetOwnerId(), wrong.GetOwnerRpc())
}

// usageFailed is ErrInternal when err, a usage read's failure, is the node
// at addr answering that it failed (gRPC Internal: the owner's engine, or
// a node forwarding it for a Gateway client), as a charge's failure at its
// owner is; nil for any other error. It was "did not answer" with
// ErrUnavailable, the owner counted unreachable and the ring read again.
//
// A node's own Unavailable answer (nodeAnswered: held after a pause,
// handing the account over) is ErrUnavailable saying it answered: it read
// "did not answer", counted the node unreachable and read the ring again.
func usageFailed(account, addr string, err error) error {
	st, ok := status.FromError(err)
	switch {
	case !ok:
		return nil
	case st.Code() == codes.Internal:
		return fmt.Errorf("%w: %s failed the usage read of account %q: %s", ErrInternal, addr, account, st.Message())
	case st.Code() == codes.Unavailable && strings.HasPrefix(st.Message(), nodeAnswered):
		return fmt.Errorf("%w: %s cannot read the usage of account %q now (%s); retry", ErrUnavailable, addr, account, strings.TrimPrefix(st.Message(), nodeAnswered))
	}
	return nil
}

// closedError is the error of a call to account's owner at addr that Close
// cut (err, how it failed). Certainly never sent (still queued, or not
// connected yet): ErrClosed, nothing was applied. Otherwise the owner may
// have applied it: ErrUnavailable with an unknown outcome, as for any call
// without an answer; ErrClosed would read as "nothing happened, give up",
// and a charge the owner applied would stand unrefunded.
func closedError(o op, account, addr string, err error) error {
	var ns *notSentError
	if errors.As(err, &ns) || notSent(err) {
		return fmt.Errorf("%w: the %s for account %q was not sent, so nothing was applied", ErrClosed, o.name, account)
	}
	return fmt.Errorf("%w: the client was closed before the owner of account %q at %s answered the %s (%v); %s",
		o.unanswered(), account, addr, o.name, err, o.closed)
}

// peerError is the error for a connection the client could not get.
func (c *Client) peerError(err error) error {
	if errors.Is(err, errClosed) || c.closed.Load() {
		return ErrClosed
	}
	return fmt.Errorf("%w: %v", ErrUnavailable, err)
}

// rejected reports whether err, a failed call, is the node turning the call
// away before any handler ran (see ErrRejected): an answer, not silence, so
// neither the outcome is unknown nor another attempt of any use.
func rejected(err error) bool {
	st, ok := status.FromError(err)
	if !ok {
		return false
	}
	switch st.Code() {
	case codes.Unauthenticated, codes.PermissionDenied, codes.Unimplemented, codes.ResourceExhausted, codes.InvalidArgument:
		return true
	}
	return false
}

// rejectedError is ErrRejected for the call (what) on account's owner at
// addr, keeping err (its gRPC status) in the chain.
func rejectedError(account, addr, what string, err error) error {
	return fmt.Errorf("%w: %s refused the %s for account %q (%w); nothing was applied, and every call is refused alike until an operator fixes what it names (the RPC token, the versions of the nodes)",
		ErrRejected, addr, what, account, err)
}

// notSent reports whether err, a failed call, certainly never reached the
// node: gRPC could not connect (refused, no route, the Dialer's error), or
// the call's deadline came while it waited for a connection still being
// made (an address that takes the TCP connection and never answers, a
// blackholed one: gRPC had picked no transport, so it opened no stream),
// so the call was not written to any connection. Only this client's own
// transport's errors count ("connection error: ...", "... while waiting for
// connections to become ready"), not a node's answer quoting one (a seed
// that could not reach the owner of a usage read it forwarded for a
// Gateway client: that seed took the call).
func notSent(err error) bool {
	st, ok := status.FromError(err)
	if !ok {
		return false
	}
	msg := strings.ToLower(st.Message())
	switch st.Code() {
	case codes.Unavailable:
		return strings.HasPrefix(msg, "connection error") && strings.Contains(msg, "error while dialing")
	case codes.DeadlineExceeded, codes.Canceled:
		return strings.HasPrefix(msg, "context ") && strings.HasSuffix(msg, " while waiting for connections to become ready")
	}
	return false
}

// refreshAfter reads a new ring view unless another call replaced seen
// meanwhile. It asks prefer first and avoid last.
func (c *Client) refreshAfter(ctx context.Context, seen *clientView, prefer, avoid string) {
	if !c.lockRefresh(ctx) {
		return // the caller's deadline came first; it goes on with the view it has
	}
	defer c.unlockRefresh()
	if c.view.Load() != seen {
		return
	}
	if err := c.refreshViewLocked(ctx, prefer, avoid); err != nil {
		c.opts.Logger.Warn("ring view refresh failed", "err", err)
	}
}

// refreshBehind is refreshAfter(seen, avoid) in the background, for a call
// whose caller's context ended before its owner at avoid answered (or
// before the refresh after it was done), so that the next call goes to the
// owner a fresh view names. At most one runs at a time, bounded by
// CallTimeout; Close cancels it and waits for it.
func (c *Client) refreshBehind(seen *clientView, avoid string) {
	if c.closed.Load() || !c.behindOn.CompareAndSwap(false, true) {
		return
	}
	c.behind.start(func() {
		defer c.behindOn.Store(false)
		ctx, cancel := context.WithTimeout(c.bg, c.opts.CallTimeout)
		defer cancel()
		c.refreshAfter(ctx, seen, "", avoid)
	})
}

func (c *Client) refreshView(ctx context.Context, prefer string) error {
	if !c.lockRefresh(ctx) {
		return fmt.Errorf("router: ring view refresh: %w", ctx.Err())
	}
	defer c.unlockRefresh()
	return c.refreshViewLocked(ctx, prefer, "")
}

// lockRefresh takes the refresh token, or gives up when ctx ends first.
func (c *Client) lockRefresh(ctx context.Context) bool {
	select {
	case c.refreshing <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

func (c *Client) unlockRefresh() { <-c.refreshing }

// refreshViewLocked asks prefer, then the known members, then the seeds
// (firstAnswer), and keeps the first answer. REQUIRES: the refresh token
// (lockRefresh).
func (c *Client) refreshViewLocked(ctx context.Context, prefer, avoid string) error {
	v, err := firstAnswer(ctx, c.sources(prefer, avoid), c.readView)
	if err != nil {
		return fmt.Errorf("router: no node gave its ring view: %w", err)
	}
	c.view.Store(v)
	c.stats.Refreshes.Add(1)
	c.peers.forget(c.wanted, time.Now())
	return nil
}

// askStagger is how long firstAnswer waits for one node before it asks the
// next one too: far longer than a healthy node takes to answer (a read of
// memory, one round trip), so a healthy cluster gets one call per refresh,
// and far shorter than CallTimeout, so a node that accepts connections and
// never answers (SIGSTOPped, overloaded) costs a refresh this much rather
// than the caller's whole deadline.
const askStagger = 250 * time.Millisecond

// firstAnswer asks addrs in order, staggered: the next one when the last
// one asked failed, or has not answered within askStagger. The first
// answer wins and the calls still out are canceled; it returns when they
// have ended (they end with their context), so no call outlives it. When
// every node failed, the error joins theirs; when ctx ended first, it wraps
// ctx's error.
func firstAnswer[T any](ctx context.Context, addrs []string, ask func(context.Context, string) (T, error)) (T, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type answer struct {
		v   T
		err error
	}
	answers := make(chan answer, len(addrs)) // buffered: a call that lost never blocks
	next, out := 0, 0
	askNext := func() {
		addr := addrs[next]
		next, out = next+1, out+1
		go func() {
			v, err := ask(ctx, addr)
			answers <- answer{v, err}
		}()
	}
	// drain waits for the calls still out once ctx is canceled.
	drain := func() {
		cancel()
		for ; out > 0; out-- {
			<-answers
		}
	}
	var zero T
	if len(addrs) == 0 {
		return zero, errors.New("no node to ask")
	}
	var errs []error
	stagger := time.NewTimer(askStagger)
	defer stagger.Stop()
	askNext()
	for {
		select {
		case a := <-answers:
			out--
			if a.err == nil {
				drain()
				return a.v, nil
			}
			errs = append(errs, a.err)
			if next < len(addrs) && ctx.Err() == nil {
				askNext()
				stagger.Reset(askStagger)
			} else if out == 0 {
				if cerr := ctxEnded(ctx); cerr != nil {
					return zero, fmt.Errorf("%w: %w", cerr, errors.Join(errs...))
				}
				return zero, errors.Join(errs...)
			}
		case <-stagger.C:
			if next < len(addrs) {
				askNext()
				stagger.Reset(askStagger)
			}
		case <-ctx.Done():
			cerr := ctx.Err()
			drain()
			asked := strings.Join(addrs[:next], ", ")
			if len(errs) == 0 {
				return zero, fmt.Errorf("%w before any answer (asked %s)", cerr, asked)
			}
			return zero, fmt.Errorf("%w before an answer (asked %s): %w", cerr, asked, errors.Join(errs...))
		}
	}
}

// wanted reports whether the client may call addr: a member of its view or
// a seed. Connections to other addresses are closed after a grace.
func (c *Client) wanted(addr string) bool {
	if v := c.view.Load(); v != nil && slices.ContainsFunc(v.members, func(m *pb.Member) bool { return m.RpcAddr == addr }) {
		return true
	}
	return slices.Contains(c.seeds, addr)
}

// sources lists the addresses to ask, each once: prefer, the members of the
// current view and the seeds, but not avoid: a node whose call just went
// unanswered for CallTimeout, which asked again would keep the caller
// waiting that long once more (a charge to a hung single node took twice
// CallTimeout).
func (c *Client) sources(prefer, avoid string) []string {
	seen := map[string]bool{"": true, avoid: true}
	var out []string
	add := func(a string) {
		if !seen[a] {
			seen[a] = true
			out = append(out, a)
		}
	}
	if c.opts.Gateway {
		// The members' own addresses are out of reach (that is why): each
		// would cost a refresh askStagger before the seeds are asked.
		for i := range c.seeds {
			add(c.seeds[(int(c.gateway.Load())+i)%len(c.seeds)])
		}
		return out
	}
	add(prefer)
	if v := c.view.Load(); v != nil {
		for _, m := range v.members {
			add(m.RpcAddr)
		}
	}
	for _, s := range c.seeds {
		add(s)
	}
	return out
}

// ringHash is how a RingView says accounts map to partitions.
const ringHash = "xxhash64 % partition_count"

func (c *Client) readView(ctx context.Context, addr string) (*clientView, error) {
	p, err := c.peers.get(addr)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, c.opts.CallTimeout)
	defer cancel()
	rep, err := p.client.RingView(ctx, &pb.RingViewRequest{})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", addr, err)
	}
	if rep.Hash != ringHash || rep.PartitionCount == 0 || (len(rep.Owners) != 0 && len(rep.Owners) != int(rep.PartitionCount)) {
		return nil, fmt.Errorf("%s: a ring view this client cannot read (hash %q, %d partitions, %d owners)", addr, rep.Hash, rep.PartitionCount, len(rep.Owners))
	}
	return &clientView{epoch: rep.Epoch, layout: ring.Layout{PartitionCount: int(rep.PartitionCount)}, members: rep.Members, owners: rep.Owners}, nil
}

// maxConfigBytes bounds the config snapshot the client takes from a node
// (about 200 bytes an account with a key: millions of accounts).
const maxConfigBytes = 1 << 30

// refreshConfig reads the config snapshot from the first node that has one
// (firstAnswer, starting at the next node each read), sending the version
// held so an unchanged config costs no bytes. A newer version replaces the
// held snapshot. An older one is a node that lags (its ledger down, it
// serves the config it last read: a key revoked since would work again
// through this client), so the next node is asked; it is taken only when
// no node answered the version held or a newer one (a ledger rebuilt from
// scratch starts again lower).
func (c *Client) refreshConfig(ctx context.Context) error {
	// NB: the snapshot is one message, past gRPC's default 4 MiB limit on
	// a received one from some 20,000 accounts with a key each.
	known := int64(-1) // none: a ledger whose config never changed is at version 0, which "unchanged" answered
	held := c.snap.Load()
	if held != nil {
		known = held.Version
	}
	var olderMu sync.Mutex    // protects older
	var older *pb.ConfigReply // the newest answer older than held
	// Each read starts at the next node: a node cut off from its ledger
	// answers "unchanged" to the version it last read, and every client
	// asked that one first (the members in order), so a key revoked since
	// worked through every embedded client for the whole outage. Turning,
	// a client finds the newer version within as many reads as nodes.
	srcs := c.sources("", "")
	if n := len(srcs); n > 1 {
		turn := int(c.configTurn.Add(1)-1) % n
		srcs = append(srcs[turn:], srcs[:turn]...)
	}
	rep, err := firstAnswer(ctx, srcs, func(ctx context.Context, addr string) (*pb.ConfigReply, error) {
		p, err := c.peers.get(addr)
		if err != nil {
			return nil, err
		}
		ctx, cancel := context.WithTimeout(ctx, c.opts.CallTimeout)
		defer cancel()
		rep, err := p.client.Config(ctx, &pb.ConfigRequest{KnownVersion: known}, grpc.MaxCallRecvMsgSize(maxConfigBytes))
		switch {
		case err != nil:
			return nil, fmt.Errorf("%s: %w", addr, err)
		case !rep.Unchanged && len(rep.Snapshot) == 0:
			return nil, fmt.Errorf("%s: the node has no config snapshot yet", addr)
		case held != nil && !rep.Unchanged && rep.Version < known:
			olderMu.Lock()
			if older == nil || rep.Version > older.Version {
				older = rep
			}
			olderMu.Unlock()
			return nil, fmt.Errorf("%s: config version %d, older than the %d held (the node lags its ledger)", addr, rep.Version, known)
		}
		return rep, nil
	})
	if err != nil && ctxEnded(ctx) == nil { // every node asked: none has the version held
		olderMu.Lock()
		rep = older
		olderMu.Unlock()
	}
	switch {
	case rep == nil:
		return fmt.Errorf("router: no node gave a config snapshot: %w", err)
	case rep.Unchanged:
		return nil
	}
	s, err := snapshot.Decode(rep.Snapshot)
	if err != nil {
		return fmt.Errorf("router: config version %d from %s: %w", rep.Version, rep.Node, err)
	}
	// NB: only over the snapshot this read started from: a Refresh that
	// ran beside it (the caller's and the loop's) may have stored a newer
	// one meanwhile, which an answer to the older question must not undo.
	c.snap.CompareAndSwap(held, s)
	return nil
}

// dialError classifies a failed Dial (its error explained by
// ExplainTLSMismatch) as the calls' errors are: the error of ctx when it
// ended, ErrRejected when a node turned the client away (a wrong RPC
// token: retrying cannot help) or a seed answered HTTP, not gRPC (a node's
// public or admin port: retrying cannot help either), else ErrUnavailable
// (no node answered: retry).
func dialError(ctx context.Context, err error) error {
	msg := err.Error()
	_, public := publicPortAnswer(err)
	switch {
	case ctxEnded(ctx) != nil:
		return err // it wraps ctx's error (firstAnswer)
	case public:
		// ExplainTLSMismatch named the public port.
		return fmt.Errorf("%w: %w", ErrRejected, err)
	case strings.Contains(msg, "looked like an HTTP/1.1 header"), strings.Contains(msg, "received unexpected content-type"):
		// ExplainTLSMismatch named the likely ports for HTTP/1.1.
		return fmt.Errorf("%w: %w; the address answered HTTP, not gRPC: dial the node's RPC port, --rpc-addr (retrying cannot help)", ErrRejected, err)
	case anyRejected(err):
		return fmt.Errorf("%w: %w; fix what it names (DialOptions.Token for the nodes' --rpc-token, the nodes' versions): retrying cannot help", ErrRejected, err)
	}
	return fmt.Errorf("%w: %w", ErrUnavailable, err)
}

// publicPortAnswer reports whether err is a node's public HTTP port
// answering a gRPC call (dialled for its RPC port), and how: with an
// upstream, asking for an API key; without, answering 404 problem+json.
func publicPortAnswer(err error) (what string, ok bool) {
	msg := err.Error()
	if !strings.Contains(msg, `received unexpected content-type "application/problem+json"`) && !(anyRejected(err) && strings.Contains(msg, "API key")) {
		return "", false
	}
	if strings.Contains(msg, "API key") {
		return "asking for an API key", true
	}
	return "answering 404 (a node without --upstream)", true
}

// anyRejected reports whether err, or any error joined in it (one per node
// asked), is a node rejecting the call (rejected).
func anyRejected(err error) bool {
	if err == nil {
		return false
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return slices.ContainsFunc(j.Unwrap(), anyRejected)
	}
	if rejected(err) {
		return true
	}
	return anyRejected(errors.Unwrap(err))
}

// ExplainTLSMismatch adds the likely fix to an error of a call to a node
// that looks like a TLS mismatch (gRPC's wording names neither side's
// setting); withTLS is whether the caller dialled with TLS. Dial does it;
// programs with gRPC clients of their own can too. Other errors come back
// as they are.
func ExplainTLSMismatch(err error, withTLS bool) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	if what, ok := publicPortAnswer(err); ok {
		return fmt.Errorf("%w (the address answered as a node's public HTTP port, --http-addr, %s: dial the node's RPC port, --rpc-addr)", err, what)
	}
	switch {
	case strings.Contains(msg, "looked like an HTTP/1.1 header"):
		return fmt.Errorf("%w (the address answered HTTP/1.1, not gRPC: it is likely a node's public or admin port, --http-addr or --admin-addr; dial the node's RPC port, --rpc-addr)", err)
	case !withTLS && strings.Contains(msg, "error reading server preface: http2: frame too large"):
		// What a node's gossip port with a --gossip-key answers gRPC, and
		// its admin port (an HTTP/1.1 answer read as a frame).
		return fmt.Errorf("%w (the address answered, but not gRPC: it is likely a node's gossip port, --gossip-addr, or its admin port, --admin-addr; dial the node's RPC port, --rpc-addr)", err)
	case !withTLS && strings.Contains(msg, "error reading server preface"):
		// A node's gossip port without a --gossip-key closes the
		// connection the same way: the two cannot be told apart.
		return fmt.Errorf("%w (the address closed the connection without speaking gRPC: either it is a node's RPC port that requires TLS, "+
			"which closes plaintext connections like this: if the cluster runs with --rpc-tls-*, dial with TLS: router.DialOptions.TLS from TLSFiles.ClientConfig, quotad bench cluster --rpc-tls-*; "+
			"or it is not a node's RPC port at all (its gossip port, --gossip-addr, does the same): dial the node's --rpc-addr)", err)
	case withTLS && strings.Contains(msg, "first record does not look like a TLS handshake"):
		return fmt.Errorf("%w (the node does not speak TLS: turn on --rpc-tls-* on the nodes, or dial without TLS; "+
			"or the address is not a node's RPC port at all (its gossip port, --gossip-addr, answers like this): dial the node's --rpc-addr)", err)
	case withTLS && (strings.Contains(msg, "broken pipe") || strings.Contains(msg, "connection reset by peer")):
		// TLS 1.3: the node checks the client's certificate after the
		// client's side of the handshake is done, so its refusal can reach
		// the client as a closed connection instead of the alert.
		return fmt.Errorf("%w (the node closed the connection after the TLS handshake: it likely refused this client's certificate, one not from the cluster's CA (--rpc-tls-ca), expired, or not allowed for client auth; the node logs the handshake error)", err)
	}
	return err
}
