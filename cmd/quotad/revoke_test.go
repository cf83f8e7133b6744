package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
)

// revokeLedger is a migrated SQLite ledger whose clock stands at beat, with
// node q1 (incarnation q1-inc) registered then.
func revokeLedger(t *testing.T, beat time.Time) *flush.SQLite {
	t.Helper()
	ctx := context.Background()
	l, err := flush.OpenSQLite(ctx, filepath.Join(t.TempDir(), "ledger.db"), flush.SQLiteOptions{Now: func() time.Time { return beat }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := l.RegisterNode(ctx, "q1", "q1-inc"); err != nil {
		t.Fatal(err)
	}
	return l
}

// revoke refuses a node heard from lately (it may be running: freeing its
// reservations would let its accounts overshoot) unless --force, and a node
// id the ledger has never seen; it frees a node silent for long enough.
func TestRevokeRefusesARunningNode(t *testing.T) {
	ctx := context.Background()
	beat := time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC)
	l := revokeLedger(t, beat)
	var out bytes.Buffer
	if err := runRevoke(ctx, &out, l, "q1", false, false, beat.Add(30*time.Second)); err == nil || !strings.Contains(err.Error(), "heard from 30s ago") {
		t.Fatalf("revoke of a node heard from 30 s ago: %v, want a refusal naming how long ago", err)
	}
	out.Reset()
	if err := runRevoke(ctx, &out, l, "q1", true, false, beat.Add(30*time.Second)); err != nil {
		t.Fatalf("--dry-run of a node heard from lately: %v (a dry run changes nothing: it may look)", err)
	}
	if !strings.Contains(out.String(), "note: it was heard from 30s ago: revoke without --force refuses") {
		t.Errorf("--dry-run of a node heard from lately:\n%s\nwant a note that the real command will refuse", out.String())
	}
	if err := runRevoke(ctx, &out, l, "q2", false, true, beat.Add(time.Hour)); err == nil || !strings.Contains(err.Error(), `never seen a node "q2" (it knows: q1)`) {
		t.Fatalf("revoke of an unknown node: %v", err)
	}
	if err := runRevoke(ctx, &out, l, "q1", false, true, beat.Add(30*time.Second)); err != nil {
		t.Fatalf("--force: %v", err)
	}
	if err := runRevoke(ctx, &out, l, "q1", false, false, beat.Add(revokeQuiet)); err != nil {
		t.Fatalf("revoke of a node silent for %s: %v", revokeQuiet, err)
	}
}

// A node that stopped cleanly (the ledger recorded its stop after its
// last heartbeat) is not running: revoke frees it without --force, however
// recently it was heard from.
func TestRevokeAStoppedNode(t *testing.T) {
	ctx := context.Background()
	beat := time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC)
	l := revokeLedger(t, beat)
	if ok, err := l.NodeStopped(ctx, "q1", "q1-inc", "", 0); !ok || err != nil {
		t.Fatalf("NodeStopped: %v, %v", ok, err)
	}
	var out bytes.Buffer
	if err := runRevoke(ctx, &out, l, "q1", false, false, beat.Add(5*time.Second)); err != nil {
		t.Fatalf("revoke of a node stopped cleanly 5 s ago: %v, want it freed", err)
	}
	if !strings.Contains(out.String(), "revoked node q1") {
		t.Errorf("revoke said:\n%s", out.String())
	}
	// A later incarnation that runs is a running node again.
	if _, err := l.RegisterNode(ctx, "q1", "q1-inc2"); err != nil {
		t.Fatal(err)
	}
	if err := runRevoke(ctx, &out, l, "q1", false, false, beat.Add(5*time.Second)); err == nil || !strings.Contains(err.Error(), "heard from 5s ago") {
		t.Fatalf("revoke of a node whose later incarnation runs: %v, want a refusal", err)
	}
}

