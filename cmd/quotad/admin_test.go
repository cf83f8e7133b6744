package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/buildinfo"
	"github.com/quotaring/quotaring/internal/pki"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

const adminTestToken = "cli-test-token-0123456789abcdef"

// startAdminTestNode starts one in-process node with a SQLite ledger and the
// admin API on.
func startAdminTestNode(t *testing.T, mods ...func(*node.Config)) *node.Node {
	t.Helper()
	dir := t.TempDir()
	cfg := node.Config{ID: "n1", DataDir: filepath.Join(dir, "n1"),
		Ledger:  "sqlite:" + filepath.Join(dir, "ledger.db"),
		RPCAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", GossipAddr: "127.0.0.1:0",
		RingPreset: ring.PresetLocal, SettleInterval: 100 * time.Millisecond, SnapshotInterval: 100 * time.Millisecond,
		AdminToken: adminTestToken}
	for _, m := range mods {
		m(&cfg)
	}
	n, err := node.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Shutdown(context.Background()) })
	return n
}

// quotadAdmin runs `quotad admin ARGS...` in-process against n.
func quotadAdmin(t *testing.T, n *node.Node, token string, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	var out, errOut bytes.Buffer
	root := newRootCmd()
	root.SetArgs(append([]string{"admin", "--addr", n.AdminAddr(), "--token", token}, args...))
	root.SetOut(&out)
	root.SetErr(&errOut)
	err = root.ExecuteContext(context.Background())
	return out.String(), errOut.String(), err
}

func mustAdmin(t *testing.T, n *node.Node, args ...string) string {
	t.Helper()
	out, _, err := quotadAdmin(t, n, adminTestToken, args...)
	t.Logf("$ quotad admin %s\n%s", strings.Join(args, " "), out)
	if err != nil {
		t.Fatalf("quotad admin %s: %v", strings.Join(args, " "), err)
	}
	return out
}

