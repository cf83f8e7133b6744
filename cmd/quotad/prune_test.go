package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// quotad prune drops the event log of old months, first as a dry run that
// changes nothing, refuses a month whose charges may still be refunded, and
// leaves a ledger that quotad reconcile still finds clean.
func TestPruneCommand(t *testing.T) {
	ctx := context.Background()
	path := migratedSQLite(t)
	l, err := flush.OpenSQLite(ctx, path, flush.SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.UpsertPlan(ctx, snapshot.Plan{ID: "basic", MonthlyQuota: 100, Hard: true}); err != nil {
		t.Fatal(err)
	}
	if err := l.UpsertAccount(ctx, "acct-1", "basic"); err != nil {
		t.Fatal(err)
	}
	if _, err := l.RegisterNode(ctx, "q1", "q1-inc"); err != nil {
		t.Fatal(err)
	}
	b := &flush.Batch{Node: "q1", Incarnation: "q1-inc", Prev: 0, Next: 3, Events: true, DrainedAt: time.Now()}
	for i, month := range []time.Month{time.June, time.June, time.July} {
		wall := time.Date(2026, month, 15, 12, 0, 0, 0, time.UTC).UnixNano()
		per := shard.PeriodOf(wall)
		b.Charges = append(b.Charges, flush.Charge{Seq: uint64(i + 1), Account: "acct-1", EventID: "e" + string(rune('1'+i)), ClientID: true,
			Key: "k", Route: "GET /x", Units: 2, Wall: wall, Period: per, Allocs: []shard.Alloc{{Grant: shard.MonthlyGrantID(per), Units: 2}}})
	}
	if _, err := l.Settle(ctx, b); err != nil {
		t.Fatal(err)
	}
	l.Close()

	run := func(args ...string) (string, error) {
		var out bytes.Buffer
		root := newRootCmd()
		root.SetArgs(args)
		root.SetOut(&out)
		root.SetErr(io.Discard)
		err := root.ExecuteContext(ctx)
		return out.String(), err
	}
	ledger := "--ledger=sqlite:" + path
	// q1, heard from just now, recorded no build: it may be a quotad from
	// before the retention rules. Its restart on this build records one.
	if _, err := run("prune", ledger, "--before", "2026-07", "--dry-run"); err == nil ||
		!strings.Contains(err.Error(), "q1 (incarnation q1-inc, a build from before builds were recorded") || !strings.Contains(err.Error(), "Upgrade every node first") {
		t.Fatalf("prune while a node of unknown build runs: %v, want a refusal naming it", err)
	}
	if l, err = flush.OpenSQLite(ctx, path, flush.SQLiteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := l.RecordStart(ctx, "q1", "q1-inc", flush.NodeStart{Build: "v9.9.9", Process: "p"}); err != nil {
		t.Fatal(err)
	}
	l.Close()
	out, err := run("prune", ledger, "--before", "2026-07", "--dry-run")
	if err != nil || !strings.Contains(out, "would drop the event log of 2026-06: 2 events") || !strings.Contains(out, "nothing changed") {
		t.Fatalf("dry run: %v\n%s", err, out)
	}
	now := shard.PeriodOf(time.Now().UnixNano())
	if _, err := run("prune", ledger, "--before", now.String()); err == nil || !strings.Contains(err.Error(), "may still be refunded") {
		t.Fatalf("prune before this month: %v, want a refusal", err)
	}
	if _, err := run("prune", ledger); err == nil || !strings.Contains(err.Error(), "--before or --keep-months is required") {
		t.Fatalf("prune without --before: %v", err)
	}
	// --keep-months counts back from the ledger's month: the same line
	// serves a job that runs every month.
	july, _ := shard.ParsePeriod("2026-07")
	keep := fmt.Sprint(int(now - july))
	out, err = run("prune", ledger, "--keep-months", keep, "--dry-run")
	if err != nil || !strings.Contains(out, "would drop the event log of 2026-06: 2 events") || strings.Contains(out, "2026-07:") ||
		!strings.Contains(out, "dry run: 2 events in 1 month before 2026-07 would go") {
		t.Fatalf("dry run keeping %s months: %v\n%s", keep, err, out)
	}
	// Every month back to 1970-01 kept: nothing to drop, and the message
	// names the month (it said "before 0-01").
	most := fmt.Sprint(int(now - flush.MinBillingPeriod))
	if out, err = run("prune", ledger, "--keep-months", most, "--dry-run"); err != nil || !strings.Contains(out, "dry run: no event log before 1970-01 to drop") {
		t.Fatalf("dry run keeping %s months: %v\n%s", most, err, out)
	}
	for _, args := range [][]string{{"--keep-months", "0"}, {"--keep-months", "-3"}, {"--keep-months", "2", "--before", "2026-07"},
		{"--keep-months", "100000", "--dry-run"}, {"--keep-months", fmt.Sprint(int(now-flush.MinBillingPeriod) + 1), "--dry-run"}} {
		if _, err := run(append([]string{"prune", ledger}, args...)...); err == nil || !strings.Contains(err.Error(), "--keep-months") {
			t.Fatalf("prune %v: %v, want a refusal naming --keep-months", args, err)
		}
	}
	out, err = run("prune", ledger, "--before", "2026-08")
	if err != nil || !strings.Contains(out, "dropped the event log of 2026-07: 1 events") ||
		!strings.Contains(out, "3 events in 2 months dropped; the ledger holds no event log before 2026-08") {
		t.Fatalf("prune: %v\n%s", err, out)
	}
	out, err = run("reconcile", ledger, "--all")
	if err != nil || !strings.Contains(out, "the event log before 2026-08 was pruned") || !strings.Contains(out, "2 rows compared, 0 differences") {
		t.Fatalf("reconcile after the prune: %v\n%s", err, out)
	}
}
