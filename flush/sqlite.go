package flush

// SQLite is the embedded ledger for one machine (quotad demo, single-node
// installs), on modernc.org/sqlite: pure Go, nothing to install. Dialect
// notes:
//
//   - SQLite has one writer. Every write transaction holds SQLite.writeSem
//     and begins with BEGIN IMMEDIATE (the DSN's _txlock), so writers queue
//     here instead of failing with SQLITE_BUSY, each only until its
//     context ends; readers use deferred read-only transactions and, in WAL
//     mode, never wait for the writer.
//   - The journal is WAL with synchronous=FULL: a commit is on disk when
//     Commit returns, like a Postgres commit.
//   - Statements run one per row inside the transaction: in-process round
//     trips cost microseconds, so SettleResult.RoundTrips grows with the batch
//     here (it counts statements), unlike on Postgres.
//   - Times are INTEGER Unix nanoseconds, days TEXT 'YYYY-MM-DD', an event's
//     allocations JSON text. The event log is not partitioned: duplicates are
//     caught across months too.
//   - ":memory:" gives a private in-memory ledger (tests): one connection,
//     since each SQLite connection to ":memory:" is a database of its own.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"modernc.org/sqlite"

	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// SQLiteOptions configures OpenSQLite. The zero value is ready to use.
type SQLiteOptions struct {
	// Logger receives migrations applied. If nil, nothing is logged.
	Logger *slog.Logger
	// BusyTimeout bounds how long a statement waits for a lock another
	// process holds; 0 means 10 s.
	BusyTimeout time.Duration
	// Now reads the clock for heartbeats and timestamps the ledger writes
	// itself (created_at, refunded_at). If nil, time.Now.
	Now func() time.Time
}

// SQLite is the Ledger on SQLite. Its methods are safe for concurrent use.
type SQLite struct {
	db         *sql.DB
	path       string
	log        *slog.Logger
	now        func() time.Time
	migrations []migration

	// writeSem holds a token for every write transaction: SQLite has one
	// writer, and queueing here beats retrying on SQLITE_BUSY. A channel,
	// not a mutex, so that a writer waits only as long as its context
	// lets it: behind a settle stuck on a lock another process held, a
	// charge's reservation waited 15 s, past its 2 s bound.
	writeSem chan struct{}
}

// lockWrite takes the writer's token, or fails when ctx ends first; the
// caller releases it with unlockWrite.
func (s *SQLite) lockWrite(ctx context.Context) error {
	select {
	case s.writeSem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("waiting for the ledger's other writes (SQLite has one writer): %w", ctx.Err())
	}
}

func (s *SQLite) unlockWrite() { <-s.writeSem }

var _ Ledger = (*SQLite)(nil)

// checkSQLitePath refuses a path OpenSQLite cannot use as a file name in
// the driver's URI: empty, holding ? or # (they end a URI's path), or
// starting with // (sqlite://x/ledger.db: a URL naming host x, or by
// another convention the relative path x/ledger.db; either way not what
// it looks like).
func checkSQLitePath(path string) error {
	switch {
	case path == "" || strings.ContainsAny(path, "?#"):
		return fmt.Errorf("%w: SQLite ledger path %q: want sqlite:/path/to/ledger.db, a file path without ? or #", ErrInvalid, path)
	case strings.HasPrefix(path, "//"):
		return fmt.Errorf("%w: SQLite ledger path %q: want sqlite:/path/to/ledger.db, with one slash after the colon (sqlite://... reads as a URL naming a host), or sqlite:relative/ledger.db", ErrInvalid, path)
	}
	return nil
}

// sqliteURIPath is path as the file part of the driver's file: URI, where
// SQLite decodes %XX: a % stands for itself. (? and # are refused.)
func sqliteURIPath(path string) string { return strings.ReplaceAll(path, "%", "%25") }

// OpenSQLite opens (creating if needed) the ledger file at path, or a
// private in-memory ledger for ":memory:". It does not migrate.
func OpenSQLite(ctx context.Context, path string, opts SQLiteOptions) (*SQLite, error) {
	ms, err := loadMigrations(dialectSQLite)
	if err != nil {
		return nil, err
	}
	if err := checkSQLitePath(path); err != nil {
		return nil, err
	}
	busy := opts.BusyTimeout
	if busy <= 0 {
		busy = 10 * time.Second
	}
	params := fmt.Sprintf("_pragma=busy_timeout(%d)&_pragma=foreign_keys(1)&_pragma=synchronous(FULL)&_txlock=immediate", busy.Milliseconds())
	dsn := "file:" + sqliteURIPath(path) + "?" + params + "&_pragma=journal_mode(WAL)"
	if path == ":memory:" {
		dsn = "file::memory:?" + params
	}
	if path != ":memory:" {
		if fi, err := os.Stat(path); err == nil && fi.IsDir() {
			return nil, fmt.Errorf("%w: the SQLite ledger path %s is a directory: --ledger names the ledger's file (sqlite:%s)", ErrInvalid, path, filepath.Join(path, "ledger.db"))
		}
		// A new ledger is created readable by this user only: it holds
		// the API keys' hashes, the plans and every account's usage.
		// SQLite gives its -wal and -shm files the database's mode.
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		switch {
		case err == nil:
			f.Close()
		case errors.Is(err, fs.ErrExist) && syscall.Access(path, 2 /* W_OK */) != nil:
			// SQLite opens it and fails every write with "attempt to write
			// a readonly database", and the advice was about the directory.
			// Unavailable, as a missing directory: an operator may fix
			// either while the node waits (a volume mounted late).
			return nil, fmt.Errorf("%w: the SQLite ledger at %s is read-only for this user: make the file (and its -wal and -shm files) writable by the user quotad runs as",
				ErrUnavailable, path)
		case !errors.Is(err, fs.ErrExist):
			return nil, fmt.Errorf("%w: cannot create the SQLite ledger at %s: %v: check that its directory exists and is writable by this user",
				ErrUnavailable, path, err)
		}
	}
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, fmt.Errorf("flush: open SQLite ledger %s: %w", path, err)
	}
	if path == ":memory:" {
		db.SetMaxOpenConns(1)
	} else {
		db.SetMaxOpenConns(8)
		db.SetMaxIdleConns(8)
	}
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		if c := sqliteCode(err) & 0xff; c == sqliteNotADB || c == sqliteCorrupt {
			// Waiting will not fix it: a node refuses to start on it.
			return nil, fmt.Errorf("%w: the SQLite ledger at %s is not a database, or is damaged (%v): check that --ledger names the ledger's file and not another one; restore a damaged ledger from its backup",
				ErrInvalid, path, err)
		}
		return nil, fmt.Errorf("%w: cannot open the SQLite ledger at %s: %v: check that its directory exists and is writable by this user",
			ErrUnavailable, path, err)
	}
	now := opts.Now
	if now == nil {
		now = time.Now
	}
	return &SQLite{db: db, path: path, log: orDiscard(opts.Logger), now: now, migrations: ms, writeSem: make(chan struct{}, 1)}, nil
}

