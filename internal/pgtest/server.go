package pgtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrNoBinaries is returned by Start when initdb and postgres cannot be found.
var ErrNoBinaries = errors.New("pgtest: Postgres binaries not found")

// ErrClosed is returned by Start (the method) after Close.
var ErrClosed = errors.New("pgtest: server closed")

// dirPrefix names every server directory, so that Start can find the ones
// left behind by dead test processes (see reapStale).
const dirPrefix = "quotaring-pgtest-"

// defaultStartTimeout bounds Start when its context has no deadline.
const defaultStartTimeout = 60 * time.Second

// shutdownGrace is how long Stop waits after escalating to an immediate
// shutdown (SIGQUIT) before it kills the postmaster.
const shutdownGrace = 5 * time.Second

// Options configures Start. The zero value is ready to use.
type Options struct {
	// Dir is the directory in which the server's own directory is created.
	// If empty, os.TempDir() is used. When running as root, the postgres OS
	// user must be able to search every ancestor of Dir.
	Dir string
	// Logf, if non-nil, receives lifecycle messages (directory, port, how
	// long start took). t.Logf fits, as long as the server is closed before
	// the test ends.
	Logf func(format string, args ...any)
}

// Server is one throwaway postgres, normally one per test package.
type Server struct {
	bin     binaries
	cred    *syscall.Credential // nil unless the test process is root
	dir     string              // the server's own directory, removed by Close
	dataDir string
	logPath string // postgres's stderr, appended to across restarts
	env     []string
	logf    func(format string, args ...any)
	port    int // fixed once Start returns

	mu sync.Mutex // protects the following fields; held across Start, Stop and Close
	// cmd is the running postmaster, nil while stopped.
	cmd *exec.Cmd
	// exited is closed when cmd has exited and been reaped.
	exited chan struct{}
	closed bool
}

// Start creates a new server: it makes a directory under opts.Dir, runs
// initdb there and starts postgres on a free loopback port. It returns when
// the server accepts connections. If the binaries are missing, the error
// wraps ErrNoBinaries.
func Start(ctx context.Context, opts Options) (*Server, error) {
	began := time.Now()
	bin, err := findBinaries(os.Getenv("PATH"), defaultFallbackGlob)
	if err != nil {
		return nil, err
	}
	cred, err := childCredential()
	if err != nil {
		return nil, err
	}
	logf := opts.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	parent := opts.Dir
	if parent == "" {
		parent = os.TempDir()
	}
	reapStale(parent, logf)

	dir, err := os.MkdirTemp(parent, dirPrefix)
	if err != nil {
		return nil, fmt.Errorf("pgtest: make server dir: %w", err)
	}
	s := &Server{
		bin:     bin,
		cred:    cred,
		dir:     dir,
		dataDir: filepath.Join(dir, "data"),
		logPath: filepath.Join(dir, "postgres.log"),
		env:     childEnv(),
		logf:    logf,
	}
	if err := s.create(ctx); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	initdbTook := time.Since(began)

	s.mu.Lock()
	defer s.mu.Unlock()
	// The port is free when we look, but something else may take it before
	// postgres binds it; then try another.
	const attempts = 3
	for i := 0; ; i++ {
		if s.port, err = freePort(); err != nil {
			break
		}
		err = s.startLocked(ctx)
		if err == nil || !errors.Is(err, errAddrInUse) || i == attempts-1 {
			break
		}
		logf("pgtest: port %d was taken, trying another", s.port)
	}
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	logf("pgtest: postgres %s on %s in %s (initdb %v, total %v)",
		bin.version, s.Addr(), dir, initdbTook.Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
	return s, nil
}

// create writes the owner file, hands the directory to the postgres user
// when we are root, and runs initdb.
func (s *Server) create(ctx context.Context) error {
	if err := writeOwnerFile(s.dir); err != nil {
		return err
	}
	if s.cred != nil {
		if err := os.Chown(s.dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			return fmt.Errorf("pgtest: give %s to the postgres user: %w", s.dir, err)
		}
		if err := checkSearchable(s.dir, s.cred.Uid, s.cred.Gid); err != nil {
			return err
		}
	}
	cmd := exec.CommandContext(ctx, s.bin.initdb,
		"-D", s.dataDir,
		"-A", "trust",
		"-U", "postgres",
		"-E", "UTF8",
		"--locale=C",
		"--no-sync", // test data: nothing to keep across a machine crash
	)
	s.prepare(cmd)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("pgtest: initdb: %w\n%s", err, out)
	}
	return nil
}

