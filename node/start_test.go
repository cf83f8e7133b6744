package node

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/logbuf"
	"github.com/quotaring/quotaring/ring"
)

// nodeRows reads what the ledger at dsn knows of node id.
func nodeRows(t *testing.T, dsn, id string) []flush.NodeRow {
	t.Helper()
	l, err := flush.Open(context.Background(), dsn, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	rows, err := l.Nodes(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var out []flush.NodeRow
	for _, r := range rows {
		if r.Node == id {
			out = append(out, r)
		}
	}
	return out
}

func startConfig(dsn, dir, id string) Config { return nodeConfig(dsn, id, filepath.Join(dir, id)) }

// nodeConfig is a test node's config: id on dataDir and the ledger dsn,
// every address on a free loopback port, the local ring preset, and settle
// and snapshot intervals short enough for tests.
func nodeConfig(dsn, id, dataDir string) Config {
	return Config{ID: id, DataDir: dataDir, Ledger: dsn,
		RPCAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", GossipAddr: "127.0.0.1:0",
		RingPreset: ring.PresetLocal, SettleInterval: 100 * time.Millisecond, SnapshotInterval: 100 * time.Millisecond}
}

// A start that cannot work as configured (a --join entry that is no
// address, a gossip port in use) fails before it registers with the
// ledger: before, the node registered, then failed, and the next node to
// start waited for it as for a running peer.
func TestBadRingSettingsFailBeforeTheLedger(t *testing.T) {
	dir := t.TempDir()
	dsn := "sqlite:" + filepath.Join(dir, "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acme": 10})

	cfg := startConfig(dsn, dir, "j1")
	cfg.Join = []string{"not a host!!"}
	if _, err := Start(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), `join address "not a host!!"`) {
		t.Fatalf("start with --join 'not a host!!': %v, want the entry named", err)
	}
	if rows := nodeRows(t, dsn, "j1"); len(rows) != 0 {
		t.Fatalf("the ledger knows j1 after a start refused for its --join: %+v", rows)
	}

	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	cfg = startConfig(dsn, dir, "j2")
	cfg.GossipAddr = busy.Addr().String()
	if _, err := Start(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), "listen for gossip (--gossip-addr) on "+cfg.GossipAddr) {
		t.Fatalf("start on a gossip port in use: %v, want --gossip-addr named", err)
	}
	if rows := nodeRows(t, dsn, "j2"); len(rows) != 0 {
		t.Fatalf("the ledger knows j2 after a start refused for its gossip port: %+v", rows)
	}
}

// A start that fails after it registered (here the gossip port taken
// between the check and the join, which the test-fault transport lets the
// test arrange) records a clean stop, since its log holds nothing
// unsettled: the ledger does not keep an incarnation that looks crashed.
func TestStartFailedAfterRegisteringRecordsAStop(t *testing.T) {
	dir := t.TempDir()
	dsn := "sqlite:" + filepath.Join(dir, "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acme": 10})
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	cfg := startConfig(dsn, dir, "j3")
	cfg.GossipAddr, cfg.TestFaults = busy.Addr().String(), true // the fault transport binds at the join
	if _, err := Start(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), "--gossip-addr") {
		t.Fatalf("start on a gossip port in use: %v", err)
	}
	rows := nodeRows(t, dsn, "j3")
	if len(rows) != 1 || rows[0].Running() {
		t.Fatalf("the ledger after a start that failed once registered: %+v, want one incarnation stopped cleanly", rows)
	}
}

