// Package pgtest runs a throwaway PostgreSQL server from the local binaries,
// for tests that need the real ledger database.
//
// # Use in a test package
//
// One server serves a whole test package. TestMain hands control to Main,
// which starts that server the first time a test asks for it and stops it
// (and removes its files) after the last test:
//
//	func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }
//
//	func TestSettle(t *testing.T) {
//		dsn := pgtest.NewDB(t) // a fresh, empty database, dropped when t ends
//		conn, err := pgx.Connect(t.Context(), dsn)
//		...
//	}
//
// A test that takes the server down (to check behaviour while the ledger is
// away) uses PackageServer(t) and calls Stop and Start on it. Such a test must
// not run in parallel with others that use the server; if it leaves the server
// stopped, PackageServer's cleanup starts it again for the next test.
//
// Tests that need a server of their own (to Close it, say) call Start.
//
// # Missing binaries
//
// The binaries are looked up as initdb on PATH, then in
// /usr/lib/postgresql/<version>/bin (where Debian's postgresql package puts
// them). When they are missing, NewDB and PackageServer skip the test with
//
//	SKIP: Postgres binaries not found (initdb on PATH); set QUOTARING_REQUIRE_PG=1 to make this a failure
//
// and Main repeats it on stderr after the run, with the number of tests
// skipped. That summary shows without -v when go test runs in the package's
// directory with no package arguments; with package arguments (go test
// ./...) go test prints nothing but "ok" for a package that passed, skips
// and all. So a skip cannot be made loud enough there: with
// QUOTARING_REQUIRE_PG=1 in the environment (CI must set it) the same tests
// fail instead, so that a machine without Postgres cannot pass the ledger
// tests by skipping them.
//
// # Running as root, and why not runuser
//
// postgres and initdb refuse to run as root. When the test process is root,
// pgtest creates the server's directory, gives it to the "postgres" OS user,
// and starts initdb and postgres as that user. It does what
// `runuser -u postgres -- postgres ...` would do, but in-process: the child is
// forked with syscall.Credential set to postgres's uid and gid. Without a
// runuser process in between, the process pgtest holds is the postmaster
// itself, so it can signal the postmaster by its own PID and wait for it,
// and the kernel's parent-death signal (below) reaches the postmaster rather
// than a runuser that might not pass it on. The directory's ancestors must be
// searchable by that user: the default, os.TempDir(), is; a t.TempDir() is
// not (it is mode 0700), so do not pass one as Options.Dir when running as root.
//
// # What the server is
//
//   - It listens on 127.0.0.1 only, on a port that was free when it started
//     (kept across Stop and Start); unix-domain sockets are off, so nothing
//     is written outside its directory.
//   - Authentication is trust for user postgres: DSN gives
//     postgres://postgres@127.0.0.1:PORT/db?sslmode=disable.
//   - It is tuned for speed against machine crashes only: initdb --no-sync,
//     fsync=off and full_page_writes=off. A crash of the machine can corrupt
//     it (the data is thrown away anyway); a crash of postgres itself loses
//     nothing that was acknowledged, so tests may kill and restart it.
//     synchronous_commit stays on, on purpose: with it off, an immediate
//     shutdown or kill -9 of postgres loses the commits of the last
//     wal_writer_delay (200 ms), which TestStartAfterCrash showed, and a
//     ledger crash test would then report lost usage that quotaring did not
//     lose. With fsync off it costs about 10 µs a commit here.
//   - timezone is UTC, and the locale is C.
//
// Start returns once a connection succeeds (a connect loop with a deadline,
// never a fixed sleep). On this project's 2-core machine that takes about
// 1 s: initdb 0.5 s when the machine is idle and up to 1.3 s under load, and
// postgres is ready about 50 ms later. A restart (Stop, Start) takes about
// 60 ms.
//
// # Cleanup when a test process dies
//
// Close stops the postmaster (fast shutdown) and removes the directory. When
// the test process dies without calling Close (a panic, a -timeout, kill -9),
// two things stop a postmaster from running forever:
//
//  1. On Linux the postmaster is started with a parent-death signal (SIGINT:
//     fast shutdown), so the kernel stops it when the test process exits. The
//     caveat: the kernel sends the signal when the OS thread that started the
//     child exits, which in Go happens only if a goroutine locked to that
//     thread ends without unlocking it.
//  2. Every server directory is named quotaring-pgtest-* and holds a file
//     "owner" naming the test process (PID and start time, so a reused PID is
//     not taken for the owner). Start looks at the other such directories in
//     the same parent: where the owner is gone, it stops the postmaster named
//     in that directory's postmaster.pid (only after checking that the process
//     is a postgres whose working directory is that data directory) and
//     removes the directory. Nothing else is ever signalled.
//
// # Concurrency
//
// A Server's methods are safe for concurrent use; Stop, Start and Close are
// serialized. Port, Addr and DSN never change after Start returns.
package pgtest
