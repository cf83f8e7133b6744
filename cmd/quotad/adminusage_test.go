package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/waitfor"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
)

// TestQuotadAdminUsage: June 2001 by the node's clock (the node's own
// heartbeats are stamped by the real clock, years later, so only the node
// this test registers in June can hold the month back). acme (hard, quota
// 100) uses 55 units on two routes, beta (soft, quota 10) 25, delta (soft)
// 5 from a credit grant; gamma nothing.
func TestQuotadAdminUsage(t *testing.T) {
	for _, e := range adminEnv {
		t.Setenv(e.env, "") // not from the caller's shell
	}
	ctx := context.Background()
	june := time.Date(2001, 6, 20, 12, 0, 0, 0, time.UTC)
	clock := engine.NewManualClock(june)
	path := filepath.Join(t.TempDir(), "ledger.db")
	n := startAdminTestNode(t, func(c *node.Config) { c.Clock, c.Ledger = clock, "sqlite:"+path })
	// A second handle on the ledger, writing with the node's clock.
	l, err := flush.OpenSQLite(ctx, path, flush.SQLiteOptions{Now: func() time.Time { return time.Unix(0, clock.Now().Wall) }})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()

	mustAdmin(t, n, "plans", "set", "pro", "--quota", "100", "--hard")
	mustAdmin(t, n, "plans", "set", "metered", "--quota", "10", "--soft")
	for account, plan := range map[string]string{"acme": "pro", "beta": "metered", "gamma": "pro", "delta": "metered"} {
		mustAdmin(t, n, "accounts", "set", account, "--plan", plan)
	}
	mustAdmin(t, n, "grants", "add", "delta", "--units", "50", "--expires", "2001-06-25")
	waitfor.Cond(t, 10*time.Second, "the node's config snapshot with the accounts and delta's credits", func() bool {
		s := n.Engine().Snapshot()
		if s == nil {
			return false
		}
		_, ok := s.AccountConfig("acme")
		delta, _ := s.AccountConfig("delta")
		return ok && len(delta.Credits) == 1
	})
	for _, c := range []router.ChargeRequest{
		{Account: "acme", Route: "GET /v1/tasks", Units: 30}, {Account: "acme", Route: "POST /v1/exports", Units: 25},
		{Account: "beta", Route: "GET /v1/tasks", Units: 25}, {Account: "delta", Route: "GET /v1/tasks", Units: 5},
	} {
		if res, err := n.Router().Charge(ctx, c); err != nil || res.Reason != shard.OK {
			t.Fatalf("charge %+v: %+v %v", c, res, err)
		}
	}
	if _, err := n.SettleNow(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := l.RegisterNode(ctx, "n9", "n9-inc"); err != nil { // heard from on June 20
		t.Fatal(err)
	}

	// CSV, read in pages of 2: one row per account; no quota for delta (it
	// has no monthly grant), its credits paid 5.
	out, stderr, err := quotadAdmin(t, n, adminTestToken, "usage", "--csv", "--page-size", "2")
	wantCSV := "period,account,plan,limit,units,quota,quota_used,overage,credits_used\n" +
		"2001-06,acme,pro,hard,55,100,55,0,0\n" +
		"2001-06,beta,metered,soft,25,10,25,15,0\n" +
		"2001-06,delta,metered,soft,5,,0,0,5\n"
	if err != nil || out != wantCSV || !strings.Contains(stderr, "quotad: warning: 2001-06 is not over (as of 2001-06-20T12:00:00Z)") {
		t.Fatalf("usage --csv: %v\n%s\nstderr %q\nwant\n%s", err, out, stderr, wantCSV)
	}
	out = mustAdmin(t, n, "usage", "--csv", "--by-route", "--period", "2001-06")
	wantRoutes := "period,account,route,units\n" +
		"2001-06,acme,GET /v1/tasks,30\n" +
		"2001-06,acme,POST /v1/exports,25\n" +
		"2001-06,beta,GET /v1/tasks,25\n" +
		"2001-06,delta,GET /v1/tasks,5\n"
	if out != wantRoutes {
		t.Fatalf("usage --csv --by-route:\n%s\nwant\n%s", out, wantRoutes)
	}
	out = mustAdmin(t, n, "usage")
	for _, want := range []string{
		"2001-06 is not over (as of 2001-06-20T12:00:00Z)",
		"ACCOUNT  PLAN     LIMIT  UNITS  QUOTA  QUOTA USED  OVERAGE  CREDITS USED",
		"beta     metered  soft   25     10     25          15       0",
		"delta    metered  soft   5      -      0           0        5",
		"3 accounts with usage or a monthly grant in 2001-06",
		"= total                  85                        15\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("usage lacks %q:\n%s", want, out)
		}
	}
	var exp node.UsageExport
	raw := mustAdmin(t, n, "usage", "--json", "--page-size", "1")
	if err := json.Unmarshal([]byte(raw), &exp); err != nil || exp.Period != "2001-06" || len(exp.Usage) != 3 ||
		exp.Usage[2].Account != "delta" || exp.Usage[2].Quota != nil || *exp.Usage[2].CreditsUsed != 5 || strings.Contains(raw, `"next"`) {
		t.Fatalf("usage --json (pages of 1): %v\n%s", err, raw)
	}

	// After the month: n9 holds June back until it is heard from again.
	clock.SetWall(time.Date(2001, 7, 1, 0, 0, 30, 0, time.UTC))
	out = mustAdmin(t, n, "usage", "--period", "2001-06")
	if !strings.Contains(out, "2001-06 is not final yet (as of 2001-07-01T00:00:30Z): 1 node was heard from during the month and has not settled everything it held since it ended") ||
		!strings.Contains(out, "n9 (incarnation n9-inc, last heard from 2001-06-20T12:00:00Z, settled through never, ring state -)") {
		t.Fatalf("usage of June with n9 silent:\n%s", out)
	}
	clock.SetWall(time.Date(2001, 7, 1, 0, 2, 0, 0, time.UTC))
	if _, err := l.RegisterNode(ctx, "n9", "n9-inc"); err != nil {
		t.Fatal(err)
	}
	out, stderr, err = quotadAdmin(t, n, adminTestToken, "usage", "--period", "2001-06", "--csv")
	if err != nil || out != wantCSV || stderr != "" {
		t.Fatalf("usage of a final June: %v\n%s\nstderr %q", err, out, stderr)
	}
	// Final, but a June charge refunded in July still lowers June: the
	// export says until when.
	if out := mustAdmin(t, n, "usage", "--period", "2001-06"); !strings.Contains(out, "2001-06 is final (as of 2001-07-01T00:02:00Z)") ||
		!strings.Contains(out, "refunds of its charges can still lower it until 2001-08-01T00:00:00Z") {
		t.Fatalf("usage of a final June:\n%s", out)
	}
	var juneExp node.UsageExport
	if raw := mustAdmin(t, n, "usage", "--period", "2001-06", "--json"); json.Unmarshal([]byte(raw), &juneExp) != nil ||
		!juneExp.Final || !juneExp.RefundsOpenUntil.Equal(time.Date(2001, 8, 1, 0, 0, 0, 0, time.UTC)) {
		t.Fatalf("usage --json of a final June: refunds_open_until %v, want 2001-08-01\n%s", juneExp.RefundsOpenUntil, raw)
	}
	if out := mustAdmin(t, n, "usage", "--period", "2099-01"); !strings.Contains(out, "2099-01 has not begun") {
		t.Fatalf("usage of a month to come:\n%s", out)
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"usage", "--period", "June"}, `--period "June": want a month such as 2026-06`},
		{[]string{"usage", "--page-size", "0"}, "--page-size 0: want a number of accounts from 1 to 10000"},
		{[]string{"usage", "--page-size", "10001"}, "--page-size 10001"},
		{[]string{"usage", "--json", "--by-route"}, "--json always carries by_route"},
		{[]string{"usage", "--csv", "--json"}, "--csv and --json are two formats: give one"},
		{[]string{"usage", "--period", "1969-12"}, `--period "1969-12": want a month such as 2026-06, from 1970-01 to 2261-12`},
	} {
		_, _, err := quotadAdmin(t, n, adminTestToken, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("quotad admin %s: %v, want an error with %q", strings.Join(tc.args, " "), err, tc.want)
		}
	}
}

