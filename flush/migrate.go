package flush

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
)

// Schema migrations are embedded SQL files, one set per dialect:
//
//	migrations/postgres/0001_init.sql
//	migrations/sqlite/0001_init.sql
//
// A file's number is its version; versions start at 1 and have no gaps. Each
// file runs in its own transaction together with the insert of its row into
// schema_migrations(version, applied_at), so a migration is applied whole or
// not at all. Never edit a released file: add the next number.
//
// Migrate holds a lock while it works (Postgres: pg_advisory_lock on
// migrateLockKey; SQLite: BEGIN IMMEDIATE), so several quotad starting at once
// apply each migration once. A ledger whose schema_migrations holds a version
// above the newest embedded one was migrated by a newer quotad: Migrate
// refuses (ErrSchemaTooNew) rather than run an old binary against it.
//
//go:embed migrations/postgres/*.sql migrations/sqlite/*.sql
var migrationFiles embed.FS

// Dialects: the directory names under migrations/.
const (
	dialectPostgres = "postgres"
	dialectSQLite   = "sqlite"
)

// migration is one numbered SQL file.
type migration struct {
	version int
	name    string // file name, for messages
	sql     string
}

// loadMigrations reads the dialect's migrations in version order and checks
// that the versions run 1, 2, 3, ... without gaps or repeats.
func loadMigrations(dialect string) ([]migration, error) {
	dir := path.Join("migrations", dialect)
	entries, err := fs.ReadDir(migrationFiles, dir)
	if err != nil {
		return nil, fmt.Errorf("flush: read embedded migrations %s: %w", dir, err)
	}
	var ms []migration
	for _, e := range entries {
		num, _, ok := strings.Cut(e.Name(), "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v <= 0 || !strings.HasSuffix(e.Name(), ".sql") {
			return nil, fmt.Errorf("flush: embedded migration %s/%s: want NNNN_name.sql", dir, e.Name())
		}
		b, err := fs.ReadFile(migrationFiles, path.Join(dir, e.Name()))
		if err != nil {
			return nil, fmt.Errorf("flush: read embedded migration %s/%s: %w", dir, e.Name(), err)
		}
		ms = append(ms, migration{version: v, name: e.Name(), sql: string(b)})
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].version < ms[j].version })
	for i, m := range ms {
		if m.version != i+1 {
			return nil, fmt.Errorf("flush: embedded migrations %s: %s has version %d, want %d (versions start at 1, no gaps)", dir, m.name, m.version, i+1)
		}
	}
	if len(ms) == 0 {
		return nil, fmt.Errorf("flush: no embedded migrations in %s", dir)
	}
	return ms, nil
}

// knownSchema is the newest schema version this quotad's migrations of
// dialect reach (RecordBuild writes it; 0 only if the embedded files could
// not be read, which loadMigrations reports everywhere else).
func knownSchema(dialect string) int {
	ms, err := loadMigrations(dialect)
	if err != nil {
		return 0
	}
	return ms[len(ms)-1].version
}

// pending returns the migrations above the applied version, or
// ErrSchemaTooNew when the ledger is ahead of this binary.
func pending(ms []migration, applied int) ([]migration, error) {
	newest := ms[len(ms)-1].version
	if applied > newest {
		return nil, fmt.Errorf("%w: the ledger is at schema %d, this quotad knows up to %d: run a newer quotad (never point an older one at it)",
			ErrSchemaTooNew, applied, newest)
	}
	return ms[applied:], nil
}

// CheckSchema reports a ledger l's schema this quotad cannot work with
// as it is: ErrSchemaTooNew when a newer quotad migrated it, and an error
// naming quotad migrate when it is behind this quotad's. Commands that use
// a ledger without migrating it (reconcile, revoke) check it first, as
// serve and migrate do by migrating.
func CheckSchema(ctx context.Context, l Ledger) error {
	dialect := dialectSQLite
	if _, ok := l.(*Postgres); ok {
		dialect = dialectPostgres
	}
	ms, err := loadMigrations(dialect)
	if err != nil {
		return err
	}
	applied, err := l.SchemaVersion(ctx)
	if err != nil {
		return err
	}
	rest, err := pending(ms, applied)
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return fmt.Errorf("flush: the ledger is at schema %d, this quotad's is %d: run quotad migrate with this quotad first (or use the quotad the cluster runs)",
			applied, ms[len(ms)-1].version)
	}
	return nil
}
