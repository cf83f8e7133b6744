package flush

// Postgres is the production ledger (pgx, pgxpool). Dialect notes:
//
//   - Transactions run at READ COMMITTED. Every writer locks grants with
//     SELECT ... ORDER BY account_id, grant_id FOR UPDATE before it touches
//     grants or reservations, and writes usage and events in key order, so
//     settles, reserves and releases wait for each other instead of
//     deadlocking.
//   - Statements that belong together go out as one pgx.Batch (one network
//     round trip), the transaction's BEGIN included (Batch.BeginTx). COMMIT is
//     always its own simple query "commit": the fault proxy's commit cut
//     relies on that.
//   - A Commit error means the outcome is unknown, whatever the error says:
//     pgx reports a connection broken during COMMIT with an error for which
//     pgconn.SafeToRetry is true although the commit happened. Settle returns
//     the error and the caller retries the same batch; the settled mark makes
//     the retry a no-op. Nothing here branches on SafeToRetry.
//   - The event log is partitioned by month (see Settle and the migration);
//     its duplicate catch works within a month.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// Advisory lock keys (pg_advisory_lock takes one bigint). Fixed forever: two
// quotad versions must agree on them.
const (
	migrateLockKey   int64 = 0x71756f7461_01 // "quota" 01: Migrate
	partitionLockKey int64 = 0x71756f7461_02 // "quota" 02: creating event partitions
)

// reserveLockClass is the first key of the two-key advisory lock on a node's
// reservations, pg_advisory_xact_lock(reserveLockClass, hashtext(node)):
// Reserve takes it shared and ReleaseNode exclusive, each first, so that a
// release waits for the reserves in flight (see ReleaseNode). Two-key locks
// do not collide with the one-bigint keys above. Fixed forever, like them.
const reserveLockClass int32 = 0x71756f74 // "quot"

// defaultConnectTimeout bounds a connection attempt when neither the DSN
// (connect_timeout) nor PGOptions says otherwise, so a ledger that does not
// answer fails fast instead of hanging a start or a settle.
const defaultConnectTimeout = 5 * time.Second

// pgSessionDefaults are session settings for the ledger's connections,
// unless the DSN sets them:
//   - jit off: a settle's statements handle 100k rows with simple
//     expressions, which the planner costs high enough to JIT-compile; the
//     compilation took longer (130 ms) than it saved.
//   - temp_buffers 64MB: a 100k-charge settle stages about 20 MB in its
//     temporary table; with the default 8 MB it spills to disk.
var pgSessionDefaults = map[string]string{"jit": "off", "temp_buffers": "64MB"}

// PGOptions configures OpenPostgres. The zero value is ready to use.
type PGOptions struct {
	// MaxConns bounds the pool; 0 means pgxpool's default, max(4, NumCPU).
	MaxConns int32
	// Logger receives migrations applied, partitions created and commits whose
	// outcome is unknown. If nil, nothing is logged.
	Logger *slog.Logger
	// ConnectTimeout bounds each connection attempt. 0 means the DSN's
	// connect_timeout, or 5 s if it has none.
	ConnectTimeout time.Duration
}

// Postgres is the Ledger on PostgreSQL. Its methods are safe for concurrent
// use.
type Postgres struct {
	pool       *pgxpool.Pool
	log        *slog.Logger
	where      string // host:port/db as user, for messages (never the password)
	migrations []migration

	mu sync.Mutex // protects partitions
	// partitions holds the months whose event partition is known to exist.
	partitions map[shard.Period]bool

	// noReserveLock leaves the reservation lock out of Reserve. Set only by
	// BenchmarkReserve, to measure what the lock costs in the same run.
	noReserveLock bool
}

var _ Ledger = (*Postgres)(nil)

// parsePGConfig parses a Postgres DSN, its error (ErrInvalid) without the
// password.
func parsePGConfig(dsn string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("%w: the Postgres DSN %s does not parse: %s: check its form, postgres://USER:PASSWORD@HOST:PORT/DB?sslmode=disable, "+
			"with special characters of the user and password percent-encoded (/ as %%2F, @ as %%40, : as %%3A, # as %%23, ? as %%3F, %% as %%25)",
			ErrInvalid, redactDSN(dsn), scrubPassword(err.Error(), dsn))
	}
	return cfg, nil
}

// poolSize is the most connections a node opens: opts's when set, else
// the DSN's pool_max_conns when given, else max(4, GOMAXPROCS). pgx's own
// default, max(4, runtime.NumCPU()), counts the host's cores, not the
// container's CPU limit: five pods on 64-core hosts could open 320
// connections against Postgres's default max_connections of 100.
// GOMAXPROCS follows the cgroup's CPU limit.
func poolSize(dsn string, parsed, opt int32) int32 {
	switch {
	case opt > 0:
		return opt
	case strings.Contains(dsn, "pool_max_conns"):
		return parsed
	}
	return max(4, int32(runtime.GOMAXPROCS(0)))
}

// OpenPostgres connects to the ledger at dsn (postgres://...). It pings the
// server, so an unreachable one fails here with an error that wraps
// ErrUnavailable and names the host and database. It does not migrate.
func OpenPostgres(ctx context.Context, dsn string, opts PGOptions) (*Postgres, error) {
	ms, err := loadMigrations(dialectPostgres)
	if err != nil {
		return nil, err
	}
	cfg, err := parsePGConfig(dsn)
	if err != nil {
		return nil, err
	}
	switch {
	case opts.ConnectTimeout > 0:
		cfg.ConnConfig.ConnectTimeout = opts.ConnectTimeout
	case cfg.ConnConfig.ConnectTimeout == 0:
		cfg.ConnConfig.ConnectTimeout = defaultConnectTimeout
	}
	cfg.MaxConns = poolSize(dsn, cfg.MaxConns, opts.MaxConns)
	for k, v := range pgSessionDefaults {
		if _, set := cfg.ConnConfig.RuntimeParams[k]; !set {
			cfg.ConnConfig.RuntimeParams[k] = v
		}
	}
	cc := cfg.ConnConfig
	p := &Postgres{
		log:        orDiscard(opts.Logger),
		where:      fmt.Sprintf("%s/%s as user %s", net.JoinHostPort(cc.Host, fmt.Sprint(cc.Port)), cc.Database, cc.User),
		migrations: ms,
		partitions: make(map[shard.Period]bool),
	}
	p.pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("flush: Postgres ledger at %s: %s", p.where, scrubPassword(err.Error(), dsn))
	}
	pctx, cancel := context.WithTimeout(ctx, cfg.ConnConfig.ConnectTimeout+time.Second)
	defer cancel()
	if err := p.pool.Ping(pctx); err != nil {
		p.pool.Close()
		// NB: %w of a scrubbed error, not %s of its text: the server's
		// SQLSTATE (28P01 a wrong password, 3D000 no such database) stays
		// in the chain for WhatToCheck, whose advice for them was never
		// reached.
		return nil, fmt.Errorf("%w: cannot connect to Postgres at %s: %w: check that the server is up and reachable from here, "+
			"and the user, password, database name and sslmode in the DSN", ErrUnavailable, p.where, scrubbedError{scrubPassword(err.Error(), dsn), err})
	}
	return p, nil
}

