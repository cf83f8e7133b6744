package router

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"os"
	"path"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/internal/logsample"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// Charger decides charges at their owners: *Router on a node, *Client in a
// program. Its methods are safe for concurrent use and block until the owner
// answers or ctx ends.
type Charger interface {
	Charge(ctx context.Context, req ChargeRequest) (ChargeResult, error)
	Refund(ctx context.Context, req RefundRequest) (shard.Decision, error)
	Usage(ctx context.Context, account string) (UsageResult, error)
}

// EarlyCharger is a Charger that can answer before the charge is durable
// (*Router, for the accounts its node owns): the front then runs the
// upstream while the log syncs, and holds the client's answer until wait
// returned nil, so the sync costs no latency when the upstream is slower.
type EarlyCharger interface {
	ChargeEarly(ctx context.Context, req ChargeRequest) (ChargeResult, func(context.Context) error, error)
}

// ConfigSource gives the current config snapshot, or nil when there is none
// yet: *engine.Engine on a node, *Client in a program. Snapshot must be
// cheap and safe for concurrent use; it is called on every request.
type ConfigSource interface {
	Snapshot() *snapshot.Snapshot
}

// Bill-on policies (FrontOptions.BillOn): when a charged request keeps its
// charge.
const (
	// BillOnSuccess refunds when the upstream answers 5xx, fails or times
	// out, and for gRPC when the final grpc-status is not 0 (the default).
	BillOnSuccess = "success"
	// BillOn2xx refunds everything that is not 2xx or 3xx, and gRPC answers
	// whose final grpc-status is not 0 (gRPC answers are all HTTP 200).
	BillOn2xx = "2xx"
	// BillOnAlways never refunds what the upstream answered.
	BillOnAlways = "always"
)

// FrontOptions configure Middleware and NewProxy. Zero values take the
// defaults in brackets.
type FrontOptions struct {
	// Charger decides and refunds charges (required).
	Charger Charger
	// Config resolves API keys (by SHA-256 hash) and route weights
	// (required).
	Config ConfigSource
	// UsagePath answers the caller's usage as JSON (GET, HEAD) ["/v1/usage"]: that
	// path, for every method and host, is the front's and never reaches
	// the handler or upstream behind it.
	UsagePath string
	// NoUsageEndpoint turns UsagePath off: every path is charged and goes
	// on (for a Middleware in front of an API with a usage path of its own).
	NoUsageEndpoint bool
	// QuotaStatus is the status of a quota-exceeded refusal: 429, 402 or 403
	// [429]. Rate-limited refusals are always 429.
	QuotaStatus int
	// BillOn is BillOnSuccess, BillOn2xx or BillOnAlways [BillOnSuccess].
	BillOn string
	// MaxBodyBytes bounds a request body [10 MiB]; negative: no bound. A
	// larger Content-Length is refused with 413 before anything is charged;
	// a body without one that grows past the bound is cut off, answered 413
	// and refunded whatever BillOn says. Such a body streams, so the
	// upstream (NewProxy) has had its headers and up to MaxBodyBytes of it:
	// it sees the request aborted (its body read fails), not complete.
	// Behind Middleware, a handler that answers the cut-off read itself
	// (its own 400, or a 200 over what it read) keeps its answer, which the
	// front cannot replace once written, and the charge is refunded all
	// the same: treat the read's error as a refusal. gRPC calls (Content-Type
	// application/grpc...) are streams that may run for hours: the bound
	// does not apply to them (the gRPC server's message size limit does).
	// A body whose read fails before its end (the client went away
	// mid-body, a malformed chunked encoding, an HTTP/2 stream reset)
	// before the answer began is refunded whatever BillOn says too,
	// whatever the bound: the handler or upstream never got all of it. A
	// client still there gets 400 (bad-request). One broken off after the
	// answer began (a full-duplex upstream answers early) is billed as
	// any answered request. gRPC calls are exempt: a client ends a stream
	// by cancelling it.
	MaxBodyBytes int64
	// UpstreamTimeout bounds the wait for the upstream's response headers
	// (NewProxy only) [30s], and, before they come, the time the upstream
	// takes nothing of the request body while the front has some to give
	// (an upstream that hangs without reading: the transport's wait for
	// headers starts only once the body is written). Streaming bodies are
	// not cut off by it, nor gRPC calls' bodies.
	UpstreamTimeout time.Duration
	// BodyIdleTimeout cuts off a request body that sends nothing for this
	// long (NewProxy only) [60s; negative: never]: a client that opens a
	// request and stalls held a connection, a goroutine and an upstream
	// request for ever. The client gets 408 (request-timeout), the upstream
	// sees the request aborted, as for a body over MaxBodyBytes, and the
	// charge is refunded whatever BillOn says. A slow but steady upload goes
	// on; gRPC calls, which may idle for hours, are exempt.
	BodyIdleTimeout time.Duration
	// BodyTimeout cuts off a request body not read to its end within this
	// long of the request's arrival (NewProxy only) [0: no bound]: a client
	// that sends a byte now and then, never idle for BodyIdleTimeout, held
	// its request for as long as it liked. The client gets 408
	// (request-timeout) and the charge is refunded, as for a stalled body;
	// gRPC calls are exempt. Set it above the slowest upload you serve on
	// purpose.
	BodyTimeout time.Duration
	// Transport carries proxied requests (NewProxy only). Nil: a clone of
	// http.DefaultTransport with ResponseHeaderTimeout = UpstreamTimeout and
	// room for many idle connections to the upstream.
	Transport http.RoundTripper
	// StripAPIKeyHeader removes the header the API key was read from
	// before the upstream sees the request (NewProxy only): X-Api-Key, or
	// Authorization when the key was its Bearer token (kept, it handed the
	// key to the upstream). An Authorization sent beside an X-Api-Key is the
	// upstream's own, and is forwarded.
	StripAPIKeyHeader bool
	// ChargePreflights treats CORS preflights (OPTIONS with Origin and
	// Access-Control-Request-Method) as any other request: they then need
	// an API key, which browsers never send with them, so set it only for
	// an API no browser calls across origins. Without it a preflight goes
	// to the handler or upstream uncharged and without a Caller (see
	// Middleware).
	ChargePreflights bool
	// CORSOrigins, when set, makes the front answer CORS for browser pages
	// on these origins ("https://app.example.com", or "*" for any): it
	// answers their preflights itself, and every final answer to their
	// requests (its own refusals and usage answers, and the API's) carries
	// Access-Control-Allow-Origin and exposes the quota headers. Without
	// it CORS is the API's, and a page cannot read the front's own
	// answers. Other origins are left to the API as before.
	CORSOrigins []string
	// TrustForwarded keeps the X-Forwarded-For, -Host and -Proto, X-Real-IP
	// and Forwarded the client sent (NewProxy only; X-Forwarded-For and
	// Forwarded get the proxy's peer appended): set it when quotad runs
	// behind a load balancer that sets them, so the upstream sees the real
	// client. Without it the proxy replaces them with what it saw itself,
	// since a client could forge them.
	TrustForwarded bool
	// Upgrades are the protocols a client may switch its connection to
	// through the proxy (NewProxy only), by the names of the Upgrade
	// header, case-insensitively and whatever version follows a slash
	// [websocket]. After the upstream's 101 the proxy relays bytes both
	// ways: whatever the client sends over the switched connection reaches
	// the upstream as part of the one request billed, so allow only a
	// protocol that serves one request's worth over it (a WebSocket, or
	// Docker's "tcp" for attach). An offer of any other protocol is taken
	// out of the request, and the request is served without switching (as
	// RFC 9110 section 7.8 lets a server do). h2c is never allowed: it
	// carries any number of HTTP requests.
	Upgrades []string
	// NoUpgrades refuses every protocol switch, WebSocket included.
	NoUpgrades bool
	// ChargeTimeout bounds a charge, RefundTimeout a refund [10s each]. Both
	// outlive the client's connection on purpose: see Middleware.
	ChargeTimeout, RefundTimeout time.Duration
	// OnRequest, when set, hears every answer: its status (499 when the
	// client went away first) and the time the front added (everything but
	// the wrapped handler or the upstream). It must not block.
	OnRequest func(code int, added time.Duration)
	Logger    *slog.Logger
	// Now is the wall clock, for the seconds until a period ends in the
	// RateLimit field [time.Now]. A node passes its own clock.
	Now func() time.Time
}

