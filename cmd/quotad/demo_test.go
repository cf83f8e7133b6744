package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/cluster"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
)

// TestDemo runs `quotad demo --duration 30s` as a process, its stdout a
// pipe (so plain output), and holds it to its summary: exit 0, no
// overshoot, no lost usage, and every acknowledged unit settled, through
// the kill -9 and the restart it does half way.
func TestDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("the demo runs for 30s; skipped with -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	t0 := time.Now()
	bin, err := cluster.Build(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("built quotad in %.1fs", time.Since(t0).Seconds())
	dir := filepath.Join(t.TempDir(), "demo")
	cmd := exec.CommandContext(ctx, bin, "demo", "--duration", "30s", "--dir", dir)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	t1 := time.Now()
	err = cmd.Run()
	took := time.Since(t1)
	text := out.String()
	if err != nil || t.Failed() {
		t.Logf("quotad demo output:\n%s", text)
		for _, log := range []string{"n1.log", "n2.log", "n3.log"} {
			if b, rerr := os.ReadFile(filepath.Join(dir, log)); rerr == nil {
				t.Logf("--- %s (last lines):\n%s", log, tail(string(b), 15))
			}
		}
		t.Fatalf("quotad demo --duration 30s: %v (after %s)", err, took.Round(time.Second))
	}
	t.Logf("the demo took %.1fs", took.Seconds())
	defer func() {
		if t.Failed() {
			t.Logf("quotad demo output:\n%s", text)
		}
	}()
	acked, settled := summaryValue(t, text, "acknowledged"), summaryValue(t, text, "settled")
	if over := summaryValue(t, text, "overshoot"); over != 0 {
		t.Errorf("overshoot: %d units acknowledged beyond a hard limit", over)
	}
	if lost := summaryValue(t, text, "lost"); lost != 0 {
		t.Errorf("lost: %d acknowledged units are not in the ledger", lost)
	}
	if acked == 0 || acked != settled {
		t.Errorf("acknowledged %d units, settled %d: want them equal and above zero", acked, settled)
	}
	if !regexp.MustCompile(`(?m)^reconcile: clean `).MatchString(text) {
		t.Error("the summary has no clean reconcile line")
	}
	// The failover happened, for real, and the story is told.
	for _, want := range []*regexp.Regexp{
		regexp.MustCompile(`SIGKILL n\d \(pid \d+\)`),
		regexp.MustCompile(`declared n\d dead after`),
		regexp.MustCompile(`n\d ready after [\d.]+s: it replayed its log`),
		regexp.MustCompile(`spam-co: 429 `),
		regexp.MustCompile(`curl -i -H 'X-Api-Key: demo_you_[0-9a-f]{12}' http://127\.0\.0\.10:\d+/v1/tasks`),
		regexp.MustCompile(`http://127\.0\.0\.10:\d+/status`),
		// Quota alerts: the three customers that pass 80 % of their month's
		// quota get a signed webhook, delivered and recorded in the ledger.
		regexp.MustCompile(`alert webhook: free-co reached 80 % of its \d{4}-\d\d quota \(\d+ of \d+ units\); signature checked`),
		regexp.MustCompile(`quota alerts \(signed webhooks at 80 % and 100 % of the month's quota\): acme 80%, .*free-co 80%, .*globex 80%`),
		regexp.MustCompile(`\d in the ledger, \d delivered to the sample API's webhook, signatures checked`),
	} {
		if !want.MatchString(text) {
			t.Errorf("the output lacks %s", want)
		}
	}
	for _, bad := range []string{"refused for a bad signature", "that the webhook never took", "given up (see the node logs"} {
		if strings.Contains(text, bad) {
			t.Errorf("quota alerts: %s", bad)
		}
	}
	if strings.Contains(text, "\x1b[") {
		t.Error("ANSI escapes in the output of a demo whose stdout is not a terminal")
	}
	if _, err := os.Stat(dir); err == nil {
		if entries, _ := os.ReadDir(dir); len(entries) > 0 {
			t.Errorf("the demo left %d entries in --dir %s without --keep", len(entries), dir)
		}
	}
}

// summaryValue reads "name: N" from the summary's parseable lines.
func summaryValue(t *testing.T, text, name string) int64 {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + name + `: (\d+)$`).FindStringSubmatch(text)
	if m == nil {
		t.Fatalf("the summary has no line %q", name+": N")
	}
	v, _ := strconv.ParseInt(m[1], 10, 64)
	return v
}

func tail(s string, lines int) string {
	parts := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(parts) > lines {
		parts = parts[len(parts)-lines:]
	}
	return strings.Join(parts, "\n")
}