// scrubbedError is an error whose message had the DSN's password scrubbed
// (scrubPassword), with the original kept for errors.As (its SQLSTATE).
type scrubbedError struct {
	msg   string
	cause error
}

func (e scrubbedError) Error() string { return e.msg }
func (e scrubbedError) Unwrap() error { return e.cause }

// scrubPassword removes the DSN's password from a message, on top of pgx's
// own best-effort redaction: in a URL's userinfo, after "password=", and
// anywhere else when it is long enough not to match innocent text and is
// not also the user, database or host (a password "1", "tcp" or "postgres"
// replaced everywhere made messages unreadable and showed where it was).
func scrubPassword(msg, dsn string) string {
	if cfg, err := pgconn.ParseConfig(dsn); err == nil && len(cfg.Password) >= minScrubLen &&
		!slices.Contains([]string{cfg.User, cfg.Database, cfg.Host}, cfg.Password) {
		msg = strings.ReplaceAll(msg, cfg.Password, "xxxxx")
	}
	msg = keywordPassword.ReplaceAllString(msg, "password=xxxxx")
	if info := rawUserinfo(dsn); info != "" {
		msg = strings.ReplaceAll(msg, info+"@", "xxxxx@")
	}
	return userinfoPassword.ReplaceAllString(msg, ":xxxxx@")
}

// minScrubLen is the shortest password scrubbed wherever it appears.
const minScrubLen = 6

// closeWait bounds Close.
const closeWait = 2 * time.Second

// Close closes the pool, waiting at most closeWait. pgx says goodbye to a
// connection whose query was cancelled with a cancel request and waits
// up to 15 s for the server: a server that hangs (SIGSTOPped, say) held a
// node's shutdown that long after its final settle gave up, past its
// budget (quotad serve: drain + settle + 10 s). What is left closes in the
// background; the process exits anyway.
func (p *Postgres) Close() error {
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.pool.Close()
	}()
	t := time.NewTimer(closeWait)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		p.log.Warn("the ledger has not answered the close of its connections within "+closeWait.String()+": leaving them to close in the background",
			"ledger", p.where)
	}
	return nil
}

// fail wraps a database error for the caller: errors this package made pass
// through; connection failures wrap ErrUnavailable; the rest get the
// operation's name.
func (p *Postgres) fail(op string, err error) error {
	switch {
	case err == nil:
		return nil
	case ours(err):
		return err
	case pgUnavailable(err):
		return fmt.Errorf("%w: %s at %s: %w", ErrUnavailable, op, p.where, err)
	}
	return fmt.Errorf("flush: %s: %w", op, err)
}

// ours reports whether err already carries one of the package's sentinels.
func ours(err error) bool {
	for _, s := range []error{ErrUnavailable, ErrSchemaTooNew, ErrMarkConflict, ErrNotFound, ErrInvalid} {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// pgUnavailable reports whether err means the server could not be reached
// or the connection broke, rather than that it refused a statement.
func pgUnavailable(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// 08: connection exception; 57P01-03: shutting down or starting;
		// 53300: too many connections.
		return strings.HasPrefix(pgErr.Code, "08") || strings.HasPrefix(pgErr.Code, "57P0") || pgErr.Code == "53300"
	}
	var connErr *pgconn.ConnectError
	var netErr net.Error
	return errors.As(err, &connErr) || errors.As(err, &netErr) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err) ||
		strings.Contains(err.Error(), "conn closed")
}

// pgCode is the SQLSTATE of err, or "".
func pgCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// SQLSTATEs the admin methods turn into sentinels, and those the nodes
// explain or adapt to.
const (
	sqlUniqueViolation       = "23505"
	sqlForeignKeyViolation   = "23503"
	sqlCheckViolation        = "23514"
	sqlUndefinedTable        = "42P01"
	sqlInsufficientPrivilege = "42501"
	sqlReadOnlyTransaction   = "25006"
	sqlQueryCanceled         = "57014" // statement_timeout
	sqlLockNotAvailable      = "55P03" // lock_timeout
	sqlInvalidPassword       = "28P01"
	sqlInvalidAuthorization  = "28000"
	sqlInvalidCatalogName    = "3D000" // no such database
)

// nop is a batch callback that only checks the statement succeeded.
func nop(pgconn.CommandTag) error { return nil }

// sendTx sends b, which must begin with Batch.BeginTx, runs its callbacks,
// and returns the transaction it began for the caller to go on with. The
// caller must Rollback the transaction (deferred) in every case.
func (p *Postgres) sendTx(ctx context.Context, b *pgx.Batch) (pgx.Tx, error) {
	br := p.pool.SendBatch(ctx, b)
	tx := br.Tx()
	return tx, br.Close()
}

