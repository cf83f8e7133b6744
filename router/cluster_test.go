package router_test

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/waitfor"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/snapshot"
)

// june28 is the scenario's start: 60 h before the period ends.
var june28 = time.Date(2026, 6, 28, 12, 0, 0, 0, time.UTC)

// weights are the scenario's route weights.
var weights = map[string]int64{"GET /v1/tasks": 1, "POST /v1/tasks": 2, "POST /v1/exports": 25, "POST /v1/fail": 5, "POST /v1/grpc": 3,
	"POST /v1/grpc-ok": 3, "POST /v1/hang": 4, "POST /v1/upload": 1, "POST /quotaring.v1.Quota/Usage": 3}

// account is one seeded account with one key.
type account struct {
	id, key string // key is the plaintext
	plan    snapshot.Plan
}

func keyOf(id string) string { return "qr_test_" + id }

// seed writes plans, accounts, keys and the route weights into a fresh
// SQLite ledger.
func seed(t testing.TB, dsn string, accounts []account) {
	t.Helper()
	ctx := context.Background()
	l, err := flush.Open(ctx, dsn, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for _, a := range accounts {
		if err := l.UpsertPlan(ctx, a.plan); err != nil {
			t.Fatal(err)
		}
		if err := l.UpsertAccount(ctx, a.id, a.plan.ID); err != nil {
			t.Fatal(err)
		}
		if err := l.AddKey(ctx, snapshot.Key{ID: "key-" + a.id, Hash: snapshot.HashKey(a.key), Account: a.id}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := l.SetRoutes(ctx, 1, weights); err != nil {
		t.Fatal(err)
	}
}

// cluster is n in-process nodes on one SQLite ledger, each with the proxy
// to upstream as its front.
type cluster struct {
	nodes    []*node.Node
	clock    *engine.ManualClock
	dir, dsn string
	opts     clusterOptions
	accounts []account
}

type clusterOptions struct {
	nodes    int
	clock    *engine.ManualClock // nil: the system clock
	upstream string              // "" serves no front
	front    func(*router.FrontOptions)
	noSync   bool
	rpcToken string // the nodes' --rpc-token; "" none
	// settle is the settle interval (and the reservation window) [100ms];
	// snapshot the config refresh interval [200ms].
	settle, snapshot time.Duration
}

func startCluster(t testing.TB, accounts []account, o clusterOptions) *cluster {
	t.Helper()
	dir := t.TempDir()
	c := &cluster{clock: o.clock, dir: dir, dsn: "sqlite:" + filepath.Join(dir, "ledger.db"), opts: o, accounts: accounts}
	seed(t, c.dsn, accounts)
	t.Cleanup(func() {
		for _, nd := range c.nodes {
			nd.Shutdown(context.Background())
		}
	})
	for i := 0; i < o.nodes; i++ {
		c.add(t)
	}
	return c
}

// add starts one more node, joins it to the others and waits until every
// node sees one ring and has every key.
func (c *cluster) add(t testing.TB) *node.Node {
	t.Helper()
	id := fmt.Sprint("n", len(c.nodes)+1)
	cfg := node.Config{ID: id, DataDir: filepath.Join(c.dir, id), Ledger: c.dsn,
		RPCAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", GossipAddr: "127.0.0.1:0",
		RingPreset: ring.PresetLocal, SettleInterval: cmp.Or(c.opts.settle, 100*time.Millisecond), SnapshotInterval: cmp.Or(c.opts.snapshot, 200*time.Millisecond),
		NoSync: c.opts.noSync}
	if c.opts.rpcToken != "" {
		cfg.RPCTokens = []string{c.opts.rpcToken}
	}
	if c.clock != nil {
		cfg.Clock = c.clock
	}
	if c.opts.upstream != "" {
		u, err := url.Parse(c.opts.upstream)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Front = func(n *node.Node) (http.Handler, error) {
			opts := n.FrontOptions()
			if c.opts.front != nil {
				c.opts.front(&opts)
			}
			return router.NewProxy(u, opts)
		}
	}
	if len(c.nodes) > 0 {
		cfg.Join = []string{c.nodes[0].GossipAddr()}
	}
	nd, err := node.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	c.nodes = append(c.nodes, nd)
	c.settle(t)
	return nd
}

// stop shuts nd down and waits until the others see a ring without it.
func (c *cluster) stop(t testing.TB, nd *node.Node) {
	t.Helper()
	if err := nd.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	for i, x := range c.nodes {
		if x == nd {
			c.nodes = append(c.nodes[:i], c.nodes[i+1:]...)
			break
		}
	}
	c.settle(t)
}

// settle waits until every node sees one ring of all of them and holds
// every key.
func (c *cluster) settle(t testing.TB) {
	t.Helper()
	waitFor(t, 20*time.Second, "one ring of all nodes", func() bool {
		e := c.nodes[0].Ring().Epoch()
		for _, nd := range c.nodes {
			if nd.Ring().Epoch() != e || len(nd.Ring().View().Serving) != len(c.nodes) {
				return false
			}
		}
		return true
	})
	waitFor(t, 10*time.Second, "every node's snapshot to hold every key", func() bool {
		for _, nd := range c.nodes {
			s := nd.Engine().Snapshot()
			if s == nil {
				return false
			}
			for _, a := range c.accounts {
				if _, ok := s.Key(snapshot.HashKey(a.key)); !ok {
					return false
				}
			}
		}
		return true
	})
}

// owner is the node that owns account.
func (c *cluster) owner(t testing.TB, account string) *node.Node {
	t.Helper()
	m, ok := c.nodes[0].Ring().Owner(account)
	if !ok {
		t.Fatalf("nobody owns %q", account)
	}
	for _, nd := range c.nodes {
		if nd.ID() == m.ID {
			return nd
		}
	}
	t.Fatalf("owner %q of %q is not in the cluster", m.ID, account)
	return nil
}

// notOwner is a node that does not own any of accounts.
func (c *cluster) notOwner(t testing.TB, accounts ...string) *node.Node {
	t.Helper()
	for _, nd := range c.nodes {
		owns := false
		for _, a := range accounts {
			owns = owns || c.owner(t, a) == nd
		}
		if !owns {
			return nd
		}
	}
	t.Fatalf("every node owns one of %v", accounts)
	return nil
}

// refunds is the refunds applied across the cluster.
func (c *cluster) refunds() int64 {
	var n int64
	for _, nd := range c.nodes {
		n += nd.Engine().Stats().Refunds.Load()
	}
	return n
}

func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	waitfor.Cond(t, timeout, what, cond)
}

// upstream is the API behind the proxy. It counts what it served, by path.
type upstream struct {
	*httptest.Server
	mu     sync.Mutex // protects served and accounts
	served map[string]int
	// accounts are the X-Quota-Account values it saw.
	accounts map[string]int
	release  chan struct{} // closed at cleanup: /v1/hang returns
	hanging  atomic.Int64
}

func newUpstream(t testing.TB) *upstream {
	u := &upstream{served: map[string]int{}, accounts: map[string]int{}, release: make(chan struct{})}
	u.Server = httptest.NewServer(u)
	t.Cleanup(func() {
		close(u.release)
		u.Close()
	})
	return u
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	u.mu.Lock()
	u.served[r.Method+" "+r.URL.Path]++
	u.accounts[r.Header.Get(router.HeaderAccount)]++
	u.mu.Unlock()
	switch r.URL.Path {
	case "/v1/fail":
		http.Error(w, "upstream broke", http.StatusInternalServerError)
	case "/v1/grpc", "/v1/grpc-ok":
		status := "13"
		if r.URL.Path == "/v1/grpc-ok" {
			status = "0"
		}
		w.Header().Set("Content-Type", "application/grpc")
		w.Header().Set("Trailer", "Grpc-Status, Grpc-Message")
		w.WriteHeader(http.StatusOK)
		w.Write([]byte{0, 0, 0, 0, 0}) // one empty message
		w.Header().Set("Grpc-Status", status)
		w.Header().Set("Grpc-Message", "internal")
	case "/v1/drop": // no answer at all: the proxy answers 502
		if c, _, err := http.NewResponseController(w).Hijack(); err == nil {
			c.Close()
		}
	case "/v1/hang":
		u.hanging.Add(1)
		select {
		case <-u.release:
		case <-r.Context().Done():
		}
	default:
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]any{"ok": true, "path": r.URL.Path, "bytes": len(body),
			"account": r.Header.Get(router.HeaderAccount), "api_key_forwarded": r.Header.Get("X-Api-Key") != ""})
	}
}