// SQLiteSchemaVersion reads the schema version of the SQLite ledger file at
// path without changing the file: opened read-only, so that neither its
// journal mode nor its size changes (a command that only reads a ledger
// used to turn another program's database into WAL mode, and an empty
// file into a database, before it refused them). It is 0 with a nil error
// for a file that is no migrated ledger (empty, or a database without
// quotaring's schema), and an error for a missing file or one that is not
// an SQLite database.
func SQLiteSchemaVersion(ctx context.Context, path string) (int, error) {
	if err := checkSQLitePath(path); err != nil {
		return 0, err
	}
	if _, err := os.Stat(path); err != nil {
		return 0, fmt.Errorf("%w: no SQLite ledger at %s: %v", ErrInvalid, path, err)
	}
	db, err := sql.Open("sqlite", "file:"+sqliteURIPath(path)+"?mode=ro&_pragma=busy_timeout(5000)")
	if err != nil {
		return 0, fmt.Errorf("flush: open SQLite ledger %s: %w", path, err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	var v int
	err = db.QueryRowContext(ctx, "SELECT coalesce(max(version), 0) FROM schema_migrations").Scan(&v)
	switch {
	case err != nil && strings.Contains(err.Error(), "no such table"):
		return 0, nil
	case err != nil:
		if c := sqliteCode(err) & 0xff; c == sqliteNotADB || c == sqliteCorrupt {
			return 0, fmt.Errorf("%w: the SQLite ledger at %s is not a database, or is damaged (%v): check that --ledger names the ledger's file", ErrInvalid, path, err)
		}
		return 0, fmt.Errorf("flush: read the schema version of the SQLite ledger at %s: %w", path, err)
	}
	return v, nil
}

// Close closes the database.
func (s *SQLite) Close() error { return s.db.Close() }

// SQLite result codes the ledger tells apart (extended codes: primary | sub<<8).
const (
	sqliteBusy         = 5
	sqliteLocked       = 6
	sqliteReadOnly     = 8
	sqliteIOErr        = 10
	sqliteCorrupt      = 11
	sqliteFull         = 13
	sqliteCantOpen     = 14
	sqliteNotADB       = 26
	sqliteConstraintFK = 19 | 3<<8
	sqliteConstraintPK = 19 | 6<<8
	sqliteConstraintUq = 19 | 8<<8
)

func sqliteCode(err error) int {
	var e *sqlite.Error
	if errors.As(err, &e) {
		return e.Code()
	}
	return 0
}

// fail wraps an error as Postgres.fail does.
func (s *SQLite) fail(op string, err error) error {
	if err == nil || ours(err) {
		return err
	}
	switch sqliteCode(err) & 0xff {
	case sqliteBusy, sqliteLocked, sqliteReadOnly, sqliteIOErr, sqliteFull, sqliteCantOpen:
		return fmt.Errorf("%w: %s in %s: %w", ErrUnavailable, op, s.path, err)
	}
	return fmt.Errorf("flush: %s: %w", op, err)
}

// write runs fn in a write transaction (BEGIN IMMEDIATE) and commits.
func (s *SQLite) write(ctx context.Context, fn func(tx *sql.Tx) error) error {
	if err := s.lockWrite(ctx); err != nil {
		return err
	}
	defer s.unlockWrite()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit()
}

// read runs fn in a read-only transaction, which sees one snapshot.
func (s *SQLite) read(ctx context.Context, fn func(tx *sql.Tx) error) error {
	tx, err := s.db.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
	if err != nil {
		return err
	}
	defer tx.Rollback()
	return fn(tx)
}

// --- Migrations -------------------------------------------------------------

// Migrate applies the embedded migrations, each in a BEGIN IMMEDIATE
// transaction, which is the lock: the version is read again inside it.
func (s *SQLite) Migrate(ctx context.Context) error {
	// A database of another program's (tables, and no schema_migrations):
	// migrating added the ledger's tables to it, and exit 0.
	var foreign []string
	rows, err := s.db.QueryContext(ctx, "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")
	if err != nil {
		return s.fail("migrate: list the tables", err)
	}
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			rows.Close()
			return s.fail("migrate: list the tables", err)
		}
		if name == "schema_migrations" {
			foreign = nil
			break
		}
		foreign = append(foreign, name)
	}
	rows.Close()
	if len(foreign) > 0 {
		return fmt.Errorf("%w: the SQLite file %s holds tables of another program (%s) and no quotaring schema: it is not a ledger; give --ledger a new file (or the ledger's)",
			ErrInvalid, s.path, strings.Join(foreign[:min(len(foreign), 5)], ", "))
	}
	if _, err := s.db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
		version    INTEGER PRIMARY KEY,
		applied_at INTEGER NOT NULL)`); err != nil {
		return s.fail("migrate: create schema_migrations", err)
	}
	for {
		var applied int
		var todo []migration
		err := s.write(ctx, func(tx *sql.Tx) error {
			if err := tx.QueryRowContext(ctx, "SELECT coalesce(max(version), 0) FROM schema_migrations").Scan(&applied); err != nil {
				return err
			}
			var err error
			if todo, err = pending(s.migrations, applied); err != nil || len(todo) == 0 {
				return err
			}
			m := todo[0]
			if _, err := tx.ExecContext(ctx, m.sql); err != nil {
				return fmt.Errorf("apply %s/%s: %w", dialectSQLite, m.name, err)
			}
			_, err = tx.ExecContext(ctx, "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)", m.version, s.now().UnixNano())
			return err
		})
		if err != nil {
			return s.fail("migrate", err)
		}
		if len(todo) == 0 {
			return nil
		}
		s.log.Info("flush: applied migration", "ledger", "sqlite", "version", todo[0].version, "file", todo[0].name)
	}
}

// Clock implements Ledger: this machine's clock, which an embedded ledger
// shares with the node (not Options.Now, which is the node's own reading).
func (s *SQLite) Clock(ctx context.Context) (time.Time, error) {
	if err := ctx.Err(); err != nil {
		return time.Time{}, err
	}
	return time.Now().UTC(), nil
}

// SchemaVersion is the highest applied migration, 0 for an empty database.
func (s *SQLite) SchemaVersion(ctx context.Context) (int, error) {
	var v int
	err := s.db.QueryRowContext(ctx, "SELECT coalesce(max(version), 0) FROM schema_migrations").Scan(&v)
	if err != nil && strings.Contains(err.Error(), "no such table") {
		return 0, nil
	}
	return v, s.fail("read schema version", err)
}

// execTestSQL runs SQL for the conformance suite's corruption tests.
func (s *SQLite) execTestSQL(ctx context.Context, query string) error {
	if err := s.lockWrite(ctx); err != nil {
		return err
	}
	defer s.unlockWrite()
	_, err := s.db.ExecContext(ctx, query)
	return err
}

// --- Nodes and alerts -------------------------------------------------------

// RegisterNode records (node, incarnation) if new, refreshes its heartbeat,
// and returns its settled mark.
func (s *SQLite) RegisterNode(ctx context.Context, node, incarnation string) (uint64, error) {
	return s.Heartbeat(ctx, node, incarnation, "", time.Time{})
}

// Heartbeat implements Ledger.
func (s *SQLite) Heartbeat(ctx context.Context, node, incarnation, process string, drainedAt time.Time) (uint64, error) {
	if node == "" || incarnation == "" {
		return 0, fmt.Errorf("%w: register node: node and incarnation must be set", ErrInvalid)
	}
	var seq int64
	err := s.write(ctx, func(tx *sql.Tx) error {
		now := s.now().UnixNano()
		return tx.QueryRowContext(ctx, `INSERT INTO nodes (node_id, incarnation, heartbeat_at, created_at) VALUES (?, ?, ?, ?)
			ON CONFLICT (node_id, incarnation) DO UPDATE SET heartbeat_at = excluded.heartbeat_at,
				stopped_at = CASE WHEN ? = '' OR process IS NULL OR process = ? THEN NULL ELSE stopped_at END,
				settled_through = CASE WHEN ? IS NULL OR NOT (? = '' OR process IS NULL OR process = ?) THEN settled_through
					ELSE min(excluded.heartbeat_at, ?) END
			RETURNING settled_seq`, node, incarnation, now, now, process, process, nullNanos(drainedAt), process, process, nullNanos(drainedAt)).Scan(&seq)
	})
	return uint64(seq), s.fail("register node "+node+"/"+incarnation, err)
}

// NodeStopped implements Ledger.
func (s *SQLite) NodeStopped(ctx context.Context, node, incarnation, process string, settled uint64) (bool, error) {
	var n int64
	err := s.write(ctx, func(tx *sql.Tx) error {
		r, err := tx.ExecContext(ctx, `UPDATE nodes SET stopped_at = ? WHERE node_id = ? AND incarnation = ? AND settled_seq = ?
			AND (? = '' OR process IS NULL OR process = ?)`,
			s.now().UnixNano(), node, incarnation, int64(settled), process, process)
		if err == nil {
			n, err = r.RowsAffected()
		}
		return err
	})
	return n == 1, s.fail("record that node "+node+"/"+incarnation+" stopped", err)
}

// RecordStart implements Ledger.
func (s *SQLite) RecordStart(ctx context.Context, node, incarnation string, st NodeStart) error {
	err := s.write(ctx, func(tx *sql.Tx) error {
		r, err := tx.ExecContext(ctx, `UPDATE nodes SET build = ?, schema_known = ?, process = ?, registered_at = ? WHERE node_id = ? AND incarnation = ?`,
			st.Build, knownSchema(dialectSQLite), st.Process, s.now().UnixNano(), node, incarnation)
		var n int64
		if err == nil {
			n, err = r.RowsAffected()
		}
		if err == nil && n != 1 {
			err = fmt.Errorf("%w: node %s/%s is not registered", ErrInvalid, node, incarnation)
		}
		return err
	})
	return s.fail("record the start of node "+node+"/"+incarnation, err)
}

// LastStart implements Ledger.
func (s *SQLite) LastStart(ctx context.Context, node string) (NodeStart, error) {
	var st NodeStart
	err := s.read(ctx, func(tx *sql.Tx) error {
		err := tx.QueryRowContext(ctx, `SELECT coalesce(build, ''), process, incarnation FROM nodes
			WHERE node_id = ? AND process IS NOT NULL ORDER BY registered_at DESC LIMIT 1`, node).Scan(&st.Build, &st.Process, &st.Incarnation)
		if errors.Is(err, sql.ErrNoRows) {
			return nil
		}
		return err
	})
	return st, s.fail("read the last start of node "+node, err)
}

// Nodes lists every (node, incarnation) with its settled mark.
func (s *SQLite) Nodes(ctx context.Context) ([]NodeRow, error) {
	var out []NodeRow
	err := s.read(ctx, func(tx *sql.Tx) error {
		return queryEach(ctx, tx, `SELECT node_id, incarnation, settled_seq, heartbeat_at, stopped_at, coalesce(build, ''), coalesce(schema_known, 0),
			settled_through, created_at FROM nodes ORDER BY node_id, incarnation`, nil,
			func(scan func(...any) error) error {
				var n NodeRow
				var seq, hb, created int64
				var stopped, through sql.NullInt64
				if err := scan(&n.Node, &n.Incarnation, &seq, &hb, &stopped, &n.Build, &n.SchemaKnown, &through, &created); err != nil {
					return err
				}
				n.Settled, n.Heartbeat, n.Created = uint64(seq), time.Unix(0, hb).UTC(), time.Unix(0, created).UTC()
				if stopped.Valid {
					n.Stopped = time.Unix(0, stopped.Int64).UTC()
				}
				if through.Valid {
					n.SettledThrough = time.Unix(0, through.Int64).UTC()
				}
				out = append(out, n)
				return nil
			})
	})
	return out, s.fail("list nodes", err)
}

// RecordAlert claims an alert once per (account, period, threshold).
func (s *SQLite) RecordAlert(ctx context.Context, a AlertRecord) (bool, error) {
	if err := checkAlertKey(a); err != nil {
		return false, err
	}
	var n int64
	err := s.write(ctx, func(tx *sql.Tx) error {
		now := s.now().UnixNano()
		r, err := tx.ExecContext(ctx, `INSERT INTO alerts (account_id, period, threshold, crossed_at, claim, used, limit_units, state, created_at, claimed_at)
			VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?)
			ON CONFLICT (account_id, period, threshold) DO UPDATE SET `+alertRearmSet+`
			WHERE `+alertRearmWhere,
			a.Account, a.Period.String(), a.Threshold, a.CrossedAt.UnixNano(), a.Claim, a.Used, a.Limit, now, now)
		if err == nil {
			n, err = r.RowsAffected()
		}
		if err == nil && n == 0 { // this caller's own earlier claim (its reply lost) still counts as won
			err = tx.QueryRowContext(ctx, `SELECT count(*) FROM alerts WHERE account_id = ? AND period = ? AND threshold = ? AND claim = ?`,
				a.Account, a.Period.String(), a.Threshold, a.Claim).Scan(&n)
		}
		return err
	})
	return n == 1, s.fail("record alert", err)
}

// MissedAlerts lists thresholds crossed with no alert (see Ledger).
func (s *SQLite) MissedAlerts(ctx context.Context, period shard.Period, thresholds []int, limit int) ([]MissedAlert, error) {
	if err := checkMissed(thresholds, limit); err != nil || len(thresholds) == 0 {
		return nil, err
	}
	ts, _ := json.Marshal(thresholds)
	var out []MissedAlert
	err := s.read(ctx, func(tx *sql.Tx) error {
		return queryEach(ctx, tx, `SELECT g.account_id, t.value, g.used, g.units
			FROM grants g, json_each(?) t
			WHERE g.grant_id = ? AND g.units > 0 AND g.used >= (g.units / 100) * t.value + ((g.units % 100) * t.value + 99) / 100
				AND NOT EXISTS (SELECT 1 FROM alerts a WHERE a.account_id = g.account_id AND a.period = ? AND a.threshold = t.value
					AND `+alertCovers+`)
			ORDER BY g.account_id, t.value
			LIMIT ?`, []any{string(ts), shard.MonthlyGrantID(period), period.String(), limit},
			func(scan func(...any) error) error {
				var m MissedAlert
				err := scan(&m.Account, &m.Threshold, &m.Used, &m.Limit)
				out = append(out, m)
				return err
			})
	})
	return out, s.fail("look for missed alerts of "+period.String(), err)
}

// FinishAlert records the end of a round of deliveries (see Ledger).
func (s *SQLite) FinishAlert(ctx context.Context, a AlertRecord, state AlertState, attempts int, lastErr string) (bool, error) {
	if err := checkAlertFinish(a, state); err != nil {
		return false, err
	}
	var n int64
	err := s.write(ctx, func(tx *sql.Tx) error {
		var finished any
		if state != AlertPending {
			finished = s.now().UnixNano()
		}
		ended := a.Claim + claimEnded
		r, err := tx.ExecContext(ctx, `UPDATE alerts SET state = ?, attempts = attempts + CASE WHEN claim = ? THEN 0 ELSE ? END,
				last_error = CASE WHEN ? = '' THEN last_error ELSE ? END, finished_at = ?,
				claim = CASE WHEN ? = 'pending' THEN ? ELSE claim END
			WHERE account_id = ? AND period = ? AND threshold = ? AND state = 'pending'
				AND (claim = ? OR (? IN ('pending', 'delivered') AND claim = ?))`,
			string(state), ended, attempts, lastErr, lastErr, finished, string(state), ended,
			a.Account, a.Period.String(), a.Threshold, a.Claim, string(state), ended)
		if err == nil {
			n, err = r.RowsAffected()
		}
		return err
	})
	return n == 1, s.fail("finish alert", err)
}

// sqliteAlerts runs an alert query and scans its rows (alertColumns).
func sqliteAlerts(ctx context.Context, tx *sql.Tx, query string, args ...any) ([]AlertRecord, error) {
	var out []AlertRecord
	err := queryEach(ctx, tx, query, args, func(scan func(...any) error) error {
		var a AlertRecord
		var period string
		var crossed, created, claimed int64
		var finished sql.NullInt64
		if err := scan(&a.Account, &period, &a.Threshold, &a.Used, &a.Limit, &crossed, &a.Claim, &a.State,
			&created, &claimed, &finished, &a.Attempts, &a.LastError); err != nil {
			return err
		}
		var ok bool
		if a.Period, ok = shard.ParsePeriod(period); !ok {
			return fmt.Errorf("alert of %s: period %q is not YYYY-MM", a.Account, period)
		}
		a.CrossedAt, a.CreatedAt, a.ClaimedAt = time.Unix(0, crossed).UTC(), time.Unix(0, created).UTC(), time.Unix(0, claimed).UTC()
		if finished.Valid {
			a.FinishedAt = time.Unix(0, finished.Int64).UTC()
		}
		out = append(out, a)
		return nil
	})
	return out, err
}

// TakeOverAlerts claims stale pending alerts and gives up old ones (see Ledger).
func (s *SQLite) TakeOverAlerts(ctx context.Context, claim string, lease, giveUpAfter time.Duration, limit int) (taken, givenUp []AlertRecord, err error) {
	if err := checkTakeOver(claim, lease, giveUpAfter, limit); err != nil {
		return nil, nil, err
	}
	err = s.write(ctx, func(tx *sql.Tx) error {
		now := s.now().UnixNano()
		stale, old := now-lease.Nanoseconds(), now-giveUpAfter.Nanoseconds()
		var err error
		givenUp, err = sqliteAlerts(ctx, tx, `UPDATE alerts SET state = 'given_up', finished_at = ?
			WHERE state = 'pending' AND claimed_at < ? AND created_at < ? RETURNING `+alertColumns, now, stale, old)
		if err != nil {
			return err
		}
		// One writer at a time: no other sweep sees these rows stale once this commits.
		taken, err = sqliteAlerts(ctx, tx, `UPDATE alerts SET claim = ?, claimed_at = ?
			WHERE rowid IN (SELECT rowid FROM alerts WHERE state = 'pending' AND claimed_at < ? ORDER BY claimed_at LIMIT ?)
			RETURNING `+alertColumns, claim, now, stale, limit)
		return err
	})
	if err != nil {
		return nil, nil, s.fail("take over alerts", err)
	}
	sortAlerts(taken)
	sortAlerts(givenUp)
	return taken, givenUp, nil
}

// ResendAlert makes a finished alert pending again (see Ledger).
func (s *SQLite) ResendAlert(ctx context.Context, account string, period shard.Period, threshold int) (AlertRecord, error) {
	var out AlertRecord
	err := s.write(ctx, func(tx *sql.Tx) error {
		found, err := sqliteAlerts(ctx, tx, `SELECT `+alertColumns+` FROM alerts WHERE account_id = ? AND period = ? AND threshold = ?`,
			account, period.String(), threshold)
		if err != nil {
			return err
		}
		if err := resendable(found, account, period, threshold); err != nil {
			return err
		}
		found, err = sqliteAlerts(ctx, tx, `UPDATE alerts SET state = 'pending', finished_at = NULL, created_at = ?,
				claimed_at = 0, claim = 'resend'
			WHERE account_id = ? AND period = ? AND threshold = ? RETURNING `+alertColumns, s.now().UnixNano(), account, period.String(), threshold)
		if err == nil {
			out = found[0]
		}
		return err
	})
	return out, s.fail("resend alert", err)
}

// Alerts lists the alerts that match q.
func (s *SQLite) Alerts(ctx context.Context, q AlertQuery) ([]AlertRecord, error) {
	period, state, limit := q.args()
	var out []AlertRecord
	err := s.read(ctx, func(tx *sql.Tx) error {
		var err error
		out, err = sqliteAlerts(ctx, tx, `SELECT `+alertColumns+` FROM alerts
			WHERE (?1 = '' OR account_id = ?1) AND (?2 = '' OR period = ?2) AND (?3 = '' OR state = ?3)
			ORDER BY account_id, period, threshold LIMIT ?4`, q.Account, period, state, limit)
		return err
	})
	return out, s.fail("list alerts", err)
}

// queryEach runs a query and calls fn with a scanner for every row.
func queryEach(ctx context.Context, tx *sql.Tx, query string, args []any, fn func(scan func(...any) error) error) error {
	rows, err := tx.QueryContext(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := fn(rows.Scan); err != nil {
			return err
		}
	}
	return rows.Err()
}

// --- Admin ------------------------------------------------------------------

// admin runs an admin change and the config bump in one write transaction.
func (s *SQLite) admin(ctx context.Context, op string, fn func(tx *sql.Tx) error) error {
	return s.fail(op, s.write(ctx, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `UPDATE config_version SET version = version + 1 WHERE id = 1`); err != nil {
			return err
		}
		return fn(tx)
	}))
}

// UpsertPlan creates or changes a plan (see Postgres.UpsertPlan).
func (s *SQLite) UpsertPlan(ctx context.Context, p snapshot.Plan) error {
	if err := validatePlan(&p); err != nil {
		return err
	}
	return s.admin(ctx, "upsert plan "+p.ID, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO plans (plan_id, rate, burst, monthly_quota, hard) VALUES (?, ?, ?, ?, ?)
			ON CONFLICT (plan_id) DO UPDATE SET rate = excluded.rate, burst = excluded.burst,
				monthly_quota = excluded.monthly_quota, hard = excluded.hard`,
			p.ID, p.Rate, p.Burst, p.MonthlyQuota, p.Hard); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, `UPDATE grants SET units = ?
			WHERE kind = 'monthly' AND expires_at > ? AND account_id IN (SELECT account_id FROM accounts WHERE plan_id = ?)`,
			p.MonthlyQuota, s.now().UnixNano(), p.ID)
		return err
	})
}

