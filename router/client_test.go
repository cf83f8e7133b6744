package router_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

func dial(t testing.TB, o router.DialOptions, seeds ...string) *router.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := o.Dial(ctx, seeds...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// embeddedFront dials a client to seed and serves the middleware on it,
// around an upstream of its own, on the cluster's clock: the embedded
// counterpart of seed's proxy.
func embeddedFront(t *testing.T, c *cluster, seed *node.Node) (*router.Client, *httptest.Server) {
	t.Helper()
	client := dial(t, router.DialOptions{RefreshInterval: -1}, seed.RPCAddr())
	mw, err := router.Middleware(router.FrontOptions{Charger: client, Config: client,
		Now: func() time.Time { return time.Unix(0, c.clock.Now().Wall) }})
	if err != nil {
		t.Fatal(err)
	}
	local := httptest.NewServer(mw(newUpstream(t)))
	t.Cleanup(local.Close)
	return client, local
}

// Show 5: the embedded client, connected to one node, with the middleware
// around a local handler, answers as the proxy does, while the accounts are
// owned by the other nodes.
func TestEmbeddedMiddlewareMatchesProxy(t *testing.T) {
	up := newUpstream(t)
	plan := snapshot.Plan{ID: "rate", Rate: "3/m", Burst: 3, MonthlyQuota: 60, Hard: true}
	viaProxy := account{id: "via-proxy", key: keyOf("via-proxy"), plan: plan}
	embedded := account{id: "embedded", key: keyOf("embedded"), plan: plan}
	c := startCluster(t, []account{viaProxy, embedded}, clusterOptions{nodes: 3, clock: engine.NewManualClock(june28), upstream: up.URL})
	seedNode := c.notOwner(t, viaProxy.id, embedded.id)
	proxy := "http://" + seedNode.HTTPAddr()

	client, local := embeddedFront(t, c, seedNode)
	if s := client.Snapshot(); s == nil || !s.HasAccount(embedded.id) {
		t.Fatalf("the client has no config snapshot with %q", embedded.id)
	}

	steps := []struct{ method, path string }{
		{"GET", "/v1/tasks"}, {"POST", "/v1/tasks"}, {"POST", "/v1/exports"},
		{"GET", "/v1/tasks"}, // the bucket of 3 is empty: rate-limited
		{"GET", "/v1/usage"},
	}
	compare := func(what string, p, m answer) {
		t.Helper()
		if p.status != m.status || p.problem != m.problem {
			t.Fatalf("%s: proxy %d %+v, middleware %d %+v", what, p.status, p.problem, m.status, m.problem)
		}
		for _, h := range []string{"RateLimit-Policy", "RateLimit", "X-Quota-Limit", "X-Quota-Remaining", "X-Quota-Reset", "Retry-After", "Content-Type"} {
			if p.header.Get(h) != m.header.Get(h) {
				t.Fatalf("%s: %s: proxy %q, middleware %q", what, h, p.header.Get(h), m.header.Get(h))
			}
		}
	}
	for i, s := range steps {
		what := fmt.Sprint("step ", i+1, ": ", s.method, " ", s.path)
		p := do(t, proxy, s.method, s.path, viaProxy.key, nil)
		m := do(t, local.URL, s.method, s.path, embedded.key, nil)
		compare(what, p, m)
		if s.path == "/v1/usage" {
			pu, mu := p.usage(t), m.usage(t)
			pu.Account = mu.Account
			if !reflect.DeepEqual(pu, mu) || mu.Used != 28 {
				t.Fatalf("usage: proxy %+v, middleware %+v", pu, mu)
			}
		}
	}
	last := do(t, local.URL, "GET", "/v1/tasks", embedded.key, nil)
	if last.status != 429 || last.problem.Type != router.ProblemRateLimited || last.header.Get("Retry-After") != "20" ||
		last.header.Get("RateLimit-Policy") != `"burst";q=3;w=60, "quota";q=60;w=2592000` ||
		last.header.Get("RateLimit") != `"burst";r=0;t=20, "quota";r=32;t=216000` {
		t.Fatalf("rate-limited: %d %+v %v", last.status, last.problem, last.header)
	}
	compare("an unknown key", do(t, proxy, "GET", "/v1/tasks", "qr_nope", nil), do(t, local.URL, "GET", "/v1/tasks", "qr_nope", nil))
	compare("no key", do(t, proxy, "GET", "/v1/tasks", "", nil), do(t, local.URL, "GET", "/v1/tasks", "", nil))

	// A token later both go on.
	c.clock.Advance(20 * time.Second)
	compare("after 20 s", do(t, proxy, "GET", "/v1/tasks", viaProxy.key, nil), do(t, local.URL, "GET", "/v1/tasks", embedded.key, nil))

	// The client's own calls: the owners decided, never the seed node.
	u, err := client.Usage(context.Background(), embedded.id)
	if err != nil || u.Used != 29 || u.Node != c.owner(t, embedded.id).ID() || u.Node == seedNode.ID() {
		t.Fatalf("client usage %+v, %v; want 29 used, decided at the owner", u, err)
	}
	if n := client.Stats().WrongOwner.Load(); n != 0 {
		t.Fatalf("%d WrongOwner answers in a stable ring", n)
	}
}

// The client charges at the owner, refunds once, and dedups client ids.
func TestClientChargeRefundUsage(t *testing.T) {
	acct := account{id: "direct", key: keyOf("direct"), plan: monthly("m10", 10)}
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 3, clock: engine.NewManualClock(june28)})
	client := dial(t, router.DialOptions{}, c.notOwner(t, acct.id).RPCAddr())
	ctx := context.Background()

	res, err := client.Charge(ctx, router.ChargeRequest{Account: acct.id, Route: "GET /x", Units: 4})
	if err != nil || res.Reason != shard.OK || res.Remaining != 6 || res.Receipt == nil || res.Node != c.owner(t, acct.id).ID() {
		t.Fatalf("charge: %+v, %v", res, err)
	}
	for i := 0; i < 2; i++ {
		d, err := client.Refund(ctx, router.RefundRequest{Account: acct.id, EventID: res.EventID, Receipt: res.Receipt})
		want := []shard.Reason{shard.Refunded, shard.AlreadyRefunded}[i]
		if err != nil || d.Reason != want {
			t.Fatalf("refund %d: %+v, %v; want %s", i+1, d, err, want)
		}
	}
	for i := 0; i < 2; i++ {
		res, err := client.Charge(ctx, router.ChargeRequest{Account: acct.id, EventID: "once", ClientID: true, Units: 3})
		want := []shard.Reason{shard.OK, shard.Replayed}[i]
		if err != nil || res.Reason != want || res.Remaining != 7 {
			t.Fatalf("charge %d with a client id: %+v, %v; want %s and 7 left", i+1, res, err, want)
		}
	}
	res, err = client.Charge(ctx, router.ChargeRequest{Account: acct.id, Units: 8})
	if err != nil || res.Reason != shard.QuotaExceeded || res.RetryAfter != int64(60*time.Hour) {
		t.Fatalf("over the quota: %+v, %v", res, err)
	}
	if res, err := client.Charge(ctx, router.ChargeRequest{Account: "nobody", Units: 1}); err != nil || res.Reason != shard.UnknownAccount {
		t.Fatalf("unknown account: %+v, %v", res, err)
	}
	if u, err := client.Usage(ctx, acct.id); err != nil || !u.Known || u.Used != 3 || u.Remaining != 7 {
		t.Fatalf("usage %+v, %v", u, err)
	}
}

