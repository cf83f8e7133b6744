package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
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