func (u *upstream) count(methodPath string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.served[methodPath]
}

func (u *upstream) sawAccount(id string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.accounts[id]
}

// answer is what a test looks at in a response.
type answer struct {
	status  int
	header  http.Header
	trailer http.Header
	body    []byte
	problem router.Problem
}

// do sends one request to base+path with the key (if any) and extra
// headers as "Name: value".
func do(t testing.TB, base, method, path, key string, body io.Reader, headers ...string) answer {
	t.Helper()
	return doWith(t, http.DefaultClient, base, method, path, key, body, headers...)
}

// h2cClient speaks HTTP/2 without TLS (prior knowledge), as gRPC clients do.
func h2cClient() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: &p}}
}

// doWith is do through client.
func doWith(t testing.TB, client *http.Client, base, method, path, key string, body io.Reader, headers ...string) answer {
	t.Helper()
	req, err := http.NewRequest(method, base+path, body)
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	for _, h := range headers {
		k, v, _ := strings.Cut(h, ": ")
		req.Header.Add(k, v)
	}
	res, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	a := answer{status: res.StatusCode, header: res.Header}
	if a.body, err = io.ReadAll(res.Body); err != nil {
		t.Fatal(err)
	}
	a.trailer = res.Trailer
	if res.Header.Get("Content-Type") == "application/problem+json" {
		if err := json.Unmarshal(a.body, &a.problem); err != nil {
			t.Fatalf("problem body %q: %v", a.body, err)
		}
	}
	return a
}

func (a answer) remaining(t testing.TB) string {
	t.Helper()
	return a.header.Get("X-Quota-Remaining")
}

func (a answer) usage(t testing.TB) router.UsageReport {
	t.Helper()
	if a.status != http.StatusOK {
		t.Fatalf("usage: %d %s", a.status, a.body)
	}
	var u router.UsageReport
	if err := json.Unmarshal(a.body, &u); err != nil {
		t.Fatalf("usage %q: %v", a.body, err)
	}
	return u
}

// expect fails unless a has status and (when given) remaining units.
func expect(t testing.TB, what string, a answer, status int, remaining string) {
	t.Helper()
	if a.status != status {
		t.Fatalf("%s: status %d, want %d (%s)", what, a.status, status, a.body)
	}
	if remaining != "" && a.remaining(t) != remaining {
		t.Fatalf("%s: X-Quota-Remaining %q, want %s (%s)", what, a.remaining(t), remaining, a.body)
	}
}
