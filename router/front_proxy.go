package router

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/http/httpguts"
)

// Request headers the proxy sets for the upstream, and Middleware for the
// handler it wraps. Whatever the client sent under these names is dropped
// first, so the upstream or handler can trust them.
const (
	// HeaderAccount names the account the request was charged to.
	HeaderAccount = "X-Quota-Account"
	// HeaderEvent names the charge (the Idempotency-Key when one was sent).
	HeaderEvent = "X-Quota-Event"
)

// CheckUpstream reports an upstream URL NewProxy refuses: not an absolute
// http://, https:// or h2c:// URL, no host name, a port that is not a
// number from 1 to 65535, a fragment (never sent), or a user and password
// (ReverseProxy does not send them: put credentials in a header the
// upstream reads).
func CheckUpstream(u *url.URL) error {
	switch {
	case u == nil || (u.Scheme != "http" && u.Scheme != "https" && u.Scheme != "h2c") || u.Host == "":
		return fmt.Errorf("upstream %v: want an absolute http://, https:// or h2c:// URL, such as http://127.0.0.1:8081", u)
	}
	if err := CheckURLHost(u, "upstream "+u.Redacted(), "http://HOST[:PORT][/base]"); err != nil {
		return err
	}
	if u.User != nil {
		return fmt.Errorf("upstream %v: the proxy does not send a user and password from the URL: leave them out", u.Redacted())
	}
	return nil
}

// CheckURLHost reports what keeps an absolute URL from reaching a server:
// no host name, a port that is not a number from 1 to 65535 (or a colon
// with none after it), or a #fragment, which is never sent. name is the URL
// as errors show it (without its password), want the form to ask for.
// --upstream and --alert-webhook are checked by it.
func CheckURLHost(u *url.URL, name, want string) error {
	switch {
	case u.Hostname() == "":
		return fmt.Errorf("%s: the URL names no host: want %s", name, want)
	case u.Fragment != "":
		return fmt.Errorf("%s: a #fragment is never sent to a server: leave it out", name)
	}
	if p := u.Port(); p != "" {
		if !validPort(p) {
			return fmt.Errorf("%s: port %q is not a number from 1 to 65535", name, p)
		}
	} else if strings.HasSuffix(u.Host, ":") {
		return fmt.Errorf("%s: the port after the colon is missing", name)
	}
	return nil
}

// validPort reports whether p is a TCP port number, 1 to 65535.
func validPort(p string) bool {
	n, err := strconv.Atoi(p)
	return err == nil && n >= 1 && n <= 65535
}

// trailerCopy is a request body that, at its end, copies the trailers the
// client sent (in, filled as the body ends) into the upstream request's
// (out), which the transport sends after the body.
type trailerCopy struct {
	io.ReadCloser
	in, out http.Header
	strip   bool // StripAPIKeyHeader (dropTrailer)
}

func (t *trailerCopy) Read(p []byte) (int, error) {
	n, err := t.ReadCloser.Read(p)
	if err == io.EOF {
		for k, v := range t.in {
			if len(v) > 0 && !dropTrailer(k, t.strip) {
				t.out[k] = v
			}
		}
	}
	return n, err
}

// responseTrailers is an upstream's response body that, as it ends, drops
// the trailers named as the front's own headers (frontHeaders): an
// upstream's value for one, announced or not, reached the client after the
// body, where a client that merges trailers into headers read it beside or
// instead of the front's. The transport fills res.Trailer as the body ends
// (at EOF, or at Close), on the goroutine reading it: ReverseProxy's, which
// copies res.Trailer to the client after Close.
type responseTrailers struct {
	io.ReadCloser
	res *http.Response
}

func (b *responseTrailers) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		delFrontHeaders(b.res.Trailer)
	}
	return n, err
}

func (b *responseTrailers) Close() error {
	err := b.ReadCloser.Close()
	delFrontHeaders(b.res.Trailer)
	return err
}