// A client with an old ring view follows WrongOwner to the new owner.
func TestClientFollowsWrongOwner(t *testing.T) {
	var accounts []account
	for i := 0; i < 40; i++ {
		id := fmt.Sprint("acct-", i)
		accounts = append(accounts, account{id: id, key: keyOf(id), plan: monthly("m100", 100)})
	}
	c := startCluster(t, accounts, clusterOptions{nodes: 2})
	client := dial(t, router.DialOptions{RefreshInterval: -1}, c.nodes[0].RPCAddr())
	before := map[string]string{}
	for _, a := range accounts {
		before[a.id] = c.owner(t, a.id).ID()
	}
	epoch := client.Epoch()
	c.add(t)
	if client.Epoch() != epoch {
		t.Fatal("the client refreshed on its own")
	}
	moved := ""
	for _, a := range accounts {
		if c.owner(t, a.id).ID() != before[a.id] {
			moved = a.id
			break
		}
	}
	if moved == "" {
		t.Fatal("no account moved to the new node")
	}
	res, err := client.Charge(context.Background(), router.ChargeRequest{Account: moved, Units: 1})
	if err != nil || res.Reason != shard.OK || res.Node != c.owner(t, moved).ID() {
		t.Fatalf("charge of moved account %s: %+v, %v; want OK at %s", moved, res, err, c.owner(t, moved).ID())
	}
	if client.Stats().WrongOwner.Load() == 0 || client.Epoch() == epoch {
		t.Fatalf("no WrongOwner followed (%d) or the view was not refreshed", client.Stats().WrongOwner.Load())
	}
}

