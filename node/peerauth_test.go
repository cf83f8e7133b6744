package node

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/quotaring/quotaring/internal/logbuf"
	"github.com/quotaring/quotaring/internal/pki"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
)

// readyz is a node's /readyz: its status and body.
func readyz(t *testing.T, nd *Node) (int, string) {
	t.Helper()
	resp, err := http.Get("http://" + nd.AdminAddr() + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// joinRefused starts a node that joins first (through gossip, which has
// its own key) configured by mod, and waits until its /readyz says why it
// takes no accounts, naming want; the cluster still serves without it.
func joinRefused(t *testing.T, first *Node, dsn, id, want string, mod func(*Config)) (*Node, *logbuf.Buffer) {
	t.Helper()
	cfg := nodeConfig(dsn, id, filepath.Join(t.TempDir(), id))
	cfg.Join = []string{first.GossipAddr()}
	logs := new(logbuf.Buffer)
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	mod(&cfg)
	n2, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n2.Shutdown(context.Background()) })
	waitFor(t, 10*time.Second, id+" in n1's gossip", func() bool {
		return slices.ContainsFunc(first.Ring().View().Members, func(m ring.Meta) bool { return m.ID == id })
	})
	var code int
	var body string
	waitFor(t, 10*time.Second, id+"'s /readyz saying "+want, func() bool {
		code, body = readyz(t, n2)
		return code == http.StatusServiceUnavailable && strings.Contains(body, want)
	})
	t.Logf("%s: /readyz %d: %s", id, code, body)
	if n2.Ready() || n2.isServing() {
		t.Fatalf("%s says it is ready (serving %v) while its peers refuse its RPC calls: %s", id, n2.isServing(), body)
	}
	if v := first.Ring().View(); !slices.Equal(v.Serving, []string{"n1"}) {
		t.Fatalf("n1's ring serves %v: %s took accounts that nobody could forward to or from it", v.Serving, id)
	}
	if !strings.Contains(logs.String(), want) {
		t.Errorf("%s's log does not say %q:\n%s", id, want, logs.String())
	}
	return n2, logs
}

// A node whose RPC token the serving nodes refuse (another one, or none),
// or that requires a token they do not send, joins the gossip (its key is
// right) but takes no accounts, and its /readyz and its log name
// --rpc-token: before, it took its share of the ring, said it was ready,
// and every charge forwarded to or from it failed 500 while its own log
// said nothing. The node that refuses its calls logs them with the
// caller's address.
func TestNodeWhoseRPCTokenThePeersRefuseOwnsNothing(t *testing.T) {
	const token = "rpc-token-0123456789abcdef"
	for name, tc := range map[string]struct {
		cluster, joiner []string
		want            string // in n2's /readyz and log
		refusedLog      string // in n1's log; "" when n1 refuses nothing
	}{
		"a wrong token":                      {[]string{token}, []string{"another-token-0123456789"}, "wrong RPC token", "refused an RPC call from 127.0.0.1:"},
		"no token":                           {[]string{token}, nil, "requires the cluster's RPC token", "refused an RPC call from 127.0.0.1:"},
		"a token where the cluster has none": {nil, []string{token}, "have no RPC token, so they send none, while this node requires one (--rpc-token)", ""},
	} {
		t.Run(name, func(t *testing.T) {
			dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
			seedLedger(t, dsn, twentyAccounts(100))
			var n1Logs logbuf.Buffer
			n1 := startNodesWith(t, dsn, func(c *Config) {
				c.RPCTokens = tc.cluster
				c.Logger = slog.New(slog.NewTextHandler(&n1Logs, nil))
			})[0]
			joinRefused(t, n1, dsn, "n2", tc.want, func(c *Config) { c.RPCTokens = tc.joiner })
			_, body := readyz(t, n1)
			if !strings.Contains(body, "ready") {
				t.Errorf("n1's /readyz: %s", body)
			}
			if tc.refusedLog == "" {
				return
			}
			waitFor(t, 5*time.Second, "n1 logging the refusal, naming --rpc-token", func() bool {
				l := n1Logs.String()
				return strings.Contains(l, tc.refusedLog) && strings.Contains(l, "the host of n2") && strings.Contains(l, "--rpc-token (QUOTAD_RPC_TOKEN)")
			})
		})
	}
}

