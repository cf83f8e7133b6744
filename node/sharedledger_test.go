package node

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
)

// A node whose --ledger names another database than its peers' is refused
// before it takes any account: a copy of the cluster's ledger (a restored
// backup, a staging clone) holds the same rows, and an empty database is
// migrated, so neither looked wrong; the node served its share of the
// accounts from them. A node on the cluster's ledger starts.
func TestNodeOnAnotherLedgerIsRefused(t *testing.T) {
	dir := t.TempDir()
	ledger := filepath.Join(dir, "ledger.db")
	dsn := "sqlite:" + ledger
	seedLedger(t, dsn, map[string]int64{"acme": 100})
	n1 := startNodesWith(t, dsn, nil)[0]

	// A consistent copy of the cluster's ledger, made while n1 runs.
	copied := filepath.Join(dir, "copy.db")
	db, err := sql.Open("sqlite", "file:"+ledger)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`VACUUM INTO '` + copied + `'`); err != nil {
		t.Fatal(err)
	}
	db.Close()

	start := func(id, ledgerDSN string) (*Node, error) {
		cfg := startConfig(ledgerDSN, dir, id)
		cfg.Join = []string{n1.GossipAddr()}
		nd, err := Start(context.Background(), cfg)
		if err == nil {
			t.Cleanup(func() { nd.Shutdown(context.Background()) })
		}
		return nd, err
	}
	for name, tc := range map[string]struct{ ledger, saw string }{
		"a copy of the cluster's ledger": {"sqlite:" + copied, "no start of this node id at all"},
		"an empty database":              {"sqlite:" + filepath.Join(dir, "empty.db"), "no start of this node id at all"},
	} {
		_, err := start("n2", tc.ledger)
		if !errors.Is(err, errWrongLedger) || !strings.Contains(err.Error(), "node n1") || !strings.Contains(err.Error(), tc.saw) ||
			!strings.Contains(err.Error(), "Give it the other nodes' --ledger") {
			t.Errorf("%s: Start: %v; want it refused, naming the peer, what it saw and what to do", name, err)
		}
	}
	if s := n1.Ring().View().Serving; len(s) != 1 {
		t.Fatalf("a refused node serves in n1's ring: %v", s)
	}
	// n2 started once on the copy, so the cluster's ledger has no start of
	// it; n3 has never started anywhere: both start on the cluster's.
	for _, id := range []string{"n2", "n3"} {
		if _, err := start(id, dsn); err != nil {
			t.Fatalf("%s on the cluster's ledger: %v", id, err)
		}
	}
}

// The review of the check above: a node restarted on a copy of the
// ledger with charges still in its log settled them into the copy before
// it asked a peer, so it was refused with its log marked settled and the
// charges billed where no bill finds them. It now asks between recording
// its start and settling: refused, the copy holds none of its events, and
// its restart on the cluster's ledger settles them there.
func TestRefusedLedgerGetsNothingSettled(t *testing.T) {
	dir := t.TempDir()
	ledger := filepath.Join(dir, "ledger.db")
	dsn := "sqlite:" + ledger
	accounts := twentyAccounts(1000)
	seedLedger(t, dsn, accounts)
	nodes := startNodesWith(t, dsn, nil, func(c *Config) { c.SettleInterval = time.Hour })
	n1, n2 := nodes[0], nodes[1]
	acct := ownedBy(t, n2, accounts)
	ctx := context.Background()
	for range 5 {
		if res, err := n2.Router().Charge(ctx, router.ChargeRequest{Account: acct, Route: "GET /x", Units: 1}); err != nil || res.Reason != shard.OK {
			t.Fatalf("charge at n2: %+v %v", res, err)
		}
	}
	if n2.wal.SettledSeq() == n2.wal.DurableSeq() {
		t.Fatal("n2's charges settled already; the test needs them in its log")
	}
	n2.Kill()

	copied := filepath.Join(dir, "copy.db")
	db, err := sql.Open("sqlite", "file:"+ledger)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(`VACUUM INTO '` + copied + `'`); err != nil {
		t.Fatal(err)
	}
	n2Events := func(path string) int {
		t.Helper()
		d, err := sql.Open("sqlite", "file:"+path)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		var c int
		if err := d.QueryRow(`SELECT count(*) FROM events WHERE node_id = 'n2'`).Scan(&c); err != nil {
			t.Fatal(err)
		}
		return c
	}
	restart := func(ledgerDSN string) (*Node, error) {
		cfg := startConfig(ledgerDSN, dir, "n2")
		cfg.DataDir, cfg.Join = n2.cfg.DataDir, []string{n1.GossipAddr()}
		return Start(ctx, cfg)
	}
	if _, err := restart("sqlite:" + copied); !errors.Is(err, errWrongLedger) {
		t.Fatalf("n2 restarted on the copy: %v, want errWrongLedger", err)
	}
	if c := n2Events(copied); c != 0 {
		t.Fatalf("the refused start settled %d of n2's events into the copy", c)
	}
	again, err := restart(dsn)
	if err != nil {
		t.Fatalf("n2 restarted on the cluster's ledger: %v", err)
	}
	t.Cleanup(func() { again.Shutdown(context.Background()) })
	if c := n2Events(ledger); c != 5 {
		t.Fatalf("the cluster's ledger holds %d of n2's 5 events after its restart there", c)
	}
}

// A later start of this node id by another process, which the peers' ledger
// and this node's own both read, is a twin, not another ledger: the check
// says so (CI caught two twins started at once, one told its ledger was
// wrong).
func TestSharedLedgerCheckTellsATwinFromAnotherLedger(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acme": 100})
	nodes := startNodesWith(t, dsn, nil, nil)
	n2 := nodes[1]
	ctx := context.Background()
	if err := n2.checkSharedLedger(ctx, n2.Ledger()); err != nil {
		t.Fatalf("n2 on the cluster's ledger: %v", err)
	}
	if err := n2.Ledger().RecordStart(ctx, "n2", n2.wal.Incarnation(), flush.NodeStart{Build: "devel", Process: "twin-process"}); err != nil {
		t.Fatal(err)
	}
	err := n2.checkSharedLedger(ctx, n2.Ledger())
	if !errors.Is(err, errNodeIDInUse) || errors.Is(err, errWrongLedger) || !strings.Contains(err.Error(), "another process started as this node id after this one") {
		t.Fatalf("a twin's later start: %v, want errNodeIDInUse naming it", err)
	}
}