// inTx runs the statements queued on b (after BeginTx) and commits.
func (p *Postgres) inTx(ctx context.Context, b *pgx.Batch) error {
	tx, err := p.sendTx(ctx, b)
	defer tx.Rollback(ctx)
	if err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// --- Migrations -------------------------------------------------------------

// Migrate applies the embedded migrations under pg_advisory_lock, one
// transaction per file.
func (p *Postgres) Migrate(ctx context.Context) error {
	conn, err := p.pool.Acquire(ctx)
	if err != nil {
		return p.fail("migrate", err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", migrateLockKey); err != nil {
		return p.fail("migrate: take the migration lock", err)
	}
	defer func() {
		// The lock belongs to the session: if it cannot be released, close
		// the connection rather than hand a locked session back to the pool.
		if _, err := conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", migrateLockKey); err != nil {
			conn.Conn().Close(context.WithoutCancel(ctx))
		}
	}()
	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
		version    integer PRIMARY KEY,
		applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return p.fail("migrate: create schema_migrations", err)
	}
	var applied int
	if err := conn.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM schema_migrations").Scan(&applied); err != nil {
		return p.fail("migrate: read schema version", err)
	}
	todo, err := pending(p.migrations, applied)
	if err != nil {
		return err
	}
	for _, m := range todo {
		if err := p.applyMigration(ctx, conn.Conn(), m); err != nil {
			return p.fail("migrate: apply "+dialectPostgres+"/"+m.name, err)
		}
		p.log.Info("flush: applied migration", "ledger", "postgres", "version", m.version, "file", m.name)
	}
	now, err := p.Clock(ctx)
	if err != nil {
		return err
	}
	cur := shard.PeriodOf(now.UnixNano())
	pers := make([]shard.Period, 0, partitionsAhead+1)
	for i := range partitionsAhead + 1 {
		pers = append(pers, cur+shard.Period(i))
	}
	if _, err := p.createPartitions(ctx, pers); err != nil {
		return p.fail("migrate: create the event partitions of the next months", err)
	}
	return nil
}

func (p *Postgres) applyMigration(ctx context.Context, conn *pgx.Conn, m migration) error {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, m.sql); err != nil { // no arguments: simple protocol, several statements
		return err
	}
	if _, err := tx.Exec(ctx, "INSERT INTO schema_migrations (version) VALUES ($1)", m.version); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// SchemaVersion is the highest applied migration, 0 for an empty database.
func (p *Postgres) SchemaVersion(ctx context.Context) (int, error) {
	var v int
	err := p.pool.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM schema_migrations").Scan(&v)
	if pgCode(err) == sqlUndefinedTable {
		return 0, nil
	}
	return v, p.fail("read schema version", err)
}

// Clock implements Ledger: the server's clock_timestamp() (now() would be
// the transaction's start).
func (p *Postgres) Clock(ctx context.Context) (time.Time, error) {
	var t time.Time
	err := p.pool.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&t)
	return t.UTC(), p.fail("read the server's clock", err)
}

// execTestSQL runs SQL for the conformance suite's corruption tests.
func (p *Postgres) execTestSQL(ctx context.Context, query string) error {
	_, err := p.pool.Exec(ctx, query)
	return err
}

// --- Nodes and alerts -------------------------------------------------------

// RegisterNode records (node, incarnation) if new, refreshes its heartbeat,
// and returns its settled mark.
func (p *Postgres) RegisterNode(ctx context.Context, node, incarnation string) (uint64, error) {
	return p.Heartbeat(ctx, node, incarnation, "", time.Time{})
}

// Heartbeat implements Ledger.
func (p *Postgres) Heartbeat(ctx context.Context, node, incarnation, process string, drainedAt time.Time) (uint64, error) {
	if node == "" || incarnation == "" {
		return 0, fmt.Errorf("%w: register node: node and incarnation must be set", ErrInvalid)
	}
	var seq int64
	err := p.pool.QueryRow(ctx, `INSERT INTO nodes (node_id, incarnation) VALUES ($1, $2)
		ON CONFLICT (node_id, incarnation) DO UPDATE SET heartbeat_at = now(),
			stopped_at = CASE WHEN $4 = '' OR nodes.process IS NULL OR nodes.process = $4 THEN NULL ELSE nodes.stopped_at END,
			settled_through = CASE WHEN $3::timestamptz IS NULL OR NOT ($4 = '' OR nodes.process IS NULL OR nodes.process = $4) THEN nodes.settled_through
				ELSE LEAST(now(), $3::timestamptz) END
		RETURNING settled_seq`, node, incarnation, nullTime(drainedAt), process).Scan(&seq)
	return uint64(seq), p.fail("register node "+node+"/"+incarnation, err)
}

// NodeStopped implements Ledger.
func (p *Postgres) NodeStopped(ctx context.Context, node, incarnation, process string, settled uint64) (bool, error) {
	tag, err := p.pool.Exec(ctx, `UPDATE nodes SET stopped_at = now() WHERE node_id = $1 AND incarnation = $2 AND settled_seq = $3
		AND ($4 = '' OR process IS NULL OR process = $4)`,
		node, incarnation, int64(settled), process)
	return tag.RowsAffected() == 1, p.fail("record that node "+node+"/"+incarnation+" stopped", err)
}

// RecordStart implements Ledger.
func (p *Postgres) RecordStart(ctx context.Context, node, incarnation string, s NodeStart) error {
	tag, err := p.pool.Exec(ctx, `UPDATE nodes SET build = $3, schema_known = $4, process = $5, registered_at = clock_timestamp()
		WHERE node_id = $1 AND incarnation = $2`,
		node, incarnation, s.Build, knownSchema(dialectPostgres), s.Process)
	if err == nil && tag.RowsAffected() != 1 {
		err = fmt.Errorf("%w: node %s/%s is not registered", ErrInvalid, node, incarnation)
	}
	return p.fail("record the start of node "+node+"/"+incarnation, err)
}

// LastStart implements Ledger.
func (p *Postgres) LastStart(ctx context.Context, node string) (NodeStart, error) {
	var s NodeStart
	err := p.pool.QueryRow(ctx, `SELECT coalesce(build, ''), process, incarnation FROM nodes
		WHERE node_id = $1 AND process IS NOT NULL ORDER BY registered_at DESC LIMIT 1`, node).Scan(&s.Build, &s.Process, &s.Incarnation)
	if errors.Is(err, pgx.ErrNoRows) {
		return NodeStart{}, nil
	}
	return s, p.fail("read the last start of node "+node, err)
}

