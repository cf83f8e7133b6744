package node

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/logbuf"
	"github.com/quotaring/quotaring/internal/pki"
	"github.com/quotaring/quotaring/internal/waitfor"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// seedLedger creates the ledger with one hard plan per quota.
func seedLedger(t *testing.T, dsn string, accounts map[string]int64) {
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
	for id, q := range accounts {
		if err := l.UpsertPlan(ctx, snapshot.Plan{ID: "plan-" + id, MonthlyQuota: q, Hard: true}); err != nil {
			t.Fatal(err)
		}
		if err := l.UpsertAccount(ctx, id, "plan-"+id); err != nil {
			t.Fatal(err)
		}
	}
}

// twentyAccounts is acct-0 .. acct-19, each with a hard quota of quota,
// for seedLedger.
func twentyAccounts(quota int64) map[string]int64 {
	accounts := map[string]int64{}
	for i := range 20 {
		accounts[fmt.Sprint("acct-", i)] = quota
	}
	return accounts
}

// chargeEachThrough charges every account one unit through nd (waiting for
// nd's config snapshot to know them) and returns how many went to another
// owner: the forwarding path, when not 0.
func chargeEachThrough(t *testing.T, nd *Node, accounts map[string]int64) (forwarded int) {
	t.Helper()
	ctx := context.Background()
	for acct := range accounts {
		if owner, _ := nd.Ring().Owner(acct); owner.ID != nd.cfg.ID {
			forwarded++
		}
		waitFor(t, 10*time.Second, acct+" charged through "+nd.cfg.ID, func() bool {
			res, err := nd.Router().Charge(ctx, router.ChargeRequest{Account: acct, Route: "GET /x", Units: 1})
			if err != nil {
				t.Fatal(err)
			}
			if res.Reason == shard.UnknownAccount {
				return false // nd's config snapshot is not there yet
			}
			if res.Reason != shard.OK {
				t.Fatalf("charge of %s through %s: %v", acct, nd.cfg.ID, res.Reason)
			}
			return true
		})
	}
	return forwarded
}

// clientChargesEach dials an embedded client with opts at addrs and charges
// each account one unit through it; every charge must be OK. what names the
// client in failures.
func clientChargesEach(t *testing.T, what string, opts router.DialOptions, accounts map[string]int64, addrs ...string) {
	t.Helper()
	ctx := context.Background()
	c, err := opts.Dial(ctx, addrs...)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	defer c.Close()
	for acct := range accounts {
		if res, err := c.Charge(ctx, router.ChargeRequest{Account: acct, Route: "GET /x", Units: 1}); err != nil || res.Reason != shard.OK {
			t.Fatalf("%s, charge of %s: %+v %v", what, acct, res, err)
		}
	}
}

func startNodes(t *testing.T, dsn string, n int) []*Node {
	t.Helper()
	dir := t.TempDir()
	var nodes []*Node
	for i := 0; i < n; i++ {
		cfg := Config{ID: fmt.Sprint("n", i+1), DataDir: filepath.Join(dir, fmt.Sprint("n", i+1)), Ledger: dsn,
			RPCAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", GossipAddr: "127.0.0.1:0",
			RingPreset: ring.PresetLocal, SettleInterval: 100 * time.Millisecond, SnapshotInterval: 200 * time.Millisecond}
		if i > 0 {
			cfg.Join = []string{nodes[0].GossipAddr()}
		}
		nd, err := Start(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		nodes = append(nodes, nd)
	}
	t.Cleanup(func() {
		for _, nd := range nodes {
			nd.Shutdown(context.Background())
		}
	})
	waitFor(t, 20*time.Second, "one ring of all nodes", func() bool {
		e := nodes[0].Ring().Epoch()
		for _, nd := range nodes {
			if nd.Ring().Epoch() != e || len(nd.Ring().View().Serving) != n {
				return false
			}
		}
		return true
	})
	return nodes
}

func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	waitfor.Cond(t, timeout, what, cond)
}