// DefaultMaxBodyBytes is FrontOptions.MaxBodyBytes's default.
const DefaultMaxBodyBytes = 10 << 20

// DefaultBodyIdleTimeout is FrontOptions.BodyIdleTimeout's default.
const DefaultBodyIdleTimeout = time.Minute

// statusClientClosed is what OnRequest hears when the client went away
// before an answer (nginx's 499).
const statusClientClosed = 499

// Check validates the policy fields (all but Charger and Config), so a
// command line can refuse bad flags before it starts a node.
func (o FrontOptions) Check() error { return o.policyDefaults() }

func (o *FrontOptions) defaults() error {
	if o.Charger == nil || o.Config == nil {
		return errors.New("router: FrontOptions.Charger and FrontOptions.Config are required")
	}
	for _, v := range []any{o.Charger, o.Config} {
		if c, ok := v.(*Client); ok && (c == nil || c.peers == nil) {
			// A nil *Client in the interface, or a zero Client{}: the first
			// request would panic, or answer 503 for ever.
			return errors.New("router: FrontOptions.Charger and Config must be a *Client made by Dial, not nil or a zero Client")
		}
	}
	return o.policyDefaults()
}

func (o *FrontOptions) policyDefaults() error {
	if err := checkCORSOrigins(o.CORSOrigins); err != nil {
		return err
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.UsagePath == "" {
		o.UsagePath = "/v1/usage"
	}
	if !strings.HasPrefix(o.UsagePath, "/") {
		return fmt.Errorf("router: usage path %q must start with /", o.UsagePath)
	}
	switch o.QuotaStatus {
	case 0:
		o.QuotaStatus = http.StatusTooManyRequests
	case http.StatusTooManyRequests, http.StatusPaymentRequired, http.StatusForbidden:
	default:
		return fmt.Errorf("router: quota status %d: want 429, 402 or 403", o.QuotaStatus)
	}
	switch o.BillOn {
	case "":
		o.BillOn = BillOnSuccess
	case BillOnSuccess, BillOn2xx, BillOnAlways:
	default:
		return fmt.Errorf("router: bill-on %q: want success, 2xx or always", o.BillOn)
	}
	if o.MaxBodyBytes == 0 {
		o.MaxBodyBytes = DefaultMaxBodyBytes
	}
	for _, d := range []*time.Duration{&o.UpstreamTimeout, &o.ChargeTimeout, &o.RefundTimeout, &o.BodyTimeout} {
		if *d < 0 {
			return fmt.Errorf("router: front timeouts must not be negative (got %s)", *d)
		}
	}
	if o.NoUpgrades && len(o.Upgrades) > 0 {
		return fmt.Errorf("router: NoUpgrades with Upgrades %q: set one of them", o.Upgrades)
	}
	for _, p := range o.Upgrades {
		if err := checkUpgradeName(p); err != nil {
			return err
		}
	}
	setDefaultDuration(&o.UpstreamTimeout, 30*time.Second)
	setDefaultDuration(&o.BodyIdleTimeout, DefaultBodyIdleTimeout)
	setDefaultDuration(&o.ChargeTimeout, 10*time.Second)
	setDefaultDuration(&o.RefundTimeout, 10*time.Second)
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

func setDefaultDuration(d *time.Duration, v time.Duration) {
	if *d == 0 {
		*d = v
	}
}

// Caller is what the front decided about a request it let through; the
// wrapped handler reads it with CallerFrom.
type Caller struct {
	Account string
	KeyID   string
	Route   string // the route pattern that matched ("*" for none)
	Units   int64  // what the request costs
	// EventID names the charge (the Idempotency-Key when one was sent).
	EventID string
	// Replayed: a retry of an event already charged; nothing was charged now.
	Replayed bool
	Decision shard.Decision
}

type callerKey struct{}

// CallerFrom returns the Caller the middleware attached to a request's
// context. It is the handler's own copy: changing it changes nothing the
// front does (the refund goes to the account and event charged).
func CallerFrom(ctx context.Context) (*Caller, bool) {
	c, ok := ctx.Value(callerKey{}).(*Caller)
	return c, ok
}

// Middleware returns the HTTP front as middleware: every request must carry
// an API key; its account is charged the route's units before next runs,
// and refunded after next returns when BillOn says the answer was a failure.
//
// In order, for each request:
//
//	UsagePath (unless NoUsageEndpoint): answer the caller's usage (JSON), charge nothing
//	API key: X-Api-Key, else Authorization: Bearer  (none or unknown: 401)
//	Idempotency-Key: 1..255 printable ASCII, an sf-string or bare, else 400; it becomes the event id
//	Content-Length over MaxBodyBytes: 413
//	route and units: the snapshot's route weights
//	charge at the owner: refused -> problem+json, next never runs
//	set RateLimit-Policy, RateLimit, X-Quota-*; call next
//	refund once if next's answer is a failure under BillOn
//
// Two things reach next unlike the rest. CORS preflights (OPTIONS with
// Origin and Access-Control-Request-Method) carry no credentials, by the
// Fetch standard: they reach next uncharged, with no Caller (CallerFrom's
// ok is false), and next must answer them without doing the work (register
// handlers with their method, "POST /v1/exports", or check ok); set
// FrontOptions.ChargePreflights for an API no browser calls. And the
// usage endpoint never reaches next, but for its preflight (as every
// preflight). Every request next sees has the client's X-Quota-Account
// and X-Quota-Event dropped, and a charged one
// carries the front's (HeaderAccount, HeaderEvent), as the proxy's
// upstream does, so code moved between the two can trust them.
//
// The charge and the refund run on a context detached from the client's
// (bounded by ChargeTimeout and RefundTimeout): a client that hangs up
// mid-charge must not leave a charge whose outcome the front never learns.
// A charge that completes for a client already gone is refunded at once.
// A refund after next's answer runs before the answer completes: the head
// (status and headers) is flushed first, the end of the body waits for the
// refund's round trip (at most RefundTimeout), so that a client that sees
// a failure and retries at once finds the units back. The answers the
// front writes itself for a refunded request (413 for a body over
// MaxBodyBytes, the proxy's 502 and 504) wait for the refund before
// anything is sent, and carry the quota headers of the state after it, or
// none when the refund failed.
//
// The options marked "NewProxy only" are refused here: they describe the
// proxy's upstream, and set on a middleware they did nothing
// (StripAPIKeyHeader left the key in the handler's request). A nil
// handler is refused when it is wrapped, as http.Handle does, not at each
// request.
func Middleware(opts FrontOptions) (func(http.Handler) http.Handler, error) {
	if names := opts.proxyOnly(); len(names) > 0 {
		return nil, fmt.Errorf("router: Middleware: FrontOptions.%s apply to NewProxy only (they describe its upstream): leave them unset for a middleware",
			strings.Join(names, ", FrontOptions."))
	}
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	return func(next http.Handler) http.Handler {
		if next == nil {
			panic("router: Middleware: a nil http.Handler")
		}
		return &front{opts: opts, next: next}
	}, nil
}

// proxyOnly names the options of o that only NewProxy uses, set.
func (o *FrontOptions) proxyOnly() []string {
	var names []string
	for _, x := range []struct {
		name string
		set  bool
	}{
		{"UpstreamTimeout", o.UpstreamTimeout != 0}, {"BodyIdleTimeout", o.BodyIdleTimeout != 0}, {"BodyTimeout", o.BodyTimeout != 0},
		{"Transport", o.Transport != nil}, {"StripAPIKeyHeader", o.StripAPIKeyHeader}, {"TrustForwarded", o.TrustForwarded},
		{"Upgrades", len(o.Upgrades) > 0}, {"NoUpgrades", o.NoUpgrades},
	} {
		if x.set {
			names = append(names, x.name)
		}
	}
	return names
}

type front struct {
	opts FrontOptions
	next http.Handler
	// undecided, rejected and failed sample the lines of charges that
	// failed (undecidedLog, failedLog), and usageLog the usage reads': in an
	// outage every request writes one.
	undecided, rejected, failed, usageLog logsample.Sampler
	// proxy is set for NewProxy's front: next marks when the request
	// reached the upstream (markSent), so clientLeft can tell a client that
	// left before it from one that left after.
	proxy bool
	// base is the upstream URL's path (NewProxy): the upstream sees a
	// request's path joined to it, and so redirects to the canonical path
	// under it.
	base string
}

// charged is one request's charge, refunded at most once.
type charged struct {
	Caller
	receipt  *shard.Receipt
	refunded bool // a refund was made or tried (once only)
	// refundFailed: the refund tried did not go through (the charge stands).
	refundFailed bool
	// durable, when set, waits until the charge is durable (EarlyCharger).
	durable func(context.Context) error
	// canonical, when set, is where a Go ServeMux would redirect the
	// request (snapshot.Routes.MatchRedirect: a path not in canonical form,
	// or a subtree's root without its slash): the escaped path, priced as
	// its route. The request is refunded when the upstream answers with
	// that redirect, and only then (canonicalRedirect).
	canonical string
	// hard: the account's plan refuses past its quota, so the quota is a
	// limit the RateLimit fields advertise (not for a soft plan).
	hard bool
}

// units reports whether the request was charged units now: not for a route
// of weight 0, which has no receipt and nothing to refund.
func (c *charged) units() bool { return c.receipt != nil || c.Replayed }

func (f *front) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	r = withoutLookalikes(r)
	if f.proxy && r.Method == http.MethodConnect {
		// ReverseProxy would send it on as "CONNECT /", and relay an
		// answer with a body, which RFC 9110 section 9.3.6 forbids for a
		// 2xx to CONNECT: the proxy tunnels nothing. Refused before the key
		// is looked up, so nothing is charged.
		p := newProblem("about:blank", "Not Implemented", http.StatusNotImplemented,
			"This API proxy does not tunnel (CONNECT); send the request itself to it, with its method and path.")
		p.write(w, r)
		f.observe(p.Status, time.Since(start))
		return
	}
	if origin := f.corsOrigin(r); origin != "" {
		cw := &corsWriter{ResponseWriter: w, origin: origin}
		// An answer nobody wrote (the handler returned without a word)
		// goes out after ServeHTTP returns, with the header map as it is
		// then: it carried no CORS headers, and a page could not read it.
		defer cw.set()
		w = cw
		if isPreflight(r) {
			answerPreflight(w, r) // the front answers CORS for these origins: the API never sees it
			f.observe(http.StatusNoContent, time.Since(start))
			return
		}
	}
	if r.URL.Path == f.opts.UsagePath && !f.opts.NoUsageEndpoint {
		// Before preflights: the usage endpoint is the front's, never the
		// API's, so a preflight for it is not the API's to answer either
		// (it gets the endpoint's 405).
		f.observe(f.serveUsage(w, r), time.Since(start))
		return
	}
	if !f.opts.ChargePreflights && isPreflight(r) {
		// A browser's CORS preflight carries no credentials: the API answers
		// it, uncharged; the request it announces is charged as usual.
		if r.ContentLength != 0 {
			// Browsers send none: a body here is a request dressed as a
			// preflight to pass uncharged and unbounded (--max-body-bytes).
			p := newProblem(ProblemBadRequest, "Bad Request", http.StatusBadRequest,
				"A CORS preflight (OPTIONS with Origin and Access-Control-Request-Method) carries no body; send the request itself with its API key.")
			p.write(w, r)
			f.observe(p.Status, time.Since(start))
			return
		}
		if r.Header.Get(HeaderAccount) != "" || r.Header.Get(HeaderEvent) != "" {
			r = r.Clone(r.Context()) // the caller's request stays as it was
			r.Header.Del(HeaderAccount)
			r.Header.Del(HeaderEvent)
		}
		rec := &recorder{ResponseWriter: w}
		f.next.ServeHTTP(rec, r)
		f.observe(rec.code(r), 0) // NB: the front added nothing
		return
	}
	c, prob := f.admit(r)
	if prob != nil {
		if c != nil && (c.Decision.Reason == shard.RateLimited || c.Decision.Reason == shard.QuotaExceeded || c.Decision.Reason == shard.IDReused || c.Decision.Reason == shard.ReplayLimit) {
			setQuotaHeaders(w.Header(), &c.Decision, f.opts.Now().Unix(), c.hard) // the owner's state; other refusals have none
		}
		prob.write(w, r)
		f.observe(prob.Status, time.Since(start))
		return
	}
	if r.Context().Err() != nil { // the client left while we charged
		f.refund(r, c, "the client went away before the request was served")
		f.observe(statusClientClosed, time.Since(start))
		return
	}
	now := f.opts.Now().Unix()
	setQuotaHeaders(w.Header(), &c.Decision, now, c.hard)
	rec := &recorder{ResponseWriter: w, headers: func(h http.Header) { setQuotaHeaders(h, &c.Decision, now, c.hard) },
		charged: c.units()}
	rec.refundFirst = func(why string) bool { return f.refundFirst(rec, r, c, why) }
	if c.durable != nil {
		rec.gate = func() error {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), f.opts.ChargeTimeout)
			defer cancel()
			return c.durable(ctx)
		}
		rec.gateFailed = func(err error) {
			f.opts.Logger.Error("charge not durable: the answer is withheld", "account", c.Account, "event", c.EventID, "err", err)
			// The upstream's headers may be in the map already (ReverseProxy
			// copies them before WriteHeader): none of them describes this
			// answer (Content-Encoding, Set-Cookie, Trailer...).
			clear(rec.ResponseWriter.Header())
			notDurable().write(rec.ResponseWriter, r)
		}
	}
	// next gets its own Caller (changing it cannot redirect the refund), on
	// a copy of the request (the caller's stays as it was).
	caller := c.Caller
	ctx := context.WithValue(r.Context(), callerKey{}, &caller)
	if f.proxy {
		ctx = context.WithValue(ctx, sentKey{}, new(atomic.Bool))
	}
	r = r.WithContext(ctx)
	served := r
	rec.clientLeft = func() bool {
		// Canceled alone: a deadline (an outer middleware's timeout) is
		// the server giving up, and its 504 is refunded as before.
		return clientLeft(served) && errors.Is(served.Context().Err(), context.Canceled)
	}
	// Only the front says which account and event a request was charged
	// to: a client's own values are forged.
	r.Header = r.Header.Clone()
	r.Header.Set(HeaderAccount, c.Account)
	r.Header.Set(HeaderEvent, c.EventID)
	var body *limitedBody
	bounded := f.bodyBounded(r)
	idle, total := f.proxy && f.opts.BodyIdleTimeout > 0, f.proxy && f.opts.BodyTimeout > 0
	// Every body but a gRPC call's is wrapped, to notice one the client
	// breaks off (a gRPC client ends a stream by cancelling it).
	if r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0 && !isGRPCCall(r) {
		body = &limitedBody{ReadCloser: r.Body}
		if bounded {
			body.ReadCloser = http.MaxBytesReader(w, r.Body, f.opts.MaxBodyBytes)
			if !f.proxy && r.ContentLength < 0 {
				body.before = w.Header().Clone() // a body that may grow over the bound (finish)
			}
		}
		if idle {
			body.idle = f.opts.BodyIdleTimeout
		}
		if total {
			body.total, body.deadline = f.opts.BodyTimeout, start.Add(f.opts.BodyTimeout)
		}
		if idle || total {
			body.rc = http.NewResponseController(w)
		}
		r.Body, rec.body = body, body
	}
	var t time.Time
	var inNext time.Duration
	defer func() {
		p := recover()
		if inNext == 0 && !t.IsZero() {
			inNext = time.Since(t)
		}
		if p == http.ErrAbortHandler && rec.gateErr != nil {
			// The gate failed: the front answered 500 in full and failed
			// every write after it, which ReverseProxy answers with this
			// abort. Passing it on would cut the connection under that
			// answer (the client read EOF or a stream reset).
			p = nil
		}
		if p != nil && (p != http.ErrAbortHandler || (rec.writeErr == nil && !clientLeft(r))) {
			rec.failed = true // NB: an abort after a failed write, or once the client left, is the client leaving, not the upstream failing
		}
		rec.panicked = p != nil
		if body != nil {
			if f.proxy && clientLeft(r) && !body.answered.Load() && !body.eof.Load() {
				// The client went away (an HTTP/2 stream reset) before its
				// body ended and before an answer: the upstream cannot have
				// had the whole request (the transport aborts it), so it is
				// broken off as a failed read would say. ReverseProxy returns
				// on the cancelled context, often before the transport
				// reads the body again.
				body.broken.Store(true)
			}
			body.handlerDone()
		}
		f.finish(rec, r, c, body)
		f.observe(rec.code(r), time.Since(start)-inNext)
		if p != nil {
			panic(p)
		}
	}()
	t = time.Now()
	f.next.ServeHTTP(rec, r)
	inNext = time.Since(t)
}