func TestQuotadAdmin(t *testing.T) {
	for _, e := range adminEnv {
		t.Setenv(e.env, "") // not from the caller's shell
	}
	n := startAdminTestNode(t)
	ctx := context.Background()

	if out := mustAdmin(t, n, "plans", "set", "pro", "--rate", "10/s", "--burst", "20", "--quota", "1000", "--hard"); !strings.Contains(out, "plan pro set: rate 10/s, burst 20, 1000 units a month, hard") {
		t.Fatalf("plans set: %q", out)
	}
	mustAdmin(t, n, "plans", "set", "metered", "--quota", "50", "--soft")
	// The node's error names its field; the command shows the flag typed.
	if _, _, err := quotadAdmin(t, n, adminTestToken, "plans", "set", "big", "--quota", "4000000000000000000", "--hard"); err == nil || !strings.HasPrefix(err.Error(), "--quota: ") {
		t.Errorf("plans set with a quota past the bound: %v; want the error to name --quota", err)
	}
	if out := mustAdmin(t, n, "plans", "list"); !strings.Contains(out, "pro") || !strings.Contains(out, "metered") || !strings.Contains(out, "soft") {
		t.Fatalf("plans list: %q", out)
	}
	// plans set replaces every setting: leaving out --rate (or --burst, for
	// the same rate) of a plan that has one would remove it; refused,
	// naming the value that keeps it.
	for args, want := range map[string]string{
		"plans set pro --quota 2000 --hard":             "give --rate 10/s to keep it",
		"plans set pro --rate 10/s --quota 2000 --hard": "give --burst 20 to keep it",
		"plans set pro --burst 20 --quota 2000 --hard":  "give --rate 10/s to keep it",
	} {
		if _, _, err := quotadAdmin(t, n, adminTestToken, strings.Fields(args)...); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want a refusal saying %q", args, err, want)
		}
	}
	if out := mustAdmin(t, n, "plans", "list"); !strings.Contains(out, "10/s") {
		t.Fatalf("plans list after the refusals: %q, want pro's rate kept", out)
	}
	if out := mustAdmin(t, n, "plans", "set", "metered", "--rate", "none", "--quota", "60", "--soft"); !strings.Contains(out, "no rate limit, 60 units") {
		t.Fatalf("plans set --rate none: %q", out)
	}
	mustAdmin(t, n, "plans", "set", "limited", "--rate", "5/s", "--quota", "10", "--hard")
	if out := mustAdmin(t, n, "plans", "set", "limited", "--rate", "none", "--quota", "10", "--hard"); !strings.Contains(out, "no rate limit") {
		t.Fatalf("plans set --rate none on a plan with a rate: %q", out)
	}
	if out := mustAdmin(t, n, "accounts", "set", "acme", "--plan", "pro"); !strings.Contains(out, "account acme is on plan pro") {
		t.Fatalf("accounts set: %q", out)
	}

	// The key is printed once, with the reminder on stderr.
	out, warn, err := quotadAdmin(t, n, adminTestToken, "keys", "create", "acme")
	if err != nil || !strings.Contains(warn, "shown only once") {
		t.Fatalf("keys create: %v, stderr %q", err, warn)
	}
	var key string
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "key" {
			key = f[1]
		}
	}
	if !strings.HasPrefix(key, node.KeyPrefix) {
		t.Fatalf("keys create printed %q", out)
	}
	snap, err := n.Ledger().Snapshot(ctx, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	k, ok := snap.Key(snapshot.HashKey(key))
	if !ok || k.Account != "acme" {
		t.Fatalf("the printed key is not in the ledger (by hash): %+v", snap.Keys)
	}

	if out := mustAdmin(t, n, "grants", "add", "acme", "--units", "500", "--expires", "2200-01-01", "--id", "order-1"); !strings.Contains(out, "grant order-1: 500 units for acme") {
		t.Fatalf("grants add: %q", out)
	}
	// A retry of the same grant changes nothing; another under its id is refused.
	if out := mustAdmin(t, n, "grants", "add", "acme", "--units", "500", "--expires", "2200-01-01", "--id", "order-1"); !strings.Contains(out, "grant order-1 was there already, the same: 500 units") {
		t.Fatalf("a retry of grants add: %q", out)
	}
	if _, _, err := quotadAdmin(t, n, adminTestToken, "grants", "add", "acme", "--units", "501", "--id", "order-1"); err == nil || !strings.Contains(err.Error(), "(HTTP 409)") ||
		!strings.HasPrefix(err.Error(), "--id: ") {
		t.Fatalf("another grant under order-1: %v, want a 409 naming --id", err)
	}

	if out := mustAdmin(t, n, "routes", "set", "--default", "1", "GET /v1/tasks=1", "POST /v1/exports=25"); !strings.Contains(out, "2 patterns, default 1") {
		t.Fatalf("routes set: %q", out)
	}
	if out := mustAdmin(t, n, "routes", "show"); !strings.Contains(out, "POST /v1/exports") {
		t.Fatalf("routes show: %q", out)
	}
	// No patterns would wipe the table: refused without --clear.
	if _, _, err := quotadAdmin(t, n, adminTestToken, "routes", "set"); err == nil || !strings.Contains(err.Error(), "--clear") {
		t.Fatalf("routes set with no patterns: %v, want a refusal naming --clear", err)
	}
	if _, _, err := quotadAdmin(t, n, adminTestToken, "routes", "set", "--clear", "GET /x=1"); err == nil {
		t.Fatal("routes set --clear with a pattern: accepted")
	}
	if out := mustAdmin(t, n, "routes", "show"); !strings.Contains(out, "POST /v1/exports") {
		t.Fatalf("routes show after the refusals: %q, want the table untouched", out)
	}
	// A default other than 1 is not reset by leaving --default out.
	mustAdmin(t, n, "routes", "set", "--default", "0", "GET /v1/tasks=1")
	if _, _, err := quotadAdmin(t, n, adminTestToken, "routes", "set", "GET /v1/tasks=1", "POST /v1/exports=25"); err == nil || !strings.Contains(err.Error(), "give --default 0 to keep it") {
		t.Fatalf("routes set without --default over a default of 0: %v, want a refusal naming --default 0", err)
	}
	mustAdmin(t, n, "routes", "set", "--default", "1", "GET /v1/tasks=1", "POST /v1/exports=25")

	out = mustAdmin(t, n, "accounts", "show", "acme")
	for _, want := range []string{"plan     pro (rate 10/s, burst 20, 1000 units a month, hard)", k.ID, "order-1", "credits", "500", "2200-01-01T00:00:00Z"} {
		if !strings.Contains(out, want) {
			t.Fatalf("accounts show lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, key) {
		t.Fatal("accounts show prints the key's plaintext")
	}
	var v node.AccountView
	if err := json.Unmarshal([]byte(mustAdmin(t, n, "accounts", "show", "acme", "--json")), &v); err != nil || v.Plan.ID != "pro" || len(v.Grants) != 1 {
		t.Fatalf("accounts show --json: %+v %v", v, err)
	}
	if out := mustAdmin(t, n, "nodes"); !strings.Contains(out, "n1") || !strings.Contains(out, "serving") ||
		!strings.Contains(out, "BUILD") || !strings.Contains(out, buildinfo.Read().Short()) {
		t.Fatalf("nodes: %q, want n1 serving, with its build", out)
	}
	if out := mustAdmin(t, n, "reservations"); !strings.Contains(out, "total") || !strings.Contains(out, "n1 (the node that answered) holds what the ledger reserves for it") {
		t.Fatalf("reservations: %q", out)
	}
	// An alert claimed in the ledger (as a node does when acme crosses 80 %).
	june := shard.PeriodOf(time.Date(2026, 6, 28, 12, 0, 0, 0, time.UTC).UnixNano())
	if _, err := n.Ledger().RecordAlert(ctx, flush.AlertRecord{Account: "acme", Period: june, Threshold: 80, Used: 800, Limit: 1000,
		CrossedAt: time.Date(2026, 6, 28, 12, 0, 0, 0, time.UTC), Claim: "test"}); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Ledger().RecordAlert(ctx, flush.AlertRecord{Account: "acme", Period: june, Threshold: 100, Used: 1000, Limit: 1000,
		CrossedAt: time.Date(2026, 6, 29, 12, 0, 0, 0, time.UTC), Claim: "test"}); err != nil {
		t.Fatal(err)
	}
	if out := mustAdmin(t, n, "alerts", "--period", "2026-06", "--limit", "1"); !strings.Contains(out, "80%") || strings.Contains(out, "100%") ||
		!strings.Contains(out, "... more than 1: narrow with --account, --period or --state, or raise --limit") {
		t.Fatalf("alerts --limit 1:\n%s", out)
	}
	if out := mustAdmin(t, n, "alerts", "--period", "2026-07"); strings.Contains(out, "acme") {
		t.Fatalf("alerts --period 2026-07 lists June's:\n%s", out)
	}
	out = mustAdmin(t, n, "alerts", "--account", "acme")
	if !strings.Contains(out, "acme     2026-06  80%        800/1000    pending") || !strings.Contains(out, "2026-06-28T12:00:00Z") {
		t.Fatalf("alerts:\n%s", out)
	}
	// Resending: a given-up alert is pending again; a pending one is refused.
	gaveUp := flush.AlertRecord{Account: "acme", Period: june, Threshold: 80, Claim: "test"}
	if ok, err := n.Ledger().FinishAlert(ctx, gaveUp, flush.AlertGivenUp, 1, "the webhook answered 401"); err != nil || !ok {
		t.Fatalf("give up: %v %v", ok, err)
	}
	if out := mustAdmin(t, n, "alerts", "resend", "acme", "2026-06", "80"); !strings.Contains(out, "the 2026-06 80% alert of acme is pending again (1 attempt so far)") {
		t.Fatalf("alerts resend: %q", out)
	}
	if out := mustAdmin(t, n, "alerts", "--state", "delivered"); strings.Contains(out, "acme") {
		t.Fatalf("alerts --state delivered lists a pending one:\n%s", out)
	}
	if out := mustAdmin(t, n, "keys", "revoke", k.ID); !strings.Contains(out, "revoked") {
		t.Fatalf("keys revoke: %q", out)
	}

	// Errors are the server's detail.
	for _, tc := range []struct {
		token string
		args  []string
		want  string
	}{
		{adminTestToken, []string{"plans", "set", "x", "--rate", "ten", "--quota", "5", "--hard"}, `rate "ten": no /: want TOKENS/PERIOD`},
		{adminTestToken, []string{"accounts", "set", "beta", "--plan", "nope"}, `plan "nope" does not exist`},
		{adminTestToken, []string{"accounts", "show", "ghost"}, `account "ghost" does not exist (HTTP 404)`},
		{adminTestToken, []string{"routes", "set", "GET /v1/{id=2"}, "not a valid pattern"},
		{adminTestToken, []string{"routes", "set", "get /v1/tasks=1", "POST /v1/exports=25"}, `weights["get /v1/tasks"]: method "get" is not upper case`},
		{adminTestToken, []string{"routes", "set", "GET /v1/x"}, "want 'METHOD /pattern=UNITS'"},
		{adminTestToken, []string{"grants", "add", "acme", "--units", "5", "--expires", "soon"}, "--expires \"soon\""},
		{adminTestToken, []string{"plans", "set", "x", "--quota", "5"}, "hard soft"},
		{adminTestToken, []string{"alerts", "--state", "sent"}, `"sent": want pending, delivered, given_up or legacy`},
		{adminTestToken, []string{"alerts", "--period", "June"}, `"June": want a month such as 2026-06`},
		{adminTestToken, []string{"alerts", "--limit", "0"}, `"0": want a number from 1 to 10000`},
		{adminTestToken, []string{"alerts", "resend", "acme", "2026-06", "100"}, "the 2026-06 100% alert of acme is pending already"},
		{adminTestToken, []string{"alerts", "resend", "acme", "2026-05", "80"}, "no 2026-05 80% alert of acme in the ledger"},
		{adminTestToken, []string{"alerts", "resend", "acme", "June", "80"}, `"June": want a month such as 2026-06`},
		{adminTestToken, []string{"alerts", "resend", "acme", "2026-06", "180"}, `"180": want a percentage from 1 to 100`},
		{adminTestToken, []string{"alerts", "resend", "acme", "2026-06", "+80"}, `threshold "+80": want a percentage from 1 to 100`},
		{adminTestToken, []string{"alerts", "resend", "acme", "2026-06"}, "want ACCOUNT PERIOD THRESHOLD (such as: acme 2026-06 80), got 2 arguments"},
		{adminTestToken, []string{"alerts", "resend", "", "2026-06", "80"}, `account "": want 1 to 200 characters`},
		{adminTestToken, []string{"alerts", "--limit", "-5"}, `"-5": want a number from 1 to 10000`},
		{adminTestToken, []string{"alerts", "test"}, "this node sends no quota alerts: start quotad serve with --alert-webhook"},
		{"wrong-token", []string{"plans", "list"}, "the admin token is wrong"},
		{"", []string{"plans", "list"}, "no token given: set --token or QUOTAD_ADMIN_TOKEN"},
	} {
		_, _, err := quotadAdmin(t, n, tc.token, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("quotad admin %s: %v, want an error with %q", strings.Join(tc.args, " "), err, tc.want)
		}
	}

	// An account id that is not a plain path segment reaches the account.
	mustAdmin(t, n, "accounts", "set", "team#42", "--plan", "pro")
	if out := mustAdmin(t, n, "accounts", "show", "team#42"); !strings.Contains(out, "team#42") {
		t.Fatalf("accounts show team#42:\n%s", out)
	}
	// An empty route table, asked for.
	if out := mustAdmin(t, n, "routes", "set", "--clear", "--default", "2"); !strings.Contains(out, "0 patterns, default 2") {
		t.Fatalf("routes set --clear: %q", out)
	}
}

func TestQuotadAdminUnreachable(t *testing.T) {
	var out bytes.Buffer
	root := newRootCmd()
	root.SetArgs([]string{"admin", "--addr", "127.0.0.1:1", "--token", "x", "plans", "list"})
	root.SetOut(&out)
	root.SetErr(&out)
	err := root.ExecuteContext(context.Background())
	if err == nil || !strings.Contains(err.Error(), "cannot reach the admin API at http://127.0.0.1:1") {
		t.Fatalf("%v", err)
	}
}

// quotad admin pointed at a server that is not the admin API says so,
// instead of printing an empty success: another JSON API (here quotad
// bench upstream's answer), and a node's public port, whose problem says
// the key is unknown, or (without --upstream) that it serves no front.
func TestQuotadAdminWrongServer(t *testing.T) {
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"ok":true}`))
	}))
	defer other.Close()
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusUnauthorized)
		json.NewEncoder(w).Encode(map[string]any{"type": router.ProblemUnknownKey, "status": 401,
			"detail": "The API key is not known (revoked, mistyped, or not sent)."})
	}))
	defer front.Close()
	// A node without --upstream answers 404 on its public port, where the
	// command said to start it with --upstream.
	bare := startAdminTestNode(t)
	for _, tc := range []struct{ addr, want string }{
		{other.URL, "the answer is not the quotad admin API's"},
		{front.URL, "this answer came from a node's public HTTP port, --http-addr"},
		{"http://" + bare.HTTPAddr(), "this answer came from a node's public HTTP port, --http-addr"},
	} {
		for _, args := range [][]string{{"keys", "create", "acme"}, {"nodes"}} {
			var out bytes.Buffer
			root := newRootCmd()
			root.SetArgs(append([]string{"admin", "--addr", tc.addr, "--token", "x"}, args...))
			root.SetOut(&out)
			root.SetErr(&out)
			if err := root.ExecuteContext(context.Background()); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("admin %v at %s: %v (printed %q); want an error saying %q", args, tc.addr, err, out.String(), tc.want)
			}
		}
	}
}

func TestServeAlertFlags(t *testing.T) {
	var cfg node.Config
	af := serveAdminFlags{webhook: "http://billing/hooks", secret: "s", lease: 0, giveUp: time.Hour}
	if err := af.apply(&cfg, ""); err == nil || !strings.Contains(err.Error(), "--alert-lease 0s and --alert-give-up 1h0m0s must be positive") {
		t.Fatalf("a zero lease: %v", err)
	}
	af.lease = 2 * time.Hour
	if err := af.apply(&cfg, ""); err == nil || !strings.Contains(err.Error(), "--alert-give-up 1h0m0s is less than twice --alert-lease 2h0m0s") {
		t.Fatalf("a give-up age shorter than the lease: %v", err)
	}
	af.lease = 5 * time.Second
	if err := af.apply(&cfg, "tok"); err == nil || !strings.Contains(err.Error(), "--alert-lease 5s: want at least 30s") {
		t.Fatalf("a lease shorter than a webhook call's round: %v", err)
	}
	cfg.TestFaults = true // chaos tests shorten it, to see takeovers
	if err := af.apply(&cfg, "tok"); err != nil || cfg.AlertLease != 5*time.Second || cfg.AlertGiveUp != time.Hour || cfg.AlertWebhook != "http://billing/hooks" {
		t.Fatalf("%v %+v", err, cfg)
	}
	cfg.TestFaults = false
	af.lease = 30 * time.Second
	for webhook, want := range map[string]string{
		"http://127.0.0.1:99999/hooks":        `--alert-webhook http://127.0.0.1:99999/hooks: port "99999" is not a number from 1 to 65535`,
		"http://:8081/hooks":                  "--alert-webhook http://:8081/hooks: the URL names no host",
		"https://billing/hooks#quota":         "a #fragment is never sent",
		"ftp://billing/hooks":                 "want an absolute http:// or https:// URL",
		"https://u:pw@billing:0/hooks?t=tok1": `--alert-webhook https://u@billing:0/hooks?…: port "0"`,
	} {
		af.webhook = webhook
		if err := af.apply(&cfg, ""); err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "pw") || strings.Contains(err.Error(), "tok1") {
			t.Errorf("--alert-webhook %s: %v, want %q, without the password or query", webhook, err, want)
		}
	}
}