// dropTrailer reports a request trailer (canonical name k) the proxy does
// not pass on: the names it sets for the upstream to trust (the caller's
// account and event, the Idempotency-Key it billed under) and, with strip,
// the API key's. A client's trailer of that name reached an upstream that
// reads trailers as headers (many merge them), with the client's value.
// So are the names that say who the client is (forged, they pass for the
// balancer's or this proxy's) and the method overrides (the front prices a
// POST by its override header, not by a trailer).
func dropTrailer(k string, strip bool) bool {
	switch k {
	case HeaderAccount, HeaderEvent, "Idempotency-Key", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto", "Forwarded", "X-Real-Ip", "Via":
		return true
	case "Authorization", "X-Api-Key":
		return strip
	}
	return slices.Contains(clientIPHeaders, k) || slices.Contains(methodOverrides, k)
}

// clientIPHeaders are the other headers frameworks read the client's
// address from (chi's RealIP reads True-Client-IP before X-Real-IP and
// X-Forwarded-For; Cloudflare's, Akamai's and Fastly's, which libraries
// trust when present). The proxy sets X-Forwarded-For and X-Real-IP; these
// a client sent are dropped, since none of them came from this proxy.
// With TrustForwarded, the balancer in front may set them: they pass.
var clientIPHeaders = []string{"True-Client-Ip", "X-Client-Ip", "Cf-Connecting-Ip", "Fastly-Client-Ip", "X-Cluster-Client-Ip"}

// canonicalKey is the form in which the proxy passes an Idempotency-Key
// on: the key itself when it can stand bare, else an sf-string. "k1" and
// k1 are one key, billed once: the upstream, which de-duplicates by the
// key it receives, must get one spelling of it.
func canonicalKey(k string) string {
	if !strings.ContainsAny(k, `"\,`) {
		return k
	}
	var b strings.Builder
	b.WriteByte('"')
	for i := range len(k) {
		if k[i] == '"' || k[i] == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(k[i])
	}
	b.WriteByte('"')
	return b.String()
}