// pricedHost is the host a request is priced by: the one the upstream
// serves it as. The proxy always rewrites Host to the upstream's, so an
// upstream that serves by hostname reads X-Forwarded-Host; with
// TrustForwarded the proxy passes on the one the request came with (the
// first, the client's end), and pricing by Host instead let a request with
// a cheap Host and a dear X-Forwarded-Host be served dear and billed cheap.
func (f *front) pricedHost(r *http.Request) string {
	if f.proxy && f.opts.TrustForwarded {
		if v := r.Header.Get("X-Forwarded-Host"); v != "" {
			first, _, _ := strings.Cut(v, ",")
			return strings.TrimSpace(first)
		}
	}
	return r.Host
}

// methodOverrides are the headers with which a POST asks the framework
// behind it to run it as another method: Rack's MethodOverride, Symfony
// and Laravel, Express's method-override, Google's APIs.
// Canonical forms (X-HTTP-Method-Override and the others), read straight
// from the header map: a key that is not canonical costs an allocation per
// lookup.
var methodOverrides = []string{"X-Http-Method-Override", "X-Http-Method", "X-Method-Override"}

// pricedMethod is the method a request is priced by. A POST that names
// another method in a method-override header may run as that method
// upstream, so it is priced as the dearer of the two: priced as a POST,
// a cheap POST /v1/things carrying "X-HTTP-Method-Override: DELETE" was
// served as a dear DELETE and billed as a POST. An upstream that ignores
// the header bills no less than the POST.
func pricedMethod(snap *snapshot.Snapshot, r *http.Request, host string) string {
	if r.Method != http.MethodPost {
		return r.Method // the frameworks override POSTs only
	}
	method, units := r.Method, int64(-1) // units: the POST's, once looked up
	overrides(r, func(m string) {
		if m == method {
			return
		}
		if units < 0 {
			_, units, _ = snap.Routes.MatchRedirect(method, host, r.URL.EscapedPath())
		}
		if _, u, _ := snap.Routes.MatchRedirect(m, host, r.URL.EscapedPath()); u > units {
			method, units = m, u
		}
	})
	return method
}