// The flags are checked before anything starts.
func TestDemoFlags(t *testing.T) {
	full := t.TempDir()
	os.WriteFile(filepath.Join(full, "x"), nil, 0o644)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--nodes", "0"}, "--nodes 0: want 1 to 9"},
		{[]string{"--nodes", "10"}, "--nodes 10"},
		{[]string{"--duration", "5s"}, "--duration 5s: want 10s to 30m"},
		{[]string{"--dir", full}, "is not empty"},
	} {
		var out bytes.Buffer
		root := newRootCmd()
		root.SetArgs(append([]string{"demo"}, tc.args...))
		root.SetOut(&out)
		root.SetErr(&out)
		err := root.ExecuteContext(context.Background())
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("quotad demo %s: %v, want an error with %q", strings.Join(tc.args, " "), err, tc.want)
		}
	}
	var out bytes.Buffer
	root := newRootCmd()
	root.SetArgs([]string{"demo", "--help"})
	root.SetOut(&out)
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	for _, flag := range []string{"--duration", "--nodes", "--dir", "--keep", "--plain", "SIGKILL"} {
		if !strings.Contains(out.String(), flag) {
			t.Errorf("quotad demo --help does not mention %s", flag)
		}
	}
}

func TestFailoverPlan(t *testing.T) {
	for _, tc := range []struct {
		nodes         int
		dur           time.Duration
		kill, restart time.Duration
		ok            bool
	}{
		{3, 60 * time.Second, 24 * time.Second, 36 * time.Second, true},
		{3, 30 * time.Second, 12 * time.Second, 18 * time.Second, true},
		{2, 30 * time.Second, 12 * time.Second, 18 * time.Second, true},
		{1, 60 * time.Second, 0, 0, false},
		{3, 12 * time.Second, 0, 0, false},
	} {
		kill, restart, ok := failoverPlan(tc.nodes, tc.dur)
		if kill != tc.kill || restart != tc.restart || ok != tc.ok {
			t.Errorf("failoverPlan(%d, %s) = %s, %s, %v; want %s, %s, %v", tc.nodes, tc.dur, kill, restart, ok, tc.kill, tc.restart, tc.ok)
		}
	}
}

// The sample API creates one task per (account, Idempotency-Key), as an API
// behind quotaring should: the proxy bills a retry once and still sends it
// on, and a reviewer got two tasks from the retry the demo tells you to try.
func TestDemoAPICreatesOneTaskPerKey(t *testing.T) {
	a := &demoAPI{}
	req := func(account, key string) *http.Request {
		r := httptest.NewRequest("POST", "/v1/tasks", nil)
		r.Header.Set(router.HeaderAccount, account)
		if key != "" {
			r.Header.Set("Idempotency-Key", key)
		}
		return r
	}
	first := a.createTask(req("acme", "order-1"))
	if again := a.createTask(req("acme", "order-1")); again != first {
		t.Errorf("a retry with the key created %s, want %s again", again, first)
	}
	if other := a.createTask(req("globex", "order-1")); other == first {
		t.Errorf("another account's request with the same key got %s's task", first)
	}
	if a.createTask(req("acme", "")) == a.createTask(req("acme", "")) {
		t.Error("two requests without a key got one task")
	}
}

// The alerts that differ from what the webhook took fail the demo: they
// were only shown in red, and the demo said OK and exited 0. An alert
// still pending is not a failure (its lease runs on after the demo).
func TestDemoAlertProblems(t *testing.T) {
	d := &demoRun{out: io.Discard, api: &demoAPI{}}
	d.api.badAlerts.Store(1)
	d.api.alerts = []node.Alert{{Account: "acme", Period: "2026-06", Threshold: 80}}
	june := shard.PeriodOf(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC).UnixNano())
	problems := d.alertLines([]flush.AlertRecord{
		{Account: "acme", Period: june, Threshold: 80, State: flush.AlertDelivered},
		{Account: "acme", Period: june, Threshold: 100, State: flush.AlertDelivered}, // never taken
		{Account: "beta", Period: june, Threshold: 80, State: flush.AlertPending},
	})
	if got := strings.Join(problems, "; "); got != "1 alerts refused by the webhook for a bad signature; 1 alerts marked delivered that the webhook never took" {
		t.Errorf("problems: %q", got)
	}
}

// A --dir the demo cannot create is named by its flag: it printed only
// "mkdir ...: no such file or directory". (/proc takes no directories,
// root's included.)
func TestDemoDirThatCannotBeMade(t *testing.T) {
	const dir = "/proc/quotaring-demo-test/demo"
	_, _, err := demoDir(dir)
	if err == nil || !strings.Contains(err.Error(), "--dir "+dir+": cannot create it") {
		t.Fatalf("demo --dir under /proc: %v; want --dir named", err)
	}
}

// The live view's REFUSED/S counts decided refusals, as the status page
// does: with the charges answered quota-unavailable in it, the two
// disagreed (0.3 a second against "0 refused").
func TestDemoViewCountsDecidedRefusals(t *testing.T) {
	m := parseMetrics(strings.NewReader(`# TYPE quotaring_charges_total counter
quotaring_charges_total{reason="ok",result="ok"} 300
quotaring_charges_total{reason="quota_exceeded",result="refused"} 4
quotaring_charges_total{reason="rate_limited",result="refused"} 2
quotaring_charges_total{reason="unavailable",result="refused"} 12
`))
	if m["ok"] != 300 || m["refused"] != 6 || m["quotaring_charges_total"] != 318 {
		t.Errorf("parsed %v, want ok 300, refused 6 (quota-unavailable left out), total 318", m)
	}
}
