package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/quotaring/quotaring/node"
)

// adminNoNode runs quotad admin ARGS against an address where nothing
// listens: an error other than "cannot reach" was found before the call.
func adminNoNode(t *testing.T, args ...string) error {
	t.Helper()
	var out bytes.Buffer
	root := newRootCmd()
	root.SetArgs(append([]string{"admin", "--addr", "127.0.0.1:1", "--token", "x"}, args...))
	root.SetOut(&out)
	root.SetErr(&out)
	return root.ExecuteContext(context.Background())
}

// The ids of new plans, accounts and grants are checked as the admin API
// checks them, before the call; looking an id up is not.
func TestQuotadAdminNewIDs(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"accounts", "set", "acme\u200b", "--plan", "pro"}, `account id "acme\u200b": character 5 (U+200B, at byte 5) is a format character`},
		{[]string{"accounts", "set", "acme\u00a0", "--plan", "pro"}, "is a space"},
		{[]string{"accounts", "set", "acme\xff", "--plan", "pro"}, "byte 5 (0xFF) is not UTF-8"},
		{[]string{"plans", "set", "pro\u0085", "--quota", "1", "--hard"}, `plan id "pro\u0085": character 4 (U+0085, at byte 4) is a control character`},
		{[]string{"grants", "add", "acme", "--units", "5", "--id", "order\u200b1"}, `--id "order\u200b1": character 6 (U+200B, at byte 6) is a format character`},
	} {
		if err := adminNoNode(t, c.args...); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("quotad admin %q: %v, want it refused before the call, saying %q", c.args, err, c.want)
		}
	}
	// An account stored before the check can still be shown.
	if err := adminNoNode(t, "accounts", "show", "acme\u200b"); err == nil || !strings.Contains(err.Error(), "cannot reach") {
		t.Errorf("accounts show of an id stored before the check: %v, want it asked of the node", err)
	}
}

// Flags are checked as typed: --soft=false made a soft plan, --period ""
// (an unset variable) meant the current month, and the node's errors named
// its fields (monthly_quota) rather than the flags.
func TestQuotadAdminFlagsAsTyped(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"plans", "set", "pro", "--quota", "5", "--soft=false"}, "--soft=false: say what the plan is, --hard or --soft"},
		{[]string{"plans", "set", "pro", "--quota", "-5", "--hard"}, "--quota -5: want 0 or more"},
		{[]string{"grants", "add", "acme", "--units", "0"}, "--units 0: want 1 or more"},
		{[]string{"accounts", "show", "acme", "--period", ""}, "--period is empty (an unset variable?)"},
		{[]string{"usage", "--period", ""}, "--period is empty"},
		{[]string{"alerts", "--account", ""}, "--account is empty"},
		// Read as their defaults, these gave a second grant on a retry, a
		// grant that never lapses and a plan without its rate limit.
		{[]string{"grants", "add", "acme", "--units", "5", "--id", ""}, "--id is empty"},
		{[]string{"grants", "add", "acme", "--units", "5", "--expires", ""}, "--expires is empty"},
		{[]string{"grants", "add", "acme", "--units", "5", "--starts", ""}, "--starts is empty"},
		{[]string{"plans", "set", "pro", "--quota", "5", "--hard", "--rate", ""}, "--rate is empty"},
		{[]string{"--ca-cert", "", "nodes"}, "--ca-cert is empty"},
	} {
		if err := adminNoNode(t, c.args...); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("quotad admin %q: %v, want it refused before the call, saying %q", c.args, err, c.want)
		}
	}
	if got, err := parseWhen("starts", "2026-07-01T00:00:00.75Z"); err != nil || got != "2026-07-01T00:00:00.75Z" {
		t.Errorf("--starts with a fraction of a second: %q, %v; want it kept", got, err)
	}
}

// Months past 2261 wrapped around (accounts show --period 9999-12 showed
// 1816-02): every --period has the bounds of the ledger, checked before
// the call.
func TestQuotadAdminPeriodBounds(t *testing.T) {
	for _, args := range [][]string{
		{"accounts", "show", "acme", "--period", "9999-12"}, {"accounts", "show", "acme", "--period", "2262-05"},
		{"alerts", "--period", "9999-12"}, {"alerts", "resend", "acme", "2262-01", "80"}, {"usage", "--period", "1969-12"},
	} {
		if err := adminNoNode(t, args...); err == nil || !strings.Contains(err.Error(), "want a month such as 2026-06, from 1970-01 to 2261-12") {
			t.Errorf("quotad admin %q: %v, want it refused before the call, giving the bounds", args, err)
		}
	}
	if err := adminNoNode(t, "accounts", "show", "acme", "--period", "2261-12"); err == nil || !strings.Contains(err.Error(), "cannot reach") {
		t.Errorf("accounts show --period 2261-12: %v, want it asked of the node", err)
	}
}

// A node that does not answer within --timeout is not called unreachable:
// the command says it timed out and, for a change, that the change may or
// may not have been applied.
func TestQuotadAdminTimeout(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		// A node whose ledger hangs: no answer until the client gives up.
		// NB: the body read first, or the server would not notice the
		// client leaving and cancel the context.
		io.Copy(io.Discard, r.Body)
		<-r.Context().Done()
	}))
	defer srv.Close()
	run := func(args ...string) error {
		root := newRootCmd()
		root.SetArgs(append([]string{"admin", "--addr", srv.URL, "--token", "x", "--timeout", "100ms"}, args...))
		root.SetOut(io.Discard)
		root.SetErr(io.Discard)
		return root.ExecuteContext(context.Background())
	}
	// NB: with --rate and --burst, plans set makes no read before its write.
	err := run("plans", "set", "pro", "--quota", "5", "--hard", "--rate", "10/s", "--burst", "20")
	if err == nil || strings.Contains(err.Error(), "cannot reach") || !strings.Contains(err.Error(), "no answer within --timeout 100ms") ||
		!strings.Contains(err.Error(), "may or may not have been applied") {
		t.Errorf("a write timing out: %v", err)
	}
	err = run("plans", "list")
	if err == nil || strings.Contains(err.Error(), "cannot reach") || !strings.Contains(err.Error(), "no answer within --timeout 100ms") ||
		strings.Contains(err.Error(), "applied") {
		t.Errorf("a read timing out: %v", err)
	}
	// The default outlasts the node's own bound on the ledger, after which
	// it answers 503 saying nothing was changed.
	if adminDefaultTimeout <= node.AdminLedgerTimeout {
		t.Errorf("--timeout's default %s is not longer than the node's %s", adminDefaultTimeout, node.AdminLedgerTimeout)
	}
}
