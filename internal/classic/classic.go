// Package classic is the design quotaring replaces, kept to measure against:
// one SQL transaction per charge,
//
//	BEGIN;
//	INSERT OR IGNORE INTO events (account, event_id, units) VALUES (?, ?, ?);  -- idempotency
//	UPDATE usage SET used = used + ? WHERE account = ? AND used + ? <= quota;  -- exact quota
//	COMMIT;  (or ROLLBACK when the UPDATE matched nothing)
//
// on SQLite, in memory or in a file (WAL journal, synchronous=FULL, so a
// commit is durable like the engine's Sync). It is exact and simple, and
// every charge waits for the database: that is the cost the engine's group
// commit and in-memory decisions remove.
//
//	s, err := classic.Open(":memory:") // or a file's path
//	err = s.SetQuota(ctx, "acme", 1000)
//	charged, err := s.Charge(ctx, "acme", "event-1", 1) // false, nil: the event id was charged before
//	// err is ErrQuotaExceeded past the quota
//
// quotad bench engine runs it beside the engine (its sqlite-memory and
// sqlite-file targets).
package classic

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"

	_ "modernc.org/sqlite" // the pure-Go SQLite driver
)

// Store is a classic quota store.
type Store struct {
	db *sql.DB
	mu sync.Mutex // serialises writers: SQLite has one writer at a time
}

// Open opens path (":memory:" for memory) and creates the tables.
func Open(path string) (*Store, error) {
	// SQLite decodes %XX in a file: URI's path: a % stands for itself.
	dsn := "file:" + strings.ReplaceAll(path, "%", "%25") + "?_pragma=journal_mode(WAL)&_pragma=synchronous(FULL)&_pragma=busy_timeout(10000)"
	if path == ":memory:" {
		dsn = "file::memory:"
	}
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, fmt.Errorf("classic: open %s: %w", path, err)
	}
	db.SetMaxOpenConns(1) // one connection: ":memory:" is per connection, and SQLite writes one at a time
	for _, q := range []string{
		`CREATE TABLE IF NOT EXISTS events (account TEXT NOT NULL, event_id TEXT NOT NULL, units INTEGER NOT NULL, PRIMARY KEY (account, event_id))`,
		`CREATE TABLE IF NOT EXISTS usage (account TEXT PRIMARY KEY, used INTEGER NOT NULL, quota INTEGER NOT NULL)`,
	} {
		if _, err := db.Exec(q); err != nil {
			db.Close()
			return nil, fmt.Errorf("classic: create tables in %s: %w", path, err)
		}
	}
	return &Store{db: db}, nil
}

// Close closes the database.
func (s *Store) Close() error { return s.db.Close() }

// SetQuota creates or resets an account.
func (s *Store) SetQuota(ctx context.Context, account string, quota int64) error {
	_, err := s.db.ExecContext(ctx, `INSERT INTO usage (account, used, quota) VALUES (?, 0, ?) ON CONFLICT (account) DO UPDATE SET quota = excluded.quota, used = 0`, account, quota)
	return err
}

// ErrQuotaExceeded is returned when the charge does not fit.
var ErrQuotaExceeded = errors.New("classic: quota exceeded")

// Charge charges units once per (account, eventID). It reports whether the
// event was new.
func (s *Store) Charge(ctx context.Context, account, eventID string, units int64) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return false, err
	}
	defer tx.Rollback()
	res, err := tx.ExecContext(ctx, `INSERT OR IGNORE INTO events (account, event_id, units) VALUES (?, ?, ?)`, account, eventID, units)
	if err != nil {
		return false, err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return false, nil // a retry: already charged
	}
	res, err = tx.ExecContext(ctx, `UPDATE usage SET used = used + ? WHERE account = ? AND used + ? <= quota`, units, account, units)
	if err != nil {
		return false, err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return false, ErrQuotaExceeded
	}
	return true, tx.Commit()
}

// Used reads an account's counter.
func (s *Store) Used(ctx context.Context, account string) (int64, error) {
	var n int64
	err := s.db.QueryRowContext(ctx, `SELECT used FROM usage WHERE account = ?`, account).Scan(&n)
	return n, err
}