// overrides calls fn with each method a POST names to run as: every item
// of a method-override header's comma list (Express's method-override
// takes the first; another framework may take another), and a _method
// query parameter (Symfony and Laravel read it from the query too), upper
// case, method tokens only.
func overrides(r *http.Request, fn func(method string)) {
	each := func(v string) {
		for _, item := range strings.Split(v, ",") {
			if m := strings.ToUpper(strings.TrimSpace(item)); validMethod(m) {
				fn(m)
			}
		}
	}
	for _, h := range methodOverrides {
		for _, v := range r.Header[h] {
			each(v)
		}
	}
	// NB: parsed whenever the query holds an escape too: ?%5Fmethod=DELETE
	// is _method to every framework that reads it, and skipped the check.
	// The name is read as PHP reads it too (Symfony, Laravel): ?.method
	// and ?+_method are $_GET['_method'] there.
	if q := r.URL.RawQuery; strings.Contains(q, "method") || strings.IndexByte(q, '%') >= 0 {
		query := r.URL.Query()
		// NB: in order: RequestTarget hashes what this finds.
		for _, k := range slices.Sorted(maps.Keys(query)) {
			if k != "_method" && phpName(k) != "_method" {
				continue
			}
			for _, v := range query[k] {
				each(v)
			}
		}
	}
}

// phpName is a query parameter's name as PHP registers it: leading spaces
// dropped, the other spaces and dots made underscores.
func phpName(k string) string {
	return strings.Map(func(c rune) rune {
		if c == ' ' || c == '.' {
			return '_'
		}
		return c
	}, strings.TrimLeft(k, " "))
}

// validMethod reports whether m is a method token (RFC 9110 section 9.1).
func validMethod(m string) bool {
	for i := 0; i < len(m); i++ {
		if !tokenChar(m[i]) {
			return false
		}
	}
	return m != ""
}

// admit resolves the key and the route, and charges. A refusal comes back
// as a problem (with the charge's decision when there is one).
func (f *front) admit(r *http.Request) (*charged, *Problem) {
	key, snap, prob := f.caller(r)
	if prob != nil {
		return nil, prob
	}
	eventID, prob := idempotencyKey(r.Header)
	if prob != nil {
		return nil, prob
	}
	if f.bodyBounded(r) && r.ContentLength > f.opts.MaxBodyBytes {
		return nil, tooLarge(f.opts.MaxBodyBytes)
	}
	host := f.pricedHost(r)
	method := pricedMethod(snap, r, host)
	route, units, redirect := snap.Routes.MatchRedirect(method, host, r.URL.EscapedPath())
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), f.opts.ChargeTimeout)
	defer cancel()
	req := ChargeRequest{Account: key.Account, EventID: eventID, ClientID: eventID != "", Key: key.ID, Route: route, Units: units}
	if req.ClientID {
		req.Target = RequestTarget(r)
	}
	var res ChargeResult
	var durable func(context.Context) error
	var err error
	if early, ok := f.opts.Charger.(EarlyCharger); ok {
		res, durable, err = early.ChargeEarly(ctx, req)
	} else {
		res, err = f.opts.Charger.Charge(ctx, req)
	}
	if err != nil {
		if retryable(ctx, err) {
			f.undecidedLog(key.Account, err)
			return nil, unavailable("The quota service cannot decide this request now. Retry in a second; with the same Idempotency-Key a retry is never billed twice.")
		}
		f.failedLog("charge failed", key.Account, err)
		return nil, internalError()
	}
	c := &charged{Caller: Caller{Account: key.Account, KeyID: key.ID, Route: route, Units: units, EventID: res.EventID,
		Replayed: res.Reason == shard.Replayed, Decision: res.Decision}, durable: durable, hard: hardQuota(snap, key.Account)}
	if redirect {
		c.canonical = canonicalPath(snap, method, host, r.URL.EscapedPath())
	}
	if !res.Reason.Accepted() {
		if durable != nil {
			_ = durable(ctx) // a refusal logs nothing; this only reports it to metrics
		}
		return c, refusal(&res.Decision, units, f.opts.QuotaStatus)
	}
	if res.Reason == shard.OK || res.Reason == shard.Replayed {
		// A Replayed answer's receipt names the charge it relied on: the
		// replay's take-back carries it, so that it counts at any owner
		// (after the account moved, the next owner has no entry of it).
		c.receipt = res.Receipt
	}
	return c, nil
}

// retryable reports whether a charge's (or a usage read's) error is one a
// retry can fix, answered quota-unavailable (503, Retry-After) rather than
// internal-error (500): no owner decided now or its answer was lost
// (ErrUnavailable); the call's deadline passed, ctx's (whatever the owner
// answered then: one of an earlier version answered it INTERNAL, "context
// deadline exceeded"); or a node turned another's call away (ErrRejected:
// the nodes' --rpc-token, TLS or versions differ), which an operator fixes,
// not the client, whose retry goes through once they have. Nothing in
// these says the client's request is at fault; clients that retry only 503
// dropped them as 500s.
//
// ErrClosed too: the Charger is a Client closed or shutting down, as the
// process serving the middleware stops; another replica serves the retry.
// It was a 500 "failed to decide", with an ERROR line per request.
func retryable(ctx context.Context, err error) bool {
	return errors.Is(err, ErrUnavailable) || errors.Is(err, ErrRejected) || errors.Is(err, ErrClosed) ||
		errors.Is(err, context.DeadlineExceeded) || ctxEnded(ctx) != nil
}

// undecidedLog logs a charge answered quota-unavailable (retryable), one
// line a second at most, with the count held back: in a ledger or owner
// outage every request gets here (896 lines in 2 s in the Postgres audit).
// A rejection between nodes has a line of its own, an error: it lasts until
// an operator fixes the nodes.
func (f *front) undecidedLog(account string, err error) {
	now := time.Now()
	if errors.Is(err, ErrRejected) {
		if ok, held := f.rejected.Allow(now, time.Second); ok {
			f.opts.Logger.Error("charge undecided: a node refused this node's call; the nodes' --rpc-token (QUOTAD_RPC_TOKEN), --rpc-tls-* or versions differ, "+
				"and the client was answered quota-unavailable until an operator fixes them", "account", account, "err", err, "similar_lines_held_back", held)
		}
		return
	}
	if ok, held := f.undecided.Allow(now, time.Second); ok {
		f.opts.Logger.Warn("charge undecided", "account", account, "err", err, "similar_lines_held_back", held)
	}
}

