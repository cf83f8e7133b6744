package node

import (
	"context"
	"errors"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
)

// The rules of forwardAuth, on a hand-driven clock: refusals count only
// once they persist (minForwardRefusals, the latest forwardRefusedFor or
// more after the first, with no answer between), an answer clears a peer, a peer that does not answer
// (Unavailable) changes nothing, and only a majority of the serving peers
// refusing makes the node unready.
func TestForwardRefusalsMustPersistAndBeAMajority(t *testing.T) {
	peers := []ring.Meta{{ID: "n2", RPCAddr: "a2"}, {ID: "n3", RPCAddr: "a3"}, {ID: "n4", RPCAddr: "a4"}}
	refused := status.Error(codes.Unauthenticated, "wrong RPC token")
	down := status.Error(codes.Unavailable, "connection refused")
	t0 := time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC)
	why := func(f *forwardAuth) string {
		r, errs := f.refusing(peers)
		return forwardRefusalWhy(peers, r, errs)
	}
	refuseAll := func(f *forwardAuth, addrs []string, times int, at time.Time) {
		for range times {
			for _, a := range addrs {
				f.heard(a, refused, true, at)
			}
		}
	}

	var f forwardAuth
	refuseAll(&f, []string{"a2", "a3", "a4"}, 10, t0)
	if w := why(&f); w != "" {
		t.Fatalf("unready on refusals all at one time: %s", w)
	}
	refuseAll(&f, []string{"a2", "a3", "a4"}, 1, t0.Add(forwardRefusedFor-time.Nanosecond))
	if w := why(&f); w != "" {
		t.Fatalf("unready on refusals spread over less than %s: %s", forwardRefusedFor, w)
	}
	refuseAll(&f, []string{"a2", "a3", "a4"}, 1, t0.Add(forwardRefusedFor))
	if w := why(&f); !strings.Contains(w, "--rpc-token") || !strings.Contains(w, "n2 at a2, n3 at a3, n4 at a4") {
		t.Fatalf("every peer refusing for %s: %q; want a reason naming them and --rpc-token", forwardRefusedFor, w)
	}

	f = forwardAuth{}
	refuseAll(&f, []string{"a2", "a3", "a4"}, 1, t0)
	refuseAll(&f, []string{"a2", "a3", "a4"}, minForwardRefusals-2, t0.Add(time.Hour))
	if w := why(&f); w != "" {
		t.Fatalf("unready on %d refusals each: %s", minForwardRefusals-1, w)
	}

	f = forwardAuth{}
	refuseAll(&f, []string{"a2"}, 10, t0)
	refuseAll(&f, []string{"a2"}, 1, t0.Add(time.Hour))
	if w := why(&f); w != "" {
		t.Fatalf("unready with one peer of three refusing (the odd one out): %s", w)
	}
	refuseAll(&f, []string{"a3"}, 10, t0)
	refuseAll(&f, []string{"a3"}, 1, t0.Add(time.Hour))
	if w := why(&f); w == "" {
		t.Fatal("ready with two peers of three refusing persistently")
	}
	// A peer going down says nothing of the credentials: its refusals
	// stand, and a peer never refused is not made a refuser.
	f.heard("a3", down, false, t0.Add(time.Hour))
	f.heard("a4", down, false, t0.Add(time.Hour))
	if w := why(&f); w == "" {
		t.Fatal("an Unavailable answer cleared a peer's refusals")
	}
	// One answer clears a peer.
	f.heard("a3", nil, false, t0.Add(time.Hour))
	if w := why(&f); w != "" {
		t.Fatalf("unready after a refusing peer answered: %s", w)
	}
	// A peer that left the ring is forgotten.
	f.refusing(peers[1:])
	if s := f.suspects(); len(s) != 0 {
		t.Fatalf("suspects %v after a2 left the serving peers", s)
	}
	// TLS refusals name the TLS flags.
	f = forwardAuth{}
	tlsErr := status.Error(codes.Unavailable, "authentication handshake failed: remote error: tls: unknown certificate authority")
	for i := range minForwardRefusals { // one a probe interval apart
		f.heard("a2", tlsErr, true, t0.Add(time.Duration(i)*forwardRefusedFor/(minForwardRefusals-1)))
		f.heard("a3", tlsErr, true, t0.Add(time.Duration(i)*forwardRefusedFor/(minForwardRefusals-1)))
	}
	if w := why(&f); !strings.Contains(w, "--rpc-tls-ca") {
		t.Fatalf("TLS refusals: %q; want the --rpc-tls-* flags named", w)
	}
}