// UpsertAccount creates an account or moves it to another plan.
func (s *SQLite) UpsertAccount(ctx context.Context, id, plan string) error {
	if id == "" || plan == "" {
		return fmt.Errorf("%w: an account needs an id and a plan", ErrInvalid)
	}
	return s.admin(ctx, "upsert account "+id, func(tx *sql.Tx) error {
		var quota int64
		err := tx.QueryRowContext(ctx, `SELECT monthly_quota FROM plans WHERE plan_id = ?`, plan).Scan(&quota)
		if errors.Is(err, sql.ErrNoRows) {
			return fmt.Errorf("%w: account %q: plan %q does not exist", ErrNotFound, id, plan)
		}
		if err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO accounts (account_id, plan_id) VALUES (?, ?)
			ON CONFLICT (account_id) DO UPDATE SET plan_id = excluded.plan_id`, id, plan); err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, `UPDATE grants SET units = ? WHERE account_id = ? AND kind = 'monthly' AND expires_at > ?`,
			quota, id, s.now().UnixNano())
		return err
	})
}

// AddKey stores a key by its hash.
func (s *SQLite) AddKey(ctx context.Context, k snapshot.Key) error {
	if err := validateKey(&k); err != nil {
		return err
	}
	return s.admin(ctx, "add key "+k.ID, func(tx *sql.Tx) error {
		if err := s.needAccount(ctx, tx, k.Account); err != nil {
			return fmt.Errorf("key %q: %w", k.ID, err)
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO api_keys (key_id, key_hash, account_id, created_at) VALUES (?, ?, ?, ?)`,
			k.ID, k.Hash, k.Account, s.now().UnixNano())
		if c := sqliteCode(err); c == sqliteConstraintUq || c == sqliteConstraintPK {
			return fmt.Errorf("%w: key %q: a key with this id or hash is already stored", ErrInvalid, k.ID)
		}
		return err
	})
}