// Nodes lists every (node, incarnation) with its settled mark.
func (p *Postgres) Nodes(ctx context.Context) ([]NodeRow, error) {
	rows, _ := p.pool.Query(ctx, `SELECT node_id, incarnation, settled_seq, heartbeat_at, stopped_at, coalesce(build, ''), coalesce(schema_known, 0),
		settled_through, created_at FROM nodes ORDER BY node_id, incarnation`)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (NodeRow, error) {
		var n NodeRow
		var seq int64
		var stopped, through *time.Time
		err := r.Scan(&n.Node, &n.Incarnation, &seq, &n.Heartbeat, &stopped, &n.Build, &n.SchemaKnown, &through, &n.Created)
		n.Settled, n.Heartbeat, n.Created = uint64(seq), n.Heartbeat.UTC(), n.Created.UTC() // NB: pgx gives the process's zone; SQLite's are UTC
		if stopped != nil {
			n.Stopped = stopped.UTC()
		}
		if through != nil {
			n.SettledThrough = through.UTC()
		}
		return n, err
	})
	return out, p.fail("list nodes", err)
}

// RecordAlert claims an alert once per (account, period, threshold).
func (p *Postgres) RecordAlert(ctx context.Context, a AlertRecord) (bool, error) {
	if err := checkAlertKey(a); err != nil {
		return false, err
	}
	// NB: the second EXISTS sees the rows committed before this statement,
	// so a claim this caller made earlier (its reply lost) counts as won;
	// one that committed while the INSERT waited on its key is looked for
	// below.
	var won bool
	err := p.pool.QueryRow(ctx, `WITH ins AS (
			INSERT INTO alerts (account_id, period, threshold, crossed_at, claim, used, limit_units, state)
			VALUES ($1, $2, $3, $4, $5, $6, $7, 'pending')
			ON CONFLICT (account_id, period, threshold) DO UPDATE SET `+alertRearmSet+`
			WHERE `+alertRearmWhere+` RETURNING 1)
		SELECT EXISTS (SELECT 1 FROM ins) OR EXISTS (SELECT 1 FROM alerts
			WHERE account_id = $1 AND period = $2 AND threshold = $3 AND claim = $5)`,
		a.Account, a.Period.String(), a.Threshold, a.CrossedAt, a.Claim, a.Used, a.Limit).Scan(&won)
	if err == nil && !won {
		// The statement's snapshot is from before it waited on the key: an
		// earlier attempt of this claim (its reply lost) that committed
		// meanwhile is not in it. A statement of its own sees it.
		err = p.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM alerts
			WHERE account_id = $1 AND period = $2 AND threshold = $3 AND claim = $4)`,
			a.Account, a.Period.String(), a.Threshold, a.Claim).Scan(&won)
	}
	if err != nil {
		return false, p.fail("record alert", err)
	}
	return won, nil
}

// FinishAlert records the end of a round of deliveries (see Ledger).
func (p *Postgres) FinishAlert(ctx context.Context, a AlertRecord, state AlertState, attempts int, lastErr string) (bool, error) {
	if err := checkAlertFinish(a, state); err != nil {
		return false, err
	}
	tag, err := p.pool.Exec(ctx, `UPDATE alerts SET state = $5, attempts = attempts + CASE WHEN claim = $8 THEN 0 ELSE $6 END,
			last_error = CASE WHEN $7 = '' THEN last_error ELSE $7 END,
			finished_at = CASE WHEN $5 = 'pending' THEN NULL ELSE now() END,
			claim = CASE WHEN $5 = 'pending' THEN $8 ELSE claim END
		WHERE account_id = $1 AND period = $2 AND threshold = $3 AND state = 'pending'
			AND (claim = $4 OR ($5 IN ('pending', 'delivered') AND claim = $8))`,
		a.Account, a.Period.String(), a.Threshold, a.Claim, string(state), attempts, lastErr, a.Claim+claimEnded)
	if err != nil {
		return false, p.fail("finish alert", err)
	}
	return tag.RowsAffected() == 1, nil
}

// alertColumns are what scanPgAlert and sqliteAlerts read, in their order.
const alertColumns = `account_id, period, threshold, used, limit_units, crossed_at, claim, state,
	created_at, claimed_at, finished_at, attempts, last_error`

func scanPgAlert(r pgx.CollectableRow) (AlertRecord, error) {
	var a AlertRecord
	var period string
	var finished *time.Time
	if err := r.Scan(&a.Account, &period, &a.Threshold, &a.Used, &a.Limit, &a.CrossedAt, &a.Claim, &a.State,
		&a.CreatedAt, &a.ClaimedAt, &finished, &a.Attempts, &a.LastError); err != nil {
		return a, err
	}
	if finished != nil {
		a.FinishedAt = *finished
	}
	var ok bool
	if a.Period, ok = shard.ParsePeriod(period); !ok {
		return a, fmt.Errorf("alert of %s: period %q is not YYYY-MM", a.Account, period)
	}
	return a, nil
}

// TakeOverAlerts claims stale pending alerts and gives up old ones (see Ledger).
func (p *Postgres) TakeOverAlerts(ctx context.Context, claim string, lease, giveUpAfter time.Duration, limit int) (taken, givenUp []AlertRecord, err error) {
	if err := checkTakeOver(claim, lease, giveUpAfter, limit); err != nil {
		return nil, nil, err
	}
	err = pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, `UPDATE alerts SET state = 'given_up', finished_at = now()
			WHERE state = 'pending' AND claimed_at < now() - $1 * interval '1 microsecond'
				AND created_at < now() - $2 * interval '1 microsecond'
			RETURNING `+alertColumns, lease.Microseconds(), giveUpAfter.Microseconds())
		var err error
		if givenUp, err = pgx.CollectRows(rows, scanPgAlert); err != nil {
			return err
		}
		// SKIP LOCKED: a node sweeping at the same time takes other rows,
		// and once this commits their claims are fresh again.
		rows, _ = tx.Query(ctx, `UPDATE alerts a SET claim = $1, claimed_at = now()
			FROM (SELECT account_id, period, threshold FROM alerts
				WHERE state = 'pending' AND claimed_at < now() - $2 * interval '1 microsecond'
				ORDER BY claimed_at LIMIT $3 FOR UPDATE SKIP LOCKED) s
			WHERE a.account_id = s.account_id AND a.period = s.period AND a.threshold = s.threshold
			RETURNING `+prefixed("a.", alertColumns), claim, lease.Microseconds(), limit)
		taken, err = pgx.CollectRows(rows, scanPgAlert)
		return err
	})
	if err != nil {
		return nil, nil, p.fail("take over alerts", err)
	}
	sortAlerts(taken)
	sortAlerts(givenUp)
	return taken, givenUp, nil
}

// MissedAlerts lists thresholds crossed with no alert (see Ledger): the
// monthly grants are read by their id, each threshold as a row of its own.
// Reached is used >= ceil(units * threshold / 100) in integers that cannot
// overflow (node's reached): used * 100 did past 9.2e16, and failed the
// query for every account.
func (p *Postgres) MissedAlerts(ctx context.Context, period shard.Period, thresholds []int, limit int) ([]MissedAlert, error) {
	if err := checkMissed(thresholds, limit); err != nil || len(thresholds) == 0 {
		return nil, err
	}
	rows, _ := p.pool.Query(ctx, `SELECT g.account_id, t.threshold, g.used, g.units
		FROM grants g CROSS JOIN unnest($2::int[]) AS t(threshold)
		WHERE g.grant_id = $1 AND g.units > 0 AND g.used >= (g.units / 100) * t.threshold + ((g.units % 100) * t.threshold + 99) / 100
			AND NOT EXISTS (SELECT 1 FROM alerts a WHERE a.account_id = g.account_id AND a.period = $3 AND a.threshold = t.threshold
				AND `+alertCovers+`)
		ORDER BY g.account_id, t.threshold
		LIMIT $4`, shard.MonthlyGrantID(period), thresholds, period.String(), limit)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (MissedAlert, error) {
		var m MissedAlert
		err := r.Scan(&m.Account, &m.Threshold, &m.Used, &m.Limit)
		return m, err
	})
	return out, p.fail("look for missed alerts of "+period.String(), err)
}

// ResendAlert makes a finished alert pending again (see Ledger).
func (p *Postgres) ResendAlert(ctx context.Context, account string, period shard.Period, threshold int) (AlertRecord, error) {
	var out AlertRecord
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, `SELECT `+alertColumns+` FROM alerts WHERE account_id = $1 AND period = $2 AND threshold = $3 FOR UPDATE`,
			account, period.String(), threshold)
		found, err := pgx.CollectRows(rows, scanPgAlert)
		if err != nil {
			return err
		}
		if err := resendable(found, account, period, threshold); err != nil {
			return err
		}
		rows, _ = tx.Query(ctx, `UPDATE alerts SET state = 'pending', finished_at = NULL, created_at = now(),
				claimed_at = 'epoch', claim = 'resend'
			WHERE account_id = $1 AND period = $2 AND threshold = $3 RETURNING `+alertColumns, account, period.String(), threshold)
		found, err = pgx.CollectRows(rows, scanPgAlert)
		if err == nil {
			out = found[0]
		}
		return err
	})
	return out, p.fail("resend alert", err)
}

// Alerts lists the alerts that match q.
func (p *Postgres) Alerts(ctx context.Context, q AlertQuery) ([]AlertRecord, error) {
	period, state, limit := q.args()
	rows, _ := p.pool.Query(ctx, `SELECT `+alertColumns+` FROM alerts
		WHERE ($1 = '' OR account_id = $1) AND ($2 = '' OR period = $2) AND ($3 = '' OR state = $3)
		ORDER BY account_id, period, threshold LIMIT $4`, q.Account, period, state, limit)
	out, err := pgx.CollectRows(rows, scanPgAlert)
	return out, p.fail("list alerts", err)
}

// --- Admin ------------------------------------------------------------------

// bumpConfigSQL is the first statement of every admin transaction: it bumps
// the config version and, by locking its one row, serializes admin changes.
const bumpConfigSQL = `UPDATE config_version SET version = version + 1 WHERE id = 1`

// admin runs an admin change: the config bump, then queue's statements, in
// one transaction.
func (p *Postgres) admin(ctx context.Context, op string, queue func(b *pgx.Batch)) error {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(bumpConfigSQL).Exec(nop)
	queue(b)
	return p.fail(op, p.inTx(ctx, b))
}

// UpsertPlan creates or changes a plan. A new monthly quota also applies to
// the monthly grants of the current and later periods of the plan's
// accounts (a grant that has not expired), so that what nodes can reserve
// follows the plan they are told about.
func (p *Postgres) UpsertPlan(ctx context.Context, plan snapshot.Plan) error {
	if err := validatePlan(&plan); err != nil {
		return err
	}
	return p.admin(ctx, "upsert plan "+plan.ID, func(b *pgx.Batch) {
		b.Queue(`INSERT INTO plans (plan_id, rate, burst, monthly_quota, hard) VALUES ($1, $2, $3, $4, $5)
			ON CONFLICT (plan_id) DO UPDATE SET rate = excluded.rate, burst = excluded.burst,
				monthly_quota = excluded.monthly_quota, hard = excluded.hard`,
			plan.ID, plan.Rate, plan.Burst, plan.MonthlyQuota, plan.Hard).Exec(nop)
		b.Queue(`UPDATE grants g SET units = $2 FROM accounts a
			WHERE a.plan_id = $1 AND g.account_id = a.account_id AND g.kind = 'monthly' AND g.expires_at > now()`,
			plan.ID, plan.MonthlyQuota).Exec(nop)
	})
}

// UpsertAccount creates an account or moves it to another plan (its
// unexpired monthly grants take the new plan's quota).
func (p *Postgres) UpsertAccount(ctx context.Context, id, plan string) error {
	if id == "" || plan == "" {
		return fmt.Errorf("%w: an account needs an id and a plan", ErrInvalid)
	}
	err := p.admin(ctx, "upsert account "+id, func(b *pgx.Batch) {
		b.Queue(`INSERT INTO accounts (account_id, plan_id) VALUES ($1, $2)
			ON CONFLICT (account_id) DO UPDATE SET plan_id = excluded.plan_id`, id, plan).Exec(nop)
		b.Queue(`UPDATE grants g SET units = p.monthly_quota FROM plans p
			WHERE p.plan_id = $2 AND g.account_id = $1 AND g.kind = 'monthly' AND g.expires_at > now()`, id, plan).Exec(nop)
	})
	if pgCode(err) == sqlForeignKeyViolation {
		return fmt.Errorf("%w: account %q: plan %q does not exist", ErrNotFound, id, plan)
	}
	return err
}

// AddKey stores a key by its hash.
func (p *Postgres) AddKey(ctx context.Context, k snapshot.Key) error {
	if err := validateKey(&k); err != nil {
		return err
	}
	err := p.admin(ctx, "add key "+k.ID, func(b *pgx.Batch) {
		b.Queue(`INSERT INTO api_keys (key_id, key_hash, account_id) VALUES ($1, $2, $3)`, k.ID, k.Hash, k.Account).Exec(nop)
	})
	switch pgCode(err) {
	case sqlForeignKeyViolation:
		return fmt.Errorf("%w: key %q: account %q does not exist", ErrNotFound, k.ID, k.Account)
	case sqlUniqueViolation:
		return fmt.Errorf("%w: key %q: a key with this id or hash is already stored", ErrInvalid, k.ID)
	}
	return err
}

// RevokeKey revokes a key; revoking a revoked key changes nothing.
func (p *Postgres) RevokeKey(ctx context.Context, keyID string) error {
	return p.admin(ctx, "revoke key "+keyID, func(b *pgx.Batch) {
		b.Queue(`UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()) WHERE key_id = $1`, keyID).
			Exec(func(ct pgconn.CommandTag) error {
				if ct.RowsAffected() == 0 {
					return fmt.Errorf("%w: key %q", ErrNotFound, keyID)
				}
				return nil
			})
	})
}

// AddGrant adds a credit grant to an account.
func (p *Postgres) AddGrant(ctx context.Context, account string, g snapshot.Grant) error {
	if err := validateGrant(account, &g); err != nil {
		return err
	}
	err := p.admin(ctx, "add grant "+account+"/"+g.ID, func(b *pgx.Batch) {
		b.Queue(`INSERT INTO grants (account_id, grant_id, kind, units, starts_at, expires_at) VALUES ($1, $2, 'credit', $3, $4, $5)`,
			account, g.ID, g.Units, g.StartsAt, nullTime(g.ExpiresAt)).Exec(nop)
	})
	switch pgCode(err) {
	case sqlForeignKeyViolation:
		return fmt.Errorf("%w: grant %q: account %q does not exist", ErrNotFound, g.ID, account)
	case sqlUniqueViolation:
		return fmt.Errorf("%w: account %q already has a grant %q", ErrInvalid, account, g.ID)
	}
	return err
}

// SetRoutes stores a new version of the route weights and makes it active.
func (p *Postgres) SetRoutes(ctx context.Context, defaultUnits int64, weights map[string]int64) (int64, error) {
	if err := validateRoutes(defaultUnits, weights); err != nil {
		return 0, err
	}
	patterns := make([]string, 0, len(weights))
	units := make([]int64, 0, len(weights))
	for pat, u := range weights {
		patterns = append(patterns, pat)
		units = append(units, u)
	}
	var version int64
	err := p.admin(ctx, "set routes", func(b *pgx.Batch) {
		b.Queue(`UPDATE route_versions SET active = false WHERE active`).Exec(nop)
		b.Queue(`WITH v AS (
				INSERT INTO route_versions (version, default_units, active)
				SELECT coalesce(max(version), 0) + 1, $1, true FROM route_versions
				RETURNING version
			), w AS (
				INSERT INTO route_weights (version, pattern, units)
				SELECT v.version, t.pattern, t.units FROM v, unnest($2::text[], $3::bigint[]) AS t(pattern, units)
			)
			SELECT version FROM v`, defaultUnits, patterns, units).QueryRow(func(r pgx.Row) error { return r.Scan(&version) })
	})
	return version, err
}

// nullTime maps the zero time to NULL ("never").
func nullTime(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

// --- Reads ------------------------------------------------------------------

// Snapshot reads the config in one REPEATABLE READ transaction, so every
// table is seen at the same instant.
func (p *Postgres) Snapshot(ctx context.Context, wall time.Time) (*snapshot.Snapshot, error) {
	s := &snapshot.Snapshot{Routes: snapshot.Routes{Default: 1}}
	accounts := make(map[string]int) // account id -> index in s.Accounts
	_, prev := monthlyUsedPeriods(wall)

	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	b.Queue(`SELECT version FROM config_version WHERE id = 1`).QueryRow(func(r pgx.Row) error { return r.Scan(&s.Version) })
	b.Queue(`SELECT plan_id, rate, burst, monthly_quota, hard FROM plans ORDER BY plan_id`).Query(func(rows pgx.Rows) error {
		var pl snapshot.Plan
		_, err := pgx.ForEachRow(rows, []any{&pl.ID, &pl.Rate, &pl.Burst, &pl.MonthlyQuota, &pl.Hard}, func() error {
			s.Plans = append(s.Plans, pl)
			return nil
		})
		return err
	})
	b.Queue(`SELECT account_id, plan_id FROM accounts ORDER BY account_id`).Query(func(rows pgx.Rows) error {
		var a snapshot.Account
		_, err := pgx.ForEachRow(rows, []any{&a.ID, &a.Plan}, func() error {
			accounts[a.ID] = len(s.Accounts)
			s.Accounts = append(s.Accounts, snapshot.Account{ID: a.ID, Plan: a.Plan})
			return nil
		})
		return err
	})
	b.Queue(`SELECT account_id, grant_id, units, used, starts_at, expires_at FROM grants
		WHERE kind = 'credit' ORDER BY account_id, grant_id`).Query(func(rows pgx.Rows) error {
		var account string
		var g snapshot.Grant
		var expires *time.Time
		_, err := pgx.ForEachRow(rows, []any{&account, &g.ID, &g.Units, &g.Used, &g.StartsAt, &expires}, func() error {
			g.StartsAt = g.StartsAt.UTC()
			g.ExpiresAt = time.Time{}
			if expires != nil {
				g.ExpiresAt = expires.UTC()
			}
			i := accounts[account]
			s.Accounts[i].Credits = append(s.Accounts[i].Credits, g)
			return nil
		})
		return err
	})
	// The previous period, the current one, and any later one a node whose
	// clock ran ahead billed in (a new owner starts the account there: G9).
	b.Queue(`SELECT account_id, grant_id, used FROM grants WHERE kind = 'monthly' AND period >= $1
		ORDER BY account_id, grant_id`, prev.String()).Query(func(rows pgx.Rows) error {
		var account, grant string
		var used int64
		_, err := pgx.ForEachRow(rows, []any{&account, &grant, &used}, func() error {
			a := &s.Accounts[accounts[account]]
			if a.MonthlyUsed == nil {
				a.MonthlyUsed = make(map[string]int64)
			}
			a.MonthlyUsed[grant] = used
			return nil
		})
		return err
	})
	// The settled split by route of the current period and any later one.
	b.Queue(`SELECT account_id, period, route, units FROM usage_monthly WHERE period >= $1 AND units <> 0
		ORDER BY period, account_id, route`, shard.PeriodOf(wall.UnixNano()).String()).Query(func(rows pgx.Rows) error {
		var account, period, route string
		var units int64
		_, err := pgx.ForEachRow(rows, []any{&account, &period, &route, &units}, func() error {
			if i, ok := accounts[account]; ok {
				s.Accounts[i].SetRouteUsed(period, route, units)
			}
			return nil
		})
		return err
	})
	b.Queue(`SELECT key_id, key_hash, account_id FROM api_keys WHERE revoked_at IS NULL ORDER BY key_id`).Query(func(rows pgx.Rows) error {
		var k snapshot.Key
		_, err := pgx.ForEachRow(rows, []any{&k.ID, &k.Hash, &k.Account}, func() error {
			s.Keys = append(s.Keys, k)
			return nil
		})
		return err
	})
	b.Queue(`SELECT v.version, v.default_units, w.pattern, w.units
		FROM route_versions v LEFT JOIN route_weights w ON w.version = v.version
		WHERE v.active ORDER BY w.pattern`).Query(func(rows pgx.Rows) error {
		var pattern *string
		var units *int64
		_, err := pgx.ForEachRow(rows, []any{&s.Routes.Version, &s.Routes.Default, &pattern, &units}, func() error {
			if pattern != nil {
				if s.Routes.Weights == nil {
					s.Routes.Weights = make(map[string]int64)
				}
				s.Routes.Weights[*pattern] = *units
			}
			return nil
		})
		return err
	})
	tx, err := p.sendTx(ctx, b)
	defer tx.Rollback(ctx) // read only: nothing to commit
	if err != nil {
		return nil, p.fail("read snapshot", err)
	}
	return buildSnapshot(s)
}

// accountExistsSQL is queued before reads of one account, to tell "no
// such account" from "nothing yet".
const accountExistsSQL = `SELECT EXISTS (SELECT 1 FROM accounts WHERE account_id = $1)`

func queueAccountExists(b *pgx.Batch, account string) {
	b.Queue(accountExistsSQL, account).QueryRow(func(r pgx.Row) error {
		var ok bool
		if err := r.Scan(&ok); err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("%w: account %q", ErrNotFound, account)
		}
		return nil
	})
}

// Usage sums an account's daily aggregates over a period, by route.
func (p *Postgres) Usage(ctx context.Context, account string, period shard.Period) (AccountUsage, error) {
	u := AccountUsage{Account: account, Period: period, ByRoute: make(map[string]int64)}
	b := &pgx.Batch{}
	queueAccountExists(b, account)
	b.Queue(`SELECT route, sum(units)::bigint FROM usage_daily
		WHERE account_id = $1 AND day >= $2::date AND day < $3::date GROUP BY route`,
		account, time.Unix(0, period.Start()).UTC(), time.Unix(0, period.End()).UTC()).Query(func(rows pgx.Rows) error {
		var route string
		var units int64
		_, err := pgx.ForEachRow(rows, []any{&route, &units}, func() error {
			u.ByRoute[route] = units
			u.Units += units
			return nil
		})
		return err
	})
	err := p.pool.SendBatch(ctx, b).Close()
	return u, p.fail("read usage of "+account, err)
}

// pgBillingSQL reads a page of BillingUsage in one statement: the page's
// accounts ($1 after, $5 at most) with usage on the period's days ($2, $3)
// or its monthly grant ($4), then per account its usage by route, that
// grant, and the event log's unrefunded units of the period and what
// credit grants paid of them ($6: the period, for what was pruned of it).
// The events are read from the period's partition only, by the partition's
// primary key (account first).
const pgBillingSQL = `WITH page AS (
	SELECT a.account_id, a.plan_id, p.hard
	FROM accounts a JOIN plans p ON p.plan_id = a.plan_id
	WHERE a.account_id > $1
		AND (EXISTS (SELECT 1 FROM usage_daily u WHERE u.account_id = a.account_id AND u.day >= $2::date AND u.day < $3::date)
			OR EXISTS (SELECT 1 FROM grants g WHERE g.account_id = a.account_id AND g.grant_id = $4))
	ORDER BY a.account_id
	LIMIT $5
)
SELECT page.account_id, page.plan_id, page.hard, coalesce(r.units, 0), coalesce(r.by_route, '{}'::jsonb),
	g.units IS NOT NULL, coalesce(g.units, 0), coalesce(g.used, 0), coalesce(ev.units, 0), coalesce(ev.credits, 0)
