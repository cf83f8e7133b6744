package flush

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/internal/faultproxy"
	"github.com/quotaring/quotaring/internal/pgtest"
	"github.com/quotaring/quotaring/internal/waitfor"
	"github.com/quotaring/quotaring/shard"
)

func TestSQLiteConformance(t *testing.T) {
	RunConformance(t, func(t *testing.T) Ledger {
		l, err := OpenSQLite(t.Context(), filepath.Join(t.TempDir(), "ledger.db"), SQLiteOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return l
	})
}

func TestPostgresConformance(t *testing.T) {
	RunConformance(t, func(t *testing.T) Ledger { return openPG(t, pgtest.NewDB(t)) })
}

// migratedPG is a migrated ledger on a fresh database of the package's
// Postgres, closed when the test ends.
func migratedPG(t *testing.T) *Postgres {
	t.Helper()
	l := openPG(t, pgtest.NewDB(t))
	t.Cleanup(func() { l.Close() })
	if err := l.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	return l
}

func openPG(t testing.TB, dsn string) *Postgres {
	t.Helper()
	l, err := OpenPostgres(context.Background(), dsn, PGOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestSQLiteInMemory(t *testing.T) {
	ctx := t.Context()
	l, err := OpenSQLite(ctx, ":memory:", SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	confSetup(t, l, 10, "acct-1")
	n := confNode(t, l, "node-a")
	n.settle(t, chargeOf("acct-1", "e1", 3, confJune))
	wantGrant(t, l, "acct-1", confJune, 3, 0)
}

// TestPostgresCommitReplyLost: the COMMIT of a settle happens but its reply
// is lost. Settle must report an error (the outcome is unknown), and the
// retry of the same batch must find it applied: counted once.
func TestPostgresCommitReplyLost(t *testing.T) {
	ctx := t.Context()
	l, proxy := migratedPGBehindProxy(t)
	confSetup(t, l, 100, "acct-1")
	n := confNode(t, l, "node-a")
	n.settle(t, chargeOf("acct-1", "e0", 1, confJune)) // partitions and statements in place

	n.mu.Lock()
	b := n.batchLocked(chargeOf("acct-1", "e1", 3, confJune), chargeOf("acct-1", "e2", 4, confJune))
	n.mu.Unlock()
	proxy.CutAfterCommit(1)
	if res, err := l.Settle(ctx, b); err == nil {
		t.Fatalf("settle whose commit reply was lost: %+v, nil error; want an error", res)
	}
	if st := proxy.Stats(); st.Cuts == 0 {
		t.Fatalf("the proxy cut nothing: %+v", st)
	}
	res, err := l.Settle(ctx, b)
	if err != nil || res.Applied {
		t.Fatalf("retry of the batch: %+v, %v; want Applied false (the lost commit happened)", res, err)
	}
	wantGrant(t, l, "acct-1", confJune, 8, 0)
	wantUsage(t, l, "acct-1", 8)
	if es := eventsOf(t, l, "acct-1"); len(es) != 3 {
		t.Errorf("%d events, want 3", len(es))
	}
	wantReconciled(t, l)
}

// migratedPGBehindProxy is a fresh migrated database reached through a
// fault proxy, to cut what the tests choose.
func migratedPGBehindProxy(t *testing.T) (*Postgres, *faultproxy.Proxy) {
	t.Helper()
	dsn := pgtest.NewDB(t)
	srv := pgtest.PackageServer(t)
	proxy, err := faultproxy.New("127.0.0.1:0", srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proxy.Close() })
	l := openPG(t, strings.Replace(dsn, srv.Addr(), proxy.Addr(), 1))
	t.Cleanup(func() { l.Close() })
	if err := l.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	return l, proxy
}

// TestPostgresReserveCommitReplyLost: a reservation whose COMMIT happens
// but whose reply is lost fails with an engine.ReserveUncertainError that
// names the units now reserved for the node: the engine counts them as
// what the ledger may hold beyond its allowances.
func TestPostgresReserveCommitReplyLost(t *testing.T) {
	ctx := t.Context()
	l, proxy := migratedPGBehindProxy(t)
	confSetup(t, l, 100, "acct-1")
	if _, err := l.Reserve(ctx, "node-a", ReserveRequest{Account: "acct-1", Wall: confWallTime(), Need: 1}); err != nil {
		t.Fatal(err) // the month's grant and the statements in place
	}
	proxy.CutAfterCommit(1)
	res, err := l.Reserve(ctx, "node-a", ReserveRequest{Account: "acct-1", Wall: confWallTime(), Need: 7})
	unc, ok := errors.AsType[*engine.ReserveUncertainError](err)
	if !ok {
		t.Fatalf("reserve whose commit reply was lost: %+v, %v; want an engine.ReserveUncertainError", res, err)
	}
	if unc.Units != 7 {
		t.Errorf("ReserveUncertainError.Units = %d, want the 7 the commit reserved", unc.Units)
	}
	if !errors.Is(err, ErrUnavailable) {
		t.Errorf("%v: want it to wrap ErrUnavailable (the connection broke)", err)
	}
	wantGrant(t, l, "acct-1", confJune, 0, 8)
	// A reservation that reserved nothing has no outcome in doubt.
	if _, err := l.Reserve(ctx, "node-b", ReserveRequest{Account: "acct-1", Wall: confWallTime(), Need: 92}); err != nil {
		t.Fatal(err)
	}
	proxy.CutAfterCommit(1)
	_, err = l.Reserve(ctx, "node-a", ReserveRequest{Account: "acct-1", Wall: confWallTime(), Need: 5})
	if err == nil {
		t.Fatal("a reserve whose commit was cut answered no error")
	}
	if _, ok := errors.AsType[*engine.ReserveUncertainError](err); ok {
		t.Errorf("a reserve of nothing whose commit was cut: %v; want no ReserveUncertainError", err)
	}
	proxy.CutAfterCommit(0)
}

// TestPostgresConnectErrors: a DSN that does not parse or does not connect
// fails fast with a message that names the host and database, says what to
// check, and never shows the password.
func TestPostgresConnectErrors(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	// A listener that accepts and never answers: only the connect timeout
	// ends the wait.
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { silent.Close() }) // not defer: the subtests run after this function returns
	go func() {
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	refused, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refusedAddr := refused.Addr().String()
	refused.Close()

	for _, c := range []struct {
		name, dsn   string
		unavailable bool
		mention     []string
	}{
		{"refused", "postgres://quota:s3cret-pw@" + refusedAddr + "/ledgerdb?sslmode=disable", true, []string{refusedAddr, "ledgerdb", "check"}},
		{"silent", "postgres://quota:s3cret-pw@" + silent.Addr().String() + "/ledgerdb?sslmode=disable", true, []string{silent.Addr().String(), "ledgerdb"}},
		{"unparsable", "postgres://quota:s3cret-pw@127.0.0.1:notaport/ledgerdb", false, []string{"does not parse", "postgres://USER:PASSWORD@HOST:PORT/DB"}},
		// A '/' (or ':', '@') not percent-encoded: the password was printed.
		{"unencoded password", "postgres://quota:s3cret-pw/x@db.example:5432/ledgerdb", false, []string{"does not parse", "percent-encoded", "%2F"}},
		{"unencoded password with @ and :", "postgres://quota:s3cret-pw@:w/rd?#%&=x y@db.example:5432/ledgerdb", false, []string{"does not parse"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			began := time.Now()
			l, err := OpenPostgres(ctx, c.dsn, PGOptions{ConnectTimeout: 500 * time.Millisecond})
			took := time.Since(began)
			if err == nil {
				l.Close()
				t.Fatal("OpenPostgres succeeded")
			}
			t.Logf("error after %v: %v", took.Round(time.Millisecond), err)
			if took > 5*time.Second {
				t.Errorf("took %v: the connect timeout does not bound it", took)
			}
			if errors.Is(err, ErrUnavailable) != c.unavailable {
				t.Errorf("wraps ErrUnavailable: %v, want %v", errors.Is(err, ErrUnavailable), c.unavailable)
			}
			if strings.Contains(err.Error(), "s3cret-pw") || strings.Contains(err.Error(), "w/rd") {
				t.Errorf("the error shows the password")
			}
			for _, m := range c.mention {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("the error does not mention %q", m)
				}
			}
		})
	}
}

// TestPostgresRoundTripsConstant: a settle sends the same number of
// statements for 10 charges as for 5,000, with the event log on and off.
func TestPostgresRoundTripsConstant(t *testing.T) {
	l := migratedPG(t)
	accounts := make([]string, 50)
	for i := range accounts {
		accounts[i] = fmt.Sprintf("acct-%d", i)
	}
	confSetup(t, l, 1_000_000, accounts...)
	for _, events := range []bool{true, false} {
		n := confNode(t, l, fmt.Sprintf("node-events-%v", events))
		n.events = events
		n.settle(t, chargeOf(accounts[0], "warm", 1, confJune)) // partitions and monthly grants in place
		var trips []int
		for _, size := range []int{10, 5000} {
			recs := make([]rec, 0, size+2)
			for i := range size {
				recs = append(recs, chargeOf(accounts[i%len(accounts)], fmt.Sprintf("e%d-%d", size, i), 1, confJune).withReserved())
			}
			recs = append(recs, refundOf(accounts[0], fmt.Sprintf("e%d-0", size), 1, confJune), refundOf(accounts[1], "never-charged", 1, confJune))
			trips = append(trips, n.settle(t, recs...).RoundTrips)
		}
		if trips[0] != trips[1] {
			t.Errorf("events %v: %d statements for 10 charges, %d for 5,000", events, trips[0], trips[1])
		}
		t.Logf("events %v: %d statements per settle", events, trips[0])
	}
}

func TestOpen(t *testing.T) {
	ctx := t.Context()
	l, err := Open(ctx, "sqlite:"+filepath.Join(t.TempDir(), "a.db"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := l.(*SQLite); !ok {
		t.Errorf("sqlite: gave %T", l)
	}
	l.Close()
	l, err = Open(ctx, filepath.Join(t.TempDir(), "b.db"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := l.(*SQLite); !ok {
		t.Errorf("a .db path gave %T", l)
	}
	l.Close()
	_, err = Open(ctx, "mysql://root:hunter2@db/ledger", nil)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "postgres://") || !strings.Contains(err.Error(), "sqlite:") ||
		strings.Contains(err.Error(), "hunter2") {
		t.Errorf("an unknown ledger: %v; want ErrInvalid naming both forms, without the password", err)
	}
}

func TestPostgresOpen(t *testing.T) {
	l, err := Open(t.Context(), pgtest.NewDB(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, ok := l.(*Postgres); !ok {
		t.Errorf("postgres:// gave %T", l)
	}
}

func TestDayOf(t *testing.T) {
	for _, c := range []struct {
		wall time.Time
		want string
	}{
		{time.Date(2026, 6, 15, 0, 0, 0, 0, time.UTC), "2026-06-15"},
		{time.Date(2026, 6, 15, 23, 59, 59, 999999999, time.UTC), "2026-06-15"},
		{time.Date(1969, 12, 31, 23, 0, 0, 0, time.UTC), "1969-12-31"},
	} {
		if got := dayString(dayOf(c.wall.UnixNano())); got != c.want {
			t.Errorf("day of %v = %s, want %s", c.wall, got, c.want)
		}
	}
}

// TestPostgresUnavailable: with the server down, calls fail with
// ErrUnavailable (nodes keep serving and settle later, G8); once it is back
// the same Ledger works again without being reopened.
func TestPostgresUnavailable(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.NewDB(t)
	srv := pgtest.PackageServer(t)
	l := openPG(t, dsn)
	defer l.Close()
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	confSetup(t, l, 100, "acct-1")
	n := confNode(t, l, "node-a")
	n.settle(t, chargeOf("acct-1", "e1", 1, confJune))

	if err := srv.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	n.mu.Lock()
	b := n.batchLocked(chargeOf("acct-1", "e2", 2, confJune))
	n.mu.Unlock()
	if _, err := l.Settle(ctx, b); !errors.Is(err, ErrUnavailable) {
		t.Errorf("settle with the server down: %v, want ErrUnavailable", err)
	}
	if _, err := l.Snapshot(ctx, confWallTime()); !errors.Is(err, ErrUnavailable) {
		t.Errorf("snapshot with the server down: %v, want ErrUnavailable", err)
	}
	if _, err := l.Reserve(ctx, "node-a", ReserveRequest{Account: "acct-1", Wall: confWallTime(), Need: 1}); !errors.Is(err, ErrUnavailable) {
		t.Errorf("reserve with the server down: %v, want ErrUnavailable", err)
	}

	if err := srv.Start(ctx); err != nil {
		t.Fatal(err)
	}
	var res SettleResult
	var err error
	for range 3 { // the pool finds out about its dead connections one by one
		if res, err = l.Settle(ctx, b); err == nil {
			break
		}
	}
	if err != nil || !res.Applied {
		t.Fatalf("settle after the server came back: %+v, %v", res, err)
	}
	n.next = b.Next
	wantGrant(t, l, "acct-1", confJune, 3, 0)
}

// A directory that is missing is waited for, as a ledger that is down (a
// volume mounted late): ErrUnavailable naming the path and what to check.
func TestSQLiteUnavailable(t *testing.T) {
	_, err := OpenSQLite(t.Context(), filepath.Join(t.TempDir(), "missing-dir", "ledger.db"), SQLiteOptions{})
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "missing-dir") || !strings.Contains(err.Error(), "check that its directory exists") {
		t.Errorf("open in a missing directory: %v; want ErrUnavailable naming the path and what to check", err)
	}
}

// The ledger is the file the path names, byte for byte: SQLite reads its
// name as a URI, where %20 is a space, so a path with a % in it created
// one file and kept the ledger in another.
func TestSQLitePathIsTheFile(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "q%20data")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "ledger%41.db")
	l, err := OpenSQLite(t.Context(), path, SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	l.Close()
	if fi, err := os.Stat(path); err != nil || fi.Size() == 0 {
		t.Errorf("the ledger at %s: %v, %v bytes; want the migrated database there", path, err, fi)
	}
	if entries, _ := os.ReadDir(filepath.Dir(dir)); len(entries) != 1 {
		t.Errorf("files beside the data dir: %v; want none (the ledger went elsewhere)", entries)
	}
	for _, name := range []string{"ledgerA.db", "ledger%41.db-journal"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
			t.Errorf("%s exists: the ledger was written under a decoded name", name)
		}
	}
}

// A directory, or a sqlite:// URL (a host, or a relative path by another
// convention), is never a ledger: refused as invalid, not waited for.
func TestSQLiteLedgerThatCanNeverOpen(t *testing.T) {
	_, err := OpenSQLite(t.Context(), t.TempDir(), SQLiteOptions{})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "is a directory") {
		t.Errorf("open a directory: %v; want ErrInvalid saying it is a directory", err)
	}
	for _, ledger := range []string{"sqlite://tmp/ledger.db", "sqlite:///tmp/ledger.db"} {
		if err := CheckLedger(ledger); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "sqlite:/path/to/ledger.db, with one slash") {
			t.Errorf("CheckLedger(%q) = %v; want ErrInvalid naming the one-slash form", ledger, err)
		}
	}
}

// --ledger strings that can only be a mistake are refused as invalid with
// what to write instead: an in-memory SQLite ledger (accepted, it lost every
// plan, key and charge at exit), a scheme in capitals (the error showed it
// lower-cased, like the form it asked for), another scheme whose string
// ends in .db (taken as a relative path, and waited for).
func TestLedgerStringsThatCanOnlyBeMistakes(t *testing.T) {
	for ledger, want := range map[string]string{
		"sqlite::memory:":               "in-memory SQLite database",
		":memory:":                      "in-memory SQLite database",
		"Postgres://u@127.0.0.1:1/x":    `write the scheme "Postgres:" in lower case`,
		"SQLite:/tmp/ledger.db":         `write the scheme "SQLite:" in lower case`,
		"file:/tmp/x.db":                "takes no file ledger",
		"mysql://db.internal/ledger.db": "takes no mysql ledger",
	} {
		if err := CheckLedger(ledger); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), want) {
			t.Errorf("CheckLedger(%q) = %v; want ErrInvalid saying %q", ledger, err, want)
		}
	}
	for _, ledger := range []string{"ledger.db", "data/ledger.db", "/var/lib/quotad/ledger.db", "sqlite:data:1/ledger.db", "postgres://u@127.0.0.1:1/x"} {
		if err := CheckLedger(ledger); err != nil {
			t.Errorf("CheckLedger(%q) = %v; want it taken", ledger, err)
		}
	}
	if path, ok := SQLitePath("file:/tmp/x.db"); ok {
		t.Errorf("SQLitePath(file:/tmp/x.db) = %q, true; want it not taken as a path", path)
	}
}