func TestClusterInProcessExactQuota(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acme": 20})
	nodes := startNodes(t, dsn, 3)
	ctx := context.Background()
	var ok, refused atomic.Int64
	var wg sync.WaitGroup
	for i := 0; i < 100; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := nodes[i%3].Router().Charge(ctx, router.ChargeRequest{Account: "acme", Route: "GET /x", Units: 1})
			if err != nil {
				t.Error(err)
				return
			}
			switch res.Reason {
			case shard.OK:
				ok.Add(1)
			case shard.QuotaExceeded:
				refused.Add(1)
			default:
				t.Errorf("reason %v", res.Reason)
			}
		}()
	}
	wg.Wait()
	if ok.Load() != 20 || refused.Load() != 80 {
		t.Fatalf("%d ok, %d refused; want 20 and 80", ok.Load(), refused.Load())
	}
	for _, nd := range nodes {
		if _, err := nd.SettleNow(ctx); err != nil {
			t.Fatal(err)
		}
	}
	grants, err := nodes[0].Ledger().Grants(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	var used int64
	for _, g := range grants {
		used += g.Used
	}
	if used != 20 {
		t.Fatalf("ledger used %d, want 20 (%+v)", used, grants)
	}
}

// Listeners on every address (":0", like the defaults ":7400") advertise a
// reachable host, never "[::]", and a Start that fails after the node is
// built returns an error instead of panicking.
func TestAdvertisesReachableAddresses(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"a": 1})
	nd, err := Start(context.Background(), Config{ID: "n1", DataDir: t.TempDir(), Ledger: dsn, RingPreset: ring.PresetLocal,
		RPCAddr: ":0", HTTPAddr: ":0", AdminAddr: ":0", GossipAddr: ":0", AdvertiseHost: "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	defer nd.Shutdown(context.Background())
	self := nd.Ring().Self()
	for _, a := range []string{self.RPCAddr, self.HTTPAddr, self.AdminAddr, self.GossipAddr} {
		if host, _, _ := net.SplitHostPort(a); host != "127.0.0.1" {
			t.Errorf("advertised %q, want host 127.0.0.1", a)
		}
	}
	_, err = Start(context.Background(), Config{ID: "n1", DataDir: t.TempDir(), Ledger: dsn,
		RPCAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", GossipAddr: "not-an-ip:0"})
	if err == nil {
		t.Fatal("a node with a bad gossip address started")
	}
}

// An owner that leaves hands its reservations back and notes the handoff;
// the node that gains the account reserves for it before its first charge.
func TestGainedAccountsAreReservedAhead(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"busy": 1000})
	var logs [2]logbuf.Buffer
	nodes := startNodesWith(t, dsn, func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(&logs[0], nil)) },
		func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(&logs[1], nil)) })
	ctx := context.Background()
	for i := 0; i < 50; i++ {
		if res, err := nodes[0].Router().Charge(ctx, router.ChargeRequest{Account: "busy", Units: 1}); err != nil || res.Reason != shard.OK {
			t.Fatalf("charge %d: %v %v", i, res.Reason, err)
		}
	}
	owner, other, otherLog := nodes[0], nodes[1], &logs[1]
	if m, _ := owner.Ring().Owner("busy"); m.ID != owner.ID() {
		owner, other, otherLog = nodes[1], nodes[0], &logs[0]
	}
	if other.Engine().AllowanceHeld() != 0 {
		t.Fatal("the non-owner holds a reservation before the handoff")
	}
	if err := owner.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, "the remaining node to reserve ahead for the account it gained", func() bool {
		return other.Engine().AllowanceHeld() > 0
	})
	// It says so, counting the accounts it reserved for.
	waitFor(t, 10*time.Second, "the log line of the prefetch", func() bool {
		return strings.Contains(otherLog.String(), "reserved ahead for recently handed-off accounts")
	})
	if out := otherLog.String(); !strings.Contains(out, "accounts=1") {
		t.Fatalf("the prefetch's log line does not count 1 account:\n%s", out)
	}
}