// An owner that does not answer: the client refreshes its view once and
// retries at the owner the ring now names; if the ring still names the
// silent owner, the answer is ErrUnavailable and nobody else decides.
func TestClientUnreachableOwner(t *testing.T) {
	var accounts []account
	for i := 0; i < 12; i++ {
		id := fmt.Sprint("acct-", i)
		accounts = append(accounts, account{id: id, key: keyOf(id), plan: monthly("m100", 100)})
	}
	c := startCluster(t, accounts, clusterOptions{nodes: 3})
	ctx := context.Background()

	// A silent owner still on the ring: blocked by the client's dialer.
	target := accounts[0].id
	owner := c.owner(t, target)
	var blocked atomic.Value
	blocked.Store(owner.RPCAddr())
	dialer := func(ctx context.Context, addr string) (net.Conn, error) {
		if addr == blocked.Load().(string) {
			return nil, errors.New("blocked by the test")
		}
		var d net.Dialer
		return d.DialContext(ctx, "tcp", addr)
	}
	seed := c.notOwner(t, target)
	client := dial(t, router.DialOptions{RefreshInterval: -1, CallTimeout: time.Second, Dialer: dialer}, seed.RPCAddr())
	_, err := client.Charge(ctx, router.ChargeRequest{Account: target, Units: 1})
	if !errors.Is(err, router.ErrUnavailable) || !strings.Contains(err.Error(), "was not sent") {
		t.Fatalf("charge at an owner the client cannot connect to: %v, want ErrUnavailable saying the charge was not sent", err)
	}
	u, err := owner.Router().Usage(ctx, target)
	if err != nil || u.Used != 0 {
		t.Fatalf("usage at the owner %+v, %v: nothing may have been charged", u, err)
	}

	// The owner leaves: the client's view is stale, its dial fails, and the
	// fresh view names the survivor that took the account over.
	blocked.Store("")
	c.stop(t, owner)
	res, err := client.Charge(ctx, router.ChargeRequest{Account: target, Units: 1})
	if err != nil || res.Reason != shard.OK || res.Node != c.owner(t, target).ID() {
		t.Fatalf("charge after the owner left: %+v, %v", res, err)
	}
	if client.Stats().Unreachable.Load() < 2 {
		t.Fatalf("Unreachable %d, want the two failed calls counted", client.Stats().Unreachable.Load())
	}
}

// Dial fails clearly when no seed answers.
func TestDialNoSeed(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := (router.DialOptions{CallTimeout: time.Second}).Dial(ctx, addr); err == nil {
		t.Fatal("Dial to a closed port succeeded")
	}
	if _, err := router.Dial(ctx); err == nil {
		t.Fatal("Dial without seeds succeeded")
	}
}

// hungSeed is an address that accepts TCP connections and never answers,
// as a SIGSTOPped node does (the kernel completes the handshake).
func hungSeed(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c) // held open, never read
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		for _, c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String()
}