// Another program's SQLite database is never made a ledger: migrating it
// added the ledger's tables to it (exit 0). Reading its schema version
// leaves it byte for byte as it was, as it leaves an empty file empty (a
// read-only command used to switch the one to WAL mode and make the other
// a database before refusing them).
func TestSQLiteForeignDatabase(t *testing.T) {
	dir := t.TempDir()
	foreign := filepath.Join(dir, "other-app.db")
	db, err := sql.Open("sqlite", foreign)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec("CREATE TABLE users (id INTEGER PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	db.Close()
	before, err := os.ReadFile(foreign)
	if err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty.db")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{foreign, empty} {
		if v, err := SQLiteSchemaVersion(t.Context(), path); v != 0 || err != nil {
			t.Errorf("SQLiteSchemaVersion(%s) = %d, %v; want 0, nil", filepath.Base(path), v, err)
		}
	}
	if after, _ := os.ReadFile(foreign); !bytes.Equal(after, before) {
		t.Error("reading the foreign database's schema version changed it")
	}
	if fi, err := os.Stat(empty); err != nil || fi.Size() != 0 {
		t.Errorf("reading the empty file's schema version changed it (%v)", err)
	}
	if _, err := SQLiteSchemaVersion(t.Context(), filepath.Join(dir, "missing.db")); !errors.Is(err, ErrInvalid) {
		t.Errorf("SQLiteSchemaVersion of a missing file: %v, want ErrInvalid", err)
	}
	l, err := OpenSQLite(t.Context(), foreign, SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := l.Migrate(t.Context()); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "tables of another program (users)") {
		t.Fatalf("migrate another program's database: %v; want ErrInvalid naming its tables", err)
	}
	ledger := filepath.Join(dir, "ledger.db")
	l2, err := OpenSQLite(t.Context(), ledger, SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	for range 2 { // a new ledger, then one up to date
		if err := l2.Migrate(t.Context()); err != nil {
			t.Fatalf("migrate a ledger: %v", err)
		}
	}
	if v, err := SQLiteSchemaVersion(t.Context(), ledger); v == 0 || err != nil {
		t.Errorf("SQLiteSchemaVersion of a migrated ledger = %d, %v", v, err)
	}
}

// A new SQLite ledger, and its -wal file, are readable by their owner only:
// they hold the API keys' hashes and every account's usage. An existing
// file keeps its mode.
func TestSQLiteNewFileIsPrivate(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "ledger.db")
	l, err := OpenSQLite(t.Context(), path, SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{path, path + "-wal"} {
		fi, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		if m := fi.Mode().Perm(); m&0o077 != 0 {
			t.Errorf("%s: mode %v, want no access for group and others", filepath.Base(f), m)
		}
	}
	l.Close()
	shared := filepath.Join(dir, "shared.db")
	if err := os.WriteFile(shared, nil, 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(shared, 0o640); err != nil { // past the umask
		t.Fatal(err)
	}
	l, err = OpenSQLite(t.Context(), shared, SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := l.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(shared); fi.Mode().Perm() != 0o640 {
		t.Errorf("an existing ledger file: mode %v, want its own 0640 kept", fi.Mode().Perm())
	}
}

// A file that is not an SQLite database (or a damaged one) is not an
// outage to wait out: ErrInvalid, saying what to check, and nothing
// written to it.
func TestSQLiteNotADatabase(t *testing.T) {
	path := filepath.Join(t.TempDir(), "notes.db")
	junk := []byte(strings.Repeat("these are not the pages of a database\n", 200))
	if err := os.WriteFile(path, junk, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := OpenSQLite(t.Context(), path, SQLiteOptions{})
	if !errors.Is(err, ErrInvalid) || errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "is not a database, or is damaged") {
		t.Fatalf("open a file that is not a database: %v; want ErrInvalid saying so", err)
	}
	if got, _ := os.ReadFile(path); string(got) != string(junk) {
		t.Fatal("the file was changed")
	}
	if w := WhatToCheck(fmt.Errorf("x: %w", &sqliteLikeErr{})); !strings.Contains(w, "SQLite file") {
		t.Errorf("WhatToCheck of an SQLite ledger's error: %q", w)
	}
}

type sqliteLikeErr struct{}

func (*sqliteLikeErr) Error() string {
	return "cannot open the SQLite ledger at /x/l.db: unable to open"
}

// The password leaves messages, and nothing else does: a short password
// replaced everywhere garbled messages and showed where it was.
func TestScrubPassword(t *testing.T) {
	for _, tc := range []struct{ dsn, msg, want string }{
		{"postgres://quotad:1@127.0.0.1:1/db", "dial tcp 127.0.0.1:1: connect: connection refused",
			"dial tcp 127.0.0.1:1: connect: connection refused"},
		{"postgres://postgres:postgres@127.0.0.1:1/postgres", "failed to connect to `user=postgres database=postgres`",
			"failed to connect to `user=postgres database=postgres`"},
		{"postgres://quotad:s3cretpass@db/q", "cannot parse postgres://quotad:s3cretpass@db/q; s3cretpass",
			"cannot parse postgres://quotad:xxxxx@db/q; xxxxx"},
		{"host=db user=quotad password=abc dbname=q", "bad DSN host=db password=abc dbname=q", "bad DSN host=db password=xxxxx dbname=q"},
	} {
		if got := scrubPassword(tc.msg, tc.dsn); got != tc.want {
			t.Errorf("%s\n got  %q\n want %q", tc.dsn, got, tc.want)
		}
	}
}

// A ledger that is neither form is named in the error with its password
// hidden, whichever form the password came in.
func TestInvalidLedgerHidesThePassword(t *testing.T) {
	for _, dsn := range []string{
		"host=127.0.0.1 port=1 user=u password=s3cretpw dbname=db",
		"host=127.0.0.1 user=u password='s3cret pw' dbname=db",
		"mysql://u:s3cretpw@db/q",
		"pg://u:s3cret/pw@db/q?password=s3cretpw",
	} {
		err := CheckLedger(dsn)
		if !errors.Is(err, ErrInvalid) || strings.Contains(err.Error(), "s3cret") || !strings.Contains(err.Error(), "xxxxx") {
			t.Errorf("CheckLedger(%q) = %v; want ErrInvalid with the password hidden", dsn, err)
		}
	}
}

// An alert claimed under schema 4 was sent, or lost, under the at-most-once
// rule of its day: migration 5 marks it legacy, and no node sends it again.
func TestAlertClaimedBeforeDeliveryTrackingIsNotResent(t *testing.T) {
	for _, tc := range []struct {
		name   string
		open   func(t *testing.T) (Ledger, *[]migration)
		insert string
	}{
		{"sqlite", func(t *testing.T) (Ledger, *[]migration) {
			l, err := OpenSQLite(t.Context(), filepath.Join(t.TempDir(), "ledger.db"), SQLiteOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return l, &l.migrations
		}, `INSERT INTO alerts (account_id, period, threshold, sent_at, claim) VALUES ('acme', '2026-06', 80, 1781524800000000000, 'old')`},
		{"postgres", func(t *testing.T) (Ledger, *[]migration) {
			l := openPG(t, pgtest.NewDB(t))
			return l, &l.migrations
		}, `INSERT INTO alerts (account_id, period, threshold, sent_at, claim) VALUES ('acme', '2026-06', 80, '2026-06-15 12:00:00+00', 'old')`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := t.Context()
			l, ms := tc.open(t)
			defer l.Close()
			all := *ms
			*ms = all[:4]
			if err := l.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			mustExecSQL(t, l, tc.insert)
			*ms = all
			if err := l.Migrate(ctx); err != nil {
				t.Fatalf("migrate to %d: %v", len(all), err)
			}
			got, err := l.Alerts(ctx, AlertQuery{})
			want := time.Date(2026, 6, 15, 12, 0, 0, 0, time.UTC)
			if err != nil || len(got) != 1 || got[0].State != AlertLegacy || !got[0].CrossedAt.Equal(want) || !got[0].FinishedAt.Equal(want) {
				t.Fatalf("alerts after migrating: %+v, %v", got, err)
			}
			if taken, givenUp, err := l.TakeOverAlerts(ctx, "new", time.Nanosecond, time.Nanosecond, 10); err != nil || len(taken)+len(givenUp) != 0 {
				t.Fatalf("takeover of a legacy alert: %+v %+v %v", taken, givenUp, err)
			}
			if _, err := l.ResendAlert(ctx, "acme", got[0].Period, 80); !errors.Is(err, ErrInvalid) {
				t.Fatalf("resend of a legacy alert: %v, want ErrInvalid (its figures are unknown)", err)
			}
		})
	}
}

// A role that may read and write the ledger's rows but not change its
// schema (the least privilege for the nodes; the owner runs quotad
// migrate): it checks the schema without migrating, and settles into the
// event partitions migrate made ahead. Before, it failed the first settle
// of every month ("must be owner of table events"); a month migrate did
// not make says to run it.
func TestPostgresLeastPrivilegeRole(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.NewDB(t)
	owner := openPG(t, dsn)
	defer owner.Close()
	if err := owner.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	role := fmt.Sprintf("dml_%d", time.Now().UnixNano())
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	for _, q := range []string{
		"CREATE ROLE " + role + " LOGIN",
		"REVOKE CREATE ON SCHEMA public FROM PUBLIC",
		"GRANT USAGE ON SCHEMA public TO " + role,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO " + role,
		"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO " + role,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	u, _ := url.Parse(dsn)
	u.User = url.User(role)
	l := openPG(t, u.String())
	defer l.Close()
	if err := CheckSchema(ctx, l); err != nil {
		t.Fatalf("CheckSchema as the DML role: %v", err)
	}
	if err := l.Migrate(ctx); err == nil || WhatToCheck(err) == WhatToCheck(nil) {
		t.Fatalf("Migrate as the DML role: %v (hint %q); want a privilege error with its own hint", err, WhatToCheck(err))
	}
	confSetup(t, owner, 100, "acct-1")
	n := confNode(t, l, "node-a")
	// The suite's charges are in June 2026, a month migrate did not make
	// (it makes the current one and the next 12).
	n.mu.Lock()
	b := n.batchLocked(chargeOf("acct-1", "e1", 1, confJune))
	n.mu.Unlock()
	if _, err := l.Settle(ctx, b); err == nil || !strings.Contains(err.Error(), "run quotad migrate as the ledger's owner") {
		t.Fatalf("settle into a month with no partition as the DML role: %v; want one naming quotad migrate", err)
	}
	// The owner makes it (as migrate does for the months ahead): the role settles.
	if _, err := owner.createPartitions(ctx, []shard.Period{shard.PeriodOf(confWallTime().UnixNano())}); err != nil {
		t.Fatal(err)
	}
	n.settle(t, chargeOf("acct-1", "e1", 1, confJune))
	wantGrant(t, owner, "acct-1", confJune, 1, 0)
	var missing []string
	now := shard.PeriodOf(time.Now().UnixNano())
	for i := range partitionsAhead + 1 {
		var ok bool
		if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", partitionName(now+shard.Period(i))).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		if !ok {
			missing = append(missing, partitionName(now+shard.Period(i)))
		}
	}
	if len(missing) > 0 {
		t.Fatalf("migrate did not make the partitions of the months ahead: %v missing", missing)
	}
}

// Two owners settle one event id at once (a handoff): node-b's batch (its
// charge of e1 and its own attempt's refund of it) commits while node-a's
// insert statement waits on e1's unique key. That statement's snapshot is
// older than node-b's commit, so it did not see the row: node-a's served
// charge was taken for a plain duplicate, not billed, and the event stayed
// refunded (chaos --faults all --seed 42, G4). It takes the event over.
func TestPostgresConcurrentSettleOfOneEvent(t *testing.T) {
	ctx := t.Context()
	l := migratedPG(t)
	confSetup(t, l, 100, "acct-1")
	a, b := confNode(t, l, "node-a"), confNode(t, l, "node-b")
	// e0, billed by node-b already, makes node-a's batch below conflict at
	// once: it then inserts through staging, in one statement.
	b.settle(t, chargeOf("acct-1", "e0", 1, confJune))
	// node-b's next batch, held open: e1 charged and refunded (its attempt's
	// refund: the grants and usage it moves cancel out).
	tx, err := l.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO events (account_id, event_id, client_id, key_id, route, units, charged_at, period, period_start,
			node_id, incarnation, seq, grant_ids, grant_units, refunded, refunded_at)
		VALUES ('acct-1', 'e1', true, 'key-acct-1', $1, 2, $2, '2026-06', '2026-06-01', 'node-b', 'node-b-inc', 99, $3, '{2}', true, now())`,
		confRoute, confWallTime(), []string{confJune}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	var res SettleResult
	go func() {
		a.mu.Lock()
		defer a.mu.Unlock()
		var err error
		res, err = l.Settle(context.Background(), a.batchLocked(chargeOf("acct-1", "e0", 1, confJune), chargeOf("acct-1", "e1", 2, confJune)))
		done <- err
	}()
	// node-a's insert waits on e1's key; then node-b commits.
	waitfor.Cond(t, 10*time.Second, "node-a's settle waits on e1's row", func() bool { return lockWaiters(t, l) > 0 })
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil || !res.Applied {
		t.Fatalf("node-a's settle: %+v, %v", res, err)
	}
	for _, e := range eventsOf(t, l, "acct-1") {
		if e.EventID == "e1" && (e.Refunded || e.Node != "node-a") {
			t.Fatalf("e1 after node-a's served charge settled: %+v, want node-a's, billed", e)
		}
	}
	wantUsage(t, l, "acct-1", 3)
	wantReconciled(t, l)
}

// TestPostgresSettleAfterAnotherProcessPrunedItsMonth: a node knows a
// month's partition exists (it settled there) when quotad prune, another
// process, drops it; a late record of that month (a node restored from an
// old copy) fails once, and the next try creates the partition again.
func TestPostgresSettleAfterAnotherProcessPrunedItsMonth(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.NewDB(t)
	node, operator := openPG(t, dsn), openPG(t, dsn)
	defer node.Close()
	defer operator.Close()
	if err := node.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	confSetup(t, node, 100, "acct-1")
	n := confNode(t, node, "node-a")
	n.settle(t, chargeOf("acct-1", "e1", 1, confJune))
	if _, err := operator.PruneEvents(ctx, PruneOptions{Before: confPeriod + 1}); err != nil {
		t.Fatal(err)
	}
	b := n.batchLocked(chargeOf("acct-1", "e2", 1, confJune))
	if _, err := node.Settle(ctx, b); err == nil || !strings.Contains(err.Error(), "no partition") {
		t.Fatalf("settle into the dropped partition: %v, want the server's 'no partition' error", err)
	}
	res, err := node.Settle(ctx, b)
	if err != nil || !res.Applied {
		t.Fatalf("the next try: %+v, %v; want applied into a partition created again", res, err)
	}
	wantGrant(t, node, "acct-1", confJune, 2, 0)
	wantReconciled(t, node)
}

// TestPostgresPruneGivesUpOnALongLock: a prune waits at most 5 s for the
// event log's locks (an export, a settle stuck mid-transaction), rather than
// queue every node's settles behind it, and says to run it again.
func TestPostgresPruneGivesUpOnALongLock(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.NewDB(t)
	l := openPG(t, dsn)
	defer l.Close()
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	confSetup(t, l, 100, "acct-1")
	confNode(t, l, "node-a").settle(t, chargeOf("acct-1", "e1", 1, confJune))
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if _, err := tx.Exec(ctx, `UPDATE events SET units = units WHERE account_id = 'acct-1'`); err != nil {
		t.Fatal(err)
	}
	_, err = l.PruneEvents(ctx, PruneOptions{Before: confPeriod + 1})
	if err == nil || !strings.Contains(err.Error(), "run quotad prune again") {
		t.Fatalf("prune while a transaction writes the month: %v, want a lock timeout that says to run it again", err)
	}
	tx.Rollback(ctx)
	if res, err := l.PruneEvents(ctx, PruneOptions{Before: confPeriod + 1}); err != nil || len(res.Months) != 1 {
		t.Fatalf("prune again: %+v, %v", res, err)
	}
}

// A node's pool follows its CPU limit (GOMAXPROCS), not the host's cores,
// unless the DSN or the options say otherwise.
func TestPoolSize(t *testing.T) {
	want := max(4, int32(runtime.GOMAXPROCS(0)))
	for _, tc := range []struct {
		dsn         string
		parsed, opt int32
		want        int32
	}{
		{"postgres://u@db/q", 64, 0, want},
		{"postgres://u@db/q?pool_max_conns=2", 2, 0, 2},
		{"host=db pool_max_conns=3", 3, 0, 3},
		{"postgres://u@db/q?pool_max_conns=2", 2, 7, 7},
	} {
		if got := poolSize(tc.dsn, tc.parsed, tc.opt); got != tc.want {
			t.Errorf("poolSize(%q, %d, %d) = %d, want %d", tc.dsn, tc.parsed, tc.opt, got, tc.want)
		}
	}
}

// onBothLedgers runs test as two subtests, on a fresh migrated SQLite
// ledger and on a fresh migrated Postgres one, for behaviour the two must
// share that the conformance suite does not cover.
func onBothLedgers(t *testing.T, test func(t *testing.T, l Ledger)) {
	for name, open := range map[string]func(t *testing.T) Ledger{
		"sqlite": func(t *testing.T) Ledger {
			l, err := OpenSQLite(t.Context(), filepath.Join(t.TempDir(), "ledger.db"), SQLiteOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return l
		},
		"postgres": func(t *testing.T) Ledger { return openPG(t, pgtest.NewDB(t)) },
	} {
		t.Run(name, func(t *testing.T) {
			l := open(t)
			t.Cleanup(func() { l.Close() })
			if err := l.Migrate(t.Context()); err != nil {
				t.Fatalf("migrate: %v", err)
			}
			test(t, l)
		})
	}
}

// A node's reservation never goes below zero: an operator revoked node-a
// (quotad revoke frees what it held) before node-a settled the charge of 20
// it had made from that reservation, and node-a has reserved 5 again since.
// The settle moves the 20 to used and takes them off node-a's reservation
// of 5, which stops at 0: a reservation of -15 would lower the grant's
// reserved total and let other nodes reserve 15 units that are not there
// (G1). Run on both ledgers.
func TestSettleAfterRevokeKeepsReservationsAtZero(t *testing.T) {
	onBothLedgers(t, func(t *testing.T, l Ledger) {
		ctx := t.Context()
		confSetup(t, l, 100, "acct-1")
		a := confNode(t, l, "node-a")
		if res, err := l.Reserve(ctx, "node-a", ReserveRequest{Account: "acct-1", Wall: confWallTime(), Need: 30}); err != nil || granted(res) != 30 {
			t.Fatalf("node-a reserves 30: %+v %v", res, err)
		}
		if _, err := l.ReleaseNode(ctx, "node-a"); err != nil { // quotad revoke --node node-a
			t.Fatal(err)
		}
		// node-a, back, reserves again before its log settles.
		if res, err := l.Reserve(ctx, "node-a", ReserveRequest{Account: "acct-1", Wall: confWallTime(), Need: 5}); err != nil || granted(res) != 5 {
			t.Fatalf("node-a reserves 5 after the revoke: %+v %v", res, err)
		}
		a.settle(t, chargeOf("acct-1", "e1", 20, confJune).withReserved())
		wantGrant(t, l, "acct-1", confJune, 20, 0)
		if r := reservationOf(t, l, "node-a", "acct-1", confJune); r != 0 {
			t.Errorf("node-a's reservation after settling a charge it made before the revoke: %d, want 0", r)
		}
		res, err := l.Reserve(ctx, "node-b", ReserveRequest{Account: "acct-1", Wall: confWallTime(), Need: 100})
		if err != nil || granted(res) != 80 {
			t.Fatalf("node-b reserves all it can: %+v %v; want 80 (100 minus the 20 used)", res, err)
		}
	})
}

func granted(res ReserveResult) int64 {
	var n int64
	for _, a := range res.Granted {
		n += a.Units
	}
	return n
}

// One batch holds a June charge of e1, its refund, and a July charge of e1
// with the same ledger id (the node's clock jumped into July and its dedup
// memory no longer held the id, so it started over at its first
// generation). The June charge was refunded: the July one is a new charge,
// billed, not a duplicate of a charge that no longer stands, exactly as
// when the three settle in separate batches. On both ledgers: SQLite,
// which keeps one event row whatever the month, settled every charge
// before the refunds, took the July charge for a duplicate of the June
// one, then refunded June, and billed nothing.
func TestRefundedChargeAndItsNextMonthRetryInOneBatch(t *testing.T) {
	onBothLedgers(t, refundedChargeAndItsNextMonthRetryInOneBatch)
}

func refundedChargeAndItsNextMonthRetryInOneBatch(t *testing.T, l Ledger) {
	confSetup(t, l, 100, "acct-1")
	a := confNode(t, l, "node-a")
	june := time.Date(2026, 6, 30, 22, 0, 0, 0, time.UTC)
	july := time.Date(2026, 7, 1, 1, 0, 0, 0, time.UTC)
	res := a.settle(t, chargeOf("acct-1", "e1", 2, "").at(june), refundOf("acct-1", "e1", 2, "").at(june), chargeOf("acct-1", "e1", 3, "").at(july))
	if len(res.Duplicates) != 0 {
		t.Fatalf("e1 charged, refunded, charged again in July, in one batch: duplicates %+v, want none", res.Duplicates)
	}
	var billed int64
	for _, e := range eventsOf(t, l, "acct-1") {
		if !e.Refunded {
			billed += e.Units
		}
	}
	if billed != 3 {
		t.Fatalf("billed %d units, want 3 (the July charge): %+v", billed, eventsOf(t, l, "acct-1"))
	}
	wantGrant(t, l, "acct-1", "m:2026-07", 3, 0)
	wantReconciled(t, l)
}

// Reconcile names units the event log charged to a grant the ledger has no
// row of (a credit deleted by hand, a restore that lost rows): the counter
// reads 0 against the events' 5, a difference, never a row left out. Run on
// both ledgers.
func TestReconcileNamesEventsOfAMissingGrant(t *testing.T) {
	onBothLedgers(t, func(t *testing.T, l Ledger) {
		confSetup(t, l, 100, "acct-1")
		a := confNode(t, l, "node-a")
		a.settle(t, chargeOf("acct-1", "e1", 5, confJune))
		mustExecSQL(t, l, `DELETE FROM grants WHERE account_id = 'acct-1' AND grant_id = '`+confJune+`'`)
		rows, err := ReconcileRows(t.Context(), l)
		if err != nil {
			t.Fatal(err)
		}
		want := ReconcileRow{Account: "acct-1", Kind: "grant", Scope: confJune, Counter: 0, Events: 5, Diff: true}
		for _, r := range rows {
			if r == want {
				return
			}
		}
		t.Fatalf("reconcile rows %+v, want %+v among them", rows, want)
	})
}

// Overage is what the month used past its quota, from the first unit: one
// unit over bills one unit of overage, exactly the quota bills none.
func TestBillingOverageFromTheFirstUnitOver(t *testing.T) {
	for _, c := range []struct{ used, overage int64 }{{99, 0}, {100, 0}, {101, 1}, {150, 50}} {
		r := BillingRow{Monthly: true, Quota: 100, QuotaUsed: c.used, Units: c.used}
		r.finish(c.used, 0)
		if r.Overage != c.overage {
			t.Errorf("%d used of a quota of 100: overage %d, want %d", c.used, r.Overage, c.overage)
		}
	}
}

// A Reserve in flight when ReleaseNode runs: node-a's first reservation on
// a grant waits for the grant's row lock (held here by another
// transaction, as a settle holds it) while quotad revoke, or the node's own
// shutdown, frees everything node-a holds. ReleaseNode's statements did not
// see the reservation row the Reserve had not committed yet, so the Reserve
// committed after the release and stranded its units (chaos --seed 11,
// RES and LIVE). ReleaseNode waits for it now, and frees it too.
func TestPostgresReleaseNodeWaitsForAReserveInFlight(t *testing.T) {
	ctx := t.Context()
	l := migratedPG(t)
	confSetup(t, l, 100, "acct-1")
	// node-b's reservation makes the month's grant exist, so that it can be
	// locked below.
	if _, err := l.Reserve(ctx, "node-b", ReserveRequest{Account: "acct-1", Wall: confWallTime(), Need: 5}); err != nil {
		t.Fatal(err)
	}
	releaseNodeDuringWrite(t, l, "node-a's Reserve", func() error {
		_, err := l.Reserve(context.Background(), "node-a", ReserveRequest{Account: "acct-1", Wall: confWallTime(), Need: 10})
		return err
	})
	wantGrant(t, l, "acct-1", confJune, 0, 5)
}

// lockWaiters counts the sessions of l's database that wait for a lock.
func lockWaiters(t *testing.T, l *Postgres) int {
	t.Helper()
	var n int
	if err := l.pool.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// releaseNodeDuringWrite runs write, a transaction of node-a's on
// acct-1's grant, while another transaction holds the grant's row (as a
// settle of another node does), then ReleaseNode("node-a") while write
// waits; once the row is free both must succeed and the ledger must hold
// nothing of node-a's: ReleaseNode waited for write and freed what it
// left, rather than returning at once having seen nothing.
func releaseNodeDuringWrite(t *testing.T, l *Postgres, what string, write func() error) {
	t.Helper()
	ctx := t.Context()
	blocker, err := l.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Rollback(ctx)
	if _, err := blocker.Exec(ctx, `SELECT 1 FROM grants WHERE account_id = 'acct-1' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	wrote := make(chan error, 1)
	go func() { wrote <- write() }()
	waitfor.Cond(t, 10*time.Second, what+" waits on the grant's row", func() bool { return lockWaiters(t, l) >= 1 })
	released := make(chan error, 1)
	var returned atomic.Bool
	go func() {
		_, err := l.ReleaseNode(context.Background(), "node-a")
		returned.Store(true)
		released <- err
	}()
	// ReleaseNode either waits behind the write or (the bug) returns at
	// once having freed nothing.
	waitfor.Cond(t, 10*time.Second, "ReleaseNode returns or waits", func() bool { return returned.Load() || lockWaiters(t, l) >= 2 })
	if err := blocker.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-wrote; err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if err := <-released; err != nil {
		t.Fatalf("ReleaseNode node-a: %v", err)
	}
	held, err := l.Reservations(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range held {
		if r.Node == "node-a" {
			t.Errorf("after ReleaseNode node-a, the ledger still holds %+v: %s committed after the release", r, what)
		}
	}
}

// TestPostgresReleaseNodeWaitsForASettleInFlight: a settle that gives a
// refund's units back to node-a's reservation creates node-a's first
// reservation row on the grant; a ReleaseNode running meanwhile must wait
// for it and free it, not return having seen nothing (quotad revoke --force
// of a node still settling).
func TestPostgresReleaseNodeWaitsForASettleInFlight(t *testing.T) {
	l := migratedPG(t)
	confSetup(t, l, 100, "acct-1")
	a := confNode(t, l, "node-a")
	// Charged under a reservation node-a has no row for: the grant's used
	// goes up, and node-a still has no reservation row.
	a.settle(t, chargeOf("acct-1", "e1", 4, confJune).withReserved())
	releaseNodeDuringWrite(t, l, "node-a's settle of a refund", func() error {
		a.mu.Lock()
		defer a.mu.Unlock()
		res, err := l.Settle(context.Background(), a.batchLocked(refundOf("acct-1", "e1", 4, confJune).withReserved()))
		if err == nil && !res.Applied {
			err = fmt.Errorf("the refund's batch was not applied")
		}
		return err
	})
	wantGrant(t, l, "acct-1", confJune, 0, 0)
}
