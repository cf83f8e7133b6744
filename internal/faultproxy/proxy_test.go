package faultproxy

import (
	"context"
	"errors"
	"io"
	"net"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/quotaring/quotaring/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// fixture is a fresh database, a direct connection to it, and a proxy in
// front of its server.
type fixture struct {
	direct   *pgx.Conn
	proxy    *Proxy
	proxyDSN string // the database, through the proxy
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	dsn := pgtest.NewDB(t)
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	p, err := New("127.0.0.1:0", u.Host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	u.Host = p.Addr()
	return &fixture{direct: connect(t, dsn), proxy: p, proxyDSN: u.String()}
}

// connect opens a connection that the test closes at its end.
func connect(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// tryConnect connects with a deadline, for connections expected to fail.
func tryConnect(t *testing.T, dsn string) (*pgx.Conn, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err == nil {
		t.Cleanup(func() { _ = conn.Close(context.Background()) })
	}
	return conn, err
}

func count(t *testing.T, conn *pgx.Conn, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := conn.QueryRow(t.Context(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func TestQueryThroughProxy(t *testing.T) {
	f := newFixture(t)
	conn := connect(t, f.proxyDSN)
	var got string
	if err := conn.QueryRow(t.Context(), "SELECT current_database() || ':' || $1::text", "ok").Scan(&got); err != nil {
		t.Fatal(err)
	}
	var want string
	if err := f.direct.QueryRow(t.Context(), "SELECT current_database() || ':ok'").Scan(&want); err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Errorf("through proxy: %q, want %q", got, want)
	}
	st := f.proxy.Stats()
	if st.Accepted != 1 || st.Active != 1 || st.BytesUp == 0 || st.BytesDown == 0 || st.Cuts != 0 {
		t.Errorf("Stats = %+v", st)
	}
}

// TestCutAfterCommit: the client's commit fails, yet the row is committed.
// With sslmode=prefer pgx first sends an SSLRequest, which the server
// (ssl=off) answers with 'N'; the proxy must keep parsing after it.
func TestCutAfterCommit(t *testing.T) {
	for _, sslmode := range []string{"disable", "prefer"} {
		t.Run("sslmode="+sslmode, func(t *testing.T) {
			f := newFixture(t)
			ctx := t.Context()
			if _, err := f.direct.Exec(ctx, "CREATE TABLE charges (id int PRIMARY KEY)"); err != nil {
				t.Fatal(err)
			}
			u, _ := url.Parse(f.proxyDSN)
			q := u.Query()
			q.Set("sslmode", sslmode)
			u.RawQuery = q.Encode()
			dsn := u.String()

			// insert runs BEGIN; INSERT; COMMIT through the proxy on a new
			// connection and returns Commit's error.
			insert := func(id int, commit bool) error {
				t.Helper()
				conn := connect(t, dsn)
				tx, err := conn.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(ctx)
				if _, err := tx.Exec(ctx, "INSERT INTO charges VALUES ($1)", id); err != nil {
					t.Fatal(err)
				}
				if !commit {
					return tx.Rollback(ctx)
				}
				return tx.Commit(ctx)
			}

			f.proxy.CutAfterCommit(1)

			// A ROLLBACK is not a COMMIT: it goes through and the cut stays armed.
			if err := insert(0, false); err != nil {
				t.Fatalf("rollback with a commit cut armed: %v", err)
			}
			if st := f.proxy.Stats(); st.CommitCuts != 0 {
				t.Fatalf("a rollback was cut: %+v", st)
			}

			if err := insert(1, true); err == nil {
				t.Fatal("Commit returned nil although the proxy cut the connection")
			} else {
				// NB: pgx v5.12.0 reports this as "conn closed" with
				// pgconn.SafeToRetry(err) == true, although the COMMIT was
				// sent and committed: MultiResultReader.NextResult drops the
				// EOF and the next read finds the connection closed. Callers
				// must treat any Commit error as "outcome unknown".
				t.Logf("client saw: %v (%T), pgconn.SafeToRetry=%v", err, err, pgconn.SafeToRetry(err))
			}
			if n := count(t, f.direct, "SELECT count(*) FROM charges WHERE id = 1"); n != 1 {
				t.Fatalf("row 1: count = %d, want 1: the commit should have happened", n)
			}
			if st := f.proxy.Stats(); st.CommitCuts != 1 || st.Cuts != 1 {
				t.Errorf("Stats = %+v, want one commit cut", st)
			}

			// The cut was used up: the next commit goes through.
			if err := insert(2, true); err != nil {
				t.Fatalf("second commit: %v", err)
			}
			if n := count(t, f.direct, "SELECT count(*) FROM charges"); n != 2 {
				t.Errorf("rows = %d, want 2", n)
			}
			if st := f.proxy.Stats(); st.CommitCuts != 1 {
				t.Errorf("CommitCuts = %d after the cut was used up, want 1", st.CommitCuts)
			}
		})
	}
}

func TestSetDown(t *testing.T) {
	f := newFixture(t)
	ctx := t.Context()
	before := connect(t, f.proxyDSN)

	f.proxy.SetDown(true)
	if err := before.Ping(ctx); err == nil {
		t.Error("a connection opened before SetDown(true) still works")
	}
	if _, err := tryConnect(t, f.proxyDSN); err == nil {
		t.Fatal("connected through a proxy that is down")
	}
	if st := f.proxy.Stats(); st.Refused == 0 || st.Cuts != 1 {
		t.Errorf("Stats = %+v, want refused > 0 and 1 cut", st)
	}

	f.proxy.SetDown(false)
	conn, err := tryConnect(t, f.proxyDSN)
	if err != nil {
		t.Fatalf("connect after SetDown(false): %v", err)
	}
	if err := conn.Ping(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestCutAll(t *testing.T) {
	f := newFixture(t)
	ctx := t.Context()
	a, b := connect(t, f.proxyDSN), connect(t, f.proxyDSN)
	f.proxy.CutAll()
	if a.Ping(ctx) == nil || b.Ping(ctx) == nil {
		t.Error("a connection survived CutAll")
	}
	if err := connect(t, f.proxyDSN).Ping(ctx); err != nil {
		t.Errorf("new connection after CutAll: %v", err)
	}
	if st := f.proxy.Stats(); st.Cuts != 2 {
		t.Errorf("Cuts = %d, want 2", st.Cuts)
	}
}

func TestLatency(t *testing.T) {
	f := newFixture(t)
	ctx := t.Context()
	conn := connect(t, f.proxyDSN)
	const d = 50 * time.Millisecond
	f.proxy.SetLatency(d)
	start := time.Now()
	if _, err := conn.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatal(err)
	}
	// At least one chunk each way, each delayed by d. No upper bound: a
	// slow machine may take longer.
	if took := time.Since(start); took < 2*d {
		t.Errorf("round trip took %v with latency %v each way, want >= %v", took, d, 2*d)
	}
	f.proxy.SetLatency(0)
	if _, err := conn.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatal(err)
	}
}

func TestClose(t *testing.T) {
	f := newFixture(t)
	conn := connect(t, f.proxyDSN)
	if err := f.proxy.Close(); err != nil {
		t.Fatal(err)
	}
	if err := conn.Ping(t.Context()); err == nil {
		t.Error("a connection survived Close")
	}
	if st := f.proxy.Stats(); st.Active != 0 {
		t.Errorf("Active = %d after Close", st.Active)
	}
	if c, err := net.Dial("tcp", f.proxy.Addr()); err == nil {
		c.Close()
		t.Error("the proxy still accepts connections after Close")
	}
	if err := f.proxy.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestHalfClose: a client that shuts its write side still gets the server's
// answer, as over a direct connection. No Postgres needed.
func TestHalfClose(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	served := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			served <- err
			return
		}
		defer c.Close()
		req, err := io.ReadAll(c) // until the client's half-close
		if err == nil {
			_, err = c.Write(append(req, " world"...))
		}
		served <- err
	}()

	p, err := New("127.0.0.1:0", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(30 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "hello world" {
		t.Errorf("got %q, want %q", got, "hello world")
	}
	if err := <-served; err != nil {
		t.Fatal(err)
	}
}

// TestDialError: with nothing at the target, the client is closed and the
// failure counted.
func TestDialError(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	target := ln.Addr().String()
	ln.Close() // nothing listens there now
	p, err := New("127.0.0.1:0", target)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	// The proxy resets the client so fast that even Dial may see it.
	if c, err := net.Dial("tcp", p.Addr()); err == nil {
		defer c.Close()
		if err := c.SetDeadline(time.Now().Add(30 * time.Second)); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("read from a proxied connection with no target: %v, want EOF or reset", err)
		}
	}
	if st := p.Stats(); st.DialErrors != 1 {
		t.Errorf("DialErrors = %d, want 1", st.DialErrors)
	}
}

// A frozen proxy holds every byte and every connection: a query neither
// fails nor answers until the client's own deadline, and a connection made
// while frozen is answered once thawed (held, not dropped), as by a
// SIGSTOPped server.
func TestFrozen(t *testing.T) {
	f := newFixture(t)
	conn := connect(t, f.proxyDSN)
	f.proxy.SetFrozen(true)
	f.proxy.SetFrozen(true) // twice is once
	late := make(chan error, 1)
	go func() {
		c, err := pgx.Connect(t.Context(), f.proxyDSN)
		if err == nil {
			_, err = c.Exec(t.Context(), "SELECT 1")
			_ = c.Close(context.Background())
		}
		late <- err
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	_, err := conn.Exec(ctx, "SELECT 1")
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) && !pgconn.Timeout(err) {
		t.Fatalf("query through a frozen proxy: %v, want the client's deadline", err)
	}
	select {
	case err := <-late:
		t.Fatalf("a connection made while frozen got through: %v", err)
	default:
	}
	f.proxy.SetFrozen(false)
	f.proxy.SetFrozen(false)
	if err := <-late; err != nil {
		t.Fatalf("connection made while frozen, after the thaw: %v", err)
	}
	if st := f.proxy.Stats(); st.Cuts != 0 || st.Refused != 0 {
		t.Fatalf("a freeze cut or refused connections: %+v", st)
	}
}