// prepare sets what every child process shares: who it runs as, where, with
// which environment, and that it dies with us.
func (s *Server) prepare(cmd *exec.Cmd) {
	cmd.Dir = s.dir
	cmd.Env = s.env
	cmd.SysProcAttr = childSysProcAttr(s.cred)
}

// Start starts a stopped server again, on the same port and data (also after
// the postmaster died on its own; postgres then recovers from its WAL). It is
// a no-op on a running server.
func (s *Server) Start(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	if s.runningLocked() {
		return nil
	}
	return s.startLocked(ctx)
}

// runningLocked reports whether the postmaster runs, forgetting it if it
// has exited on its own (crashed, or killed by someone else).
//
// REQUIRES: s.mu held.
func (s *Server) runningLocked() bool {
	if s.cmd == nil {
		return false
	}
	select {
	case <-s.exited:
		s.cmd, s.exited = nil, nil
		return false
	default:
		return true
	}
}

var errAddrInUse = errors.New("pgtest: address already in use")

// startLocked starts postgres and waits until it accepts connections.
//
// REQUIRES: s.mu held, s.cmd == nil.
func (s *Server) startLocked(ctx context.Context) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultStartTimeout)
		defer cancel()
	}
	logFile, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("pgtest: open log: %w", err)
	}
	logStart, _ := logFile.Seek(0, io.SeekEnd)

	cmd := exec.Command(s.bin.postgres,
		"-D", s.dataDir,
		"-p", strconv.Itoa(s.port),
		"-c", "listen_addresses=127.0.0.1",
		"-c", "unix_socket_directories=", // TCP only: nothing outside s.dir, no 107-byte path limit
		// Speed over durability against machine crashes; a process crash
		// loses nothing. synchronous_commit stays on: off loses the last
		// ~200 ms of acknowledged commits when postgres itself is killed,
		// which would fail the ledger's crash tests for the wrong reason.
		"-c", "fsync=off",
		"-c", "full_page_writes=off",
		"-c", "timezone=UTC",
		"-c", "log_timezone=UTC",
	)
	s.prepare(cmd)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	err = cmd.Start()
	_ = logFile.Close() // the child has its own descriptor
	if err != nil {
		return fmt.Errorf("pgtest: start postgres: %w", err)
	}
	exited := make(chan struct{})
	go func() {
		// Ends when postgres exits; Stop and Close wait for it.
		_ = cmd.Wait()
		close(exited)
	}()
	s.cmd, s.exited = cmd, exited

	if err := s.waitReady(ctx, exited); err != nil {
		_ = s.stopLocked(context.Background()) // it might be half up
		tail := s.logSince(logStart)
		if strings.Contains(tail, "Address already in use") {
			return fmt.Errorf("%w: port %d: %v", errAddrInUse, s.port, err)
		}
		return fmt.Errorf("pgtest: start postgres on port %d: %w\npostgres log:\n%s", s.port, err, tail)
	}
	return nil
}