// A busy port is an error that names the flag, and the ports opened before
// it are closed again (a node that failed to start holds nothing).
func TestBusyPortNamesTheFlag(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	free, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	rpcAddr := free.Addr().String()
	free.Close()
	dir := t.TempDir()
	_, err = Start(context.Background(), Config{ID: "n1", DataDir: filepath.Join(dir, "n1"), Ledger: "sqlite:" + filepath.Join(dir, "l.db"),
		RPCAddr: rpcAddr, HTTPAddr: busy.Addr().String(), AdminAddr: "127.0.0.1:0", GossipAddr: "127.0.0.1:0", RingPreset: ring.PresetLocal})
	if err == nil || !strings.Contains(err.Error(), "--http-addr") {
		t.Fatalf("start on a busy HTTP port: %v, want an error naming --http-addr", err)
	}
	// The gossip port too (memberlist opens it, TCP and UDP).
	_, err = Start(context.Background(), Config{ID: "n1", DataDir: filepath.Join(dir, "n1"), Ledger: "sqlite:" + filepath.Join(dir, "l.db"),
		RPCAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", GossipAddr: busy.Addr().String(), RingPreset: ring.PresetLocal})
	if err == nil || !strings.Contains(err.Error(), "--gossip-addr") {
		t.Fatalf("start on a busy gossip port: %v, want an error naming --gossip-addr", err)
	}
	again, err := net.Listen("tcp", rpcAddr)
	if err != nil {
		t.Fatalf("the RPC port of the node that failed to start is still held: %v", err)
	}
	again.Close()
}

// A ledger migrated by a newer quotad is refused at start with an error
// that says to upgrade, not served from the data dir while retrying (the
// older node would misread tables it does not know).
func TestLedgerFromANewerQuotadIsRefused(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "l.db")
	seedLedger(t, "sqlite:"+path, nil)
	db, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`INSERT INTO schema_migrations (version, applied_at) VALUES (9999, 0)`); err != nil {
		t.Fatal(err)
	}
	db.Close()
	nd, err := Start(context.Background(), Config{ID: "n1", DataDir: filepath.Join(dir, "n1"), Ledger: "sqlite:" + path,
		RPCAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", GossipAddr: "127.0.0.1:0", RingPreset: ring.PresetLocal})
	if err == nil {
		nd.Shutdown(context.Background())
		t.Fatal("a node started on a ledger at schema 9999")
	}
	if !errors.Is(err, flush.ErrSchemaTooNew) || !strings.Contains(err.Error(), "run a newer quotad") {
		t.Fatalf("start on a ledger from a newer quotad: %v, want ErrSchemaTooNew saying to run a newer quotad", err)
	}
}

// A node that starts with neither the ledger nor a config snapshot joins
// the ring owning nothing, so the accounts it would own are served by the
// others (before, it took its share and answered every one of them
// quota-unavailable, through every node); once the ledger answers, it takes
// its share.
func TestNodeWithoutConfigOwnsNothing(t *testing.T) {
	dir := t.TempDir()
	dsn := "sqlite:" + filepath.Join(dir, "ledger", "l.db")
	if err := os.Mkdir(filepath.Join(dir, "ledger"), 0o755); err != nil {
		t.Fatal(err)
	}
	accounts := twentyAccounts(100)
	seedLedger(t, dsn, accounts)
	n1 := startNodesWith(t, dsn, nil)[0]

	// n2's ledger is the same file, through a directory that does not
	// exist yet: unreachable, as a wrong host or a firewall would make it.
	link := filepath.Join(dir, "link")
	ctx := context.Background()
	n2, err := Start(ctx, Config{ID: "n2", DataDir: filepath.Join(dir, "n2"), Ledger: "sqlite:" + filepath.Join(link, "l.db"),
		RPCAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", GossipAddr: "127.0.0.1:0", RingPreset: ring.PresetLocal,
		Join: []string{n1.GossipAddr()}, SettleInterval: 100 * time.Millisecond, SnapshotInterval: 100 * time.Millisecond, LedgerRetry: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n2.Shutdown(context.Background()) })
	waitFor(t, 10*time.Second, "n1 to see n2 as a member", func() bool { return len(n1.Ring().View().Members) == 2 })
	if v := n1.Ring().View(); !slices.Equal(v.Serving, []string{"n1"}) {
		t.Fatalf("n2 without a config serves: ring view %v", v.Serving)
	}
	if n2.Ready() {
		t.Fatal("n2 says it is ready without a config")
	}
	for acct := range accounts {
		for _, through := range []*Node{n1, n2} {
			res, err := through.Router().Charge(ctx, router.ChargeRequest{Account: acct, Route: "GET /x", Units: 1})
			if err != nil || res.Reason != shard.OK {
				t.Fatalf("charge of %s through %s while n2 has no config: %+v %v", acct, through.cfg.ID, res, err)
			}
		}
	}

	if err := os.Symlink(filepath.Join(dir, "ledger"), link); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "n2 to serve once the ledger answers", func() bool {
		return slices.Equal(n1.Ring().View().Serving, []string{"n1", "n2"}) && n2.Ready()
	})
	owned := 0
	for acct := range accounts {
		if owner, _ := n1.Ring().Owner(acct); owner.ID == "n2" {
			owned++
			waitFor(t, 10*time.Second, acct+" charged at n2", func() bool {
				res, err := n1.Router().Charge(ctx, router.ChargeRequest{Account: acct, Route: "GET /x", Units: 1})
				if err != nil {
					t.Fatal(err)
				}
				return res.Reason == shard.OK && res.Node == "n2"
			})
		}
	}
	if owned == 0 {
		t.Fatal("n2 owns none of the 20 accounts once serving")
	}
}

// A node whose gossip the cluster refuses (another --gossip-key) does not
// serve alone: it would decide the cluster's accounts a second time. It
// stays unready and says why.
func TestNodeLockedOutOfTheClusterOwnsNothing(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acct-1": 100})
	key := func(k string) func(*Config) { return func(c *Config) { c.GossipKeys = [][]byte{[]byte(k)} } }
	n1 := startNodesWith(t, dsn, key("cluster-key-0123456789abcdefghij"))[0]
	dir := t.TempDir()
	n2, err := Start(context.Background(), Config{ID: "n2", DataDir: filepath.Join(dir, "n2"), Ledger: dsn,
		RPCAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", GossipAddr: "127.0.0.1:0", RingPreset: ring.PresetLocal,
		Join: []string{n1.GossipAddr()}, GossipKeys: [][]byte{[]byte("another-key-0123456789abcdefghij")}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n2.Shutdown(context.Background()) })
	if v := n2.Ring().View(); len(v.Serving) != 0 {
		t.Fatalf("n2, locked out of the cluster, serves a ring of its own: %v", v.Serving)
	}
	if n2.Ready() {
		t.Fatal("n2, locked out of the cluster, says it is ready")
	}
	resp, err := http.Get("http://" + n2.AdminAddr() + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "the gossip keys differ") {
		t.Fatalf("n2's /readyz: %d %s, want 503 saying the gossip keys differ", resp.StatusCode, body)
	}
	if v := n1.Ring().View(); !slices.Equal(v.Serving, []string{"n1"}) {
		t.Fatalf("n1's ring: %v", v.Serving)
	}
}

// Nodes that share a gossip key form one ring (the ring's tests show that
// a node without it cannot join).
func TestGossipKeyRing(t *testing.T) {
	key := []byte("0123456789abcdef")
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	withKey := func(c *Config) { c.GossipKeys = [][]byte{key} }
	nodes := startNodesWith(t, dsn, withKey, withKey)
	if got := nodes[1].Ring().View().Serving; len(got) != 2 {
		t.Fatalf("serving %v, want both nodes", got)
	}
}

// With an RPC token, nodes forward to each other with it and an embedded
// client with it works; a client without it, or with another, is refused
// Unauthenticated before anything is charged, and a short token is refused
// at start.
func TestRPCToken(t *testing.T) {
	const token = "rpc-token-0123456789abcdef"
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	accounts := twentyAccounts(100)
	seedLedger(t, dsn, accounts)
	withToken := func(c *Config) { c.RPCTokens = []string{token} }
	nodes := startNodesWith(t, dsn, withToken, withToken)
	ctx := context.Background()

	if chargeEachThrough(t, nodes[0], accounts) == 0 {
		t.Fatal("no account is owned by n2: the forwarding path was not tested")
	}

	clientChargesEach(t, "embedded client with the token", router.DialOptions{Token: token}, accounts, nodes[0].RPCAddr())

	for name, tc := range map[string]struct{ token, want string }{
		"no token":    {"", "requires the cluster's RPC token"},
		"wrong token": {"another-token-0123456789", "wrong RPC token"},
	} {
		_, err := router.DialOptions{Token: tc.token}.Dial(ctx, nodes[0].RPCAddr())
		t.Logf("%s: %v", name, err)
		if err == nil || !strings.Contains(err.Error(), "code = Unauthenticated") || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Dial: %v, want Unauthenticated saying %q", name, err, tc.want)
		}
	}

	_, err := Start(ctx, Config{ID: "n9", DataDir: filepath.Join(t.TempDir(), "n9"), Ledger: dsn, RPCTokens: []string{"short"},
		RPCAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", GossipAddr: "127.0.0.1:0", RingPreset: ring.PresetLocal})
	if err == nil || !strings.Contains(err.Error(), "--rpc-token) is 5 characters; use at least 16") {
		t.Fatalf("start with a 5-character RPC token: %v", err)
	}
}

// Mid-rotation (README, "Rotating"), a node that sends the old token and
// accepts the new one and a node that sends the new one and accepts the
// old one forward to each other, and clients with either token work.
func TestRPCTokenRotation(t *testing.T) {
	const oldToken, newToken = "old-rpc-token-0123456789", "new-rpc-token-0123456789"
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	accounts := twentyAccounts(100)
	seedLedger(t, dsn, accounts)
	nodes := startNodesWith(t, dsn,
		func(c *Config) { c.RPCTokens = []string{oldToken, newToken} },
		func(c *Config) { c.RPCTokens = []string{newToken, oldToken} })
	forwarded := map[string]int{}
	for _, through := range nodes {
		forwarded[through.cfg.ID] = chargeEachThrough(t, through, accounts)
	}
	if forwarded["n1"] == 0 || forwarded["n2"] == 0 {
		t.Fatalf("forwarded %v: both directions must be tested", forwarded)
	}
	for _, tok := range []string{oldToken, newToken} {
		clientChargesEach(t, "client with "+tok, router.DialOptions{Token: tok}, accounts, nodes[0].RPCAddr(), nodes[1].RPCAddr())
	}
}

// TestRPCTLS: nodes with --rpc-tls-* forward to each other over mutual TLS,
// and an embedded client with a certificate of the cluster's CA charges
// through either; a plaintext client, or one whose certificate another CA
// signed, does not get past the handshake. The status page says so.
func TestRPCTLS(t *testing.T) {
	dir := t.TempDir()
	ca, err := pki.NewCA("cluster CA")
	if err != nil {
		t.Fatal(err)
	}
	// Nodes advertise 127.0.0.1; the certificate carries it, and a DNS
	// name for clients that check that instead (--rpc-tls-server-name).
	files, err := ca.WriteFiles(dir, "node", pki.Names{DNS: []string{"quotad.internal"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	accounts := twentyAccounts(100)
	seedLedger(t, dsn, accounts)
	withTLS := func(c *Config) { c.RPCTLS = files }
	nodes := startNodesWith(t, dsn, withTLS, withTLS)
	ctx := context.Background()

	if chargeEachThrough(t, nodes[0], accounts) == 0 {
		t.Fatal("no account is owned by n2: the forwarding path was not tested")
	}

	named := files
	named.ServerName = "quotad.internal"
	for name, f := range map[string]router.TLSFiles{"by IP": files, "by server name": named} {
		cfg, err := f.ClientConfig()
		if err != nil {
			t.Fatal(err)
		}
		clientChargesEach(t, "embedded client with TLS, "+name, router.DialOptions{TLS: cfg}, accounts, nodes[0].RPCAddr())
	}

	other, _ := pki.NewCA("another CA")
	otherFiles, err := other.WriteFiles(filepath.Join(dir, "other"), "client", pki.Names{})
	if err != nil {
		t.Fatal(err)
	}
	foreign, _ := files.ClientConfig()
	otherCfg, _ := otherFiles.ClientConfig()
	foreign.GetClientCertificate = otherCfg.GetClientCertificate
	for name, tc := range map[string]struct {
		cfg  *tls.Config
		want string
	}{
		"plaintext": {nil, "dial with TLS: router.DialOptions.TLS"},
		// TLS 1.3 sends the node's refusal of the client's certificate
		// after the client's handshake: it arrives as the alert, or, when
		// the client's first write meets the closed connection, as that.
		"a certificate of another CA": {foreign, "unknown certificate authority|it likely refused this client's certificate"},
	} {
		dctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		_, err := router.DialOptions{TLS: tc.cfg, CallTimeout: time.Second}.Dial(dctx, nodes[0].RPCAddr())
		cancel()
		t.Logf("%s: %v", name, err)
		if err == nil || !slices.ContainsFunc(strings.Split(tc.want, "|"), func(w string) bool { return strings.Contains(err.Error(), w) }) {
			t.Errorf("%s: Dial: %v, want an error saying %q", name, err, tc.want)
		}
	}
	// The other way round: a TLS client against a plaintext node (n3).
	plainDSN := "sqlite:" + filepath.Join(t.TempDir(), "plain.db")
	seedLedger(t, plainDSN, map[string]int64{"acct-0": 1})
	plain := startNodesWith(t, plainDSN, nil)
	cfg, _ := files.ClientConfig()
	dctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err = router.DialOptions{TLS: cfg, CallTimeout: time.Second}.Dial(dctx, plain[0].RPCAddr())
	cancel()
	t.Logf("TLS client, plaintext node: %v", err)
	if err == nil || !strings.Contains(err.Error(), "the node does not speak TLS") {
		t.Errorf("TLS client against a plaintext node: %v, want the hint", err)
	}

	resp, err := http.Get("http://" + nodes[0].AdminAddr() + "/status")
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(page), "RPC over mutual TLS") {
		t.Error("the status page does not say the RPC port is mutual TLS")
	}
	// The certificate's expiry is exported per port (an expired RPC
	// certificate went unnoticed until a node restarted); 0 without TLS.
	pair, err := tls.LoadX509KeyPair(files.Cert, files.Key)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := labeledGauge(t, nodes[0], "quotaring_tls_certificate_expiry_timestamp_seconds", "port", "rpc"), float64(pair.Leaf.NotAfter.Unix()); got != want {
		t.Errorf("quotaring_tls_certificate_expiry_timestamp_seconds{port=rpc} = %v, want %v", got, want)
	}
	if got := labeledGauge(t, nodes[0], "quotaring_tls_certificate_expiry_timestamp_seconds", "port", "http"); got != 0 {
		t.Errorf("quotaring_tls_certificate_expiry_timestamp_seconds{port=http} = %v, want 0 (no TLS there)", got)
	}
}

// TestRPCTLSCARotation: the cluster's CA rotates on running nodes, with no
// restart: both CAs in every node's bundle, certificates of the new CA,
// then the new CA alone, each taken from the files at the next handshake.
// A node started afterwards with the new CA alone joins and charges both
// ways, an embedded client of the new CA charges through the old nodes,
// and a client still on a certificate of the retired CA is refused.
func TestRPCTLSCARotation(t *testing.T) {
	dir := t.TempDir()
	oldCA, _ := pki.NewCA("old CA")
	newCA, _ := pki.NewCA("new CA")
	ip := pki.Names{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}}
	files := make([]router.TLSFiles, 3)
	for i := range files {
		f, err := oldCA.WriteFiles(filepath.Join(dir, fmt.Sprint("n", i+1)), "node", ip)
		if err != nil {
			t.Fatal(err)
		}
		files[i] = f
	}
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	accounts := twentyAccounts(100)
	seedLedger(t, dsn, accounts)
	nodes := startNodesWith(t, dsn, func(c *Config) { c.RPCTLS = files[0] }, func(c *Config) { c.RPCTLS = files[1] })
	for _, nd := range nodes {
		chargeEachThrough(t, nd, accounts)
	}

	// Each write moves the file's mtime a minute further, as a rename
	// by cert-manager would.
	step := 0
	write := func(path string, b []byte) {
		t.Helper()
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		step++
		later := time.Now().Add(time.Duration(step) * time.Minute)
		if err := os.Chtimes(path, later, later); err != nil {
			t.Fatal(err)
		}
	}
	both := append(append([]byte{}, oldCA.PEM...), newCA.PEM...)
	for _, f := range files[:2] {
		write(f.CA, both)
	}
	for _, f := range files[:2] {
		certPEM, keyPEM, err := newCA.Issue("node", ip)
		if err != nil {
			t.Fatal(err)
		}
		write(f.Key, keyPEM)
		write(f.Cert, certPEM)
	}
	for _, f := range files[:2] {
		write(f.CA, newCA.PEM)
	}

	// n3 knows the new CA alone: its handshakes with n1 and n2 (new
	// connections both ways) need their new certificates and bundles.
	fresh, err := newCA.WriteFiles(filepath.Join(dir, "n3"), "node", ip)
	if err != nil {
		t.Fatal(err)
	}
	cfg := nodeConfig(dsn, "n3", filepath.Join(t.TempDir(), "n3"))
	cfg.Join, cfg.RPCTLS = []string{nodes[0].GossipAddr()}, fresh
	n3, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n3.Shutdown(context.Background()) })
	waitFor(t, 20*time.Second, "n3 serving in every node's ring", func() bool {
		for _, nd := range append(nodes, n3) {
			if !slices.Contains(nd.Ring().View().Serving, "n3") {
				return false
			}
		}
		return true
	})
	forwarded := map[string]int{}
	for _, nd := range append(nodes, n3) {
		forwarded[nd.cfg.ID] = chargeEachThrough(t, nd, accounts)
	}
	if forwarded["n3"] == 0 || forwarded["n1"] == 0 {
		t.Fatalf("forwarded %v: n3 to the old nodes and back must both be tested", forwarded)
	}
	client, err := fresh.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	clientChargesEach(t, "embedded client of the new CA", router.DialOptions{TLS: client}, accounts, nodes[0].RPCAddr())

	stale, err := oldCA.WriteFiles(filepath.Join(dir, "stale"), "client", ip)
	if err != nil {
		t.Fatal(err)
	}
	write(stale.CA, both)
	staleCfg, err := stale.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	dctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	_, err = router.DialOptions{TLS: staleCfg, CallTimeout: time.Second}.Dial(dctx, nodes[0].RPCAddr())
	cancel()
	if err == nil {
		t.Fatal("a client on a certificate of the retired CA dialled n1")
	}
	t.Logf("a client of the retired CA: %v", err)
}

// TestHTTPSPorts: with HTTPTLS and AdminTLS (--http-tls-*, --admin-tls-*)
// the public front and the admin port serve HTTPS, HTTP/2 offered; a
// plaintext request gets Go's 400; the status page links the other nodes'
// pages over https; a pair missing its key stops the start, naming the flag.
func TestHTTPSPorts(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.NewCA("public CA")
	files, err := ca.WriteFiles(dir, "node", pki.Names{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	pair := router.CertFiles{Cert: files.Cert, Key: files.Key}
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acct-0": 1})
	withHTTPS := func(c *Config) { c.HTTPTLS, c.AdminTLS = pair, pair }
	nodes := startNodesWith(t, dsn, withHTTPS, withHTTPS)

	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca.PEM)
	tlsCfg := &tls.Config{RootCAs: roots}
	tr := &http.Transport{TLSClientConfig: tlsCfg, ForceAttemptHTTP2: true}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	for _, c := range []struct{ what, url, want string }{
		{"the admin port's /healthz", "https://" + nodes[0].AdminAddr() + "/healthz", ""},
		{"the status page", "https://" + nodes[0].AdminAddr() + "/status", "https://" + nodes[1].AdminAddr() + "/status"},
		{"the public front", "https://" + nodes[0].HTTPAddr() + "/v1/x", "--upstream"},
	} {
		resp, err := client.Get(c.url)
		if err != nil {
			t.Fatalf("%s over HTTPS: %v", c.what, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.ProtoMajor != 2 {
			t.Errorf("%s: %s, want HTTP/2 offered over TLS", c.what, resp.Proto)
		}
		if !strings.Contains(string(body), c.want) {
			t.Errorf("%s: %d %q, want %q in it", c.what, resp.StatusCode, body, c.want)
		}
	}
	for _, addr := range []string{nodes[0].AdminAddr(), nodes[0].HTTPAddr()} {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "HTTPS server") {
			t.Errorf("plain HTTP to %s: %d %q, want 400 from an HTTPS server", addr, resp.StatusCode, body)
		}
	}

	cfg := Config{ID: "n9", DataDir: filepath.Join(dir, "n9"), Ledger: dsn, RPCAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0",
		AdminAddr: "127.0.0.1:0", GossipAddr: "127.0.0.1:0", RingPreset: ring.PresetLocal, AdminTLS: router.CertFiles{Cert: files.Cert}}
	if nd, err := Start(context.Background(), cfg); err == nil {
		nd.Shutdown(context.Background())
		t.Fatal("a node started with --admin-tls-cert and no key")
	} else if !strings.Contains(err.Error(), "--admin-tls-key") {
		t.Fatalf("no key: %v, want it to name --admin-tls-key", err)
	}
}

// The HTTP servers' own error lines land in the node's log: failed TLS
// handshakes (scanners, plaintext clients) at debug, the rest at warn.
func TestServerErrorLog(t *testing.T) {
	var buf strings.Builder
	l := slog.NewLogLogger(serverErrorLog(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))), slog.LevelWarn)
	l.Printf("http: TLS handshake error from 127.0.0.1:5: client sent an HTTP request to an HTTPS server")
	l.Printf("http: panic serving 127.0.0.1:6: boom")
	out := buf.String()
	if !strings.Contains(out, `level=DEBUG msg="http: TLS handshake error`) || !strings.Contains(out, `level=WARN msg="http: panic serving`) {
		t.Fatalf("log:\n%s", out)
	}
}

// A node that restarts alone (the first node, started without --join, or
// one whose seeds do not answer) while the ledger heard from the others
// moments ago does not take accounts: it would own every account beside
// them. It serves once they reach it.
func TestRestartedNodeAloneWaitsForTheOthers(t *testing.T) {
	again, n2 := restartAlone(t, nil)
	why := again.notServable()
	if !strings.Contains(why, "alone in the ring while the ledger heard from n2") {
		t.Fatalf("restarted alone: notServable %q, want it waiting for n2", why)
	}
	if owned := len(again.Ring().View().Owners); owned != 0 {
		t.Fatalf("restarted alone, its ring has %d owned partitions: it took accounts", owned)
	}
	resp, err := http.Get("http://" + again.AdminAddr() + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "alone in the ring") {
		t.Fatalf("/readyz: %d %q", resp.StatusCode, body)
	}

	n2.gossipF.UnblockAll() // n2's rejoin loop reaches it
	waitFor(t, 20*time.Second, "the restarted node serving in one ring with n2", func() bool {
		v := again.Ring().View()
		owners := map[string]bool{}
		for _, o := range v.Owners {
			owners[o] = true
		}
		return owners["n1"] && owners["n2"] && again.isServing()
	})
}

// restartAlone starts two nodes, n1 and n2, and restarts n1 (its config
// changed by change, when set, which is given n2) while n2 cannot reach
// it: n1 comes back alone in its ring. n2.gossipF.UnblockAll lets n2's
// rejoin loop reach it.
func restartAlone(t *testing.T, change func(c *Config, n2 *Node)) (again, n2 *Node) {
	t.Helper()
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, twentyAccounts(100))
	faults := func(c *Config) { c.TestFaults = true }
	nodes := startNodesWith(t, dsn, faults, faults)
	n1, n2 := nodes[0], nodes[1]
	cfg, gossip := n1.cfg, n1.GossipAddr()
	cfg.GossipAddr = gossip // the same address, as a restarted process has
	if change != nil {
		change(&cfg, n2)
	}
	if err := n1.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := n2.gossipF.Block(gossip); err != nil { // n2 cannot reach it yet
		t.Fatal(err)
	}
	again, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { again.Shutdown(context.Background()) })
	return again, n2
}