// A hung first seed does not use up Dial's context: the next seed is asked
// after a fraction of a second and its answer wins, well within a 2 s
// deadline (the default CallTimeout is 5 s). Later ring view refreshes,
// which ask the hung seed too, still answer.
func TestDialSkipsAHungSeed(t *testing.T) {
	acct := account{id: "hung-seed", key: keyOf("hung-seed"), plan: monthly("m10", 10)}
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 1})
	hung := hungSeed(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	client, err := router.DialOptions{RefreshInterval: -1}.Dial(ctx, hung, c.nodes[0].RPCAddr())
	if err != nil {
		t.Fatalf("Dial with a hung first seed and a healthy second one: %v", err)
	}
	defer client.Close()
	if client.Snapshot() == nil {
		t.Fatal("no config snapshot: the config read waited for the hung seed")
	}
	res, err := client.Charge(ctx, router.ChargeRequest{Account: acct.id, Units: 1})
	if err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v, %v", res, err)
	}
	if err := client.Refresh(ctx); err != nil {
		t.Fatalf("refresh: %v", err)
	}
}

// When no seed answers before Dial's context ends, the error is the
// context's, and names the seeds asked.
func TestDialDeadlineIsTheContextsError(t *testing.T) {
	a, b := hungSeed(t), hungSeed(t)
	ctx, cancel := context.WithTimeout(context.Background(), 600*time.Millisecond)
	defer cancel()
	_, err := router.Dial(ctx, a, b)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), a) || !strings.Contains(err.Error(), b) {
		t.Fatalf("Dial of two hung seeds: %v; want DeadlineExceeded, naming %s and %s", err, a, b)
	}
}

// A closed client answers ErrClosed, which is not ErrUnavailable: retry
// logic must not retry a dead client forever. A zero Client fails fast.
func TestClosedAndZeroClient(t *testing.T) {
	acct := account{id: "closed", key: keyOf("closed"), plan: monthly("m10", 10)}
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 1})
	client := dial(t, router.DialOptions{}, c.nodes[0].RPCAddr())
	if err := client.Close(); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	calls := map[string]func(*router.Client) error{
		"Charge": func(cl *router.Client) error {
			_, err := cl.Charge(ctx, router.ChargeRequest{Account: acct.id, Units: 1})
			return err
		},
		"Refund": func(cl *router.Client) error {
			_, err := cl.Refund(ctx, router.RefundRequest{Account: acct.id, EventID: "x", Receipt: &shard.Receipt{EventID: "x"}})
			return err
		},
		"Usage":   func(cl *router.Client) error { _, err := cl.Usage(ctx, acct.id); return err },
		"Refresh": func(cl *router.Client) error { return cl.Refresh(ctx) },
	}
	for name, call := range calls {
		if err := call(client); !errors.Is(err, router.ErrClosed) || errors.Is(err, router.ErrUnavailable) {
			t.Errorf("%s after Close: %v; want ErrClosed, not ErrUnavailable", name, err)
		}
	}
	if err := client.Close(); err != nil {
		t.Errorf("a second Close: %v", err)
	}

	var zero router.Client
	for name, call := range calls {
		done := make(chan error, 1)
		go func() { done <- call(&zero) }()
		select {
		case err := <-done:
			if !errors.Is(err, router.ErrInvalidRequest) || errors.Is(err, router.ErrUnavailable) || !strings.Contains(err.Error(), "Dial") {
				t.Errorf("%s on a zero Client: %v; want ErrInvalidRequest that says to use Dial", name, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s on a zero Client hangs", name)
		}
	}
	if err := zero.Close(); err == nil {
		t.Error("Close of a zero Client: nil error")
	}
}

// Requests no owner could charge are refused before they are sent, with an
// error naming the field; none of them is ErrUnavailable, and none is
// answered as a refusal that says "retry now".
func TestClientRefusesBadRequests(t *testing.T) {
	acct := account{id: "delta", key: keyOf("delta"), plan: monthly("m10", 10)}
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 1})
	client := dial(t, router.DialOptions{}, c.nodes[0].RPCAddr())
	ctx := context.Background()
	for _, tc := range []struct {
		req   router.ChargeRequest
		field string
	}{
		{router.ChargeRequest{}, "Account"},
		{router.ChargeRequest{Units: 1}, "Account"},
		{router.ChargeRequest{Account: acct.id, Units: -1}, "Units"},
		{router.ChargeRequest{Account: acct.id, Units: shard.MaxUnits + 1}, "Units"},
		{router.ChargeRequest{Account: acct.id, Units: 2, EventID: "plain-1"}, "ClientID"},
		// ClientID without an id: the client used to make one up, and a
		// retry of the same request was a new charge.
		{router.ChargeRequest{Account: acct.id, Units: 2, ClientID: true}, "EventID"},
	} {
		res, err := client.Charge(ctx, tc.req)
		if !errors.Is(err, router.ErrInvalidRequest) || errors.Is(err, router.ErrUnavailable) || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("charge %+v: %v; want ErrInvalidRequest naming %s", tc.req, err, tc.field)
		}
		if res.Reason.Accepted() {
			t.Errorf("charge %+v: the result's reason %s is accepted along with an error", tc.req, res.Reason)
		}
	}
	if u, err := client.Usage(ctx, acct.id); err != nil || u.Used != 0 {
		t.Fatalf("usage %+v, %v: a refused request charged something", u, err)
	}
	if _, err := client.Usage(ctx, ""); !errors.Is(err, router.ErrInvalidRequest) {
		t.Errorf("usage of the empty account: %v, want ErrInvalidRequest", err)
	}
	if _, err := client.Refund(ctx, router.RefundRequest{Account: acct.id}); !errors.Is(err, router.ErrInvalidRequest) || !strings.Contains(err.Error(), "EventID") {
		t.Errorf("refund without an event id: %v, want ErrInvalidRequest naming EventID", err)
	}
	if _, err := client.Refund(ctx, router.RefundRequest{Account: acct.id, EventID: "k-1", Replay: true}); !errors.Is(err, router.ErrInvalidRequest) || !strings.Contains(err.Error(), "Receipt") {
		t.Errorf("a replay's take-back without its receipt: %v, want ErrInvalidRequest naming Receipt", err)
	}
}