// NewProxy returns the clustered proxy: Middleware(opts) around an
// httputil.ReverseProxy to upstream: http://, https:// (HTTP/2 when the
// upstream offers it), or h2c:// for HTTP/2 without TLS, which gRPC servers
// without TLS need.
//
// What the upstream receives: the request as the client sent it (method,
// path joined to upstream's path, query, body streamed, Authorization and
// every end-to-end header; X-Api-Key too unless StripAPIKeyHeader), Host set
// to the upstream's host, X-Forwarded-For/-Host/-Proto, X-Real-IP and
// Forwarded naming the client (the client's own are dropped, unless
// TrustForwarded), Via with "quotad" appended, and X-Quota-Account and
// X-Quota-Event. ReverseProxy drops hop-by-hop headers both ways and
// handles protocol upgrades; only those in FrontOptions.Upgrades (a
// WebSocket by default) are offered to the upstream, since the requests
// sent after a switch would not be billed.
//
// Responses stream: ReverseProxy flushes at once for text/event-stream and
// for bodies of unknown length (chunked answers, gRPC), so Server-Sent
// Events and streaming RPCs are not buffered. Trailers pass through, a
// request's too (trailerCopy, but for dropTrailer's names), a response's but
// for the front's own headers' names (responseTrailers); the front reads
// grpc-status from them.
//
// CONNECT is refused with 501 problem+json before the API key is looked
// up, uncharged: the proxy tunnels nothing.
//
// The upstream failing (refused connection, reset, no response headers
// within UpstreamTimeout) is answered 502 or 504 problem+json
// (upstream-unavailable) and refunded unless BillOn is "always".
func NewProxy(upstream *url.URL, opts FrontOptions) (http.Handler, error) {
	if err := CheckUpstream(upstream); err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	h2c := upstream.Scheme == "h2c"
	if h2c {
		u := *upstream
		u.Scheme = "http"
		upstream = &u
	}
	transport := opts.Transport
	if transport == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.ResponseHeaderTimeout = opts.UpstreamTimeout
		// NB: the default of 2 idle connections per host makes a busy proxy
		// open and close a connection for most requests.
		t.MaxIdleConns, t.MaxIdleConnsPerHost = 1024, 512
		if h2c {
			t.Protocols = new(http.Protocols)
			t.Protocols.SetUnencryptedHTTP2(true) // and not HTTP/1: every request is h2c
		}
		transport = t
	}
	log := opts.Logger
	var upgrades []string // the names allowed, lower case
	switch {
	case opts.NoUpgrades:
	case opts.Upgrades == nil:
		upgrades = []string{"websocket"}
	default:
		for _, p := range opts.Upgrades {
			upgrades = append(upgrades, strings.ToLower(p))
		}
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out = markSent(pr.In, pr.Out)
			if len(pr.In.Trailer) > 0 && pr.Out.Body != nil && pr.Out.Trailer != nil {
				// ReverseProxy copies the request's Trailer map before the
				// body is read, with the names and no values: the upstream
				// got the trailers empty. (Not those dropTrailer names.)
				for k := range pr.Out.Trailer {
					if dropTrailer(k, opts.StripAPIKeyHeader) {
						delete(pr.Out.Trailer, k)
					}
				}
				pr.Out.Body = &trailerCopy{ReadCloser: pr.Out.Body, in: pr.In.Trailer, out: pr.Out.Trailer, strip: opts.StripAPIKeyHeader}
			}
			pr.Out = watchUpload(pr.In, pr.Out, opts.UpstreamTimeout)
			pr.SetURL(upstream)
			in, h := pr.In.Header, pr.Out.Header
			if h.Get("Upgrade") != "" {
				// After a 101 the proxy relays bytes: every request sent
				// over the switched connection would reach the upstream
				// unbilled and without a caller (with h2c, "h2c
				// smuggling"). Only the protocols allowed stay offered;
				// with none left, the request goes on without the offer
				// and is served as HTTP/1.1 (RFC 9110 section 7.8).
				if keep := allowedUpgrades(h.Values("Upgrade"), upgrades); keep == "" {
					h.Del("Upgrade")
					h.Del("Connection")
					h.Del("HTTP2-Settings")
				} else {
					h.Set("Upgrade", keep)
				}
			}
			peer, _, err := net.SplitHostPort(pr.In.RemoteAddr)
			if err != nil {
				peer = "" // SetXForwarded then sets no X-Forwarded-For
			}
			if opts.TrustForwarded {
				h["X-Forwarded-For"] = in["X-Forwarded-For"] // SetXForwarded appends the peer to it
				pr.SetXForwarded()
				for _, k := range []string{"X-Forwarded-Host", "X-Forwarded-Proto"} {
					if v := in.Values(k); len(v) > 0 {
						h[k] = v
					}
				}
				// ReverseProxy drops Forwarded: the balancer's passes on,
				// and this hop's element follows (RFC 7239 section 4).
				// X-Real-IP, which ReverseProxy keeps, passes as sent.
				h["Forwarded"] = in["Forwarded"]
			} else {
				pr.SetXForwarded()
				// chi's RealIP, gin and nginx's realip trust X-Real-IP
				// before X-Forwarded-For: a client's own is forged.
				h.Del("X-Real-IP")
				for _, k := range clientIPHeaders {
					h.Del(k)
				}
				if peer != "" {
					h.Set("X-Real-IP", peer)
				}
			}
			if peer != "" {
				h.Add("Forwarded", forwardedElement(peer, pr.In))
			}
			// RFC 9110 section 7.6.3: a gateway sends Via in each inbound
			// request, after the Via the request came with.
			h.Add("Via", viaProtocol(pr.In)+" quotad")
			if k, prob := idempotencyKey(pr.In.Header); prob == nil && k != "" {
				// The key the request was billed under reaches the upstream
				// even if the client named it in Connection (hop-by-hop,
				// which ReverseProxy drops): an upstream that refuses a key
				// it has completed must see it. In one spelling: "k1"
				// and k1 are billed as one key, and an upstream that
				// compared what it got ran the work twice.
				h["Idempotency-Key"] = []string{canonicalKey(k)}
			}
			h.Del(HeaderAccount)
			h.Del(HeaderEvent)
			if c, ok := CallerFrom(pr.In.Context()); ok {
				h.Set(HeaderAccount, c.Account)
				h.Set(HeaderEvent, c.EventID)
			}
			if opts.StripAPIKeyHeader {
				if _, from, _ := apiKey(pr.In.Header); from == "Authorization" {
					h.Del("Authorization") // the key was its Bearer token
				}
				h.Del("X-Api-Key")
			}
		},
		Transport:  watchEnding{transport},
		BufferPool: newBufferPool(),
		ModifyResponse: func(res *http.Response) error {
			delFrontHeaders(res.Header)
			delFrontHeaders(res.Trailer) // those announced: not announced to the client either
			// Trailers come after the body, at HTTP/2 or in a chunked
			// HTTP/1 answer; a 101's body is the switched connection,
			// which ReverseProxy needs as it is.
			if res.StatusCode != http.StatusSwitchingProtocols && (res.ProtoMajor >= 2 || res.ContentLength < 0 || res.Trailer != nil) {
				res.Body = &responseTrailers{ReadCloser: res.Body, res: res}
			}
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			upstreamError(w, r, err, opts.MaxBodyBytes, opts.UpstreamTimeout, opts.BillOn != BillOnAlways, log)
		},
		ErrorLog: slog.NewLogLogger(log.With("subsystem", "proxy").Handler(), slog.LevelWarn),
	}
	return &front{opts: opts, next: rp, proxy: true, base: upstream.Path}, nil // NB: opts.defaults ran above
}