// failedLog logs a call answered internal-error (msg: "charge failed",
// "usage failed"), sampled as undecidedLog: an owner whose log fails fails
// every charge it owns.
func (f *front) failedLog(msg, account string, err error) {
	if ok, held := f.failed.Allow(time.Now(), time.Second); ok {
		f.opts.Logger.Error(msg, "account", account, "err", err, "similar_lines_held_back", held)
	}
}

// ownedHeaders are the request headers the front sets or vouches for: the
// account and event it charged, and where the request came from.
var ownedHeaders = []string{HeaderAccount, HeaderEvent, "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto",
	"X-Real-Ip", "Forwarded", "Via"}

// lookalikeOnly are request headers the front passes on as the client sent
// them but whose "_" spellings it drops: Idempotency_Key, merged by CGI,
// WSGI and Rack into the real one, would give the upstream another key than
// the one the request was billed under, and defeat its de-duplication.
var lookalikeOnly = []string{"Idempotency-Key"}

// withoutLookalikes returns r without the headers whose names read as one
// of ownedHeaders, methodOverrides or lookalikeOnly once "_" is read as "-"
// (X_Quota_Account, X_HTTP_Method_Override): the front
// replaces the real ones, but an upstream that maps both to one name (CGI,
// WSGI, Rack: HTTP_X_QUOTA_ACCOUNT) would take a client's forged copy
// along. nginx drops such names by default for the same reason. r is
// cloned only when it has one; the caller's request stays as it was.
func withoutLookalikes(r *http.Request) *http.Request {
	var drop []string
	for name := range r.Header {
		if !strings.Contains(name, "_") {
			continue
		}
		dashed := strings.ReplaceAll(name, "_", "-")
		for _, o := range slices.Concat(ownedHeaders, methodOverrides, lookalikeOnly) {
			if strings.EqualFold(dashed, o) {
				drop = append(drop, name)
				break
			}
		}
	}
	if len(drop) == 0 {
		return r
	}
	r = r.Clone(r.Context())
	for _, name := range drop {
		delete(r.Header, name)
	}
	return r
}

// canonicalPath is where a Go ServeMux redirects a request whose path
// (escaped) MatchRedirect reports it would only redirect: the cleaned path,
// with a final slash when that names a subtree's root without it.
func canonicalPath(snap *snapshot.Snapshot, method, host, escaped string) string {
	p := cleanPath(escaped)
	if _, _, again := snap.Routes.MatchRedirect(method, host, p); again && !strings.HasSuffix(p, "/") {
		p += "/"
	}
	return p
}

// cleanPath is net/http's: path.Clean, rooted, keeping a final slash.
func cleanPath(p string) string {
	if p == "" {
		return "/"
	}
	if p[0] != '/' {
		p = "/" + p
	}
	np := path.Clean(p)
	if p[len(p)-1] == '/' && np != "/" {
		np += "/"
	}
	return np
}

// canonicalRedirectStatus reports a status a mux answers a path with when
// it only redirects it to its canonical form: Go's ServeMux (and nginx,
// gorilla's StrictSlash, chi's RedirectSlashes) send 301; some send 307 or
// 308 to keep the method. Never 302 or 303: those are a handler's
// Post/Redirect/Get, which did the work, even back to the same path.
func canonicalRedirectStatus(code int) bool {
	return code == http.StatusMovedPermanently || code == http.StatusTemporaryRedirect || code == http.StatusPermanentRedirect
}

// canonicalRedirect reports whether the 3xx next answered is the redirect
// to the canonical path: its Location, resolved against the request's URL,
// is that path (under the upstream's base path, for the proxy) with the
// request's query. Its scheme and host are not compared (an upstream
// behind the proxy names its own). Any other redirect (a handler's
// Post/Redirect/Get 303 on a path the upstream cleans itself) did the
// work, and is billed as any answer.
func (f *front) canonicalRedirect(rec *recorder, r *http.Request, canonical string) bool {
	loc := rec.Header().Get("Location")
	if loc == "" {
		return false
	}
	ref, err := url.Parse(loc)
	if err != nil {
		return false
	}
	to := r.URL.ResolveReference(ref)
	if to.RawQuery != r.URL.RawQuery {
		return false
	}
	want := []string{canonical}
	if f.base != "" && f.base != "/" {
		want = append(want, strings.TrimSuffix(f.base, "/")+canonical)
	}
	for _, w := range want {
		dec, err := url.PathUnescape(w)
		if to.EscapedPath() == w || to.Path == w || (err == nil && to.Path == dec) {
			return true
		}
	}
	return false
}

// bodyBounded reports whether MaxBodyBytes applies to r: not to gRPC calls,
// which are streams.
func (f *front) bodyBounded(r *http.Request) bool {
	return f.opts.MaxBodyBytes > 0 && !isGRPCCall(r)
}

// isGRPCCall reports a gRPC call: HTTP/2 with a gRPC content type. A
// Content-Type alone is the client's say: over HTTP/1.1 (which gRPC does not
// use) it exempted any body from the limit. gRPC-Web is not one: its calls
// are unary or server-streaming, with bounded request bodies.
func isGRPCCall(r *http.Request) bool {
	ct := r.Header.Get("Content-Type")
	return r.ProtoMajor == 2 && isGRPC(ct) && !strings.HasPrefix(ct, "application/grpc-web")
}

// isPreflight reports a CORS preflight: OPTIONS with Origin and
// Access-Control-Request-Method (the Fetch standard's definition).
func isPreflight(r *http.Request) bool {
	return r.Method == http.MethodOptions && r.Header.Get("Origin") != "" && r.Header.Get("Access-Control-Request-Method") != ""
}

// caller finds the request's API key in the config snapshot.
func (f *front) caller(r *http.Request) (snapshot.Key, *snapshot.Snapshot, *Problem) {
	plain, _, ok := apiKey(r.Header)
	if !ok {
		return snapshot.Key{}, nil, unknownKey(true)
	}
	snap := f.opts.Config.Snapshot()
	if snap == nil {
		return snapshot.Key{}, nil, unavailable("No config yet: the quota service has not read one from its ledger; retry in a second.")
	}
	key, ok := snap.Key(snapshot.HashKey(plain))
	if !ok {
		return snapshot.Key{}, nil, unknownKey(false)
	}
	return key, snap, nil
}

// apiKey reads the API key: X-Api-Key, else Authorization: Bearer. X-Api-Key
// wins so that an upstream's own bearer token can travel beside it. from
// names the header it came from (StripAPIKeyHeader drops that one).
func apiKey(h http.Header) (key, from string, ok bool) {
	if k := strings.TrimSpace(h.Get("X-Api-Key")); k != "" {
		return k, "X-Api-Key", true
	}
	auth := h.Get("Authorization")
	if len(auth) > len("Bearer ") && strings.EqualFold(auth[:len("Bearer ")], "Bearer ") {
		k := strings.TrimSpace(auth[len("Bearer "):])
		return k, "Authorization", k != ""
	}
	return "", "", false
}

// RequestTarget is the digest the HTTP front sends as ChargeRequest.Target:
// the method and the request target (path and query, as sent), so that an
// Idempotency-Key names one request and a retry of it, however it reaches
// the cluster. The host is left out: a client may retry through another
// node's address. It is never 0.
func RequestTarget(r *http.Request) uint64 {
	h := sha256.New()
	io.WriteString(h, r.Method)
	h.Write([]byte{' '})
	io.WriteString(h, r.URL.EscapedPath())
	h.Write([]byte{'?'})
	io.WriteString(h, r.URL.RawQuery)
	if r.Method == http.MethodPost {
		// A method override names another request: the same key with
		// another override is another request (422), not a free replay.
		overrides(r, func(m string) {
			h.Write([]byte{'\n'})
			io.WriteString(h, m)
		})
	}
	var sum [sha256.Size]byte
	return max(1, binary.BigEndian.Uint64(h.Sum(sum[:0])))
}

// maxIdempotencyKey bounds an Idempotency-Key's length.
const maxIdempotencyKey = 255

