package node

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"strings"
	"testing"
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