// allowedUpgrades is the Upgrade header's offers (RFC 9110 section 7.8:
// protocol names, each with an optional /version) whose names are in
// allowed, in the client's order, comma-separated; "" when none is.
func allowedUpgrades(offers []string, allowed []string) string {
	var keep []string
	for _, v := range offers {
		for _, p := range strings.Split(v, ",") {
			p = strings.TrimSpace(p)
			name, _, _ := strings.Cut(p, "/")
			if p != "" && slices.Contains(allowed, strings.ToLower(name)) {
				keep = append(keep, p)
			}
		}
	}
	return strings.Join(keep, ", ")
}

// checkUpgradeName refuses an entry of FrontOptions.Upgrades that is not a
// protocol name (an HTTP token), and h2c.
func checkUpgradeName(p string) error {
	if p == "" || strings.ContainsFunc(p, func(r rune) bool { return !httpguts.IsTokenRune(r) }) {
		return fmt.Errorf("router: upgrade %q: want a protocol name as the Upgrade header gives it, such as websocket, without a version", p)
	}
	if strings.EqualFold(p, "h2c") {
		return errors.New("router: upgrade h2c cannot be allowed: the requests sent over the switched connection would reach the upstream unbilled; clients that speak HTTP/2 without TLS connect with it directly (prior knowledge), which the front serves and bills per request")
	}
	return nil
}

// forwardedElement is the proxy's own element of Forwarded (RFC 7239):
// the peer it got r from, the Host r named and its scheme, as the
// X-Forwarded-* it sets.
func forwardedElement(peer string, r *http.Request) string {
	if strings.Contains(peer, ":") {
		peer = "[" + peer + "]" // an IPv6 address (section 6)
	}
	proto := "http"
	if r.TLS != nil {
		proto = "https"
	}
	return "for=" + forwardedValue(peer) + ";host=" + forwardedValue(r.Host) + ";proto=" + proto
}

// forwardedValue is v as a token, or as a quoted-string when it is not one.
func forwardedValue(v string) string {
	for i := 0; i < len(v); i++ {
		if !tokenChar(v[i]) {
			return strconv.Quote(v) // NB: Host and peer hold printable ASCII; Quote escapes " and \ as a quoted-string does
		}
	}
	if v == "" {
		return `""`
	}
	return v
}