// idempotencyKey validates the Idempotency-Key header: at most one, whose
// key is 1..255 printable ASCII characters. The IETF draft
// (draft-ietf-httpapi-idempotency-key-header) sends it as a structured-field
// string: a value that starts with a double quote must be one (RFC 9651
// section 3.3.3: printable ASCII, only \" and \\ escaped, a closing quote
// and nothing after it), and the key is its content. A value without quotes
// is taken as the key itself, leniently, but must not hold a double quote, a
// backslash or a comma, so that one key has one spelling and a list
// ("a", "b") is no key. Event ids are per account, so one value from two
// accounts names two events.
func idempotencyKey(h http.Header) (string, *Problem) {
	vals := h.Values("Idempotency-Key")
	switch len(vals) {
	case 0:
		return "", nil
	case 1:
	default:
		return "", badRequest("Send at most one Idempotency-Key header.")
	}
	v := vals[0]
	for i := 0; i < len(v); i++ {
		if v[i] < 0x20 || v[i] > 0x7e {
			return "", badRequest(fmt.Sprintf("The Idempotency-Key may hold printable ASCII only (byte %d is 0x%02x).", i, v[i]))
		}
	}
	k := v
	if strings.HasPrefix(v, `"`) {
		var prob *Problem
		if k, prob = sfString(v); prob != nil {
			return "", prob
		}
	} else if i := strings.IndexAny(v, `"\,`); i >= 0 {
		return "", badRequest(fmt.Sprintf("The Idempotency-Key holds %q at byte %d: a key without quotes may not hold a double quote, a backslash or a comma. Send it as a structured-field string in double quotes, with \\\" and \\\\ escapes.", v[i], i))
	}
	if k == "" || len(k) > maxIdempotencyKey {
		return "", badRequest(fmt.Sprintf("The Idempotency-Key must be 1 to %d characters long (got %d).", maxIdempotencyKey, len(k)))
	}
	if why := shard.ClientIDProblem(k); why != "" {
		return "", badRequest(fmt.Sprintf("The Idempotency-Key %q cannot be used: %s.", k, why))
	}
	return k, nil
}

// sfString parses v, printable ASCII starting with a double quote, as a
// structured-field string and returns its content.
func sfString(v string) (string, *Problem) {
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		switch c := v[i]; c {
		case '\\':
			if i+1 == len(v) || (v[i+1] != '"' && v[i+1] != '\\') {
				return "", badRequest(fmt.Sprintf("The Idempotency-Key string has a backslash at byte %d not followed by a double quote or a backslash: only \\\" and \\\\ are escapes.", i))
			}
			i++
			b.WriteByte(v[i])
		case '"':
			if i+1 < len(v) {
				return "", badRequest(fmt.Sprintf("The Idempotency-Key has %q after its closing double quote: send one key (a list such as \"a\", \"b\" is not one).", v[i+1:]))
			}
			return b.String(), nil
		default:
			b.WriteByte(c)
		}
	}
	return "", badRequest("The Idempotency-Key starts with a double quote but has no closing one: send the key as a structured-field string in double quotes, or without quotes.")
}

// finish answers a cut-off body with 413 if next did not answer, and refunds
// under the bill-on policy.
func (f *front) finish(rec *recorder, r *http.Request, c *charged, body *limitedBody) {
	rec.pass() // an answer net/http completes after next returns is an answer too
	cutWhy, cutProb := body.cutOff(f.opts.MaxBodyBytes)
	if cutProb != nil && !rec.wrote {
		if body.before != nil {
			// The handler's headers describe an answer it never wrote
			// (Content-Encoding, Set-Cookie, ETag...), not the front's
			// problem: the map goes back to what it held before next.
			h := rec.ResponseWriter.Header()
			clear(h)
			maps.Copy(h, body.before)
		}
		cutProb(f.refundFirst(rec, r, c, cutWhy)).write(rec, r)
	}
	if !c.units() {
		return // a weight-0 route: nothing of ours to return
	}
	why := ""
	code := rec.code(r)
	// The client left after the upstream (or handler) had the request: the
	// work was done or under way, whatever status the client would have
	// got (a 499 under bill-on 2xx, a gRPC stream the client cancelled,
	// whose status is then missing or CANCELLED). Refunding it let a
	// client that hangs up early start work for free.
	// So did a client that left before the answer's head: a handler that
	// answers its cancelled context with a 500 (http.Error on ctx.Done(),
	// a common pattern) was refunded work started for a client that hung
	// up on purpose.
	left := clientLeft(r) && (!rec.wrote || rec.leftBeforeHead || rec.grpcCall(r))
	switch {
	case cutWhy != "":
		why = cutWhy
	case f.opts.BillOn == BillOnAlways:
	case rec.failed:
		why = "the upstream failed"
	case left:
	case c.canonical != "" && canonicalRedirectStatus(code) && f.canonicalRedirect(rec, r, c.canonical):
		why = fmt.Sprintf("the upstream only redirected the request to its canonical path (%d)", code)
	case f.opts.BillOn == BillOn2xx && (code < 200 && code != http.StatusSwitchingProtocols || code >= 400):
		why = fmt.Sprintf("the answer was %d (bill-on 2xx)", code) // NB: a protocol upgrade that took place is a success
	case f.opts.BillOn == BillOn2xx && rec.grpcFailed(r):
		why = "the gRPC status was " + rec.grpcStatus() + " (bill-on 2xx)"
	case f.opts.BillOn == BillOnSuccess && code >= 500:
		why = fmt.Sprintf("the answer was %d", code)
	case f.opts.BillOn == BillOnSuccess && rec.grpcFailed(r):
		why = "the gRPC status was " + rec.grpcStatus()
	}
	if why == "" {
		return
	}
	// The client has the answer's head before the refund round trip, but
	// for a gRPC call: a failed call's status mostly comes trailers-only
	// (one HEADERS frame that ends the stream), and flushed now it would
	// go out as headers without the end of the stream, so that the client
	// reads INTERNAL ("closed the stream without sending trailers") instead
	// of the status. Nor after refundFirst, whose answer is written whole.
	// Never after a panic: net/http sends nothing of a buffered answer
	// whose handler panicked, and a flush here sent a handler's whole "200
	// OK" (written before a deferred call panicked) with the charge
	// refunded.
	if rec.wrote && rec.writeErr == nil && !rec.hijacked && !rec.panicked && !c.refunded && !isGRPCCall(r) {
		_ = http.NewResponseController(rec.ResponseWriter).Flush()
	}
	f.refund(r, c, why)
}

// refundFirst refunds c before the front answers for it (413 for a body
// that grew over the limit, 502 and 504 for a failed upstream), so that the
// answer's quota headers are the account's state after the refund, which
// its detail ("its charge is refunded", "the charge is refunded") describes.
// When the refund did not go through, that state is unknown and the answer
// carries no quota headers: the charged state would contradict the detail.
// The cost is the refund's round trip (at most RefundTimeout) on these
// answers only.
//
// It reports whether the charge is refunded (or there was none to refund):
// the answer's detail says which.
func (f *front) refundFirst(rec *recorder, r *http.Request, c *charged, why string) (refunded bool) {
	if c.refunded || !c.units() {
		return !c.refundFailed // nothing was charged now (weight 0), or refunded before: the headers stand
	}
	d, ok := f.refund(r, c, why)
	now := f.opts.Now().Unix()
	rec.headers = func(h http.Header) {
		if !ok {
			delFrontHeaders(h)
			return
		}
		setQuotaHeaders(h, &d, now, c.hard)
	}
	return !c.refundFailed
}

// refund returns c's units once: the attempt's own charge, or, for an
// attempt answered Replayed, takes it back from the charge it relied on (the
// owner refunds that charge only if its own attempt failed too). It returns
// the owner's answer, and whether that answer is the account's state after
// the refund (false when the refund failed or was not made).
func (f *front) refund(r *http.Request, c *charged, why string) (shard.Decision, bool) {
	if c.refunded || !c.units() {
		return shard.Decision{}, false
	}
	c.refunded = true
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), f.opts.RefundTimeout)
	defer cancel()
	req := RefundRequest{Account: c.Account, EventID: c.EventID, Receipt: c.receipt, Attempt: true}
	if c.Replayed {
		req = RefundRequest{Account: c.Account, EventID: c.EventID, Receipt: c.receipt, Replay: true}
	}
	d, err := f.refundRetried(ctx, req)
	if err == nil && d.Reason == shard.Kept {
		f.opts.Logger.Debug("refund kept: another attempt was served under this charge", "account", c.Account, "event", c.EventID, "why", why)
		return d, true
	}
	if err != nil || (d.Reason != shard.Refunded && d.Reason != shard.AlreadyRefunded) {
		// NB: the charge stands; a client id's event can still be refunded
		// by id for the dedup window (router.Client.Refund).
		f.opts.Logger.Warn("refund failed: the charge stands", "account", c.Account, "event", c.EventID,
			"units", c.Units, "why", why, "reason", d.Reason, "err", err)
		c.refundFailed = true
		return d, false
	}
	f.opts.Logger.Debug("refunded", "account", c.Account, "event", c.EventID, "units", c.Units, "why", why)
	return d, true
}