// reconcile and revoke read a ledger: a mistyped SQLite path is an error,
// not a new empty file; an unmigrated one says to migrate.
func TestReadingCommandsNeedAMigratedLedger(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "nosuch.db")
	for _, dsn := range []string{"sqlite:" + missing, missing} { // both SQLite forms
		if _, err := openMigratedLedger(context.Background(), dsn); err == nil || !strings.Contains(err.Error(), "no ledger there") {
			t.Fatalf("a missing ledger %s: %v", dsn, err)
		}
		if _, err := os.Stat(missing); !os.IsNotExist(err) {
			t.Fatalf("opening a missing ledger %s created %s (%v)", dsn, missing, err)
		}
	}
	empty := filepath.Join(dir, "empty.db")
	if err := os.WriteFile(empty, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := openMigratedLedger(context.Background(), "sqlite:"+empty); err == nil || !strings.Contains(err.Error(), "run quotad migrate") {
		t.Fatalf("an unmigrated ledger: %v", err)
	}
	// Refused without a write: the empty file became a database.
	if fi, err := os.Stat(empty); err != nil || fi.Size() != 0 {
		t.Fatalf("refusing the empty file changed it (%v)", err)
	}
}

// Ids the admin API would not route are refused before any request, and an
// API key given where its id is wanted is named as such.
func TestAdminIDArguments(t *testing.T) {
	for _, tc := range []struct {
		what, id, want string
	}{
		{"plan id", "bad id/x", "without spaces, slashes"},
		{"plan id", "", "1 to 200 characters"},
		{"key id", "qr_live_abc", "is an API key itself"},
		{"account id", "acme", ""},
		{"key id", "key_5xq2m7d3kq0a4g8r", ""},
	} {
		err := oneID(tc.what)(nil, []string{tc.id})
		if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%s %q: %v, want %q", tc.what, tc.id, err, tc.want)
		}
	}
}

// --force and prune's --lost-node override safety checks, so a variable
// left set in the environment does not: QUOTAD_FORCE is warned about and
// ignored, and revoke still refuses a node heard from just now.
func TestSafetyOverridesHaveNoEnvTwin(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	l, err := flush.OpenSQLite(context.Background(), path, flush.SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := l.RegisterNode(context.Background(), "q1", "q1-inc"); err != nil {
		t.Fatal(err)
	}
	l.Close()
	t.Setenv("QUOTAD_FORCE", "true")
	t.Setenv("QUOTAD_LOST_NODE", "q1")
	stderr, err := runQuotad(t, "revoke", "--ledger", "sqlite:"+path, "--node", "q1")
	if err == nil || !strings.Contains(err.Error(), "heard from") {
		t.Fatalf("revoke of a node heard from just now with QUOTAD_FORCE=true: %v, want the refusal", err)
	}
	for _, want := range []string{"QUOTAD_FORCE is not read: quotad revoke's --force overrides a safety check", "QUOTAD_LOST_NODE is not read: quotad prune's --lost-node"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr:\n%s\nwant %q", stderr, want)
		}
	}
	// reconcile's --data-dir lists stopped nodes' dirs: the running node's
	// own QUOTAD_DATA_DIR (a pod's environment) is not one of them.
	// Nor do the flags that name what prune and revoke destroy.
	t.Setenv("QUOTAD_DATA_DIR", t.TempDir())
	t.Setenv("QUOTAD_KEEP_MONTHS", "1")
	t.Setenv("QUOTAD_BEFORE", "2026-09")
	t.Setenv("QUOTAD_NODE", "q1")
	root := newRootCmd()
	for _, c := range []struct{ cmd, flag string }{{"reconcile", "data-dir"}, {"prune", "lost-node"}, {"revoke", "force"},
		{"prune", "keep-months"}, {"prune", "before"}, {"revoke", "node"}} {
		cmd, _, err := root.Find([]string{c.cmd})
		if err != nil {
			t.Fatal(err)
		}
		if err := bindEnv(cmd.Flags()); err != nil {
			t.Fatal(err)
		}
		if f := cmd.Flags().Lookup(c.flag); f.Changed {
			t.Errorf("%s --%s set from %s: %s", c.cmd, c.flag, envName(c.flag), f.Value)
		}
	}
}

// A ledger that knows no node at all says so, and what that suggests (the
// wrong --ledger), not "(it knows: )".
func TestRevokeOnALedgerWithoutNodes(t *testing.T) {
	ctx := context.Background()
	l, err := flush.OpenSQLite(ctx, migratedSQLite(t), flush.SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var out bytes.Buffer
	if err := runRevoke(ctx, &out, l, "q1", true, false, time.Now()); err == nil || !strings.Contains(err.Error(), "it knows no node: is --ledger the one") {
		t.Fatalf("revoke on a ledger without nodes: %v", err)
	}
}