// waitReady connects until a connection succeeds, postgres exits, or ctx
// ends. The wait between tries is a backoff, not a guess at how long start
// takes.
func (s *Server) waitReady(ctx context.Context, exited <-chan struct{}) error {
	backoff := 5 * time.Millisecond
	var lastErr error
	for {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		conn, err := pgconn.Connect(cctx, s.DSN("postgres"))
		cancel()
		if err == nil {
			return conn.Close(ctx)
		}
		lastErr = err
		t := time.NewTimer(backoff)
		select {
		case <-exited:
			t.Stop()
			return errors.New("postgres exited")
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("not ready: %w (last connect error: %v)", ctx.Err(), lastErr)
		case <-t.C:
		}
		backoff = min(2*backoff, 100*time.Millisecond)
	}
}

// Stop shuts the server down in fast mode (open sessions are ended) and
// waits for it to exit. The data stays for Start. If ctx ends first, Stop
// escalates to an immediate shutdown, then to SIGKILL. Stop is a no-op on a
// stopped server.
func (s *Server) Stop(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stopLocked(ctx)
}

// stopLocked signals only the postmaster pgtest started, by its PID. The PID
// cannot have been reused: we have not reaped it until exited is closed.
//
// REQUIRES: s.mu held.
func (s *Server) stopLocked(ctx context.Context) error {
	if s.cmd == nil {
		return nil
	}
	p, exited := s.cmd.Process, s.exited
	s.cmd, s.exited = nil, nil

	_ = p.Signal(syscall.SIGINT) // fast shutdown
	select {
	case <-exited:
		return nil
	case <-ctx.Done():
	}
	_ = p.Signal(syscall.SIGQUIT) // immediate shutdown
	t := time.NewTimer(shutdownGrace)
	defer t.Stop()
	select {
	case <-exited:
	case <-t.C:
		_ = p.Kill()
		<-exited
	}
	return fmt.Errorf("pgtest: fast shutdown did not finish: %w", ctx.Err())
}

// Running reports whether the server's postmaster is running.
func (s *Server) Running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.runningLocked()
}

// Close stops the server and removes its directory. It is safe to call more
// than once.
func (s *Server) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stopErr := s.stopLocked(ctx)
	if err := os.RemoveAll(s.dir); err != nil {
		return errors.Join(stopErr, fmt.Errorf("pgtest: remove %s: %w", s.dir, err))
	}
	return stopErr
}

// Port is the TCP port the server listens on, on 127.0.0.1.
func (s *Server) Port() int { return s.port }

// Addr is host:port of the server, for dialling it (or pointing a proxy at it).
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// Dir is the server's own directory (data in Dir/data, log in
// Dir/postgres.log). Close removes it.
func (s *Server) Dir() string { return s.dir }

// DSN is the URL of database db on this server, as user postgres.
func (s *Server) DSN(db string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User("postgres"),
		Host:     s.Addr(),
		Path:     "/" + db,
		RawQuery: "sslmode=disable",
	}
	return u.String()
}

// NewDatabase creates the database name (which must not exist yet) and
// returns its DSN. NewDB(t) picks a unique name and drops the database after
// the test.
func (s *Server) NewDatabase(ctx context.Context, name string) (dsn string, err error) {
	if err := s.admin(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", fmt.Errorf("pgtest: create database %q: %w", name, err)
	}
	return s.DSN(name), nil
}

// DropDatabase drops the database name if it exists, ending any sessions
// still connected to it.
func (s *Server) DropDatabase(ctx context.Context, name string) error {
	if err := s.admin(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("pgtest: drop database %q: %w", name, err)
	}
	return nil
}

// Dump writes database db as plain SQL to path with pg_dump (the one beside
// initdb, which matches the server's version), so that a run's ledger
// outlives the server: load it into any Postgres 15 or later with
// `createdb NAME && psql -d NAME -f PATH`. The server must be running.
func (s *Server) Dump(ctx context.Context, db, path string) error {
	pgDump := filepath.Join(filepath.Dir(s.bin.initdb), "pg_dump")
	if !isExecutable(pgDump) {
		return fmt.Errorf("pgtest: dump database %q: no pg_dump beside %s (install the Postgres client programs of that version)", db, s.bin.initdb)
	}
	cmd := exec.CommandContext(ctx, pgDump, "--no-owner", "--no-privileges", "-h", "127.0.0.1", "-p", strconv.Itoa(s.port), "-U", "postgres", "-d", db, "-f", path)
	cmd.Env = s.env
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("pgtest: dump database %q to %s: %w\n%s", db, path, err, out)
	}
	return nil
}

