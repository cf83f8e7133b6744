package node

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

func TestSettledMonth(t *testing.T) {
	june := shard.Period(2026*12 + 5)
	at := func(s string) time.Time {
		t.Helper()
		v, err := time.Parse(time.RFC3339, s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	row := func(node, inc, heartbeat string) flush.NodeRow {
		return flush.NodeRow{Node: node, Incarnation: inc, Heartbeat: at(heartbeat)}
	}
	for _, tc := range []struct {
		name      string
		rows      []flush.NodeRow
		now       string
		final     bool
		unsettled []string // node/incarnation
	}{
		{"the month runs", []flush.NodeRow{row("n1", "a", "2026-06-20T00:00:00Z")}, "2026-06-30T23:59:59Z", false, nil},
		{"over, no node heard from since", []flush.NodeRow{row("n1", "a", "2026-06-30T23:59:58Z")}, "2026-07-01T00:00:00Z", false, []string{"n1/a"}},
		{"a heartbeat less than a minute after the end", []flush.NodeRow{row("n1", "a", "2026-07-01T00:00:59Z")}, "2026-07-02T00:00:00Z", false, []string{"n1/a"}},
		{"a heartbeat a minute after the end", []flush.NodeRow{row("n1", "a", "2026-07-01T00:01:00Z")}, "2026-07-01T00:01:00Z", true, nil},
		{"a node stopped before the month began", []flush.NodeRow{row("n1", "a", "2026-05-31T23:59:59Z")}, "2026-07-01T00:00:00Z", true, nil},
		{"no nodes", nil, "2026-07-01T00:00:00Z", true, nil},
		{"a node's latest incarnation counts", []flush.NodeRow{row("n1", "old", "2026-06-10T00:00:00Z"), row("n1", "new", "2026-07-03T00:00:00Z"),
			row("n2", "b", "2026-06-29T00:00:00Z"), row("n3", "c", "2026-08-01T00:00:00Z")}, "2026-08-01T00:00:00Z", false, []string{"n2/b"}},
		{"a node stopped cleanly in the month (nothing unsettled)", []flush.NodeRow{{Node: "n1", Incarnation: "a",
			Heartbeat: at("2026-06-12T00:00:00Z"), Stopped: at("2026-06-12T00:00:01Z")}}, "2026-07-01T00:00:00Z", true, nil},
		// A current build that never settled (its start refused): what
		// it held is told by SettledThrough, never set.
		{"a node first registered after the month ended", []flush.NodeRow{{Node: "n9", Incarnation: "z", SchemaKnown: 16,
			Heartbeat: at("2026-07-05T00:00:00Z"), Created: at("2026-07-05T00:00:00Z")}}, "2026-07-06T00:00:00Z", true, nil},
		{"a node first registered less than a minute after the end", []flush.NodeRow{{Node: "n9", Incarnation: "z", SchemaKnown: 16,
			Heartbeat: at("2026-07-05T00:00:00Z"), Created: at("2026-07-01T00:00:30Z")}}, "2026-07-06T00:00:00Z", false, []string{"n9/z"}},
		{"two silent nodes, by id", []flush.NodeRow{row("n3", "c", "2026-06-29T00:00:00Z"), row("n2", "b", "2026-06-01T00:00:00Z")},
			"2026-09-01T00:00:00Z", false, []string{"n2/b", "n3/c"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			final, unsettled := flush.SettledMonth(tc.rows, june, at(tc.now))
			var got []string
			for _, x := range unsettled {
				got = append(got, x.Node+"/"+x.Incarnation)
			}
			if final != tc.final || !reflect.DeepEqual(got, tc.unsettled) {
				t.Fatalf("SettledMonth at %s: final %v, unsettled %v; want %v, %v", tc.now, final, got, tc.final, tc.unsettled)
			}
		})
	}
}

// usageFixture is a node whose clock is in June 2001 and a second handle on
// its SQLite ledger that writes with that clock (the node's own ledger
// handle stamps heartbeats with the real clock, always years after 2001:
// the node itself never holds June 2001 back).
type usageFixture struct {
	n     *Node
	clock *engine.ManualClock
	l     *flush.SQLite
}

// june2001 is when the fixture's charges happen.
func june2001() time.Time { return time.Date(2001, 6, 20, 12, 0, 0, 0, time.UTC) }

// newUsageFixture seeds June 2001: acme (hard, quota 100) 55 units on two
// routes, beta (soft, quota 10) 25, delta (soft) 5 from a credit grant and
// none from its quota, acct-0 to acct-4 (hard) 1 each, gamma nothing.
func newUsageFixture(t *testing.T) *usageFixture {
	t.Helper()
	ctx := context.Background()
	f := &usageFixture{clock: engine.NewManualClock(june2001())}
	path := filepath.Join(t.TempDir(), "ledger.db")
	l, err := flush.OpenSQLite(ctx, path, flush.SQLiteOptions{Now: func() time.Time { return time.Unix(0, f.clock.Now().Wall) }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	f.l = l
	accounts := map[string]string{"acme": "pro", "beta": "metered", "gamma": "pro", "delta": "metered"}
	for i := range 5 {
		accounts[fmt.Sprint("acct-", i)] = "pro"
	}
	for _, p := range []snapshot.Plan{{ID: "pro", MonthlyQuota: 100, Hard: true}, {ID: "metered", MonthlyQuota: 10}} {
		if err := l.UpsertPlan(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	for a, p := range accounts {
		if err := l.UpsertAccount(ctx, a, p); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.AddGrant(ctx, "delta", snapshot.Grant{ID: "order-1", Units: 50, StartsAt: june2001().AddDate(0, 0, -19),
		ExpiresAt: june2001().AddDate(0, 0, 5)}); err != nil {
		t.Fatal(err)
	}
	f.n = startNodesWith(t, "sqlite:"+path, func(c *Config) { c.AdminToken, c.Clock = testAdminToken, f.clock })[0]

	charges := []router.ChargeRequest{
		{Account: "acme", Route: "GET /v1/tasks", Units: 30}, {Account: "acme", Route: "POST /v1/exports", Units: 25},
		{Account: "beta", Route: "GET /v1/tasks", Units: 25}, {Account: "delta", Route: "GET /v1/tasks", Units: 5},
	}
	for i := range 5 {
		charges = append(charges, router.ChargeRequest{Account: fmt.Sprint("acct-", i), Route: "GET /x", Units: 1})
	}
	for _, c := range charges {
		waitFor(t, 10*time.Second, "a charge of "+c.Account, func() bool {
			res, err := f.n.Router().Charge(ctx, c)
			if err != nil {
				t.Fatal(err)
			}
			if res.Reason == shard.UnknownAccount {
				return false // the node's config snapshot is not there yet
			}
			if res.Reason != shard.OK {
				t.Fatalf("charge %+v: %v", c, res.Reason)
			}
			return true
		})
	}
	if _, err := f.n.SettleNow(ctx); err != nil {
		t.Fatal(err)
	}
	return f
}

// usage calls GET path and decodes the export; it fails the test on
// anything but 200.
func (f *usageFixture) usage(t *testing.T, path string) (UsageExport, []byte) {
	t.Helper()
	var out UsageExport
	status, raw := adminCall(t, f.n, testAdminToken, "GET", path, nil, &out)
	if status != 200 {
		t.Fatalf("GET %s: %d %s", path, status, raw)
	}
	return out, raw
}

func TestAdminUsage(t *testing.T) {
	f := newUsageFixture(t)
	ctx := context.Background()
	n100, n10, n0, n5 := int64(100), int64(10), int64(0), int64(5)
	one := func(account string) AccountUsageView {
		return AccountUsageView{Account: account, Plan: "pro", Hard: true, Units: 1, Quota: &n100, QuotaUsed: 1, CreditsUsed: &n0,
			ByRoute: map[string]int64{"GET /x": 1}}
	}
	want := []AccountUsageView{one("acct-0"), one("acct-1"), one("acct-2"), one("acct-3"), one("acct-4"),
		{Account: "acme", Plan: "pro", Hard: true, Units: 55, Quota: &n100, QuotaUsed: 55, CreditsUsed: &n0,
			ByRoute: map[string]int64{"GET /v1/tasks": 30, "POST /v1/exports": 25}},
		{Account: "beta", Plan: "metered", Units: 25, Quota: &n10, QuotaUsed: 25, Overage: 15, CreditsUsed: &n0,
			ByRoute: map[string]int64{"GET /v1/tasks": 25}},
		{Account: "delta", Plan: "metered", Units: 5, CreditsUsed: &n5, ByRoute: map[string]int64{"GET /v1/tasks": 5}},
	}

	// The current month by the node's clock, in one page; gamma (no usage,
	// no monthly grant) is not in it.
	got, raw := f.usage(t, "/admin/v1/usage")
	if got.Period != "2001-06" || !got.AsOf.Equal(june2001()) || got.Final || len(got.UnsettledNodes) != 0 || got.Next != "" ||
		!reflect.DeepEqual(got.Usage, want) {
		t.Fatalf("GET /admin/v1/usage: %s\nwant the usage %+v", raw, want)
	}
	for _, s := range []string{`"quota": null`, `"credits_used": 5`, `"overage": 15`} {
		if !bytes.Contains(raw, []byte(s)) {
			t.Errorf("the answer lacks %s: %s", s, raw)
		}
	}
	if bytes.Contains(raw, []byte(`"next"`)) {
		t.Errorf("the last page has a next: %s", raw)
	}

	// Pages of 3, following next, make the same list.
	var pages [][]string
	var all []AccountUsageView
	for after, i := "", 0; ; i++ {
		if i > 5 {
			t.Fatalf("still paging after %v", pages)
		}
		p, _ := f.usage(t, "/admin/v1/usage?period=2001-06&limit=3&after="+after)
		var ids []string
		for _, u := range p.Usage {
			ids = append(ids, u.Account)
		}
		pages, all = append(pages, ids), append(all, p.Usage...)
		if p.Next == "" {
			break
		}
		after = p.Next
	}
	wantPages := [][]string{{"acct-0", "acct-1", "acct-2"}, {"acct-3", "acct-4", "acme"}, {"beta", "delta"}}
	if !reflect.DeepEqual(pages, wantPages) || !reflect.DeepEqual(all, want) {
		t.Fatalf("pages of 3: %v, want %v (and the same rows as one page)", pages, wantPages)
	}

	if p, raw := f.usage(t, "/admin/v1/usage?period=2001-05"); len(p.Usage) != 0 || !p.Final || raw == nil {
		t.Fatalf("May 2001 (over, no node heard from in it): %s", raw)
	}

	wantProblem(t, f.n, "GET", "/admin/v1/usage?period=2001-13", nil, 400, "period")
	wantProblem(t, f.n, "GET", "/admin/v1/usage?period=June", nil, 400, "period")
	wantProblem(t, f.n, "GET", "/admin/v1/usage?period=1969-12", nil, 400, "period")
	wantProblem(t, f.n, "GET", "/admin/v1/usage?period=2262-05", nil, 400, "period")
	wantProblem(t, f.n, "GET", "/admin/v1/usage?limit=0", nil, 400, "limit")
	wantProblem(t, f.n, "GET", "/admin/v1/usage?limit=10001", nil, 400, "limit")
	wantProblem(t, f.n, "GET", "/admin/v1/usage?limit=ten", nil, 400, "limit")
	wantProblem(t, f.n, "POST", "/admin/v1/usage", nil, 405, "")

	// How final June is: n9, heard from in June, has not been heard from
	// since the month ended, so June is not final until it is, a minute
	// after the end at least.
	if _, err := f.l.RegisterNode(ctx, "n9", "n9-inc"); err != nil {
		t.Fatal(err)
	}
	f.clock.SetWall(time.Date(2001, 7, 1, 0, 0, 30, 0, time.UTC))
	got, raw = f.usage(t, "/admin/v1/usage?period=2001-06&limit=1")
	if got.Final || len(got.UnsettledNodes) != 1 || got.UnsettledNodes[0].Node != "n9" || got.UnsettledNodes[0].Incarnation != "n9-inc" ||
		!got.UnsettledNodes[0].HeartbeatAt.Equal(june2001()) || got.Next != "acct-0" {
		t.Fatalf("June after its end, n9 silent since June 20: %s", raw)
	}
	if p, raw := f.usage(t, "/admin/v1/usage"); p.Period != "2001-07" || len(p.Usage) != 0 || p.Final {
		t.Fatalf("the default period on July 1: %s", raw)
	}
	// n9 named lost (silent since June 20, holding no reservation): June is
	// final without it, as prune --lost-node has it. A node the ledger
	// does not know, or one heard from lately, is refused.
	if p, raw := f.usage(t, "/admin/v1/usage?period=2001-06&lost_node=n9"); !p.Final || len(p.UnsettledNodes) != 0 || len(p.LostNodes) != 1 || p.LostNodes[0] != "n9" {
		t.Fatalf("June with n9 named lost: %s", raw)
	}
	wantProblem(t, f.n, "GET", "/admin/v1/usage?period=2001-06&lost_node=nope", nil, 400, "lost_node")
	wantProblem(t, f.n, "GET", "/admin/v1/usage?period=2001-06&lost_node=n9,"+f.n.cfg.ID, nil, 400, "lost_node")
	if res, err := f.l.Reserve(ctx, "n9", flush.ReserveRequest{Account: "acme", Wall: june2001(), Need: 1}); err != nil || len(res.Granted) == 0 {
		t.Fatalf("reserve for n9: %+v %v", res, err)
	}
	wantProblem(t, f.n, "GET", "/admin/v1/usage?period=2001-06&lost_node=n9", nil, 400, "lost_node")
	if _, err := f.l.ReleaseNode(ctx, "n9"); err != nil {
		t.Fatal(err)
	}
	if _, err := f.l.RegisterNode(ctx, "n9", "n9-inc"); err != nil { // heard from at 00:00:30: too early
		t.Fatal(err)
	}
	if p, raw := f.usage(t, "/admin/v1/usage?period=2001-06"); p.Final || len(p.UnsettledNodes) != 1 {
		t.Fatalf("June, n9 heard from 30 s after its end: %s", raw)
	}
	f.clock.SetWall(time.Date(2001, 7, 1, 0, 1, 0, 0, time.UTC))
	if _, err := f.l.RegisterNode(ctx, "n9", "n9-inc"); err != nil {
		t.Fatal(err)
	}
	got, raw = f.usage(t, "/admin/v1/usage?period=2001-06")
	if !got.Final || len(got.UnsettledNodes) != 0 || !reflect.DeepEqual(got.Usage, want) {
		t.Fatalf("June, every node heard from a minute after its end: %s", raw)
	}
}