// needAccount fails with ErrNotFound if the account does not exist.
func (s *SQLite) needAccount(ctx context.Context, q interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
}, account string) error {
	var ok bool
	if err := q.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM accounts WHERE account_id = ?)`, account).Scan(&ok); err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("%w: account %q", ErrNotFound, account)
	}
	return nil
}

// RevokeKey revokes a key; revoking a revoked key changes nothing.
func (s *SQLite) RevokeKey(ctx context.Context, keyID string) error {
	return s.admin(ctx, "revoke key "+keyID, func(tx *sql.Tx) error {
		r, err := tx.ExecContext(ctx, `UPDATE api_keys SET revoked_at = coalesce(revoked_at, ?) WHERE key_id = ?`, s.now().UnixNano(), keyID)
		if err != nil {
			return err
		}
		if n, _ := r.RowsAffected(); n == 0 {
			return fmt.Errorf("%w: key %q", ErrNotFound, keyID)
		}
		return nil
	})
}

// AddGrant adds a credit grant to an account.
func (s *SQLite) AddGrant(ctx context.Context, account string, g snapshot.Grant) error {
	if err := validateGrant(account, &g); err != nil {
		return err
	}
	return s.admin(ctx, "add grant "+account+"/"+g.ID, func(tx *sql.Tx) error {
		if err := s.needAccount(ctx, tx, account); err != nil {
			return fmt.Errorf("grant %q: %w", g.ID, err)
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO grants (account_id, grant_id, kind, units, starts_at, expires_at) VALUES (?, ?, 'credit', ?, ?, ?)`,
			account, g.ID, g.Units, g.StartsAt.UnixNano(), nullNanos(g.ExpiresAt))
		if sqliteCode(err) == sqliteConstraintPK {
			return fmt.Errorf("%w: account %q already has a grant %q", ErrInvalid, account, g.ID)
		}
		return err
	})
}

