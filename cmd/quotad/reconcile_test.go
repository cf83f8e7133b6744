package main

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
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