// The steps of a token rotation (README, "Rotating") never keep a node
// from serving: each node accepts what every other sends. Checking the
// peers makes no call that they refuse (and log as refused).
func TestRPCTokenRotationStepsServe(t *testing.T) {
	const oldToken, newToken = "old-rpc-token-0123456789", "new-rpc-token-0123456789"
	for name, steps := range map[string][2][]string{
		"step 1 (OLD,NEW beside OLD)":     {{oldToken}, {oldToken, newToken}},
		"step 2 (NEW,OLD beside OLD,NEW)": {{oldToken, newToken}, {newToken, oldToken}},
		"step 3 (NEW beside NEW,OLD)":     {{newToken, oldToken}, {newToken}},
	} {
		t.Run(name, func(t *testing.T) {
			dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
			accounts := twentyAccounts(100)
			seedLedger(t, dsn, accounts)
			var logs logbuf.Buffer
			logTo := func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(&logs, nil)) }
			nodes := startNodesWith(t, dsn, func(c *Config) { c.RPCTokens = steps[0]; logTo(c) }, func(c *Config) { c.RPCTokens = steps[1]; logTo(c) })
			waitFor(t, 10*time.Second, "both nodes ready", func() bool { return nodes[0].Ready() && nodes[1].Ready() })
			for _, through := range nodes {
				chargeEachThrough(t, through, accounts)
			}
			for _, nd := range nodes {
				if n := nd.rpcRefusedCalls.Load(); n != 0 {
					t.Errorf("%s refused %d calls:\n%s", nd.ID(), n, logs.String())
				}
			}
		})
	}
}

// A node whose RPC certificate the serving nodes refuse (another CA's)
// takes no accounts either, and says why.
func TestNodeWhoseRPCCertificateThePeersRefuseOwnsNothing(t *testing.T) {
	dir := t.TempDir()
	names := pki.Names{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}}
	ca, err := pki.NewCA("cluster CA")
	if err != nil {
		t.Fatal(err)
	}
	files, err := ca.WriteFiles(dir, "node", names)
	if err != nil {
		t.Fatal(err)
	}
	other, err := pki.NewCA("another CA")
	if err != nil {
		t.Fatal(err)
	}
	otherFiles, err := other.WriteFiles(filepath.Join(dir, "other"), "node", names)
	if err != nil {
		t.Fatal(err)
	}
	// A node that trusts the cluster's CA and another, with a certificate
	// of the other: it verifies n1, and n1 refuses its client certificate.
	bundle := otherFiles
	bundle.CA = filepath.Join(dir, "both-cas.pem")
	if err := os.WriteFile(bundle.CA, append(slices.Clip(ca.PEM), other.PEM...), 0o644); err != nil {
		t.Fatal(err)
	}
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, twentyAccounts(100))
	n1 := startNodesWith(t, dsn, func(c *Config) { c.RPCTLS = files })[0]
	// /readyz gives the handshake's own cause and the fix for it: it gave
	// one text for every cause, never naming the side without TLS.
	for _, tc := range []struct {
		id, name string
		files    router.TLSFiles
		want     string
	}{
		// NB: TLS 1.3 sends n1's refusal of n2's certificate after n2's
		// side of the handshake: n2 reads the alert, or, when its first
		// write meets the closed connection, a broken pipe or a reset.
		{"n2", "a certificate of a CA the cluster does not trust", bundle, "failed (tls: unknown certificate authority): give every node certificates from the same CA|broken pipe): give every node certificates from the same CA|connection reset by peer): give every node certificates from the same CA"},
		{"n3", "another CA's certificate and CA", otherFiles, "failed (tls: failed to verify certificate: x509: certificate signed by unknown authority)"},
		// n1 closes the plaintext connection: EOF, or a reset.
		{"n4", "no TLS", router.TLSFiles{}, "failed (error reading server preface: EOF): this node has no --rpc-tls-*, and the serving nodes speak TLS|failed (error reading server preface: connection reset by peer): this node has no --rpc-tls-*, and the serving nodes speak TLS"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := n1.rpcHandshakeFailures.Load()
			n, _ := joinRefused(t, n1, dsn, tc.id, "the TLS handshake with n1 at", func(c *Config) { c.RPCTLS = tc.files })
			if _, body := readyz(t, n); !slices.ContainsFunc(strings.Split(tc.want, "|"), func(w string) bool { return strings.Contains(body, w) }) {
				t.Errorf("%s: /readyz %q, want it to say %q", tc.id, body, tc.want)
			}
			// n1 refused its handshakes: counted there too (it left no
			// trace on the node that refused).
			if n1.rpcHandshakeFailures.Load() == before {
				t.Errorf("%s: n1 counted none of the handshakes it refused", tc.id)
			}
		})
	}
}