// nullNanos maps the zero time to NULL ("never"), others to Unix ns.
func nullNanos(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t.UnixNano()
}

// SetRoutes stores a new version of the route weights and makes it active.
func (s *SQLite) SetRoutes(ctx context.Context, defaultUnits int64, weights map[string]int64) (int64, error) {
	if err := validateRoutes(defaultUnits, weights); err != nil {
		return 0, err
	}
	var version int64
	err := s.admin(ctx, "set routes", func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `UPDATE route_versions SET active = 0 WHERE active`); err != nil {
			return err
		}
		if err := tx.QueryRowContext(ctx, `INSERT INTO route_versions (version, default_units, created_at, active)
			SELECT coalesce(max(version), 0) + 1, ?, ?, 1 FROM route_versions RETURNING version`,
			defaultUnits, s.now().UnixNano()).Scan(&version); err != nil {
			return err
		}
		for pattern, units := range weights {
			if _, err := tx.ExecContext(ctx, `INSERT INTO route_weights (version, pattern, units) VALUES (?, ?, ?)`, version, pattern, units); err != nil {
				return err
			}
		}
		return nil
	})
	return version, err
}

// --- Reads ------------------------------------------------------------------

// Snapshot reads the config in one read transaction.
func (s *SQLite) Snapshot(ctx context.Context, wall time.Time) (*snapshot.Snapshot, error) {
	snap := &snapshot.Snapshot{Routes: snapshot.Routes{Default: 1}}
	accounts := make(map[string]int)
	_, prev := monthlyUsedPeriods(wall)
	err := s.read(ctx, func(tx *sql.Tx) error {
		if err := tx.QueryRowContext(ctx, `SELECT version FROM config_version WHERE id = 1`).Scan(&snap.Version); err != nil {
			return err
		}
		if err := queryEach(ctx, tx, `SELECT plan_id, rate, burst, monthly_quota, hard FROM plans ORDER BY plan_id`, nil,
			func(scan func(...any) error) error {
				var p snapshot.Plan
				err := scan(&p.ID, &p.Rate, &p.Burst, &p.MonthlyQuota, &p.Hard)
				snap.Plans = append(snap.Plans, p)
				return err
			}); err != nil {
			return err
		}
		if err := queryEach(ctx, tx, `SELECT account_id, plan_id FROM accounts ORDER BY account_id`, nil,
			func(scan func(...any) error) error {
				var a snapshot.Account
				err := scan(&a.ID, &a.Plan)
				accounts[a.ID] = len(snap.Accounts)
				snap.Accounts = append(snap.Accounts, a)
				return err
			}); err != nil {
			return err
		}
		if err := queryEach(ctx, tx, `SELECT account_id, grant_id, units, used, starts_at, expires_at FROM grants
			WHERE kind = 'credit' ORDER BY account_id, grant_id`, nil,
			func(scan func(...any) error) error {
				var account string
				var g snapshot.Grant
				var starts int64
				var expires sql.NullInt64
				if err := scan(&account, &g.ID, &g.Units, &g.Used, &starts, &expires); err != nil {
					return err
				}
				g.StartsAt = time.Unix(0, starts).UTC()
				if expires.Valid {
					g.ExpiresAt = time.Unix(0, expires.Int64).UTC()
				}
				a := &snap.Accounts[accounts[account]]
				a.Credits = append(a.Credits, g)
				return nil
			}); err != nil {
			return err
		}
		// The previous period, the current one, and any later one a node
		// whose clock ran ahead billed in (a new owner starts there: G9).
		if err := queryEach(ctx, tx, `SELECT account_id, grant_id, used FROM grants WHERE kind = 'monthly' AND period >= ?
			ORDER BY account_id, grant_id`, []any{prev.String()},
			func(scan func(...any) error) error {
				var account, grant string
				var used int64
				if err := scan(&account, &grant, &used); err != nil {
					return err
				}
				a := &snap.Accounts[accounts[account]]
				if a.MonthlyUsed == nil {
					a.MonthlyUsed = make(map[string]int64)
				}
				a.MonthlyUsed[grant] = used
				return nil
			}); err != nil {
			return err
		}
		// The settled split by route of the current period and any later one.
		if err := queryEach(ctx, tx, `SELECT account_id, period, route, units FROM usage_monthly WHERE period >= ? AND units <> 0
			ORDER BY period, account_id, route`, []any{shard.PeriodOf(wall.UnixNano()).String()},
			func(scan func(...any) error) error {
				var account, period, route string
				var units int64
				if err := scan(&account, &period, &route, &units); err != nil {
					return err
				}
				if i, ok := accounts[account]; ok {
					snap.Accounts[i].SetRouteUsed(period, route, units)
				}
				return nil
			}); err != nil {
			return err
		}
		if err := queryEach(ctx, tx, `SELECT key_id, key_hash, account_id FROM api_keys WHERE revoked_at IS NULL ORDER BY key_id`, nil,
			func(scan func(...any) error) error {
				var k snapshot.Key
				err := scan(&k.ID, &k.Hash, &k.Account)
				snap.Keys = append(snap.Keys, k)
				return err
			}); err != nil {
			return err
		}
		return queryEach(ctx, tx, `SELECT v.version, v.default_units, w.pattern, w.units
			FROM route_versions v LEFT JOIN route_weights w ON w.version = v.version
			WHERE v.active ORDER BY w.pattern`, nil,
			func(scan func(...any) error) error {
				var pattern sql.NullString
				var units sql.NullInt64
				if err := scan(&snap.Routes.Version, &snap.Routes.Default, &pattern, &units); err != nil {
					return err
				}
				if pattern.Valid {
					if snap.Routes.Weights == nil {
						snap.Routes.Weights = make(map[string]int64)
					}
					snap.Routes.Weights[pattern.String] = units.Int64
				}
				return nil
			})
	})
	if err != nil {
		return nil, s.fail("read snapshot", err)
	}
	return buildSnapshot(snap)
}