// tokenChar reports a tchar of RFC 9110 section 5.6.2.
func tokenChar(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// viaProtocol is the received-protocol of Via for r: "1.1", "2", "3".
func viaProtocol(r *http.Request) string {
	if r.ProtoMajor >= 2 {
		return strconv.Itoa(r.ProtoMajor)
	}
	return fmt.Sprintf("%d.%d", r.ProtoMajor, r.ProtoMinor)
}

// upstreamError is the ReverseProxy's ErrorHandler: the upstream gave no
// answer. It marks the request failed (refund) and answers problem+json.
func upstreamError(w http.ResponseWriter, r *http.Request, err error, maxBody int64, upstreamTimeout time.Duration, refunds bool, log *slog.Logger) {
	rec, _ := w.(*recorder)
	endUploadWatch(r)
	if stalled(r) {
		// Before clientLeft: the cancel is the watch's, not the client's.
		err = fmt.Errorf("%w for %s", context.Cause(r.Context()), upstreamTimeout)
	} else if clientLeft(r) {
		return // the client went away after the upstream got the request: the charge stands, nobody reads an answer
	}
	if rec != nil {
		rec.failed = true
	}
	var mbe *http.MaxBytesError
	var why string
	var prob func(refunded bool) *Problem
	switch {
	case errors.As(err, &mbe):
		why, prob = whyTooLarge, func(refunded bool) *Problem { return cutTooLarge(maxBody, refunded) }
	case rec != nil:
		why, prob = rec.body.cutOff(maxBody)
	}
	if prob != nil {
		refunded := true
		if rec != nil && rec.refundFirst != nil {
			refunded = rec.refundFirst(why)
		}
		prob(refunded).write(w, r)
		return
	}
	if r.Context().Err() != nil && !stalled(r) {
		// The client went away before the upstream got the request: it was
		// not served, so it is refunded whatever BillOn says (as a client
		// that left while its charge was decided); nobody reads an answer.
		if rec != nil && rec.refundFirst != nil && !errors.Is(context.Cause(r.Context()), ErrCutOff) {
			rec.refundFirst("the client went away before the request was served")
		}
		return
	}
	refunded := true
	if refunds && rec != nil && rec.refundFirst != nil {
		refunded = rec.refundFirst("the upstream failed")
	}
	var ne net.Error
	stall := errors.Is(err, errUpstreamStalled)
	timeout := errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) || stall || errors.Is(err, errUpstreamSilent)
	log.Warn("upstream failed", "method", r.Method, "path", r.URL.Path, "timeout", timeout, "err", err)
	charge := " The charge is refunded: retry later."
	switch {
	case rec == nil || !rec.charged:
		charge = " Nothing was charged: retry later." // a preflight, a route of weight 0
	case !refunds:
		charge = " The charge stands (bill-on always): a retry is charged again, unless it carries the same Idempotency-Key."
	case !refunded:
		charge = " The charge could not be refunded now and stands: retry later with the same Idempotency-Key, which is not charged again."
	}
	switch {
	case stall:
		newProblem(ProblemUpstreamUnavailable, "Upstream timed out", http.StatusGatewayTimeout,
			fmt.Sprintf("The upstream took none of the request body for %s and did not answer.", upstreamTimeout)+charge).write(w, r)
		return
	case timeout:
		newProblem(ProblemUpstreamUnavailable, "Upstream timed out", http.StatusGatewayTimeout,
			"The upstream did not answer in time."+charge).write(w, r)
		return
	}
	newProblem(ProblemUpstreamUnavailable, "Upstream unavailable", http.StatusBadGateway,
		"The upstream could not be reached or failed to answer."+charge).write(w, r)
}

// bufferPool reuses ReverseProxy's copy buffers (32 KiB each).
type bufferPool struct{ p sync.Pool }

func newBufferPool() *bufferPool {
	return &bufferPool{p: sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}}
}

func (b *bufferPool) Get() []byte  { return *(b.p.Get().(*[]byte)) }
func (b *bufferPool) Put(x []byte) { b.p.Put(&x) }