// A serving node whose peers start refusing the RPC token it forwards
// with (they accept only a new one; it still sends the old) stayed ready
// while every charge it forwarded failed. Now its /readyz answers 503
// naming the peer and --rpc-token once the refusals persist, and 200 again
// once the peer takes its calls (restarted accepting both tokens). The
// peer, whose own calls are taken, stays ready throughout.
func TestForwardsRefusedAfterServingUnreadyTheNode(t *testing.T) {
	const oldToken, newToken = "old-rpc-token-0123456789", "new-rpc-token-0123456789"
	dir := t.TempDir()
	dsn := "sqlite:" + filepath.Join(dir, "ledger.db")
	accounts := twentyAccounts(1000)
	seedLedger(t, dsn, accounts)
	// n1 accepts both and sends the old token; n2 has finished the
	// rotation (accepts and sends the new one only) before n1 began it.
	nodes := startNodesWith(t, dsn, func(c *Config) { c.RPCTokens = []string{oldToken, newToken} }, func(c *Config) { c.RPCTokens = []string{newToken} })
	n1, n2 := nodes[0], nodes[1]
	waitFor(t, 10*time.Second, "both nodes ready", func() bool { return n1.Ready() && n2.Ready() })
	acct := ownedBy(t, n2, accounts)
	chargeThroughN1 := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := n1.Router().Charge(ctx, router.ChargeRequest{Account: acct, Route: "GET /x", Units: 1})
		return err
	}
	if err := chargeThroughN1(); err == nil {
		t.Fatal("a charge n1 forwarded with the token n2 refuses went through; the test needs it refused")
	}
	var body string
	waitFor(t, 10*time.Second, "n1's /readyz 503 naming n2 and --rpc-token", func() bool {
		var code int
		code, body = readyz(t, n1)
		return code == http.StatusServiceUnavailable && strings.Contains(body, "n2 at ") && strings.Contains(body, "--rpc-token")
	})
	t.Logf("n1 /readyz: %s", body)
	if n1.Ready() || gaugeValue(t, n1, "quotaring_ready") != 0 {
		t.Fatal("n1.Ready() or quotaring_ready says ready while /readyz does not")
	}
	if code, body := readyz(t, n2); code != http.StatusOK {
		t.Fatalf("n2, whose calls n1 takes, is not ready: %d %s", code, body)
	}

	// n2 restarts on its address accepting the old token too: n1's probes
	// get through, and it is ready again without any traffic.
	cfg := n2.cfg
	cfg.RPCAddr = n2.RPCAddr()
	cfg.RPCTokens = []string{newToken, oldToken}
	cfg.Join = []string{n1.GossipAddr()}
	if err := n2.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	n2b, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n2b.Shutdown(context.Background()) })
	waitFor(t, 20*time.Second, "n1 and the restarted n2 ready", func() bool {
		code, _ := readyz(t, n1)
		return code == http.StatusOK && n2b.Ready()
	})
	if err := chargeThroughN1(); err != nil && !errors.Is(err, router.ErrUnavailable) {
		t.Fatalf("a charge through n1 once n2 takes its token: %v", err)
	}
}

// A peer that goes down is no refusal: the charges n1 forwards to it fail
// Unavailable, and n1 stays ready and holds nothing against it.
func TestPeerDownDoesNotUnreadyTheNode(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	accounts := twentyAccounts(1000)
	seedLedger(t, dsn, accounts)
	nodes := startNodesWith(t, dsn, nil, nil, nil)
	n1, n3 := nodes[0], nodes[2]
	waitFor(t, 10*time.Second, "every node ready", func() bool { return n1.Ready() && nodes[1].Ready() && n3.Ready() })
	acct := ownedBy(t, n3, accounts)
	n3.Kill()
	failed := 0
	for range 5 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		res, err := n1.Router().Charge(ctx, router.ChargeRequest{Account: acct, Route: "GET /x", Units: 1})
		cancel()
		switch {
		case err != nil:
			failed++
		case res.Reason != shard.OK:
			t.Fatalf("charge: %v", res.Reason)
		}
	}
	if failed == 0 {
		t.Skip("the ring moved n3's accounts before any forward to it failed; nothing to check")
	}
	if s := n1.fwdAuth.suspects(); len(s) != 0 {
		t.Fatalf("n1 counts the dead peer as refusing it: %v", s)
	}
	if code, body := readyz(t, n1); code != http.StatusOK {
		t.Fatalf("n1 unready after forwards to a dead peer failed: %d %s", code, body)
	}
}

// A TLS peer that crashes under load is no refusal. The calls in flight
// to it when it dies fail with "connection reset by peer", which
// router.CredentialsRefused counts as a refusal with TLS (a handshake
// refused after it completed looks the same), one per caller; every later
// call and probe finds the port closed ("connection refused"), which
// changes nothing. Refusals that all came in one burst did not persist
// over forwardRefusedFor: the node must stay ready, yet with the peer
// still in the ring (memberlist takes longer than forwardRefusedFor to
// declare it dead) it turned unready, in a two-node cluster the one node
// left.
func TestCrashedTLSPeerIsNoRefusal(t *testing.T) {
	peers := []ring.Meta{{ID: "n2", RPCAddr: "10.0.0.2:7001"}}
	reset := status.Error(codes.Unavailable, "error reading from server: read tcp 10.0.0.1:40000->10.0.0.2:7001: read: connection reset by peer")
	closed := status.Error(codes.Unavailable, `connection error: desc = "transport: Error while dialing: dial tcp 10.0.0.2:7001: connect: connection refused"`)
	if !router.CredentialsRefused(reset, true) || router.CredentialsRefused(closed, true) {
		t.Fatal("the test needs a reset counted as a refusal with TLS, and a closed port not")
	}
	t0 := time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC)
	var f forwardAuth
	for range 2 * minForwardRefusals { // the charges in flight when n2 died
		f.heard("10.0.0.2:7001", reset, router.CredentialsRefused(reset, true), t0)
	}
	for s := 1; s <= 10; s++ { // the probes every second after
		now := t0.Add(time.Duration(s) * forwardProbeEvery)
		f.heard("10.0.0.2:7001", closed, router.CredentialsRefused(closed, true), now)
		r, errs := f.refusing(peers)
		if w := forwardRefusalWhy(peers, r, errs); w != "" {
			t.Fatalf("%s after one burst of resets from a crashed peer, whose port is closed since: unready: %s", now.Sub(t0), w)
		}
	}
}
