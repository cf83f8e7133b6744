package flush

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
)

// Migration 0016 fills usage_monthly from the usage_daily a ledger holds
// when it runs: a ledger upgraded mid-month shows its accounts' whole month
// by route at once. The ledger is taken back to schema 15 by hand (the
// table and its triggers dropped), given usage, and migrated again.
func TestMigration16FillsUsageMonthlyFromUsageDaily(t *testing.T) {
	for name, c := range map[string]struct {
		open func(t *testing.T) Ledger
		down string
	}{
		"sqlite": {func(t *testing.T) Ledger { return migratedSQLite(t, nil) },
			`DROP TRIGGER usage_monthly_ins; DROP TRIGGER usage_monthly_upd; DROP TRIGGER usage_monthly_del;
			DROP TABLE usage_monthly; DELETE FROM schema_migrations WHERE version = 16`},
		"postgres": {func(t *testing.T) Ledger { return migratedPG(t) },
			`DROP TABLE usage_monthly; DROP FUNCTION usage_monthly_inserted, usage_monthly_updated, usage_monthly_deleted CASCADE;
			DELETE FROM schema_migrations WHERE version = 16`},
	} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			l := c.open(t)
			confSetup(t, l, 100, "acct-1")
			mustExecSQL(t, l, c.down)
			mustExecSQL(t, l, `INSERT INTO usage_daily (account_id, key_id, route, day, units, requests) VALUES
				('acct-1', 'k1', 'GET /v1/tasks', '2026-06-02', 3, 3), ('acct-1', 'k2', 'GET /v1/tasks', '2026-06-20', 4, 4),
				('acct-1', 'k1', 'POST /v1/exports', '2026-06-21', 25, 1), ('acct-1', 'k1', 'GET /v1/tasks', '2026-05-31', 9, 9)`)
			if err := l.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			s, err := l.Snapshot(ctx, time.Date(2026, 6, 25, 0, 0, 0, 0, time.UTC))
			if err != nil {
				t.Fatal(err)
			}
			want := map[string]int64{"GET /v1/tasks": 7, "POST /v1/exports": 25}
			if got := s.Accounts[0].RouteUsed["2026-06"]; !maps.Equal(got, want) {
				t.Fatalf("June by route after the migration: %v, want %v", got, want)
			}
		})
	}
}

// A node that takes an account over shows the month's whole split by route
// in its usage (what the usage endpoint answers), not only its own charges:
// q1 charges two routes and settles, the account moves to q2, which reads
// the config (the real Refresher), charges one route more, settles and
// reads again: every route counted once. Real engines, logs, settlers and
// SQLite. Before usage_monthly, q2 showed only its own GET.
func TestANewOwnerShowsTheMonthsRoutes(t *testing.T) {
	ctx := context.Background()
	r := newReplayRig(t)
	charge := func(node, id, route string, units int64) {
		t.Helper()
		res, err := r.e[node].Charge(ctx, "acct-1", shard.Charge{EventID: id, Key: "k1", Route: route, Units: units})
		if err != nil || res.Reason != shard.OK {
			t.Fatalf("charge %s at %s: %v, %v", id, node, res.Reason, err)
		}
	}
	refresh := func(node string) {
		t.Helper()
		if err := (&Refresher{Ledger: r.l, Engine: r.e[node]}).RefreshOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	wantRoutes := func(node string, want map[string]int64) {
		t.Helper()
		u, _, err := r.e[node].Usage("acct-1")
		if err != nil {
			t.Fatal(err)
		}
		if !maps.Equal(u.Routes, want) {
			t.Fatalf("usage at %s: routes %v, want %v", node, u.Routes, want)
		}
	}
	charge("q1", "e1", "GET /v1/tasks", 1)
	charge("q1", "e2", "POST /v1/exports", 25)
	r.settle(t, "q1")
	r.owner.Store("q2")
	refresh("q2")
	charge("q2", "e3", "GET /v1/tasks", 1)
	want := map[string]int64{"GET /v1/tasks": 2, "POST /v1/exports": 25}
	wantRoutes("q2", want)
	r.settle(t, "q2")
	refresh("q2")
	wantRoutes("q2", want)
}