// Usage sums an account's daily aggregates over a period, by route.
func (s *SQLite) Usage(ctx context.Context, account string, period shard.Period) (AccountUsage, error) {
	u := AccountUsage{Account: account, Period: period, ByRoute: make(map[string]int64)}
	err := s.read(ctx, func(tx *sql.Tx) error {
		if err := s.needAccount(ctx, tx, account); err != nil {
			return err
		}
		return queryEach(ctx, tx, `SELECT route, sum(units) FROM usage_daily WHERE account_id = ? AND day >= ? AND day < ? GROUP BY route`,
			[]any{account, dayString(dayOf(period.Start())), dayString(dayOf(period.End()))},
			func(scan func(...any) error) error {
				var route string
				var units int64
				err := scan(&route, &units)
				u.ByRoute[route] = units
				u.Units += units
				return err
			})
	})
	return u, s.fail("read usage of "+account, err)
}

// BillingUsage reads a page of a period's usage by account, in one read
// transaction: the page's accounts first, then what the page needs of
// usage_daily, grants and events, each read over the page's range of
// account ids (After, last].
func (s *SQLite) BillingUsage(ctx context.Context, q BillingQuery) (BillingPage, error) {
	limit, err := q.limit()
	if err != nil {
		return BillingPage{}, err
	}
	start, end := dayString(dayOf(q.Period.Start())), dayString(dayOf(q.Period.End()))
	monthly := shard.MonthlyGrantID(q.Period)
	var out []BillingRow
	err = s.read(ctx, func(tx *sql.Tx) error {
		if err := queryEach(ctx, tx, `SELECT a.account_id, a.plan_id, p.hard
			FROM accounts a JOIN plans p ON p.plan_id = a.plan_id
			WHERE a.account_id > ?
				AND (EXISTS (SELECT 1 FROM usage_daily u WHERE u.account_id = a.account_id AND u.day >= ? AND u.day < ?)
					OR EXISTS (SELECT 1 FROM grants g WHERE g.account_id = a.account_id AND g.grant_id = ?))
			ORDER BY a.account_id
			LIMIT ?`, []any{q.After, start, end, monthly, limit + 1},
			func(scan func(...any) error) error {
				var b BillingRow
				err := scan(&b.Account, &b.Plan, &b.Hard)
				out = append(out, b)
				return err
			}); err != nil || len(out) == 0 {
			return err
		}
		return s.billingFigures(ctx, tx, q, out[:min(len(out), limit)], start, end, monthly)
	})
	if err != nil {
		return BillingPage{}, s.fail("read the usage of "+q.Period.String(), err)
	}
	return billingPage(out, limit), nil
}

