package pgtest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// connect opens a pgx connection that the test closes at its end.
func connect(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dsn)
	if err != nil {
		t.Fatalf("connect %s: %v", dsn, err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

func TestServerLifecycle(t *testing.T) {
	RequireBinaries(t)
	ctx := t.Context()
	began := time.Now()
	s, err := Start(ctx, Options{Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Start took %v", time.Since(began))
	defer s.Close()
	dir, port := s.Dir(), s.Port()
	if want := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/x?sslmode=disable", port); s.DSN("x") != want {
		t.Errorf("DSN = %q, want %q", s.DSN("x"), want)
	}

	dsnA, err := s.NewDatabase(ctx, "alpha")
	if err != nil {
		t.Fatal(err)
	}
	dsnB, err := s.NewDatabase(ctx, "beta")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.NewDatabase(ctx, "alpha"); err == nil {
		t.Error("creating alpha twice succeeded")
	}

	a := connect(t, dsnA)
	if _, err := a.Exec(ctx, "CREATE TABLE t (v text); INSERT INTO t VALUES ('kept')"); err != nil {
		t.Fatal(err)
	}
	b := connect(t, dsnB)
	var missing bool
	if err := b.QueryRow(ctx, "SELECT to_regclass('t') IS NULL").Scan(&missing); err != nil {
		t.Fatal(err)
	}
	if !missing {
		t.Error("table t of alpha is visible in beta")
	}

	// Stop ends open sessions (fast mode) rather than waiting for them: a
	// is still connected.
	stopCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if err := s.Stop(stopCtx); err != nil {
		t.Fatalf("Stop with an open session: %v", err)
	}
	if s.Running() {
		t.Error("Running() after Stop")
	}
	if err := a.Ping(ctx); err == nil {
		t.Error("a session survived Stop")
	}
	dialCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if c, err := pgx.Connect(dialCtx, dsnA); err == nil {
		c.Close(ctx)
		t.Fatal("connected to a stopped server")
	}

	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if s.Port() != port {
		t.Errorf("port changed across restart: %d, then %d", port, s.Port())
	}
	var v string
	if err := connect(t, dsnA).QueryRow(ctx, "SELECT v FROM t").Scan(&v); err != nil || v != "kept" {
		t.Fatalf("after restart: v = %q, err = %v; want kept", v, err)
	}

	s.mu.Lock()
	pid := s.cmd.Process.Pid
	s.mu.Unlock()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("Close left %s: stat err = %v", dir, err)
	}
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("postmaster %d still exists after Close: kill(0) = %v", pid, err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := s.Start(ctx); !errors.Is(err, ErrClosed) {
		t.Errorf("Start after Close = %v, want ErrClosed", err)
	}
}

// TestStartAfterCrash: a postmaster that exits behind pgtest's back is seen
// as stopped, and Start brings it back with the committed data.
func TestStartAfterCrash(t *testing.T) {
	RequireBinaries(t)
	ctx := t.Context()
	s, err := Start(ctx, Options{Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	dsn, err := s.NewDatabase(ctx, "crash")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := connect(t, dsn).Exec(ctx, "CREATE TABLE t (v int); INSERT INTO t VALUES (7)"); err != nil {
		t.Fatal(err)
	}

	s.mu.Lock()
	p, exited := s.cmd.Process, s.exited
	s.mu.Unlock()
	if err := p.Signal(syscall.SIGQUIT); err != nil { // immediate shutdown: no checkpoint
		t.Fatal(err)
	}
	<-exited
	if s.Running() {
		t.Fatal("Running() after the postmaster exited")
	}
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	var v int
	if err := connect(t, dsn).QueryRow(ctx, "SELECT v FROM t").Scan(&v); err != nil || v != 7 {
		t.Fatalf("after crash recovery: v = %d, err = %v; want 7", v, err)
	}
}

func dbNameOf(t *testing.T, dsn string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimPrefix(u.Path, "/")
}

func TestNewDB(t *testing.T) {
	dsn1, dsn2 := NewDB(t), NewDB(t)
	if dsn1 == dsn2 {
		t.Fatalf("NewDB returned %q twice", dsn1)
	}
	ctx := t.Context()
	c1 := connect(t, dsn1)
	if _, err := c1.Exec(ctx, "CREATE TABLE only_in_1 (x int)"); err != nil {
		t.Fatal(err)
	}
	var missing bool
	if err := connect(t, dsn2).QueryRow(ctx, "SELECT to_regclass('only_in_1') IS NULL").Scan(&missing); err != nil || !missing {
		t.Errorf("databases are not separate: missing=%v err=%v", missing, err)
	}

	// The database of a finished test is dropped, even with a session left
	// open on it.
	var name string
	var leaked *pgx.Conn
	t.Run("inner", func(t *testing.T) {
		dsn := NewDB(t)
		name = dbNameOf(t, dsn)
		var err error
		if leaked, err = pgx.Connect(context.Background(), dsn); err != nil {
			t.Fatal(err)
		}
	})
	defer leaked.Close(context.Background())
	var n int
	if err := c1.QueryRow(ctx, "SELECT count(*) FROM pg_database WHERE datname = $1", name).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("database %s still exists after its test ended", name)
	}
}

func TestPackageServerRestartedAfterTest(t *testing.T) {
	s := PackageServer(t) // here first, so that missing binaries skip this test too
	t.Run("stops it", func(t *testing.T) {
		if err := PackageServer(t).Stop(t.Context()); err != nil {
			t.Fatal(err)
		}
		if s.Running() {
			t.Fatal("Running() after Stop")
		}
	})
	if !s.Running() {
		t.Fatal("package server left stopped after the test that stopped it")
	}
	var one int
	if err := connect(t, s.DSN("postgres")).QueryRow(t.Context(), "SELECT 1").Scan(&one); err != nil {
		t.Fatal(err)
	}
}

func TestStartRefusesDirPostgresCannotEnter(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("only root runs postgres as another user")
	}
	RequireBinaries(t)
	_, err := Start(t.Context(), Options{Dir: t.TempDir()}) // mode 0700, owned by root
	if err == nil || !strings.Contains(err.Error(), "cannot enter") || !strings.Contains(err.Error(), "TMPDIR") {
		t.Fatalf("Start in a 0700 root dir: err = %v, want 'cannot enter'", err)
	}
}

func TestUnavailable(t *testing.T) {
	missing := fmt.Errorf("%w (initdb on PATH)", ErrNoBinaries)
	other := errors.New("initdb: boom")
	for _, tc := range []struct {
		err      error
		require  bool
		wantSkip bool
		wantMsg  string
	}{
		{missing, false, true, "SKIP: Postgres binaries not found (initdb on PATH); set QUOTARING_REQUIRE_PG=1 to make this a failure"},
		{missing, true, false, "FAIL: Postgres binaries not found"},
		{other, false, false, "initdb: boom"},
		{other, true, false, "initdb: boom"},
	} {
		skip, msg := unavailable(tc.err, tc.require)
		if skip != tc.wantSkip || !strings.Contains(msg, tc.wantMsg) {
			t.Errorf("unavailable(%v, require=%v) = %v, %q; want %v, containing %q", tc.err, tc.require, skip, msg, tc.wantSkip, tc.wantMsg)
		}
	}
}

func TestFindBinaries(t *testing.T) {
	root := t.TempDir()
	mkExe := func(path string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}

	if _, err := findBinaries(filepath.Join(root, "nothing"), filepath.Join(root, "nothing/*/bin")); !errors.Is(err, ErrNoBinaries) {
		t.Fatalf("no binaries: err = %v, want ErrNoBinaries", err)
	}

	// initdb on PATH is a symlink: postgres comes from the link's target dir.
	mkExe(filepath.Join(root, "lib/15/bin/initdb"))
	mkExe(filepath.Join(root, "lib/15/bin/postgres"))
	mkExe(filepath.Join(root, "lib/16/bin/initdb"))
	mkExe(filepath.Join(root, "lib/16/bin/postgres"))
	mkExe(filepath.Join(root, "lib/9/bin/initdb"))
	mkExe(filepath.Join(root, "lib/9/bin/postgres"))
	if err := os.MkdirAll(filepath.Join(root, "path"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(root, "lib/15/bin/initdb"), filepath.Join(root, "path/initdb")); err != nil {
		t.Fatal(err)
	}
	b, err := findBinaries(filepath.Join(root, "path"), filepath.Join(root, "lib/*/bin"))
	if err != nil {
		t.Fatal(err)
	}
	if b.postgres != filepath.Join(root, "lib/15/bin/postgres") {
		t.Errorf("PATH symlink: postgres = %s, want the one beside the link's target", b.postgres)
	}

	// Not on PATH: the newest version in the fallback (16, not 9).
	b, err = findBinaries(filepath.Join(root, "nothing"), filepath.Join(root, "lib/*/bin"))
	if err != nil {
		t.Fatal(err)
	}
	if b.initdb != filepath.Join(root, "lib/16/bin/initdb") {
		t.Errorf("fallback: initdb = %s, want version 16", b.initdb)
	}
}

func TestDBNamePrefix(t *testing.T) {
	for in, want := range map[string]string{
		"TestFoo":                 "t_testfoo",
		"TestFoo/sub_case#01":     "t_testfoo_sub_case_01",
		"Test/Ünïcode and spaces": "t_test_n_code_and_spaces",
		strings.Repeat("x", 100):  "t_" + strings.Repeat("x", 40),
	} {
		if got := dbNamePrefix(in); got != want {
			t.Errorf("dbNamePrefix(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestDump writes a database to a file that holds its schema and rows, so
// that a chaos run's ledger can be read after the server is gone.
func TestDump(t *testing.T) {
	s := PackageServer(t)
	dsn := NewDB(t)
	ctx := t.Context()
	if _, err := connect(t, dsn).Exec(ctx, "CREATE TABLE kept (id text PRIMARY KEY, units bigint); INSERT INTO kept VALUES ('evt-dumped', 42)"); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "ledger.sql")
	if err := s.Dump(ctx, dbNameOf(t, dsn), path); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"CREATE TABLE public.kept", "evt-dumped\t42"} {
		if !strings.Contains(string(b), want) {
			t.Errorf("the dump lacks %q:\n%s", want, b)
		}
	}
	if err := s.Dump(ctx, "no_such_database", filepath.Join(t.TempDir(), "x.sql")); err == nil || !strings.Contains(err.Error(), `dump database "no_such_database"`) {
		t.Errorf("dumping a missing database: err = %v, want one naming it", err)
	}
}