// refundRetried sends req until the owner answers, ctx ends, or an error
// says a retry cannot help. A refund applies once, so a retry is safe; and
// an owner that has just crashed is back, or its account moved to a node
// that answers, within seconds: a single try left such a refund undone,
// and the failed request billed (a review's kill -9 did it).
func (f *front) refundRetried(ctx context.Context, req RefundRequest) (shard.Decision, error) {
	wait := refundRetryFirst
	for {
		d, err := f.opts.Charger.Refund(ctx, req)
		if err == nil || !errors.Is(err, ErrUnavailable) || ctx.Err() != nil {
			return d, err
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return d, err
		case <-t.C:
		}
		wait = min(2*wait, refundRetryMax)
	}
}

// The pauses between tries of a refund: doubling from the first to the
// most, within FrontOptions.RefundTimeout.
const (
	refundRetryFirst = 100 * time.Millisecond
	refundRetryMax   = time.Second
)

func (f *front) observe(code int, added time.Duration) {
	if f.opts.OnRequest != nil {
		f.opts.OnRequest(code, added)
	}
}

// ErrCutOff is the cause to cancel a request's context with (through the
// http.Server's BaseContext and context.WithCancelCause) when the server
// cuts it off, such as at the end of a drain: the front then refunds its
// charge as for a failed upstream, where a client that left after the
// upstream got its request stays billed.
var ErrCutOff = errors.New("router: the server cut the request off")

// sentKey is the context key of the *atomic.Bool that NewProxy's handler
// sets once the request's head is written to the upstream.
type sentKey struct{}

// markSent returns out with a trace that sets in's sent flag once out's
// head is written (to the upstream), or out as it is outside the front.
// Each attempt clears it as it begins (GetConn): the transport tries a
// request again on a fresh connection when a kept-alive one turned out
// closed by the upstream before it read it, and a client that leaves while
// that retry dials was never served (its first head went nowhere), so it
// is refunded. With the flag kept from the first attempt it stayed billed.
func markSent(in, out *http.Request) *http.Request {
	sent, ok := in.Context().Value(sentKey{}).(*atomic.Bool)
	if !ok {
		return out
	}
	return out.WithContext(httptrace.WithClientTrace(out.Context(), &httptrace.ClientTrace{
		GetConn:      func(string) { sent.Store(false) },
		WroteHeaders: func() { sent.Store(true) },
	}))
}

// clientLeft reports a client that hung up after the request reached the
// handler's upstream (or, for a handler that is not NewProxy's, at all):
// that is not the upstream failing, and the charge stands, as for a client
// that leaves a plain handler. Before, a client that dropped a streamed
// answer part way, or sent a slow POST and left, was refunded while the
// upstream did the work. A request that never reached the upstream is
// still refunded.
func clientLeft(r *http.Request) bool {
	if r.Context().Err() == nil || errors.Is(context.Cause(r.Context()), ErrCutOff) {
		return false
	}
	sent, ok := r.Context().Value(sentKey{}).(*atomic.Bool)
	return !ok || sent.Load()
}

// recorder wraps the handler's ResponseWriter: it remembers the status,
// whether anything was written, write errors, and whether the proxy's
// ErrorHandler ran. Unwrap lets http.ResponseController reach Flush,
// Hijack and deadlines of the writer below.
type recorder struct {
	http.ResponseWriter
	status   int
	wrote    bool
	failed   bool // the upstream failed (ErrorHandler) or the handler panicked
	panicked bool // the handler panicked: its buffered answer is never flushed
	// clientLeft, when set, says whether the client has hung up (the
	// request as the handler got it), and leftBeforeHead whether it had
	// when the answer's head was written.
	clientLeft     func() bool
	leftBeforeHead bool
	charged        bool // the request was charged units (not a preflight, not a route of weight 0)
	hijacked       bool // the handler took the connection over (Hijack)
	writeErr       error
	// gate, when set, runs once before anything reaches the client: the
	// charge's durability wait. If it fails, gateFailed answers instead and
	// everything next writes is dropped.
	gate       func() error
	gateFailed func(error)
	gateErr    error
	// headers, when set, puts the front's headers on the final answer
	// again: ReverseProxy clears the header map after relaying a 1xx
	// (100 Continue, 103 Early Hints).
	headers func(http.Header)
	// refundFirst refunds the charge before an answer the front writes
	// for a refunded request (front.refundFirst), and reports whether it
	// is refunded.
	refundFirst func(why string) bool
	// body is the request's body as the front wrapped it (nil when it did
	// not): ReverseProxy's ErrorHandler gets a request whose Body may not
	// be it.
	body *limitedBody
}

// final runs before the final status goes out.
func (w *recorder) final() {
	if w.clientLeft != nil {
		w.leftBeforeHead = w.clientLeft()
	}
	if w.body != nil {
		w.body.answered.Store(true)
	}
	if w.headers != nil {
		w.headers(w.Header())
	}
}

// pass runs the gate once and reports whether writes may go through.
func (w *recorder) pass() bool {
	if w.gate != nil {
		g := w.gate
		w.gate = nil
		if w.gateErr = g(); w.gateErr != nil {
			w.failed, w.wrote, w.status = true, true, http.StatusInternalServerError
			w.gateFailed(w.gateErr)
		}
	}
	return w.gateErr == nil
}

func (w *recorder) WriteHeader(code int) {
	if !w.pass() {
		return
	}
	if !w.wrote && (code >= 200 || code == http.StatusSwitchingProtocols) {
		w.status, w.wrote = code, true // 1xx other than 101 are interim: the final status is still to come
		w.final()
	} else if code < 200 && code != http.StatusSwitchingProtocols {
		// An interim answer (103 Early Hints) goes out with the header map
		// as it is: the front's values, set before the handler ran, and any
		// the upstream put on its 1xx (ReverseProxy adds them), which must
		// never reach the client. The quota headers belong on the final
		// answer, where final puts the front's back.
		delFrontHeaders(w.Header())
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *recorder) Write(b []byte) (int, error) {
	if !w.pass() {
		return 0, w.gateErr
	}
	if !w.wrote {
		w.status, w.wrote = http.StatusOK, true
		w.final()
	}
	n, err := w.ResponseWriter.Write(b)
	if err != nil && w.writeErr == nil {
		w.writeErr = err
	}
	return n, err
}

// Flush implements http.Flusher for handlers that type-assert it.
func (w *recorder) Flush() { _ = w.FlushError() }

// FlushError is Flush with its error, as http.ResponseController.Flush
// returns it: without it the controller reached the writer below through
// Unwrap, and a handler behind the middleware never saw a client's broken
// pipe there.
func (w *recorder) FlushError() error {
	if !w.pass() {
		return w.gateErr
	}
	if !w.wrote {
		w.status, w.wrote = http.StatusOK, true
		w.final()
	}
	err := http.NewResponseController(w.ResponseWriter).Flush()
	if err != nil && !errors.Is(err, http.ErrNotSupported) && w.writeErr == nil {
		w.writeErr = err
	}
	return err
}

// Hijack implements http.Hijacker, for handlers that type-assert it and
// for http.ResponseController (which ReverseProxy uses to relay a WebSocket
// or another protocol upgrade): whatever the handler writes to the
// connection bypasses the recorder, so the charge's durability wait runs
// first, and a charge that is not durable refuses the hijack (the front
// has answered 500). The front's headers go on the answer as usual:
// ReverseProxy writes its 101 with the header map.
func (w *recorder) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	if !w.pass() {
		return nil, nil, fmt.Errorf("router: the connection was not handed over: the charge is not durable (%w)", w.gateErr)
	}
	conn, brw, err := http.NewResponseController(w.ResponseWriter).Hijack()
	if err != nil {
		return nil, nil, err
	}
	w.hijacked = true
	if !w.wrote {
		w.status, w.wrote = http.StatusSwitchingProtocols, true // what an upgrade answers; net/http no longer knows
		w.final()
	}
	return conn, brw, nil
}