// billingFigures reads the figures of page, which holds the accounts with
// usage or a monthly grant in (q.After, the last one], and finishes its
// rows.
func (s *SQLite) billingFigures(ctx context.Context, tx *sql.Tx, q BillingQuery, page []BillingRow, start, end, monthly string) error {
	at := make(map[string]*BillingRow, len(page))
	for i := range page {
		at[page[i].Account] = &page[i]
	}
	last := page[len(page)-1].Account
	if err := queryEach(ctx, tx, `SELECT account_id, route, sum(units) FROM usage_daily
		WHERE account_id > ? AND account_id <= ? AND day >= ? AND day < ? GROUP BY account_id, route`,
		[]any{q.After, last, start, end},
		func(scan func(...any) error) error {
			var account, route string
			var units int64
			if err := scan(&account, &route, &units); err != nil {
				return err
			}
			if b := at[account]; b != nil && units != 0 {
				if b.ByRoute == nil {
					b.ByRoute = make(map[string]int64)
				}
				b.ByRoute[route] = units
				b.Units += units
			}
			return nil
		}); err != nil {
		return err
	}
	if err := queryEach(ctx, tx, `SELECT account_id, units, used FROM grants WHERE grant_id = ? AND account_id > ? AND account_id <= ?`,
		[]any{monthly, q.After, last},
		func(scan func(...any) error) error {
			var account string
			var units, used int64
			if err := scan(&account, &units, &used); err != nil {
				return err
			}
			if b := at[account]; b != nil {
				b.Monthly, b.Quota, b.QuotaUsed = true, units, used
			}
			return nil
		}); err != nil {
		return err
	}
	ev := make(map[string][2]int64, len(page)) // units, credits
	if err := queryEach(ctx, tx, `SELECT account_id, sum(units), sum(credits) FROM (
			SELECT e.account_id, e.units,
				(SELECT coalesce(sum(json_extract(al.value, '$.units')), 0) FROM json_each(e.allocations) al
					WHERE substr(json_extract(al.value, '$.grant'), 1, 2) <> 'm:') AS credits
			FROM events e
			WHERE e.account_id > ?1 AND e.account_id <= ?2 AND e.period = ?3 AND NOT e.refunded
			UNION ALL
			SELECT account_id, units, CASE WHEN substr(grant_id, 1, 2) = 'm:' THEN 0 ELSE units END
			FROM pruned_allocations WHERE account_id > ?1 AND account_id <= ?2 AND period = ?3
		)
		GROUP BY account_id`, []any{q.After, last, q.Period.String()},
		func(scan func(...any) error) error {
			var account string
			var units, credits int64
			err := scan(&account, &units, &credits)
			ev[account] = [2]int64{units, credits}
			return err
		}); err != nil {
		return err
	}
	for i := range page {
		e := ev[page[i].Account]
		page[i].finish(e[0], e[1])
	}
	return nil
}

