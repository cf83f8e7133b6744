package main

import (
	"bytes"
	"strings"
	"testing"
)

// A misspelt QUOTAD_* variable is reported, a real one is not.
func TestWarnUnknownEnv(t *testing.T) {
	var w bytes.Buffer
	warnUnknownEnv(&w, newRootCmd(), []string{"QUOTAD_SETTLE_INTRVAL=1s", "QUOTAD_SETTLE_INTERVAL=1s", "QUOTAD_ADMIN_TOKEN=x", "HOME=/root"})
	if got := w.String(); !strings.Contains(got, "QUOTAD_SETTLE_INTRVAL") || strings.Count(got, "\n") != 1 {
		t.Fatalf("warnings:\n%s\nwant one, for QUOTAD_SETTLE_INTRVAL", got)
	}
}

// Commands that take no arguments refuse them; variadic ones still work.
func TestStrayArguments(t *testing.T) {
	root := newRootCmd()
	for _, args := range [][]string{{"migrate", "extra"}, {"reconcile", "x"}, {"serve", "x"}} {
		c, rest, err := root.Find(args)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Args(c, rest); err == nil {
			t.Errorf("quotad %s: stray argument accepted", strings.Join(args, " "))
		}
	}
	c, rest, err := root.Find([]string{"admin", "routes", "set", "GET /a=1", "POST /b=2"})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Args(c, rest); err != nil {
		t.Errorf("admin routes set with patterns: %v", err)
	}
}

// --gossip-key is base64 of an AES key; anything else is refused, naming
// the flag and how to make a good one.
func TestParseGossipKey(t *testing.T) {
	if k, err := parseGossipKey(""); k != nil || err != nil {
		t.Fatalf("empty: %v %v, want no key", k, err)
	}
	if k, err := parseGossipKey("MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=\n"); err != nil || string(k) != "0123456789abcdef0123456789abcdef" {
		t.Fatalf("32 bytes: %q %v", k, err)
	}
	for in, want := range map[string]string{
		"not base64!": "--gossip-key: not base64",
		"c2hvcnQ=":    "--gossip-key: 5 bytes once decoded, want 16, 24 or 32: make one with openssl rand -base64 32",
	} {
		if _, err := parseGossipKey(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("parseGossipKey(%q): %v, want %q", in, err, want)
		}
	}
}