func (w *recorder) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// code is the status the client got (net/http sends 200 for a handler that
// wrote nothing), 499 when the client left first, or 500 for a handler that
// panicked before it answered (the client gets no answer, and the server's
// log has the panic).
func (w *recorder) code(r *http.Request) int {
	switch {
	case w.wrote:
		return w.status
	case r.Context().Err() != nil:
		return statusClientClosed
	case w.failed:
		return http.StatusInternalServerError
	}
	return http.StatusOK
}

// grpcStatus is the final grpc-status of a gRPC answer: the trailer (which
// ReverseProxy and grpc-go put into the header map after the body, plain or
// with http.TrailerPrefix), or the Grpc-Status header of a trailers-only
// answer. Empty when there is none.
func (w *recorder) grpcStatus() string {
	h := w.Header()
	if v := h.Values(http.TrailerPrefix + "Grpc-Status"); len(v) > 0 {
		return v[len(v)-1]
	}
	if v := h.Values("Grpc-Status"); len(v) > 0 {
		return v[len(v)-1]
	}
	return ""
}

// grpcFailed reports a gRPC answer (Content-Type application/grpc...) to a
// gRPC request whose final status is not OK. An answer with no status at
// all is not one: a stream the upstream broke fails the copy (the proxy
// aborts, and the front refunds for that), one the client cancelled stays
// billed, and one that ended cleanly without a status is no gRPC server's
// (a file served over HTTP/2 with a gRPC type, to a client that claimed
// gRPC, was refunded). gRPC-Web (application/grpc-web...) carries its
// trailers inside the body, which the front does not parse: only a
// trailers-only answer's status (in the headers) counts there. An answer
// to a request that was not gRPC is not one, whatever its Content-Type: a
// file served with the type its uploader chose was refunded.
func (w *recorder) grpcFailed(r *http.Request) bool {
	ct, in := w.Header().Get("Content-Type"), r.Header.Get("Content-Type")
	switch {
	case strings.HasPrefix(ct, "application/grpc-web") && strings.HasPrefix(in, "application/grpc-web"):
		s := w.Header().Get("Grpc-Status")
		return s != "" && s != "0"
	case isGRPC(ct) && isGRPCCall(r):
		s := w.grpcStatus()
		return s != "" && s != "0"
	}
	return false
}

// grpcCall reports a gRPC answer to a gRPC request (a stream the client
// may end by cancelling it).
func (w *recorder) grpcCall(r *http.Request) bool {
	return isGRPC(w.Header().Get("Content-Type")) && isGRPCCall(r)
}

// limitedBody notes when http.MaxBytesReader cut the body off or the
// client broke it off (a read failed other than at its end), and cuts off
// a body idle for idle, or not read to its end by deadline (the read
// deadline, the sooner of the two, moves on before each read, and goes
// once the body is read to its end: net/http's background read of the
// connection, which notices a client that hangs up, must not time out
// while the upstream answers). Its flags are atomic: http.Transport reads a
// proxied body on its own goroutine.
type limitedBody struct {
	io.ReadCloser
	tripped atomic.Bool // MaxBytesReader cut it off
	stalled atomic.Bool // it sent nothing for idle
	late    atomic.Bool // it was not read to its end by deadline
	// broken: a read failed before its end, not by the front's doing: the
	// client went away mid-body, or sent a malformed one (chunking, an
	// HTTP/2 stream reset). Errors once the body is closed (the transport
	// or the handler is done with it) or the handler returned are not.
	broken atomic.Bool
	closed atomic.Bool
	eof    atomic.Bool // a read reached the body's end
	// answered: the final answer's head went out (recorder.final). A body
	// broken off after it is not broken: the client had its answer (a
	// full-duplex upstream answers before it reads the whole body), and
	// the request is billed as any answered one.
	answered atomic.Bool

	// before is the answer's headers before next ran, for a body of
	// unknown length bounded by MaxBodyBytes in middleware mode: finish
	// puts them back under the 413 it writes when next did not answer.
	before http.Header

	idle time.Duration // 0: no idle bound
	// total is FrontOptions.BodyTimeout and deadline the request's arrival
	// plus it (zero: no bound).
	total    time.Duration
	deadline time.Time
	rc       *http.ResponseController // the request's, for its read deadline
	// done is set when the handler has returned: a ResponseController must
	// not be used after, and the transport may still read (and fail).
	done atomic.Bool
	// rcMu makes setting the read deadline and handlerDone exclusive: the
	// transport reads the body on its own goroutine, and a deadline it set
	// after the check of done and after the handler returned used a
	// ResponseWriter net/http had taken back (HTTP/2 pools its state: a nil
	// dereference on a goroutine nothing recovers, or another stream's
	// deadline; the race detector saw it).
	rcMu sync.Mutex
}

// whyTooLarge is the refund's reason for a body over the limit.
const whyTooLarge = "the request body was over the limit"

// cutOff says why the front cut the body off and what it answers: over the
// limit (413), stalled or too slow (408); "" and nil when it did not (b
// may be nil).
func (b *limitedBody) cutOff(maxBody int64) (why string, answer func(refunded bool) *Problem) {
	switch {
	case b == nil:
	case b.tripped.Load():
		return whyTooLarge, func(refunded bool) *Problem { return cutTooLarge(maxBody, refunded) }
	case b.late.Load():
		return "the request body took too long", func(refunded bool) *Problem { return bodyTooSlow(b.total, refunded) }
	case b.stalled.Load():
		return "the request body stalled", func(refunded bool) *Problem { return bodyStalled(b.idle, refunded) }
	case b.broken.Load():
		return whyBodyBroken, bodyBroken
	}
	return "", nil
}

// whyBodyBroken is the refund's reason for a body the client broke off.
const whyBodyBroken = "the request body could not be read to its end"

// Close notes that the body's reader is done with it: a read that fails
// after (or racing) it is not the client's doing.
func (b *limitedBody) Close() error {
	b.closed.Store(true)
	return b.ReadCloser.Close()
}

// handlerDone stops the read deadlines: ServeHTTP calls it as the handler
// returns.
func (b *limitedBody) handlerDone() {
	b.rcMu.Lock()
	defer b.rcMu.Unlock()
	b.done.Store(true)
}

// setReadDeadline sets the request's read deadline to d unless the handler
// has returned (NB: ErrNotSupported leaves the body unbounded, as before).
func (b *limitedBody) setReadDeadline(d time.Time) {
	b.rcMu.Lock()
	defer b.rcMu.Unlock()
	if !b.done.Load() {
		_ = b.rc.SetReadDeadline(d)
	}
}

func (b *limitedBody) Read(p []byte) (int, error) {
	timed := b.rc != nil && !b.done.Load()
	if timed {
		d := b.deadline
		if b.idle > 0 {
			if next := time.Now().Add(b.idle); d.IsZero() || next.Before(d) {
				d = next
			}
		}
		b.setReadDeadline(d)
	}
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.eof.Store(true)
	}
	if err != nil && !b.answered.Load() {
		// NB: once the answer's head went out, a body cut off, stalled or
		// broken is billed as any answered request: the client had its
		// answer (refunding it gave a full-duplex endpoint's answer away
		// to a client that padded its body past the limit, or paused).
		var mbe *http.MaxBytesError
		switch {
		case errors.As(err, &mbe):
			b.tripped.Store(true)
		case errors.Is(err, os.ErrDeadlineExceeded) && !b.deadline.IsZero() && !time.Now().Before(b.deadline):
			b.late.Store(true)
		case errors.Is(err, os.ErrDeadlineExceeded):
			b.stalled.Store(true)
		case err != io.EOF && !b.closed.Load() && !b.done.Load() && !errors.Is(err, http.ErrBodyReadAfterClose):
			b.broken.Store(true)
		}
	}
	if timed && !b.done.Load() {
		switch {
		case err == io.EOF:
			b.setReadDeadline(time.Time{})
		case err == nil && b.idle > 0:
			// The idle bound is on a read that waits, not on the time
			// between reads: on HTTP/2 the deadline's timer closes the
			// body even while no read waits, so an upstream that paused
			// reading had a steady upload cut off as stalled (408).
			b.setReadDeadline(b.deadline)
		}
	}
	return n, err
}

// What implements the front's seams.
var (
	_ Charger      = (*Router)(nil)
	_ Charger      = (*Client)(nil)
	_ ConfigSource = (*Client)(nil)
	_ ConfigSource = (*engine.Engine)(nil)
)