// A node stopped cleanly (SIGTERM: the ledger records the stop) is not
// waited for: restarted on its data dir it does not wait out its lease for
// a twin, and another node started alone does not wait for it to come back.
func TestACleanStopIsNotWaitedFor(t *testing.T) {
	dir := t.TempDir()
	dsn := "sqlite:" + filepath.Join(dir, "ledger.db")
	seedLedger(t, dsn, twentyAccounts(100))
	nodes := startNodesWith(t, dsn, nil, nil)
	cfg1 := nodes[0].cfg
	for _, nd := range nodes {
		if err := nd.Shutdown(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"n1", "n2"} {
		if rows := nodeRows(t, dsn, id); len(rows) != 1 || rows[0].Running() {
			t.Fatalf("%s after its shutdown: %+v, want stopped cleanly", id, rows)
		}
	}
	var logs logbuf.Buffer
	cfg1.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	cfg1.Join = nil // n2 is gone: n1 comes back alone
	again, err := Start(context.Background(), cfg1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { again.Shutdown(context.Background()) })
	if strings.Contains(logs.String(), "making sure no other process runs as it") {
		t.Errorf("restarted after a clean stop, it waited for a twin:\n%s", logs.String())
	}
	if why := again.notServable(); why != "" {
		t.Fatalf("restarted alone after every node stopped cleanly: notServable %q, want it serving", why)
	}
	if !again.isServing() {
		t.Fatal("restarted alone after every node stopped cleanly: not serving")
	}
}

// Two of a node's own listen addresses on one port are named as such,
// before anything is bound: the second listener's "address already in
// use" read as another process's doing.
func TestListenAddressesOnOnePort(t *testing.T) {
	dir := t.TempDir()
	dsn := "sqlite:" + filepath.Join(dir, "ledger.db")
	for _, tc := range []struct {
		http, admin, want string
	}{
		{"127.0.0.1:19999", "127.0.0.1:19999", "--http-addr 127.0.0.1:19999 and --admin-addr 127.0.0.1:19999 are one port"},
		{":19999", "127.0.0.1:19999", "--http-addr :19999 and --admin-addr 127.0.0.1:19999 are one port"},
	} {
		cfg := startConfig(dsn, dir, "p1")
		cfg.HTTPAddr, cfg.AdminAddr = tc.http, tc.admin
		if _, err := Start(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("--http-addr %s --admin-addr %s: %v, want %q", tc.http, tc.admin, err, tc.want)
		}
	}
	if err := distinctPorts([][2]string{{"--rpc-addr", "127.0.0.1:0"}, {"--http-addr", "127.0.0.1:0"}, {"--admin-addr", "127.0.0.2:9090"}, {"--gossip-addr", "127.0.0.3:9090"}}); err != nil {
		t.Errorf("port 0 twice, and one port on two hosts: %v, want them accepted", err)
	}
}

// A --ledger file that is not a database stops the start with what to
// check: before, the node logged "ledger not reached" every 2 s for ever,
// with a hint about Postgres credentials.
func TestLedgerThatIsNotADatabase(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "notes.db")
	if err := os.WriteFile(path, []byte(strings.Repeat("not a database\n", 500)), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := Start(context.Background(), startConfig("sqlite:"+path, dir, "s1"))
	if err == nil || !strings.Contains(err.Error(), "is not a database, or is damaged") {
		t.Fatalf("start on a ledger file that is not a database: %v, want a refusal saying so", err)
	}
}

// One node of the ring runs the periodic reconcile, the serving member with
// the smallest id: it reads the whole event log, and every node doing it
// multiplied that load by the cluster's size. When that node leaves, the
// next one takes over.
func TestOneNodeReconciles(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, twentyAccounts(100))
	often := func(c *Config) { c.ReconcileInterval = 50 * time.Millisecond }
	nodes := startNodesWith(t, dsn, often, often, often)
	last := func(nd *Node) float64 { return gaugeValue(t, nd, "quotaring_reconcile_last_success_timestamp_seconds") }
	waitFor(t, 10*time.Second, "n1's periodic reconciles", func() bool { return last(nodes[0]) > 0 })
	first := last(nodes[0])
	waitFor(t, 10*time.Second, "another reconcile by n1", func() bool { return last(nodes[0]) > first })
	for _, nd := range nodes[1:] {
		if v := last(nd); v != 0 {
			t.Errorf("%s ran a periodic reconcile (last success %v) beside n1", nd.ID(), v)
		}
	}
	if err := nodes[0].Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, "n2 taking the reconciles over", func() bool { return last(nodes[1]) > 0 })
	if v := last(nodes[2]); v != 0 {
		t.Errorf("n3 ran a periodic reconcile beside n2 (last success %v)", v)
	}
}

// A node that restarts into a ring where others own some of the accounts it
// held lets those go once it has handed their reservations back, as it
// does when it loses them while running: before, it kept every account it
// had ever owned, and loaded them all again at each start.
func TestRestartLetsGoOfAccountsOwnedElsewhere(t *testing.T) {
	dir := t.TempDir()
	dsn := "sqlite:" + filepath.Join(dir, "ledger.db")
	accounts := twentyAccounts(100)
	seedLedger(t, dsn, accounts)
	n1, err := Start(context.Background(), startConfig(dsn, dir, "n1"))
	if err != nil {
		t.Fatal(err)
	}
	chargeEachThrough(t, n1, accounts) // n1 alone owns all twenty
	cfg := n1.cfg
	if err := n1.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	n2, err := Start(context.Background(), startConfig(dsn, dir, "n2"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n2.Shutdown(context.Background()) })
	cfg.Join = []string{n2.GossipAddr()}
	again, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { again.Shutdown(context.Background()) })
	waitFor(t, 20*time.Second, "n1 serving in one ring with n2", func() bool {
		return again.isServing() && len(again.Ring().View().Serving) == 2 && again.Ring().Epoch() == n2.Ring().Epoch()
	})
	var elsewhere []string
	waitFor(t, 20*time.Second, "n1 holding only the accounts it owns", func() bool {
		elsewhere = elsewhere[:0]
		for _, id := range again.eng.AccountIDs() {
			if !again.owns(id) {
				elsewhere = append(elsewhere, id)
			}
		}
		return len(elsewhere) == 0
	})
}