// admin runs one statement in the postgres database.
func (s *Server) admin(ctx context.Context, sql string) error {
	conn, err := pgx.Connect(ctx, s.DSN("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, sql)
	return err
}

// logSince returns what postgres logged from offset on, at most the last 4 KiB.
func (s *Server) logSince(offset int64) string {
	b, err := os.ReadFile(s.logPath)
	if err != nil || int64(len(b)) < offset {
		return ""
	}
	b = b[offset:]
	if len(b) > 4096 {
		b = b[len(b)-4096:]
	}
	return string(b)
}

// binaries are the server programs of one Postgres installation.
type binaries struct {
	initdb, postgres string
	version          string // directory-derived, for messages only
}

// defaultFallbackGlob is where Debian and Ubuntu install the server programs;
// they are not on PATH there.
const defaultFallbackGlob = "/usr/lib/postgresql/*/bin"

// findBinaries finds initdb on path, or else in the newest directory matching
// fallbackGlob, and takes postgres from the same directory (after resolving
// symlinks), so that the two always have the same version.
func findBinaries(path, fallbackGlob string) (binaries, error) {
	var dirs []string
	for _, d := range filepath.SplitList(path) {
		if d != "" {
			dirs = append(dirs, d)
		}
	}
	if fallbackGlob != "" {
		matches, _ := filepath.Glob(fallbackGlob)
		// Newest version first: /usr/lib/postgresql/16/bin before .../15/bin.
		sort.Slice(matches, func(i, j int) bool {
			vi, _ := strconv.Atoi(filepath.Base(filepath.Dir(matches[i])))
			vj, _ := strconv.Atoi(filepath.Base(filepath.Dir(matches[j])))
			return vi > vj
		})
		dirs = append(dirs, matches...)
	}
	for _, d := range dirs {
		initdb, err := filepath.EvalSymlinks(filepath.Join(d, "initdb"))
		if err != nil || !isExecutable(initdb) {
			continue
		}
		binDir := filepath.Dir(initdb)
		postgres := filepath.Join(binDir, "postgres")
		if !isExecutable(postgres) {
			continue
		}
		return binaries{initdb: initdb, postgres: postgres, version: filepath.Base(filepath.Dir(binDir))}, nil
	}
	return binaries{}, fmt.Errorf("%w (initdb on PATH or in %s)", ErrNoBinaries, fallbackGlob)
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// childEnv is our environment without PG* variables: postgres reads PGPORT
// and PGDATA, and initdb reads PGDATA, which must not override our flags.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "PG") {
			env = append(env, kv)
		}
	}
	return append(env, "LC_ALL=C")
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgtest: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// checkSearchable reports, with a useful message, an ancestor of dir that
// the postgres user cannot enter; initdb's own error for this is cryptic.
func checkSearchable(dir string, uid, gid uint32) error {
	for d := filepath.Dir(dir); ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil {
			return fmt.Errorf("pgtest: %w", err)
		}
		perm := fi.Mode().Perm()
		fuid, fgid, ok := fileOwner(fi)
		searchable := perm&0o001 != 0 ||
			ok && fuid == uid && perm&0o100 != 0 ||
			ok && fgid == gid && perm&0o010 != 0
		if !searchable {
			return fmt.Errorf("pgtest: the postgres user cannot enter %s (mode %v): put the server under a directory it can search, "+
				"with Options.Dir or, when that is empty, TMPDIR (now %s): such as /tmp", d, perm, os.TempDir())
		}
		if d == filepath.Dir(d) {
			return nil
		}
	}
}
