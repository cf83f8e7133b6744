package main

import (
	"bytes"
	"context"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/quotaring/quotaring/internal/pki"
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
func TestParseGossipKeys(t *testing.T) {
	if k, err := parseGossipKeys(""); k != nil || err != nil {
		t.Fatalf("empty: %v %v, want no key", k, err)
	}
	if k, err := parseGossipKeys("MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=\n"); err != nil || len(k) != 1 || string(k[0]) != "0123456789abcdef0123456789abcdef" {
		t.Fatalf("32 bytes: %q %v", k, err)
	}
	if k, err := parseGossipKeys("MDEyMzQ1Njc4OWFiY2RlZg==, ZmVkY2JhOTg3NjU0MzIxMA=="); err != nil || len(k) != 2 || string(k[0]) != "0123456789abcdef" || string(k[1]) != "fedcba9876543210" {
		t.Fatalf("two keys (rotating): %q %v", k, err)
	}
	for in, want := range map[string]string{
		"not base64!":                "--gossip-key: key 1 is not base64",
		"c2hvcnQ=":                   "--gossip-key: key 1 is 5 bytes once decoded, want 16, 24 or 32: make one with openssl rand -base64 32",
		"MDEyMzQ1Njc4OWFiY2RlZg==,,": "--gossip-key: key 2 is 0 bytes",
	} {
		if _, err := parseGossipKeys(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("parseGossipKeys(%q): %v, want %q", in, err, want)
		}
	}
}

func TestParseRPCTokens(t *testing.T) {
	if tok, err := parseRPCTokens(""); tok != nil || err != nil {
		t.Fatalf("empty: %v %v", tok, err)
	}
	if tok, err := parseRPCTokens("new-token-0123456789, old-token-0123456789"); err != nil || len(tok) != 2 || tok[0] != "new-token-0123456789" {
		t.Fatalf("two tokens (rotating): %q %v", tok, err)
	}
	if _, err := parseRPCTokens("new-token-0123456789,short"); err == nil || !strings.Contains(err.Error(), "--rpc-token: token 2 is 5 characters; use at least 16") {
		t.Fatalf("a short second token: %v", err)
	}
}

// The --rpc-tls-* flags go together, and a node refuses files that cannot
// work before it binds a port, naming the file.
func TestServeRPCTLSFlags(t *testing.T) {
	dir := t.TempDir()
	ca, err := pki.NewCA("test CA")
	if err != nil {
		t.Fatal(err)
	}
	files, err := ca.WriteFiles(dir, "node", pki.Names{})
	if err != nil {
		t.Fatal(err)
	}
	base := []string{"serve", "--data-dir", filepath.Join(dir, "n1"), "--ledger", "sqlite:" + filepath.Join(dir, "ledger.db"),
		"--rpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--gossip-addr", "127.0.0.1:0"}
	for name, tc := range map[string]struct {
		args []string
		want string
	}{
		"a certificate alone": {[]string{"--rpc-tls-cert", files.Cert}, "missing --rpc-tls-key, --rpc-tls-ca"},
		"a server name alone": {[]string{"--rpc-tls-server-name", "quotad.internal"}, "--rpc-tls-server-name is set without"},
		"the key as CA": {[]string{"--rpc-tls-cert", files.Cert, "--rpc-tls-key", files.Key, "--rpc-tls-ca", files.Key},
			files.Key + " holds no PEM certificate"},
	} {
		root := newRootCmd()
		root.SetArgs(append(slices.Clone(base), tc.args...))
		root.SetOut(io.Discard)
		root.SetErr(io.Discard)
		err := root.ExecuteContext(context.Background())
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error saying %q", name, err, tc.want)
		}
	}
}