FROM page
LEFT JOIN LATERAL (
	SELECT sum(x.units)::bigint AS units, jsonb_object_agg(x.route, x.units) FILTER (WHERE x.units <> 0) AS by_route
	FROM (SELECT route, sum(units)::bigint AS units FROM usage_daily
		WHERE account_id = page.account_id AND day >= $2::date AND day < $3::date GROUP BY route) x
) r ON true
LEFT JOIN grants g ON g.account_id = page.account_id AND g.grant_id = $4
LEFT JOIN LATERAL (
	SELECT sum(x.units)::bigint AS units, sum(x.credits)::bigint AS credits FROM (
		SELECT e.units, (SELECT coalesce(sum(al.units), 0) FROM unnest(e.grant_ids, e.grant_units) AS al(grant_id, units)
			WHERE NOT starts_with(al.grant_id, 'm:')) AS credits
		FROM events e
		WHERE e.account_id = page.account_id AND e.period_start = $2::date AND NOT e.refunded
		UNION ALL
		SELECT pa.units, CASE WHEN starts_with(pa.grant_id, 'm:') THEN 0 ELSE pa.units END
		FROM pruned_allocations pa WHERE pa.account_id = page.account_id AND pa.period = $6
	) x
) ev ON true
ORDER BY page.account_id`

// BillingUsage reads a page of a period's usage by account.
func (p *Postgres) BillingUsage(ctx context.Context, q BillingQuery) (BillingPage, error) {
	limit, err := q.limit()
	if err != nil {
		return BillingPage{}, err
	}
	start, end := time.Unix(0, q.Period.Start()).UTC(), time.Unix(0, q.Period.End()).UTC()
	rows, _ := p.pool.Query(ctx, pgBillingSQL, q.After, start, end, shard.MonthlyGrantID(q.Period), limit+1, q.Period.String())
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (BillingRow, error) {
		var b BillingRow
		var evUnits, evCredits int64
		err := r.Scan(&b.Account, &b.Plan, &b.Hard, &b.Units, &b.ByRoute, &b.Monthly, &b.Quota, &b.QuotaUsed, &evUnits, &evCredits)
		b.finish(evUnits, evCredits)
		return b, err
	})
	if err != nil {
		return BillingPage{}, p.fail("read the usage of "+q.Period.String(), err)
	}
	return billingPage(out, limit), nil
}

// Grants lists an account's grants.
func (p *Postgres) Grants(ctx context.Context, account string) ([]GrantRow, error) {
	var out []GrantRow
	b := &pgx.Batch{}
	queueAccountExists(b, account)
	b.Queue(`SELECT account_id, grant_id, kind = 'monthly', coalesce(period, ''), units, used, reserved, starts_at, expires_at
		FROM grants WHERE account_id = $1 ORDER BY grant_id`, account).Query(func(rows pgx.Rows) error {
		var err error
		out, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (GrantRow, error) {
			var g GrantRow
			var expires *time.Time
			err := r.Scan(&g.Account, &g.Grant, &g.Monthly, &g.Period, &g.Units, &g.Used, &g.Reserved, &g.StartsAt, &expires)
			g.StartsAt = g.StartsAt.UTC()
			if expires != nil {
				g.ExpiresAt = expires.UTC()
			}
			return g, err
		})
		return err
	})
	err := p.pool.SendBatch(ctx, b).Close()
	return out, p.fail("read grants of "+account, err)
}

// Reconcile compares the counters with the event log (G6), in one
// REPEATABLE READ transaction. Usage is compared by UTC month of the charge
// (the month of the day its aggregate is on). Batches settled with the event
// log off count without leaving events, so their accounts show as Diff: the
// log cannot vouch for them.
func (p *Postgres) Reconcile(ctx context.Context, each func(ReconcileRow) error) error {
	collect := func(kind string) func(pgx.Rows) error {
		return func(rows pgx.Rows) error {
			r := ReconcileRow{Kind: kind}
			_, err := pgx.ForEachRow(rows, []any{&r.Account, &r.Scope, &r.Counter, &r.Events}, func() error {
				r.Diff = r.Counter != r.Events
				return each(r)
			})
			return err
		}
	}
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	b.Queue(`WITH ev AS (
			SELECT account_id, grant_id, sum(units)::bigint AS units FROM (
				SELECT e.account_id, a.grant_id, a.units
				FROM events e, unnest(e.grant_ids, e.grant_units) AS a(grant_id, units)
				WHERE NOT e.refunded
				UNION ALL SELECT account_id, grant_id, units FROM pruned_allocations
			) x
			GROUP BY 1, 2
		)
		SELECT coalesce(g.account_id, ev.account_id), coalesce(g.grant_id, ev.grant_id), coalesce(g.used, 0), coalesce(ev.units, 0)
		FROM grants g FULL JOIN ev ON ev.account_id = g.account_id AND ev.grant_id = g.grant_id
		ORDER BY 1, 2`).Query(collect("grant"))
	b.Queue(`WITH u AS (
			SELECT account_id, to_char(day, 'YYYY-MM') AS period, sum(units)::bigint AS units FROM usage_daily GROUP BY 1, 2
		), ev AS (
			SELECT account_id, to_char(charged_at AT TIME ZONE 'UTC', 'YYYY-MM') AS period, sum(units)::bigint AS units
			FROM events WHERE NOT refunded GROUP BY 1, 2
		)
		SELECT coalesce(u.account_id, ev.account_id), coalesce(u.period, ev.period), coalesce(u.units, 0), coalesce(ev.units, 0)
		FROM u FULL JOIN ev ON ev.account_id = u.account_id AND ev.period = u.period
		WHERE coalesce(u.period, ev.period) >= (SELECT coalesce(max(pruned_before), '') FROM event_retention)
		ORDER BY 1, 2`).Query(collect("usage"))
	tx, err := p.sendTx(ctx, b)
	defer tx.Rollback(ctx) // read only
	return p.fail("reconcile", err)
}

// Events lists an account's event log, tombstones included.
func (p *Postgres) Events(ctx context.Context, account string) ([]EventRow, error) {
	rows, _ := p.pool.Query(ctx, `SELECT account_id, event_id, key_id, route, units, charged_at, period, node_id, incarnation, seq, refunded, tombstone
		FROM events WHERE account_id = $1 ORDER BY charged_at, node_id, incarnation, seq`, account)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (EventRow, error) {
		var e EventRow
		var seq int64
		err := r.Scan(&e.Account, &e.EventID, &e.Key, &e.Route, &e.Units, &e.ChargedAt, &e.Period, &e.Node, &e.Incarnation, &seq, &e.Refunded, &e.Tombstone)
		e.Seq, e.ChargedAt = uint64(seq), e.ChargedAt.UTC()
		return e, err
	})
	return out, p.fail("read events of "+account, err)
}