// A call whose context ended before it was sent says so: not "the owner
// did not answer", and not counted as an unreachable owner.
func TestClientCanceledBeforeSending(t *testing.T) {
	acct := account{id: "early", key: keyOf("early"), plan: monthly("m10", 10)}
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 1})
	client := dial(t, router.DialOptions{}, c.nodes[0].RPCAddr())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := client.Charge(ctx, router.ChargeRequest{Account: acct.id, Units: 1})
	if !errors.Is(err, context.Canceled) || errors.Is(err, router.ErrUnavailable) || !strings.Contains(err.Error(), "not sent") {
		t.Fatalf("charge with a canceled context: %v; want context.Canceled, 'not sent'", err)
	}
	if n := client.Stats().Unreachable.Load(); n != 0 {
		t.Fatalf("Unreachable %d after a call that was never sent", n)
	}
}

// Dial's errors are classified as the calls' are, so a program that
// retries Dial can tell "fix the setup" from "not up yet": a node that
// turns the client away (no token, a wrong one) is ErrRejected; no node
// answering is ErrUnavailable. A node's public or admin port dialled for
// its RPC port is named as such.
func TestDialErrorsAreClassified(t *testing.T) {
	const token = "dial-test-token-0123456789"
	acct := account{id: "dial", key: keyOf("dial"), plan: monthly("m10", 10)}
	up := newUpstream(t)
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 1, rpcToken: token, upstream: up.URL})
	nd := c.nodes[0]
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	opts := router.DialOptions{RefreshInterval: -1, CallTimeout: 2 * time.Second}

	for _, tok := range []string{"", "wrong-token-0123456789abcdef"} {
		o := opts
		o.Token = tok
		_, err := o.Dial(ctx, nd.RPCAddr())
		if !errors.Is(err, router.ErrRejected) || errors.Is(err, router.ErrUnavailable) || !strings.Contains(err.Error(), "Token") {
			t.Errorf("Dial with token %q: %v; want ErrRejected naming DialOptions.Token", tok, err)
		}
	}
	o := opts
	o.Token = token
	client, err := o.Dial(ctx, nd.RPCAddr())
	if err != nil {
		t.Fatalf("Dial with the right token: %v", err)
	}
	client.Close()

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	if _, err := opts.Dial(ctx, closed); !errors.Is(err, router.ErrUnavailable) || errors.Is(err, router.ErrRejected) {
		t.Errorf("Dial of a closed port: %v; want ErrUnavailable", err)
	}

	if _, err := o.Dial(ctx, nd.HTTPAddr()); err == nil || !strings.Contains(err.Error(), "dial the node's RPC port, --rpc-addr") {
		t.Errorf("Dial of the public HTTP port: %v; want it named, and --rpc-addr", err)
	}
	if _, err := o.Dial(ctx, nd.AdminAddr()); !errors.Is(err, router.ErrRejected) || errors.Is(err, router.ErrUnavailable) ||
		!strings.Contains(err.Error(), "dial the node's RPC port, --rpc-addr") {
		t.Errorf("Dial of the admin port: %v; want ErrRejected (retrying cannot help), the port named, and --rpc-addr", err)
	}
	// A node without --upstream, as nodes for embedded clients are: its
	// public port answers 404, not asking for an API key.
	bare := startCluster(t, []account{acct}, clusterOptions{nodes: 1})
	if _, err := opts.Dial(ctx, bare.nodes[0].HTTPAddr()); !errors.Is(err, router.ErrRejected) || errors.Is(err, router.ErrUnavailable) ||
		!strings.Contains(err.Error(), "dial the node's RPC port, --rpc-addr") || strings.Contains(err.Error(), "DialOptions.Token") {
		t.Errorf("Dial of the public HTTP port of a node without --upstream: %v; want ErrRejected, the port named, and --rpc-addr, not the token", err)
	}
	// The gossip port closes the connection as a node requiring TLS does:
	// the hint names both, not TLS alone.
	if _, err := o.Dial(ctx, nd.GossipAddr()); err == nil || !strings.Contains(err.Error(), "gossip port, --gossip-addr") ||
		!strings.Contains(err.Error(), "--rpc-addr") {
		t.Errorf("Dial of the gossip port: %v; want the gossip port named as a possibility, and --rpc-addr", err)
	}
}