// The pages of one export: the month of the first answer is asked for on
// every later page (a run across midnight at a month's end stays in one
// month), final only if every page said so, and the nodes named by any
// page, once each.
func TestQuotadAdminUsagePages(t *testing.T) {
	var mu sync.Mutex // protects asked and pages
	var asked []string
	pages := map[string]string{
		"": `{"period":"2026-06","as_of":"2026-07-01T00:00:10Z","final":false,"unsettled_nodes":[{"node":"n2"}],
			"usage":[{"account":"a","plan":"p","hard":true,"units":1,"quota":5,"quota_used":1,"overage":0,"credits_used":0,"by_route":{"GET /":1}}],"next":"a"}`,
		"a": `{"period":"2026-06","as_of":"2026-07-01T00:00:11Z","final":false,"unsettled_nodes":[{"node":"n2"},{"node":"n3"}],
			"usage":[{"account":"b","plan":"p","hard":false,"units":9,"quota":5,"quota_used":9,"overage":4,"credits_used":null,"by_route":{"GET /":9}}],"next":"b"}`,
		"b": `{"period":"2026-06","as_of":"2026-07-01T00:00:12Z","final":true,"unsettled_nodes":[],"usage":[]}`,
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		asked = append(asked, r.URL.RawQuery)
		page, ok := pages[r.URL.Query().Get("after")]
		if !ok {
			page = `{"period":"2026-06","usage":[],"next":"a"}` // a node that goes back
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, page)
	}))
	defer srv.Close()
	c := &adminClient{addr: srv.URL, http: srv.Client()}
	exp, err := c.usageExport(context.Background(), "", 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	wantAsked := []string{"limit=1", "after=a&limit=1&period=2026-06", "after=b&limit=1&period=2026-06"}
	if strings.Join(asked, " ") != strings.Join(wantAsked, " ") {
		t.Errorf("asked %q, want %q", asked, wantAsked)
	}
	mu.Unlock()
	if exp.Period != "2026-06" || exp.Final || len(exp.Usage) != 2 || exp.Usage[1].Overage != 4 || exp.Usage[1].CreditsUsed != nil ||
		len(exp.UnsettledNodes) != 2 || exp.UnsettledNodes[1].Node != "n3" || exp.Next != "" ||
		!exp.AsOf.Equal(time.Date(2026, 7, 1, 0, 0, 10, 0, time.UTC)) {
		t.Fatalf("export %+v", exp)
	}
	// --lost-node goes with every page.
	mu.Lock()
	asked = nil
	mu.Unlock()
	if _, err := c.usageExport(context.Background(), "2026-06", 1, []string{"q3", "q4"}); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	for _, q := range asked {
		if !strings.Contains(q, "lost_node=q3&lost_node=q4") {
			t.Errorf("a page asked %q, without the lost nodes", q)
		}
	}
	if len(asked) != 3 {
		t.Errorf("asked %q, want 3 pages", asked)
	}
	mu.Unlock()
	mu.Lock()
	pages["b"] = `{"period":"2026-06","usage":[],"next":"0"}`
	mu.Unlock()
	if _, err := c.usageExport(context.Background(), "", 1, nil); err == nil || !strings.Contains(err.Error(), `the node answered the page after "a" a second time (after the page after "0")`) {
		t.Fatalf("a next that goes back: %v", err)
	}
}