// Grants lists an account's grants.
func (s *SQLite) Grants(ctx context.Context, account string) ([]GrantRow, error) {
	var out []GrantRow
	err := s.read(ctx, func(tx *sql.Tx) error {
		if err := s.needAccount(ctx, tx, account); err != nil {
			return err
		}
		return queryEach(ctx, tx, `SELECT account_id, grant_id, kind = 'monthly', coalesce(period, ''), units, used, reserved, starts_at, expires_at
			FROM grants WHERE account_id = ? ORDER BY grant_id`, []any{account},
			func(scan func(...any) error) error {
				var g GrantRow
				var starts int64
				var expires sql.NullInt64
				if err := scan(&g.Account, &g.Grant, &g.Monthly, &g.Period, &g.Units, &g.Used, &g.Reserved, &starts, &expires); err != nil {
					return err
				}
				g.StartsAt = time.Unix(0, starts).UTC()
				if expires.Valid {
					g.ExpiresAt = time.Unix(0, expires.Int64).UTC()
				}
				out = append(out, g)
				return nil
			})
	})
	return out, s.fail("read grants of "+account, err)
}

// Reconcile compares the counters with the event log (G6), in one read
// transaction; usage by UTC month of the charge.
func (s *SQLite) Reconcile(ctx context.Context, each func(ReconcileRow) error) error {
	collect := func(kind string) func(scan func(...any) error) error {
		return func(scan func(...any) error) error {
			r := ReconcileRow{Kind: kind}
			if err := scan(&r.Account, &r.Scope, &r.Counter, &r.Events); err != nil {
				return err
			}
			r.Diff = r.Counter != r.Events
			return each(r)
		}
	}
	err := s.read(ctx, func(tx *sql.Tx) error {
		// SQLite has no FULL JOIN before 3.39; a UNION of both sides does.
		if err := queryEach(ctx, tx, `WITH ev AS (
				SELECT account_id, grant_id, sum(units) AS units FROM (
					SELECT e.account_id, json_extract(a.value, '$.grant') AS grant_id, json_extract(a.value, '$.units') AS units
					FROM events e, json_each(e.allocations) a
					WHERE NOT e.refunded
					UNION ALL SELECT account_id, grant_id, units FROM pruned_allocations
				)
				GROUP BY 1, 2
			), k AS (
				SELECT account_id, grant_id FROM grants UNION SELECT account_id, grant_id FROM ev
			)
			SELECT k.account_id, k.grant_id, coalesce(g.used, 0), coalesce(ev.units, 0)
			FROM k
			LEFT JOIN grants g ON g.account_id = k.account_id AND g.grant_id = k.grant_id
			LEFT JOIN ev ON ev.account_id = k.account_id AND ev.grant_id = k.grant_id
			ORDER BY 1, 2`, nil, collect("grant")); err != nil {
			return err
		}
		return queryEach(ctx, tx, `WITH u AS (
				SELECT account_id, substr(day, 1, 7) AS period, sum(units) AS units FROM usage_daily GROUP BY 1, 2
			), ev AS (
				SELECT account_id, strftime('%Y-%m', charged_at / 1000000000, 'unixepoch') AS period, sum(units) AS units
				FROM events WHERE NOT refunded GROUP BY 1, 2
			), k AS (
				SELECT account_id, period FROM u UNION SELECT account_id, period FROM ev
			)
			SELECT k.account_id, k.period, coalesce(u.units, 0), coalesce(ev.units, 0)
			FROM k
			LEFT JOIN u ON u.account_id = k.account_id AND u.period = k.period
			LEFT JOIN ev ON ev.account_id = k.account_id AND ev.period = k.period
			WHERE k.period >= (SELECT coalesce(max(pruned_before), '') FROM event_retention)
			ORDER BY 1, 2`, nil, collect("usage"))
	})
	return s.fail("reconcile", err)
}

// Events lists an account's event log, tombstones included.
func (s *SQLite) Events(ctx context.Context, account string) ([]EventRow, error) {
	var out []EventRow
	err := s.read(ctx, func(tx *sql.Tx) error {
		return queryEach(ctx, tx, `SELECT account_id, event_id, key_id, route, units, charged_at, period, node_id, incarnation, seq, refunded, tombstone
			FROM events WHERE account_id = ? ORDER BY charged_at, node_id, incarnation, seq`, []any{account},
			func(scan func(...any) error) error {
				var e EventRow
				var charged, seq int64
				if err := scan(&e.Account, &e.EventID, &e.Key, &e.Route, &e.Units, &charged, &e.Period, &e.Node, &e.Incarnation, &seq, &e.Refunded, &e.Tombstone); err != nil {
					return err
				}
				e.ChargedAt, e.Seq = time.Unix(0, charged).UTC(), uint64(seq)
				// A row moved aside for a later use of its id (archivedName)
				// is listed by its id, as Postgres lists an id's months.
				e.EventID = strings.TrimSuffix(e.EventID, "\x1e"+e.Period)
				out = append(out, e)
				return nil
			})
	})
	return out, s.fail("read events of "+account, err)
}

// allocJSON is an allocation as the events table stores it.
type allocJSON struct {
	Grant string `json:"grant"`
	Units int64  `json:"units"`
}

func encodeAllocs(as []shard.Alloc) string {
	js := make([]allocJSON, len(as))
	for i, a := range as {
		js[i] = allocJSON(a)
	}
	b, _ := json.Marshal(js) // cannot fail: strings and integers
	return string(b)
}

func decodeAllocs(s string) ([]shard.Alloc, error) {
	var js []allocJSON
	if err := json.Unmarshal([]byte(s), &js); err != nil {
		return nil, fmt.Errorf("event allocations %q: %w", s, err)
	}
	as := make([]shard.Alloc, len(js))
	for i, j := range js {
		as[i] = shard.Alloc(j)
	}
	return as, nil
}
