package pgtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// RequireEnv is the environment variable that turns "Postgres binaries not
// found" from a skip into a failure when set to 1.
const RequireEnv = "QUOTARING_REQUIRE_PG"

// skipMessage is what a test that needs Postgres says when it cannot have it.
const skipMessage = "SKIP: Postgres binaries not found (initdb on PATH); set " + RequireEnv + "=1 to make this a failure"

// current is the package server of the test binary that is inside Main.
//
// It is this package's one piece of package-level mutable state, and it is
// there because NewDB(t) and PackageServer(t) get nothing but a testing.TB:
// the server TestMain owns has to be reachable from them without threading
// it through every test. Only Main sets it, before m.Run, and clears it
// after; everything mutable hangs off the packageServer it points to.
var current atomic.Pointer[packageServer]

// packageServer starts the package's server on first use, so a package (or
// a -run selection) whose tests never ask for Postgres pays nothing.
type packageServer struct {
	skipped atomic.Int64 // tests skipped for lack of binaries
	dbSeq   atomic.Int64 // makes NewDB's database names unique

	mu      sync.Mutex // protects the following fields
	started bool       // Start was tried; err is its sticky result
	srv     *Server
	err     error
}

// Main runs the tests of a package that uses Postgres, from its TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }
//
// It runs m.Run, then closes the package server if a test started one, and
// returns the exit code. If tests were skipped because the binaries are
// missing, it says so on stderr (visible without -v). A failure to close the
// server turns a passing run into a failing one.
func Main(m *testing.M) int {
	p := &packageServer{}
	if !current.CompareAndSwap(nil, p) {
		panic("pgtest: Main called while another Main is running")
	}
	defer current.Store(nil)

	code := m.Run()

	if n := p.skipped.Load(); n > 0 {
		fmt.Fprintf(os.Stderr, "\n*** pgtest: %d test(s) did not run.\n*** %s\n\n", n, skipMessage)
	}
	if err := p.close(); err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: close package server: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

// NewDB creates a database with a name unique in this test binary on the
// package server (starting the server if this is the first use) and returns
// its DSN. The database is dropped in t.Cleanup, ending sessions still open
// on it. If the binaries are missing, NewDB skips the test (or fails it,
// with QUOTARING_REQUIRE_PG=1).
func NewDB(t testing.TB) string {
	t.Helper()
	p := mustCurrent(t)
	s := p.get(t)
	if s == nil {
		return "" // t was skipped or failed; only a fake TB gets here
	}
	name := fmt.Sprintf("%s_%d", dbNamePrefix(t.Name()), p.dbSeq.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dsn, err := s.NewDatabase(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		// The test may have stopped the server.
		if err := s.Start(ctx); err != nil {
			t.Errorf("pgtest: restart server to drop %s: %v", name, err)
			return
		}
		if err := s.DropDatabase(ctx, name); err != nil {
			t.Error(err)
		}
	})
	return dsn
}

// PackageServer returns the package server, starting it if needed, for
// tests that stop and start it. A test that does must not run in parallel
// with other tests that use the server. If the test leaves the server
// stopped, its cleanup starts it again. Never Close the package server: Main
// does. Missing binaries are handled as in NewDB.
func PackageServer(t testing.TB) *Server {
	t.Helper()
	s := mustCurrent(t).get(t)
	if s == nil {
		return nil
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		if err := s.Start(ctx); err != nil {
			t.Errorf("pgtest: restart package server after %s: %v", t.Name(), err)
		}
	})
	return s
}

func mustCurrent(t testing.TB) *packageServer {
	t.Helper()
	p := current.Load()
	if p == nil {
		t.Fatal("pgtest: NewDB and PackageServer need pgtest.Main: add\n\tfunc TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }")
	}
	return p
}

// get returns the package server, starting it on first use. It returns nil
// after skipping or failing t.
func (p *packageServer) get(t testing.TB) *Server {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.started {
		p.started = true
		var logf func(string, ...any)
		if testing.Verbose() {
			// Not t.Logf: the server outlives this test.
			logf = func(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		p.srv, p.err = Start(ctx, Options{Logf: logf})
	}
	if p.err != nil {
		skip, msg := unavailable(p.err, os.Getenv(RequireEnv) == "1")
		if skip {
			p.skipped.Add(1) // before t.Skip, which does not return
			t.Skip(msg)
		} else {
			t.Fatal(msg)
		}
		return nil
	}
	return p.srv
}

func (p *packageServer) close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.srv == nil {
		return nil
	}
	return p.srv.Close()
}

// RequireBinaries skips or fails t, as NewDB would, when the Postgres
// binaries are missing; it is for tests that call Start themselves. It
// reports whether the binaries are there.
func RequireBinaries(t testing.TB) bool {
	t.Helper()
	_, err := findBinaries(os.Getenv("PATH"), defaultFallbackGlob)
	if err == nil {
		return true
	}
	if skip, msg := unavailable(err, os.Getenv(RequireEnv) == "1"); skip {
		if p := current.Load(); p != nil {
			p.skipped.Add(1) // for Main's summary
		}
		t.Skip(msg)
	} else {
		t.Fatal(msg)
	}
	return false
}

// unavailable decides what a test does when the server could not start with
// err: skip it (binaries missing and not required) or fail it (anything
// else), and with which message.
func unavailable(err error, require bool) (skip bool, msg string) {
	switch {
	case !errors.Is(err, ErrNoBinaries):
		return false, fmt.Sprintf("pgtest: start package server: %v", err)
	case require:
		return false, fmt.Sprintf("FAIL: Postgres binaries not found (initdb on PATH) and %s=1: %v", RequireEnv, err)
	default:
		return true, skipMessage
	}
}

var nonIdent = regexp.MustCompile(`[^a-z0-9]+`)

// dbNamePrefix turns a test name into the start of a database name: lower
// case, [a-z0-9_] only, short enough to leave room for the sequence number
// within Postgres's 63-byte identifiers.
func dbNamePrefix(testName string) string {
	s := strings.Trim(nonIdent.ReplaceAllString(strings.ToLower(testName), "_"), "_")
	if len(s) > 40 {
		s = s[:40]
	}
	return "t_" + s
}