// Seeds no node can be at, and no seeds, are configuration mistakes:
// ErrInvalidRequest naming the seed, not ErrUnavailable, which callers
// retry (and which retrying cannot fix).
func TestDialRefusesBadSeeds(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, seeds := range [][]string{nil, {""}, {"127.0.0.50"}, {"127.0.0.50:"}, {"http://127.0.0.50:7400"}, {"127.0.0.1:7400", " "},
		{"127.0.0.50:99999"}, {"127.0.0.50:abc"}, {" 127.0.0.50:7400"}} {
		_, err := router.Dial(ctx, seeds...)
		if !errors.Is(err, router.ErrInvalidRequest) || errors.Is(err, router.ErrUnavailable) {
			t.Errorf("Dial(%q): %v; want ErrInvalidRequest", seeds, err)
			continue
		}
		if want := "seed"; len(seeds) > 0 {
			want = fmt.Sprintf("seed %q", seeds[len(seeds)-1])
			if !strings.Contains(err.Error(), want) {
				t.Errorf("Dial(%q): %v; want it to name the %s", seeds, err, want)
			}
		}
	}
	for _, c := range []struct {
		opts router.DialOptions
		want string
	}{
		{router.DialOptions{CallTimeout: -1}, "must not be negative"},
		// time.Duration(5) is 5ns: every call timed out, as if no node answered.
		{router.DialOptions{CallTimeout: 5}, "CallTimeout 5ns and RefreshInterval 0s: want at least 10ms and 100ms"},
		// 1ns: the refresh loop read the ring thousands of times a second.
		{router.DialOptions{RefreshInterval: 1}, "want at least 10ms and 100ms"},
		// A token read from a file with its newline: gRPC refused to send
		// it, and Dial said no node answered.
		{router.DialOptions{Token: "rpc-token-0123456789abcdef\n"}, "DialOptions.Token holds spaces, a line break"},
	} {
		if _, err := c.opts.Dial(ctx, "127.0.0.1:7400"); !errors.Is(err, router.ErrInvalidRequest) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Dial with %+v: %v; want ErrInvalidRequest saying %q", c.opts, err, c.want)
		}
	}
	//lint:ignore SA1012 a nil Context is what is tested
	if _, err := router.Dial(nil, "127.0.0.1:7400"); !errors.Is(err, router.ErrInvalidRequest) || !strings.Contains(err.Error(), "nil Context") {
		t.Errorf("Dial with a nil Context: %v; want ErrInvalidRequest", err)
	}
	//lint:ignore SA1012 a nil Context is what is tested
	if _, err := (&router.Client{}).Charge(nil, router.ChargeRequest{Account: "acme", Units: 1}); !errors.Is(err, router.ErrInvalidRequest) {
		t.Errorf("Charge with a nil Context: %v; want ErrInvalidRequest (it panicked)", err)
	}
}

