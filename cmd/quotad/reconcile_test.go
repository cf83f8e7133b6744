package main

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/dirsnap"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/wal"
)

// reconcile --data-dir inspects a stopped node's dir as evidence: it lists
// the unsettled charges and leaves every file byte-identical. A read-write
// open would flush Pebble's WAL into a new sstable, MANIFEST and WAL.
func TestReconcileLeavesTheDataDirUnchanged(t *testing.T) {
	ctx := context.Background()
	ledger := migratedSQLite(t)

	// A node killed with 5 charges of 3 units unsettled: a copy of its dir
	// taken while its log is open holds them only in Pebble's WAL.
	live := filepath.Join(t.TempDir(), "q1")
	log, err := wal.Open(wal.Options{Dir: live, NodeID: "q1"})
	if err != nil {
		t.Fatal(err)
	}
	for range 5 {
		rec := shard.Record{Type: shard.RecCharge, Account: "acct-1", Units: 3}
		seq, err := log.Append(rec.AppendEncode(nil))
		if err == nil {
			err = log.WaitDurable(ctx, seq)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	dir := filepath.Join(t.TempDir(), "q1-stopped")
	if err := os.CopyFS(dir, os.DirFS(live)); err != nil {
		t.Fatal(err)
	}
	if err := log.Close(); err != nil {
		t.Fatal(err)
	}
	before := dirsnap.Take(t, dir)

	var out bytes.Buffer
	if err := runReconcile(ctx, &out, &out, "sqlite:"+ledger, []string{dir}, false); err != nil {
		t.Fatalf("reconcile: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "acct-1: +15 units pending") {
		t.Errorf("reconcile did not list the unsettled charges:\n%s", out.String())
	}
	before.Unchanged(t, dir, "reconcile")
}

// reconcile and revoke refuse a ledger a newer quotad migrated, as serve
// and migrate do: an older binary must not write to a schema it does not
// know, nor read one it would misread.
func TestLedgerCommandsRefuseANewerSchema(t *testing.T) {
	path := migratedSQLite(t)
	db, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec("INSERT INTO schema_migrations (version, applied_at) VALUES (999, 0)"); err != nil {
		t.Fatal(err)
	}
	db.Close()
	for _, args := range [][]string{{"reconcile", "--ledger", "sqlite:" + path}, {"revoke", "--ledger", "sqlite:" + path, "--node", "n1", "--force"}} {
		_, err := runQuotad(t, args...)
		if !errors.Is(err, flush.ErrSchemaTooNew) || !strings.Contains(err.Error(), "run a newer quotad") {
			t.Errorf("quotad %s on a ledger at schema 999: %v; want ErrSchemaTooNew saying to run a newer quotad", args[0], err)
		}
	}
}

// migratedSQLite makes an empty, migrated SQLite ledger and returns its path.
func migratedSQLite(t *testing.T) string {
	t.Helper()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "ledger.db")
	l, err := flush.OpenSQLite(ctx, path, flush.SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return path
}

// quotad reconcile streams its rows: more differences than one aligned
// block (reconcileBlock) are all printed, each once, with --all, the count
// is right, and the exit code is 3.
func TestReconcilePrintsEveryDifference(t *testing.T) {
	path := migratedSQLite(t)
	db, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	const n = reconcileBlock + 7
	// Daily usage with no event behind it: one difference per account.
	if _, err := db.Exec(`WITH RECURSIVE i(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM i WHERE x < ?)
		INSERT INTO usage_daily (account_id, key_id, route, day, units, requests)
		SELECT printf('acct-%05d', x), 'k', 'GET /x', '2026-06-15', 3, 1 FROM i`, n); err != nil {
		t.Fatal(err)
	}
	db.Close()
	var out bytes.Buffer
	root := newRootCmd()
	root.SetArgs([]string{"reconcile", "--ledger", "sqlite:" + path, "--all"})
	root.SetOut(&out)
	root.SetErr(&out)
	err = root.ExecuteContext(context.Background())
	var exit *exitError
	if !errors.As(err, &exit) || exit.code != 3 {
		t.Fatalf("reconcile of %d differences: %v, want exit code 3", n, err)
	}
	text := out.String()
	for _, a := range []string{"acct-00001", fmt.Sprintf("acct-%05d", reconcileBlock), fmt.Sprintf("acct-%05d", reconcileBlock+1), fmt.Sprintf("acct-%05d", n)} {
		if c := strings.Count(text, a+" "); c != 1 {
			t.Errorf("%s printed %d times, want once", a, c)
		}
	}
	if !strings.Contains(text, fmt.Sprintf("%d rows compared, %d differences", n, n)) {
		t.Errorf("summary missing or wrong:\n%s", text[max(0, len(text)-300):])
	}
}