// quotad admin alerts test: the receiver's answer and what it means, and
// exit status 1 unless it took the alert.
func TestQuotadAdminAlertTest(t *testing.T) {
	const secret = "cli-test-secret-0123456789"
	var mu sync.Mutex // protects status and got
	status, got := http.StatusNoContent, 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		ts := r.Header.Get(node.AlertTimestampHeader)
		mu.Lock()
		defer mu.Unlock()
		if r.Header.Get(node.AlertSignatureHeader) != node.SignAlert([]byte(secret), ts, body) || !strings.Contains(string(body), `"test":true`) {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		got++
		w.WriteHeader(status)
	}))
	defer srv.Close()
	n := startAdminTestNode(t, func(c *node.Config) { c.AlertWebhook, c.AlertSecret = srv.URL+"/hooks/quota", secret })
	if out := mustAdmin(t, n, "alerts", "test"); !strings.Contains(out, "test alert to "+srv.URL+"/hooks/…: the receiver answered 204") ||
		!strings.Contains(out, "the receiver took it") {
		t.Fatalf("alerts test: %q", out)
	}
	mu.Lock()
	status = http.StatusForbidden
	mu.Unlock()
	out, _, err := quotadAdmin(t, n, adminTestToken, "alerts", "test")
	if err == nil || !strings.Contains(out, "answered 403") || !strings.Contains(out, "--alert-secret") {
		t.Fatalf("alerts test against a receiver that refuses: %q, %v; want exit 1 and a hint about the secret", out, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if got != 2 {
		t.Fatalf("the receiver verified %d test alerts, want 2", got)
	}
}

// quotad serve's settings and quotad admin's can be exported in one shell:
// QUOTAD_ADMIN_ADDR (serve's host:port) does not steer quotad admin, which
// takes the node's URL from QUOTAD_ADMIN_URL and the shared
// QUOTAD_ADMIN_TOKEN.
func TestQuotadAdminEnvBesideServe(t *testing.T) {
	n := startAdminTestNode(t)
	t.Setenv("QUOTAD_ADMIN_ADDR", "127.0.0.1:1") // a node's --admin-addr, nothing listening
	t.Setenv("QUOTAD_ADMIN_URL", "http://"+n.AdminAddr())
	t.Setenv("QUOTAD_ADMIN_TOKEN", adminTestToken)
	t.Setenv("QUOTAD_ADMIN_JSON", "")
	t.Setenv("QUOTAD_ADMIN_TIMEOUT", "")
	var out, errOut bytes.Buffer
	root := newRootCmd()
	root.SetArgs([]string{"admin", "plans", "list"})
	root.SetOut(&out)
	root.SetErr(&errOut)
	if err := root.ExecuteContext(context.Background()); err != nil {
		t.Fatalf("quotad admin plans list with QUOTAD_ADMIN_URL beside QUOTAD_ADMIN_ADDR: %v", err)
	}
	if errOut.Len() > 0 {
		t.Fatalf("warnings: %s", errOut.String())
	}

	// A variable that went wrong is named.
	t.Setenv("QUOTAD_ADMIN_URL", "http://127.0.0.1:1")
	_, err := runQuotad(t, "admin", "plans", "list")
	if err == nil || !strings.Contains(err.Error(), "cannot reach the admin API at http://127.0.0.1:1") ||
		!strings.Contains(err.Error(), "--addr came from the environment variable QUOTAD_ADMIN_URL") {
		t.Fatalf("an unreachable QUOTAD_ADMIN_URL: %v", err)
	}
	// Also for the flags read before the command runs (--ca-cert).
	t.Setenv("QUOTAD_ADMIN_CA_CERT", filepath.Join(t.TempDir(), "missing.pem"))
	_, err = runQuotad(t, "admin", "plans", "list")
	if err == nil || !strings.Contains(err.Error(), "--ca-cert came from the environment variable QUOTAD_ADMIN_CA_CERT") {
		t.Fatalf("a QUOTAD_ADMIN_CA_CERT that does not exist: %v", err)
	}
	os.Unsetenv("QUOTAD_ADMIN_CA_CERT")
	// A variable that does not parse is the one error: its flag is not
	// then reported with a zero value no one gave.
	t.Setenv("QUOTAD_ADMIN_TIMEOUT", "5")
	_, err = runQuotad(t, "admin", "plans", "list")
	if err == nil || !strings.Contains(err.Error(), `QUOTAD_ADMIN_TIMEOUT="5"`) || strings.Contains(err.Error(), "--timeout 0s") {
		t.Fatalf("QUOTAD_ADMIN_TIMEOUT=5: %v, want the variable named and no made-up --timeout 0s", err)
	}
}

// The old usage, QUOTAD_ADMIN_ADDR=http://... for quotad admin, is refused
// with the new name rather than ignored for the default node.
func TestQuotadAdminOldAddrVariable(t *testing.T) {
	t.Setenv("QUOTAD_ADMIN_ADDR", "http://127.0.0.1:1")
	t.Setenv("QUOTAD_ADMIN_URL", "")
	_, err := runQuotad(t, "admin", "--token", "x", "plans", "list")
	if err == nil || !strings.Contains(err.Error(), "export QUOTAD_ADMIN_URL=http://127.0.0.1:1 and unset QUOTAD_ADMIN_ADDR") {
		t.Fatalf("QUOTAD_ADMIN_ADDR=http://... for quotad admin: %v, want an error naming QUOTAD_ADMIN_URL", err)
	}
	// --addr on the command line wins, as always (it names another port).
	_, err = runQuotad(t, "admin", "--addr", "127.0.0.1:2", "--token", "x", "plans", "list")
	if err == nil || !strings.Contains(err.Error(), "cannot reach the admin API at http://127.0.0.1:2") {
		t.Fatalf("--addr with QUOTAD_ADMIN_ADDR=http://... set: %v", err)
	}
}

// quotad admin's variables are nobody else's, but for the token that
// serve's --admin-token shares on purpose.
func TestAdminEnvOwnNames(t *testing.T) {
	other := map[string]string{}
	var walk func(*cobra.Command)
	walk = func(c *cobra.Command) {
		if c.Name() == "admin" {
			return
		}
		c.LocalFlags().VisitAll(func(f *pflag.Flag) { other[envName(f.Name)] = c.CommandPath() + " --" + f.Name })
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(newRootCmd())
	for _, e := range adminEnv {
		if by, ok := other[e.env]; ok && e.env != "QUOTAD_ADMIN_TOKEN" {
			t.Errorf("quotad admin --%s's %s is also the twin of %s", e.flag, e.env, by)
		}
	}
	if other["QUOTAD_ADMIN_TOKEN"] != "quotad serve --admin-token" {
		t.Errorf("QUOTAD_ADMIN_TOKEN is not quotad serve's --admin-token (%q)", other["QUOTAD_ADMIN_TOKEN"])
	}
}

// quotad admin's commands' flags have no environment twins, and a variable
// that looks like one is warned about, not read: QUOTAD_UNITS=7 quotad admin
// grants add acme still wants --units.
func TestQuotadAdminFlagsHaveNoTwins(t *testing.T) {
	var w bytes.Buffer
	warnUnknownEnv(&w, newRootCmd(), []string{"QUOTAD_UNITS=7", "QUOTAD_PLAN=pro", "QUOTAD_ADDR=http://q1:9090", "QUOTAD_TOKEN=x",
		"QUOTAD_RATE=100", "QUOTAD_TIMEOUT=5s", "QUOTAD_ADMIN_URL=http://q1:9090", "QUOTAD_ADMIN_TIMEOUT=5s"})
	want := "quotad: warning: QUOTAD_UNITS is not read: the flags of quotad admin's commands have no environment twins; give --units on the command line\n" +
		"quotad: warning: QUOTAD_PLAN is not read: the flags of quotad admin's commands have no environment twins; give --plan on the command line\n" +
		"quotad: warning: QUOTAD_ADDR is not read: quotad admin's --addr is set by QUOTAD_ADMIN_URL\n" +
		"quotad: warning: QUOTAD_TOKEN is not read: quotad admin's --token is set by QUOTAD_ADMIN_TOKEN\n"
	// QUOTAD_RATE and QUOTAD_TIMEOUT are other commands' (quotad chaos --rate,
	// quotad bench proxy --timeout).
	if got := w.String(); got != want {
		t.Fatalf("warnings:\n%s\nwant:\n%s", got, want)
	}

	for _, e := range adminEnv {
		t.Setenv(e.env, "")
	}
	t.Setenv("QUOTAD_UNITS", "7")
	stderr, err := runQuotad(t, "admin", "--addr", "127.0.0.1:1", "--token", "x", "grants", "add", "acme")
	if err == nil || !strings.Contains(err.Error(), `required flag(s) "units" not set`) || !strings.Contains(stderr, "QUOTAD_UNITS is not read") {
		t.Fatalf("QUOTAD_UNITS=7 quotad admin grants add acme: %v, stderr %q; want --units required and a warning about QUOTAD_UNITS", err, stderr)
	}
}

// quotad admin against a node whose admin port serves HTTPS
// (--admin-tls-*): it works with https:// and --ca-cert (or its twin), and
// each way of getting it wrong says what to change.
func TestQuotadAdminHTTPS(t *testing.T) {
	for _, e := range adminEnv {
		t.Setenv(e.env, "")
	}
	dir := t.TempDir()
	ca, _ := pki.NewCA("admin CA")
	files, err := ca.WriteFiles(dir, "admin", pki.Names{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	n := startAdminTestNode(t, func(c *node.Config) { c.AdminTLS = router.CertFiles{Cert: files.Cert, Key: files.Key} })
	https := "https://" + n.AdminAddr()
	run := func(args ...string) (string, error) {
		var out bytes.Buffer
		root := newRootCmd()
		root.SetArgs(append([]string{"admin", "--token", adminTestToken}, args...))
		root.SetOut(&out)
		root.SetErr(io.Discard)
		err := root.ExecuteContext(context.Background())
		return out.String(), err
	}
	if out, err := run("--addr", https, "--ca-cert", files.CA, "plans", "set", "pro", "--quota", "100", "--hard"); err != nil {
		t.Fatalf("over HTTPS with --ca-cert: %v", err)
	} else if !strings.Contains(out, "plan pro set") {
		t.Fatalf("over HTTPS: %q", out)
	}
	t.Setenv("QUOTAD_ADMIN_CA_CERT", files.CA)
	if _, err := run("--addr", https, "plans", "list"); err != nil {
		t.Fatalf("over HTTPS with QUOTAD_ADMIN_CA_CERT: %v", err)
	}
	t.Setenv("QUOTAD_ADMIN_CA_CERT", "")
	for name, tc := range map[string]struct {
		args []string
		want string
	}{
		"a CA the system does not know": {[]string{"--addr", https}, "give the CA that issued it with --ca-cert"},
		"http:// to an HTTPS port":      {[]string{"--addr", n.AdminAddr()}, "serves HTTPS (the node has --admin-tls-cert): use https://"},
		"--ca-cert with http://":        {[]string{"--addr", "http://" + n.AdminAddr(), "--ca-cert", files.CA}, "is not https://: the token would travel in the clear"},
		"--ca-cert of a key":            {[]string{"--addr", https, "--ca-cert", files.Key}, "holds no PEM certificate"},
	} {
		_, err := run(append(tc.args, "plans", "list")...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error saying %q", name, err, tc.want)
		}
	}
}

// quotad admin reads its token from the file QUOTAD_ADMIN_TOKEN_FILE names
// (a mounted Secret), without the file's line break; a file that is not
// there, or a token also in QUOTAD_ADMIN_TOKEN, is an error that names the
// variable.
func TestQuotadAdminTokenFile(t *testing.T) {
	n := startAdminTestNode(t)
	t.Setenv("QUOTAD_ADMIN_URL", "http://"+n.AdminAddr())
	t.Setenv("QUOTAD_ADMIN_TOKEN", "")
	file := filepath.Join(t.TempDir(), "admin-token")
	if err := os.WriteFile(file, []byte(adminTestToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("QUOTAD_ADMIN_TOKEN_FILE", file)
	if _, err := runQuotad(t, "admin", "plans", "list"); err != nil {
		t.Fatalf("quotad admin plans list with QUOTAD_ADMIN_TOKEN_FILE: %v", err)
	}
	t.Setenv("QUOTAD_ADMIN_TOKEN", adminTestToken)
	if _, err := runQuotad(t, "admin", "plans", "list"); err == nil || !strings.Contains(err.Error(), "both QUOTAD_ADMIN_TOKEN and QUOTAD_ADMIN_TOKEN_FILE are set") {
		t.Fatalf("both variables set: %v", err)
	}
	t.Setenv("QUOTAD_ADMIN_TOKEN", "")
	t.Setenv("QUOTAD_ADMIN_TOKEN_FILE", file+".missing")
	if _, err := runQuotad(t, "admin", "plans", "list"); err == nil || !strings.Contains(err.Error(), "QUOTAD_ADMIN_TOKEN_FILE: open "+file+".missing") {
		t.Fatalf("a missing file: %v", err)
	}
}

// A give-up age under twice the lease gives an alert whose first round
// failed up at the sweep that was to take it over: refused.
func TestServeAlertGiveUpLeavesATakeover(t *testing.T) {
	var cfg node.Config
	af := serveAdminFlags{webhook: "http://billing/hooks", secret: "s", lease: 10 * time.Minute, giveUp: 10 * time.Minute}
	if err := af.apply(&cfg, ""); err == nil || !strings.Contains(err.Error(), "less than twice --alert-lease") {
		t.Fatalf("--alert-give-up equal to --alert-lease: %v, want it refused", err)
	}
	af.giveUp = 20 * time.Minute
	if err := af.apply(&cfg, ""); err != nil {
		t.Fatalf("--alert-give-up twice --alert-lease: %v", err)
	}
}

// quotad admin reservations compares the ledger's rows of the node that
// answered with what that node holds, and names the grants that differ:
// units the ledger reserves for a node that holds none are stranded
// (spendable by nobody until it stops), unless its units in doubt cover
// them.
func TestPrintReservationsComparesTheAnsweringNode(t *testing.T) {
	ledger := []reservationRow{
		{"n1", "acme", "m:2026-12", 10},
		{"n1", "hard-033", "m:2026-12", 2},
		{"n2", "acme", "m:2026-12", 7},
	}
	held := []reservationRow{{"n1", "acme", "m:2026-12", 10}, {"n1", "zed", "credits", 3}}
	print := func(self string, ledger, held []reservationRow, doubt int64, unsettled ...reservationRow) string {
		var b strings.Builder
		tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
		printReservations(tw, self, ledger, held, unsettled, doubt)
		tw.Flush()
		t.Logf("\n%s", b.String())
		return b.String()
	}
	lines := func(out string) map[string]string { // account+grant -> its line, of n1's rows
		m := map[string]string{}
		for _, l := range strings.Split(out, "\n") {
			if f := strings.Fields(l); len(f) >= 5 && f[0] == "n1" {
				m[f[1]+" "+f[2]] = strings.Join(f, " ")
			}
		}
		return m
	}

	out := print("n1", ledger, held[:1], 0)
	if l := lines(out); l["acme m:2026-12"] != "n1 acme m:2026-12 10 10 0" || l["hard-033 m:2026-12"] != "n1 hard-033 m:2026-12 2 0 0 differs" {
		t.Fatalf("n1's rows: %q", l)
	}
	if !strings.Contains(out, "n2    acme") || !strings.Contains(out, "7      -") {
		t.Fatalf("another node's row is not shown as the ledger's only:\n%s", out)
	}
	if !strings.Contains(out, "holds 10 of the 12 units the ledger reserves for it, 0 in doubt: 2 units look stranded") {
		t.Fatalf("no stranded units named:\n%s", out)
	}
	if out := print("n1", ledger, held[:1], 2); !strings.Contains(out, "the 2 units it counts in doubt") || strings.Contains(out, "stranded") {
		t.Fatalf("units in doubt covering the difference:\n%s", out)
	}
	out = print("n1", ledger[:1], held, 0)
	if l := lines(out); l["zed credits"] != "n1 zed credits 0 3 0 differs" || !strings.Contains(out, "holds 13 units and the ledger reserves 10 for it: 3 units no grant backs") {
		t.Fatalf("units held with no row in the ledger:\n%s", out)
	}
	if out := print("n1", ledger[:1], held[:1], 0); !strings.Contains(out, "holds what the ledger reserves for it: 10 units") {
		t.Fatalf("agreeing:\n%s", out)
	}
	// Units its charges not settled yet spent: reserved in the ledger
	// until they settle, neither stranded nor differing.
	out = print("n1", ledger[:2], held[:1], 0, reservationRow{"n1", "hard-033", "m:2026-12", 2})
	if l := lines(out); l["hard-033 m:2026-12"] != "n1 hard-033 m:2026-12 2 0 2" || strings.Contains(out, "stranded") ||
		!strings.Contains(out, "holds what the ledger reserves for it: 12 units") || !strings.Contains(out, "spent 2 of its reserved units (UNSETTLED)") {
		t.Fatalf("units spent by unsettled charges:\n%s", out)
	}
	if out := print("", ledger, nil, 0); strings.Contains(out, "HELD BY") || !strings.Contains(strings.Join(strings.Fields(out), " "), "total 19") {
		t.Fatalf("an older quotad's answer (the ledger's rows only):\n%s", out)
	}
}

// An id stored before a rule it breaks (NFD, as macOS writes names) can
// still be changed through the command, which checks new ids before the
// call; a new such id is refused there.
func TestQuotadAdminStoredIDs(t *testing.T) {
	for _, e := range adminEnv {
		t.Setenv(e.env, "")
	}
	n := startAdminTestNode(t)
	mustAdmin(t, n, "plans", "set", "pro", "--quota", "100", "--hard")
	if err := n.Ledger().UpsertAccount(context.Background(), "mu\u0308ller", "pro"); err != nil {
		t.Fatal(err)
	}
	mustAdmin(t, n, "accounts", "set", "mu\u0308ller", "--plan", "pro")
	if _, _, err := quotadAdmin(t, n, adminTestToken, "accounts", "set", "schu\u0308tz", "--plan", "pro"); err == nil || !strings.Contains(err.Error(), "not in Unicode normal form NFC") {
		t.Errorf("accounts set of a new NFD id: %v, want it refused", err)
	}
}
