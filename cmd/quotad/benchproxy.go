package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/quotaring/quotaring/internal/loadgen"
)

// quotad bench proxy measures what the HTTP front adds to a request, with
// the front, the upstream and the load generator in processes of their own,
// as they run in production; quotad bench upstream is a sample upstream for
// it. (router's BenchmarkProxyLatency measures the same in one process.)

type benchProxyFlags struct {
	proxy, direct string
	keys          []string
	method, path  string
	rate          int
	round, warmup time.Duration
	rounds        int
	serverTiming  bool
	timeout       time.Duration
	caCert        string
	// anyProxy measures a --proxy that is not quotad's front (a bare
	// reverse proxy to compare with): its answers carry no quota headers.
	anyProxy bool
}

func newBenchProxyCmd() *cobra.Command {
	var f benchProxyFlags
	cmd := &cobra.Command{
		Use:   "proxy",
		Short: "Measure the latency a node's HTTP proxy adds, against calling its upstream directly",
		Long: `Send requests at a fixed rate (open loop: each leaves on schedule, however
slow earlier answers are) to a node's proxy (--proxy) and straight to the
upstream it forwards to (--direct), in alternating rounds so that drift in the
machine's load hits both alike, and print p50, p99 and p999 of each and what
the proxy added.

Latency counts from the moment a request leaves until its body is read. When
the upstream says how long it worked (Server-Timing: app;dur=<ms>, as quotad
bench upstream does), that time is left out of both (--server-timing), so the
upstream's own jitter does not show up as the proxy's.

Every proxied request is charged to the key's account: give the account a
plan whose quota and rate limit the run cannot exhaust (rate x rounds x round
requests, plus a warm-up round). A refusal or any other non-2xx answer counts
as an error and is reported.`,
		Example: `  # a sample upstream that works 1 ms per request, a node in front of it, a key
  export QUOTAD_ADMIN_TOKEN=$(openssl rand -hex 32) QUOTAD_ADMIN_URL=http://127.0.0.1:9090
  quotad bench upstream --listen 127.0.0.1:8081 --work 1ms &
  quotad serve --node-id n1 --data-dir ./n1 --ledger sqlite:./ledger.db \
      --upstream http://127.0.0.1:8081 --http-addr 127.0.0.1:8080 --admin-addr 127.0.0.1:9090 &
  quotad admin plans set bench --quota 1000000000 --soft   # a plan the run cannot use up
  quotad admin accounts set bench --plan bench
  quotad admin keys create bench                           # prints the key, once
  QUOTAD_API_KEY=qr_live_... quotad bench proxy --proxy http://127.0.0.1:8080 \
      --direct http://127.0.0.1:8081 --rate 2000`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBenchProxy(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.proxy, "proxy", "", "a node's proxy: its --http-addr as http://host:port (required)")
	fl.StringVar(&f.direct, "direct", "", "the upstream the node forwards to, as http://host:port (required)")
	fl.BoolVar(&f.anyProxy, "any-proxy", false, "--proxy is not a quotad node (a bare reverse proxy to compare with): do not require the quota headers on its first answer")
	fl.StringSliceVar(&f.keys, "api-key", nil, "API keys for the proxied requests, used in turn (required; prefer QUOTAD_API_KEY, which ps does not show)")
	fl.StringVar(&f.method, "method", http.MethodGet, "request method")
	fl.StringVar(&f.path, "path", "/v1/tasks", "request path (and query)")
	fl.IntVar(&f.rate, "rate", 2000, "requests per second, each way")
	fl.DurationVar(&f.round, "round", 2*time.Second, "length of one round")
	fl.IntVar(&f.rounds, "rounds", 3, "measured rounds each way, alternating direct and proxied")
	fl.DurationVar(&f.warmup, "warmup", time.Second, "an unmeasured round each way first (connections, reservations); 0 skips it")
	fl.BoolVar(&f.serverTiming, "server-timing", true, "leave out the time the upstream reports in Server-Timing (app;dur=)")
	fl.DurationVar(&f.timeout, "timeout", 10*time.Second, "how long one request may take before it counts as an error")
	fl.StringVar(&f.caCert, "ca-cert", "", "for https:// URLs (a node with --http-tls-cert): the CA certificate (PEM) to trust, when the node's certificate is not from one the system trusts")
	return cmd
}

// benchTarget is one way to the upstream.
type benchTarget struct {
	name   string
	base   string
	keys   []string
	client *http.Client
}

// benchRound is what one round measured.
type benchRound struct {
	lat      []time.Duration
	errors   int64
	firstErr error
	late     int64 // requests that left more than 1 ms after their time
}

func runBenchProxy(ctx context.Context, out, progress io.Writer, f benchProxyFlags) error {
	proxy, err := benchURL("--proxy", f.proxy)
	if err != nil {
		return err
	}
	direct, err := benchURL("--direct", f.direct)
	if err != nil {
		return err
	}
	switch {
	case len(f.keys) == 0 || slices.Contains(f.keys, ""):
		return errors.New("--api-key is required (or QUOTAD_API_KEY): a key whose account the proxied requests are charged to (quotad admin keys create ACCOUNT)")
	case f.rate < 1 || f.rate > 100_000:
		return fmt.Errorf("--rate %d: want 1 to 100000 requests per second", f.rate)
	case f.rounds < 1:
		return fmt.Errorf("--rounds %d: want at least 1", f.rounds)
	case f.round < 100*time.Millisecond:
		return fmt.Errorf("--round %v: want at least 100ms", f.round)
	case f.warmup < 0:
		return fmt.Errorf("--warmup %v: want 0 or more", f.warmup)
	case f.timeout <= 0:
		return fmt.Errorf("--timeout %v: want more than 0", f.timeout)
	case !strings.HasPrefix(f.path, "/"):
		return fmt.Errorf("--path %q: want a path starting with /", f.path)
	}
	if _, err := http.NewRequest(f.method, "http://x"+f.path, nil); err != nil {
		return fmt.Errorf("--method %q, --path %q: %v", f.method, f.path, err)
	}
	var tlsConfig *tls.Config // nil: the system's roots
	if f.caCert != "" {
		if !strings.HasPrefix(proxy, "https://") && !strings.HasPrefix(direct, "https://") {
			return fmt.Errorf("--ca-cert is set but neither --proxy %s nor --direct %s is https://", proxy, direct)
		}
		tr, err := trustingTransport(f.caCert)
		if err != nil {
			return err
		}
		tlsConfig = tr.TLSClientConfig
	}
	newClient := func() *http.Client {
		// NB: a transport of its own, HTTP/1.1 only, so that an https proxy
		// is measured against a plain direct upstream over the same kind of
		// connections, not one multiplexed HTTP/2 connection. Not a Clone:
		// Clone first sets up HTTP/2 on the transport it copies (h2 in its
		// TLS config's ALPN list), and a copy limited to HTTP/1.1 then
		// offers h2 in the handshake and speaks HTTP/1.1 (tried: "malformed
		// HTTP response" from an h2 server).
		t := &http.Transport{
			DialContext:         (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			TLSClientConfig:     tlsConfig.Clone(),
			TLSHandshakeTimeout: 10 * time.Second,
			MaxIdleConns:        1024, MaxIdleConnsPerHost: 1024, IdleConnTimeout: 90 * time.Second,
			Protocols: new(http.Protocols),
		}
		t.Protocols.SetHTTP1(true)
		return &http.Client{Transport: t, Timeout: f.timeout}
	}
	targets := []*benchTarget{
		{name: "direct", base: direct, client: newClient()},
		{name: "proxied", base: proxy, keys: f.keys, client: newClient()},
	}
	defer func() {
		for _, t := range targets {
			t.client.CloseIdleConnections()
		}
	}()
	// One request each way first: a wrong key or address is an error now,
	// not thousands of errors later.
	for _, t := range targets {
		_, h, err := t.do(ctx, f, 0)
		if err != nil {
			var unknown x509.UnknownAuthorityError
			if errors.As(err, &unknown) {
				err = fmt.Errorf("%w (give the CA that issued its certificate with --ca-cert)", err)
			}
			return fmt.Errorf("first %s request (%s %s%s): %w", t.name, f.method, t.base, f.path, err)
		}
		if t.name == "proxied" && !f.anyProxy && h.Get("RateLimit-Policy") == "" && h.Get("X-Quota-Remaining") == "" {
			// A --proxy mistyped as the upstream's address measured the
			// upstream against itself: "added +20µs", exit 0.
			return fmt.Errorf("first proxied request (%s %s%s): the answer carries no quota headers (RateLimit-Policy, X-Quota-Remaining), which the quotad proxy puts on every answer: is --proxy a node's public address (--http-addr of quotad serve --upstream), not the upstream's? (--any-proxy measures a proxy that is not quotad's)",
				f.method, t.base, f.path)
		}
	}
	fmt.Fprintf(out, "quotad bench proxy: %s %s at %d requests/s, %d rounds of %s each way (direct: %s, proxied: %s)\n",
		f.method, f.path, f.rate, f.rounds, f.round, direct, proxy)
	if f.warmup > 0 {
		for _, t := range targets {
			fmt.Fprintf(progress, "warm-up: %s for %s\n", t.name, f.warmup)
			r, err := t.openLoop(ctx, f, f.warmup)
			if ctx.Err() != nil {
				return benchInterrupted("proxy")
			} else if err != nil {
				return err
			}
			if r.errors > 0 {
				// Not counted, but said: a warm-up that used up the key's
				// quota left every measured request a 429, unexplained.
				fmt.Fprintf(progress, "warm-up: %s: %d of its requests failed, first: %v\n", t.name, r.errors, r.firstErr)
			}
		}
	}
	total := map[string]*benchRound{"direct": {}, "proxied": {}}
	stopped := 0 // the round Ctrl-C stopped; the table holds the ones before it
rounds:
	for i := 1; i <= f.rounds; i++ {
		round := map[string]*benchRound{}
		for _, t := range targets {
			r, err := t.openLoop(ctx, f, f.round)
			switch {
			case ctx.Err() != nil && i > 1: // the round's requests cut short: not counted
				stopped = i
				break rounds
			case ctx.Err() != nil:
				return benchInterrupted("proxy")
			case err != nil:
				return err
			}
			fmt.Fprintf(progress, "round %d/%d %-8s %6d requests  p50 %-9s p99 %-9s errors %d\n",
				i, f.rounds, t.name, len(r.lat), fmtDur(pctile(r.lat, 50)), fmtDur(pctile(r.lat, 99)), r.errors)
			round[t.name] = r
		}
		for name, r := range round { // both ways, or neither: the ratios compare like with like
			agg := total[name]
			agg.lat = append(agg.lat, r.lat...)
			agg.errors += r.errors
			agg.late += r.late
			if agg.firstErr == nil {
				agg.firstErr = r.firstErr
			}
		}
	}
	d, p := total["direct"], total["proxied"]
	fmt.Fprintf(out, "\n%-8s %9s %10s %10s %10s %7s\n", "", "requests", "p50", "p99", "p999", "errors")
	for _, name := range []string{"direct", "proxied"} {
		r := total[name]
		fmt.Fprintf(out, "%-8s %9d %10s %10s %10s %7d\n", name, len(r.lat), fmtDur(pctile(r.lat, 50)), fmtDur(pctile(r.lat, 99)), fmtDur(pctile(r.lat, 99.9)), r.errors)
	}
	added := func(q float64) string {
		if len(p.lat) == 0 || len(d.lat) == 0 {
			return "n/a" // nothing to compare: a side had no request through
		}
		diff := pctile(p.lat, q) - pctile(d.lat, q)
		if diff < 0 {
			return "-" + fmtDur(-diff)
		}
		return "+" + fmtDur(diff)
	}
	fmt.Fprintf(out, "%-8s %9s %10s %10s %10s\n", "added", "", added(50), added(99), added(99.9))
	for _, name := range []string{"direct", "proxied"} {
		r := total[name]
		if r.firstErr != nil {
			fmt.Fprintf(out, "%s: %d errors, the first: %v\n", name, r.errors, r.firstErr)
		}
		if n := len(r.lat) + int(r.errors); r.late*100 > int64(n) {
			fmt.Fprintf(out, "%s: %d requests left more than 1 ms late: the load generator is short of CPU, and latencies are an upper bound\n", name, r.late)
		}
	}
	if stopped > 0 {
		fmt.Fprintf(out, "(stopped in round %d of %d: the figures are those of the rounds before it)\n", stopped, f.rounds)
		return benchInterrupted("proxy")
	}
	if d.errors+p.errors > 0 {
		return fmt.Errorf("%d requests failed (see above)", d.errors+p.errors)
	}
	return nil
}

// benchURL checks a --proxy or --direct URL: http(s)://host:port[/base]; the
// request path is appended to it.
func benchURL(flag, s string) (string, error) {
	if s == "" {
		return "", fmt.Errorf("%s is required: http://host:port", flag)
	}
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("%s %q: want an absolute http:// or https:// URL, such as http://127.0.0.1:8080", flag, s)
	}
	return strings.TrimSuffix(u.String(), "/"), nil
}

// openLoop sends f.rate requests a second for d, each at its scheduled
// time (at once when the generator is behind), and returns their latencies.
func (t *benchTarget) openLoop(ctx context.Context, f benchProxyFlags, d time.Duration) (*benchRound, error) {
	n := max(1, int(d.Seconds()*float64(f.rate)))
	lat := make([]time.Duration, n)
	errs := make([]error, n)
	late, err := loadgen.OpenLoop(ctx, f.rate, n, func(i int) { lat[i], errs[i] = t.send(ctx, f, i) })
	if err != nil {
		return nil, err
	}
	r := &benchRound{lat: make([]time.Duration, 0, n), late: int64(late)}
	for i, err := range errs {
		switch {
		case err == nil:
			r.lat = append(r.lat, lat[i])
		case r.firstErr == nil:
			r.firstErr = err
			fallthrough
		default:
			r.errors++
		}
	}
	return r, nil
}

// send makes request i and returns its latency, less the upstream's own
// time when it reports it and f.serverTiming is set. A non-2xx answer is an
// error that quotes the body's start (a problem+json names its cause).
func (t *benchTarget) send(ctx context.Context, f benchProxyFlags, i int) (time.Duration, error) {
	took, _, err := t.do(ctx, f, i)
	return took, err
}

// do is send, with the answer's headers.
func (t *benchTarget) do(ctx context.Context, f benchProxyFlags, i int) (time.Duration, http.Header, error) {
	req, err := http.NewRequestWithContext(ctx, f.method, t.base+f.path, nil)
	if err != nil {
		return 0, nil, err
	}
	if len(t.keys) > 0 {
		req.Header.Set("Authorization", "Bearer "+t.keys[i%len(t.keys)])
	}
	sent := time.Now()
	res, err := t.client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	body, err := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	res.Body.Close()
	took := time.Since(sent)
	if err != nil {
		return 0, nil, fmt.Errorf("reading the answer: %w", err)
	}
	if res.StatusCode < 200 || res.StatusCode > 299 {
		return 0, nil, fmt.Errorf("%s answered %s: %.300s", t.name, res.Status, strings.TrimSpace(string(body)))
	}
	if f.serverTiming {
		took -= serverTimingApp(res.Header)
	}
	return took, res.Header, nil
}

// serverTimingApp reads the "app" metric's duration (milliseconds) from
// Server-Timing headers: Server-Timing: app;dur=1.042. Zero when absent.
func serverTimingApp(h http.Header) time.Duration {
	for _, v := range h.Values("Server-Timing") {
		for _, metric := range strings.Split(v, ",") {
			parts := strings.Split(metric, ";")
			if strings.TrimSpace(parts[0]) != "app" {
				continue
			}
			for _, p := range parts[1:] {
				if k, val, ok := strings.Cut(strings.TrimSpace(p), "="); ok && k == "dur" {
					if ms, err := strconv.ParseFloat(val, 64); err == nil && ms > 0 {
						return time.Duration(ms * float64(time.Millisecond))
					}
				}
			}
		}
	}
	return 0
}

// pctile is the q-th percentile of lat (sorted in place); 0 for none.
func pctile(lat []time.Duration, q float64) time.Duration {
	if len(lat) == 0 {
		return 0
	}
	slices.Sort(lat)
	return lat[int(float64(len(lat)-1)*q/100)]
}

type benchUpstreamFlags struct {
	listen string
	work   time.Duration
}

func newBenchUpstreamCmd() *cobra.Command {
	var f benchUpstreamFlags
	cmd := &cobra.Command{
		Use:   "upstream",
		Short: "Serve a sample API to put a node's proxy in front of (for quotad bench proxy)",
		Long: `Serve a sample API on --listen until interrupted: every request is answered
200 with a small JSON body after --work, and Server-Timing: app;dur=<ms> says
how long it worked (what quotad bench proxy leaves out of its latencies).`,
		Example: `  quotad bench upstream --listen 127.0.0.1:8081 --work 1ms`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBenchUpstream(cmd.Context(), cmd.ErrOrStderr(), f, nil)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.listen, "listen", "127.0.0.1:8081", "address to serve on (host:port)")
	fl.DurationVar(&f.work, "work", 0, "how long the API works on each request (0: it answers at once)")
	return cmd
}

// runBenchUpstream serves until ctx ends; ready, when set, gets the address.
func runBenchUpstream(ctx context.Context, progress io.Writer, f benchUpstreamFlags, ready func(addr string)) error {
	if f.work < 0 {
		return fmt.Errorf("--work %v: want 0 or more", f.work)
	}
	ln, err := net.Listen("tcp", f.listen)
	if err != nil {
		return fmt.Errorf("--listen %s: %w", f.listen, err)
	}
	srv := &http.Server{Handler: benchUpstreamHandler(f.work), ReadHeaderTimeout: 10 * time.Second}
	fmt.Fprintf(progress, "quotad bench upstream: serving http://%s, %v of work per request; Ctrl-C stops\n", ln.Addr(), f.work)
	if ready != nil {
		ready(ln.Addr().String())
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
		<-done
		return nil
	}
}

func benchUpstreamHandler(work time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		_, _ = io.Copy(io.Discard, r.Body)
		if work > 0 {
			time.Sleep(work)
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Server-Timing", fmt.Sprintf("app;dur=%.3f", float64(time.Since(start))/1e6))
		io.WriteString(w, `{"ok":true}`)
	})
}