// Middleware refuses a *Client that Dial did not make (nil, or a zero
// Client) at once: the first request panicked, or every request got 503.
// NoUsageEndpoint hands the usage path to the handler, charged as any.
func TestMiddlewareOptions(t *testing.T) {
	var nilClient *router.Client
	for name, cl := range map[string]*router.Client{"nil": nilClient, "zero": {}} {
		if _, err := router.Middleware(router.FrontOptions{Charger: cl, Config: cl}); err == nil || !strings.Contains(err.Error(), "made by Dial") {
			t.Errorf("Middleware with a %s *Client: %v; want an error saying to use Dial", name, err)
		}
	}

	acct := account{id: "own-usage", key: keyOf("own-usage"), plan: monthly("m10", 10)}
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 1})
	client := dial(t, router.DialOptions{RefreshInterval: -1}, c.nodes[0].RPCAddr())
	mw, err := router.Middleware(router.FrontOptions{Charger: client, Config: client, NoUsageEndpoint: true})
	if err != nil {
		t.Fatal(err)
	}
	up := newUpstream(t)
	local := httptest.NewServer(mw(up))
	defer local.Close()
	a := do(t, local.URL, "GET", "/v1/usage", acct.key, nil)
	if a.status != http.StatusOK || up.count("GET /v1/usage") != 1 {
		t.Fatalf("GET /v1/usage with NoUsageEndpoint: %d, the handler saw it %d times; want it served by the handler", a.status, up.count("GET /v1/usage"))
	}
	if u, err := client.Usage(context.Background(), acct.id); err != nil || u.Used != 1 {
		t.Fatalf("usage after the handler's /v1/usage: %+v, %v; want it charged as any request (1 unit)", u, err)
	}
}

// hangingConn stops delivering what the node sends once *hang is set, as
// a connection to a SIGSTOPped node does; Close ends a blocked Read.
type hangingConn struct {
	net.Conn
	hang   *atomic.Bool
	wrote  *atomic.Int64 // writes while hung: calls sent to the silent node
	closed chan struct{}
	once   sync.Once
}

func (c *hangingConn) Write(p []byte) (int, error) {
	if c.hang.Load() {
		c.wrote.Add(1)
	}
	return c.Conn.Write(p)
}

func (c *hangingConn) Read(p []byte) (int, error) {
	if c.hang.Load() {
		<-c.closed
		return 0, net.ErrClosed
	}
	n, err := c.Conn.Read(p)
	if c.hang.Load() {
		// Set while this read waited: what it read never arrives either.
		// Delivered, the answer to the first charge came through and the
		// test's queued charge was sent (flaky under load).
		<-c.closed
		return 0, net.ErrClosed
	}
	return n, err
}