// Text cells a spreadsheet would evaluate as formulas are written as text.
func TestUsageCSVNeutralisesFormulas(t *testing.T) {
	exp := &node.UsageExport{Period: "2026-06", Usage: []node.AccountUsageView{
		{Account: "=1+2", Plan: "@SUM(1)", Units: 3, QuotaUsed: 3, ByRoute: map[string]int64{"-cmd": 3}},
		{Account: "acme", Plan: "pro", Units: 1, QuotaUsed: 1, ByRoute: map[string]int64{"GET /v1/x": 1}},
	}}
	var b strings.Builder
	if err := writeUsageCSV(&b, exp, false); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "\n2026-06,'=1+2,'@SUM(1),soft,3,") || !strings.Contains(b.String(), "\n2026-06,acme,pro,soft,1,") {
		t.Errorf("CSV:\n%s\nwant the formula-looking ids behind a ' and the others as they are", b.String())
	}
	b.Reset()
	if err := writeUsageCSV(&b, exp, true); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "2026-06,'=1+2,'-cmd,3\n") {
		t.Errorf("CSV by route:\n%s", b.String())
	}
}

// alerts resend of an account named "." reached no endpoint ("no admin
// endpoint POST /admin/v1/alerts/2026-12/80/resend"): its id went into the
// path unescaped, a dot-segment the node's mux cleaned away.
func TestAlertsResendOfADotAccount(t *testing.T) {
	n := startAdminTestNode(t)
	_, _, err := quotadAdmin(t, n, adminTestToken, "alerts", "resend", ".", "2026-12", "80")
	if err == nil || strings.Contains(err.Error(), "no admin endpoint") || !strings.Contains(err.Error(), "404") {
		t.Fatalf("alerts resend . 2026-12 80: %v; want the API's 404 for an alert it does not have", err)
	}
}

// An id is one path segment, whatever it holds: "." and ".." too, which
// unescaped are dot-segments the node's mux cleans away (the admin API
// takes them as ids when escaped).
func TestPathID(t *testing.T) {
	for id, want := range map[string]string{"acme": "acme", "team#42": "team%2342", "a?b": "a%3Fb", "a%63me": "a%2563me", "a/b": "a%2Fb",
		".": "%2E", "..": "%2E%2E", "...": "...", ".a": ".a"} {
		if got := pathID(id); got != want {
			t.Errorf("pathID(%q) = %q, want %q", id, got, want)
		}
	}
}