// A node started with another --ring-preset than its peers (lan among
// local ones) times failure detection differently: each side names the
// other in an ERROR line (ring) and counts it in
// quotaring_ring_mismatched_members{reason="preset"}. It is not refused,
// as a member of another ring layout is not: the ring is the same.
func TestRingPresetMismatchIsCounted(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, twentyAccounts(100))
	nodes := startNodesWith(t, dsn, nil, func(c *Config) { c.RingPreset = ring.PresetLAN }, nil)
	for i, want := range []float64{1, 2, 1} {
		if got := mismatchGauge(t, nodes[i], "preset"); got != want {
			t.Errorf("%s: quotaring_ring_mismatched_members{reason=preset} = %v, want %v", nodes[i].ID(), got, want)
		}
		if got := mismatchGauge(t, nodes[i], "layout"); got != 0 {
			t.Errorf("%s: quotaring_ring_mismatched_members{reason=layout} = %v, want 0", nodes[i].ID(), got)
		}
	}
}

// mismatchGauge reads quotaring_ring_mismatched_members{reason}.
func mismatchGauge(t *testing.T, nd *Node, reason string) float64 {
	t.Helper()
	return labeledGauge(t, nd, "quotaring_ring_mismatched_members", "reason", reason)
}

// labeledGauge is the value of the gauge name{label="value"} nd exports.
func labeledGauge(t *testing.T, nd *Node, name, label, value string) float64 {
	t.Helper()
	families, err := nd.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	t.Fatalf("no %s{%s=%q}", name, label, value)
	return 0
}

// A node whose certificate lacks the name the others check it against
// (its advertised IP, or --rpc-tls-server-name) is refused at start: it
// could dial the others, so it went ready and took accounts that no other
// node could forward a charge to.
func TestRPCCertificateWithoutTheNodesNameIsRefused(t *testing.T) {
	dir := t.TempDir()
	ca, err := pki.NewCA("cluster CA")
	if err != nil {
		t.Fatal(err)
	}
	files, err := ca.WriteFiles(dir, "node", pki.Names{DNS: []string{"quotad.internal"}})
	if err != nil {
		t.Fatal(err)
	}
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	for _, tc := range []struct{ server, want string }{
		{"", "does not carry the name 127.0.0.1 (the host this node advertises for RPC"},
		{"other.internal", "does not carry the name other.internal (--rpc-tls-server-name"},
	} {
		cfg := nodeConfig(dsn, "n1", filepath.Join(t.TempDir(), "n1"))
		cfg.RPCTLS = files
		cfg.RPCTLS.ServerName = tc.server
		n, err := Start(context.Background(), cfg)
		if err == nil {
			n.Shutdown(context.Background())
			t.Fatalf("server name %q: Start succeeded", tc.server)
		}
		if !strings.Contains(err.Error(), tc.want) {
			t.Errorf("server name %q: %v, want it to say %q", tc.server, err, tc.want)
		}
	}
}

// A host name in --rpc-addr is resolved when the port opens, and the others
// check the IP it listens on: the name check at start is left to the
// handshake then, rather than refusing a certificate that carries that IP.
func TestRPCCertificateNameCheckSkipsHostNames(t *testing.T) {
	dir := t.TempDir()
	ca, err := pki.NewCA("cluster CA")
	if err != nil {
		t.Fatal(err)
	}
	files, err := ca.WriteFiles(dir, "node", pki.Names{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	cfg := nodeConfig("sqlite:"+filepath.Join(t.TempDir(), "ledger.db"), "n1", filepath.Join(t.TempDir(), "n1"))
	cfg.RPCAddr, cfg.RPCTLS = "localhost:0", files
	n, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatalf("--rpc-addr localhost:0 with a certificate for 127.0.0.1: %v, want it started", err)
	}
	n.Shutdown(context.Background())
}

// The cause of an expired certificate names the time of the check, which
// changed every second: each probe logged the reason anew. It is left out.
func TestHandshakeCauseIsStable(t *testing.T) {
	err := status.Error(codes.Unavailable, `connection error: desc = "transport: authentication handshake failed: tls: failed to verify certificate: x509: certificate has expired or is not yet valid: current time 2026-12-07T16:50:01Z is after 2026-12-07T16:40:00Z"`)
	if got, want := handshakeCause(err), "tls: failed to verify certificate: x509: certificate has expired or is not yet valid"; got != want {
		t.Errorf("handshakeCause = %q, want %q", got, want)
	}
}