func (c *hangingConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// A hung owner costs a charge one CallTimeout, not two: the ring view
// refresh after the silent call does not ask the node that just did not
// answer (with it the only node, the charge took twice CallTimeout). A
// call still queued behind the hung one when its context ends was never
// sent, and says so: ctx's error, not an unknown outcome.
func TestHungOwner(t *testing.T) {
	acct := account{id: "hung", key: keyOf("hung"), plan: monthly("m10", 10)}
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 1})
	var hang atomic.Bool
	var wrote atomic.Int64
	dialer := func(ctx context.Context, addr string) (net.Conn, error) {
		var d net.Dialer
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		return &hangingConn{Conn: conn, hang: &hang, wrote: &wrote, closed: make(chan struct{})}, nil
	}
	const callTimeout = 2 * time.Second
	client := dial(t, router.DialOptions{RefreshInterval: -1, CallTimeout: callTimeout, MaxInflight: 1, Dialer: dialer}, c.nodes[0].RPCAddr())
	// A free charge first: the connection to the owner is made (gRPC
	// connects lazily), so that the first write while hung is the first
	// charge's, not the connection's preface. Counted, it let the queued
	// charge below race the first for the one call in flight (CI, under
	// load: the queued charge was sent and its outcome unknown).
	if res, err := client.Charge(context.Background(), router.ChargeRequest{Account: acct.id, Units: 0}); err != nil || res.Reason != shard.OK {
		t.Fatalf("a free charge before the owner hangs: %v, %v", res.Reason, err)
	}
	hang.Store(true)

	first := make(chan error, 1)
	began := time.Now()
	go func() {
		_, err := client.Charge(context.Background(), router.ChargeRequest{Account: acct.id, Units: 1})
		first <- err
	}()
	waitFor(t, 5*time.Second, "the first charge sent", func() bool { return wrote.Load() > 0 })
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	_, err := client.Charge(ctx, router.ChargeRequest{Account: acct.id, Units: 1})
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, router.ErrUnavailable) || !strings.Contains(err.Error(), "not sent") {
		t.Errorf("a charge queued behind a hung one, its context ended: %v; want DeadlineExceeded, 'not sent'", err)
	}

	err = <-first
	took := time.Since(began)
	if !errors.Is(err, router.ErrUnavailable) {
		t.Fatalf("charge at a hung owner: %v, want ErrUnavailable", err)
	}
	if took > callTimeout*3/2 {
		t.Errorf("charge at a hung owner took %s with CallTimeout %s: the refresh after it asked the hung node again", took.Round(time.Millisecond), callTimeout)
	}
}

// An attempt's refund that travels to the owner stays an attempt's: sent
// by a node that does not own the account (Router.Refund) or by the
// embedded client, it keeps the charge when a retry with the same event id
// was answered Replayed (and so served) since, and the account stays
// billed. With Attempt lost on the way, the owner applied a plain refund
// and the served retry was free.
func TestForwardedAttemptRefundKeepsAServedRetry(t *testing.T) {
	var accounts []account
	for i := 0; i < 8; i++ {
		id := fmt.Sprint("acct-", i)
		accounts = append(accounts, account{id: id, key: keyOf(id), plan: monthly("m100", 100)})
	}
	c := startCluster(t, accounts, clusterOptions{nodes: 2})
	ctx := context.Background()
	target := accounts[0].id
	owner, other := c.owner(t, target), c.notOwner(t, target)
	client := dial(t, router.DialOptions{}, other.RPCAddr())
	type api interface {
		Charge(context.Context, router.ChargeRequest) (router.ChargeResult, error)
		Refund(context.Context, router.RefundRequest) (shard.Decision, error)
	}
	for i, via := range []api{other.Router(), client} {
		id := fmt.Sprint("job-", i)
		req := router.ChargeRequest{Account: target, EventID: id, ClientID: true, Route: "POST /v1/tasks", Units: 2}
		first, err := via.Charge(ctx, req)
		if err != nil || first.Reason != shard.OK || first.Node != owner.ID() {
			t.Fatalf("via %T: charge: %+v %v; want ok at the owner %s", via, first, err, owner.ID())
		}
		if retry, err := via.Charge(ctx, req); err != nil || retry.Reason != shard.Replayed {
			t.Fatalf("via %T: retry: %+v %v; want replayed", via, retry, err)
		}
		d, err := via.Refund(ctx, router.RefundRequest{Account: target, EventID: id, Receipt: first.Receipt, Attempt: true})
		if err != nil || d.Reason != shard.Kept {
			t.Fatalf("via %T: the first attempt's refund after its retry was served: %v %v; want kept", via, d.Reason, err)
		}
	}
	if u, _, err := owner.Engine().Usage(target); err != nil || u.Used != 4 {
		t.Fatalf("used %d (%v), want 4: both charges stay billed", u.Used, err)
	}
}
