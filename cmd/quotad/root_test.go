package main

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/pflag"

	"github.com/quotaring/quotaring/internal/buildinfo"
	"github.com/quotaring/quotaring/internal/pki"
)

// A misspelt QUOTAD_* variable is reported, a real one is not.
func TestWarnUnknownEnv(t *testing.T) {
	var w bytes.Buffer
	warnUnknownEnv(&w, newRootCmd(), []string{"QUOTAD_SETTLE_INTRVAL=1s", "QUOTAD_SETTLE_INTERVAL=1s", "QUOTAD_ADMIN_TOKEN=x", "QUOTAD_ADMIN_URL=http://q1:9090", "QUOTAD_ADMIN_ADDR=:9090", "HOME=/root"})
	if got := w.String(); !strings.Contains(got, "QUOTAD_SETTLE_INTRVAL") || strings.Count(got, "\n") != 1 {
		t.Fatalf("warnings:\n%s\nwant one, for QUOTAD_SETTLE_INTRVAL", got)
	}
	// quotad --version's flag has no twin: QUOTAD_VERSION sets nothing,
	// and was passed over in silence.
	w.Reset()
	warnUnknownEnv(&w, newRootCmd(), []string{"QUOTAD_VERSION=true"})
	if !strings.Contains(w.String(), "QUOTAD_VERSION matches no flag") {
		t.Errorf("QUOTAD_VERSION: warnings %q, want one", w.String())
	}
}

// Commands that take no arguments refuse them; variadic ones still work.
func TestStrayArguments(t *testing.T) {
	root := newRootCmd()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"migrate", "extra"}, `quotad migrate takes no arguments, only flags (got "extra")`},
		{[]string{"reconcile", "x"}, "quotad reconcile takes no arguments"},
		{[]string{"serve", "x"}, "quotad serve takes no arguments"},
		{[]string{"revoke", "n1"}, "did you mean --node n1?"},
		{[]string{"prune", "2026-10"}, "did you mean --before 2026-10?"},
		{[]string{"admin", "nodes", "x"}, "quotad admin nodes takes no arguments"},
	} {
		c, rest, err := root.Find(tc.args)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Args(c, rest); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("quotad %s: %v, want %q", strings.Join(tc.args, " "), err, tc.want)
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

// A mistyped subcommand of a group fails, suggesting the right one; the
// group alone still prints its help and succeeds.
func TestUnknownSubcommand(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"bench", "clsuter"}, `unknown command "clsuter" for quotad bench (its commands: cluster, engine, proxy, upstream): did you mean quotad bench cluster?`},
		{[]string{"admin", "plan"}, `unknown command "plan" for quotad admin`},
		{[]string{"admin", "keys", "rm"}, `unknown command "rm" for quotad admin keys`},
		// cobra's help command printed "Unknown help topic" and exited 0.
		{[]string{"help", "sevre"}, "help sevre: no such command; quotad --help lists them"},
		{[]string{"help", "admin", "nosuch"}, "help admin nosuch: no such command"},
	} {
		if _, err := runQuotad(t, tc.args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("quotad %s: %v, want %q", strings.Join(tc.args, " "), err, tc.want)
		}
	}
	var out bytes.Buffer
	root := newRootCmd()
	root.SetArgs([]string{"bench"})
	root.SetOut(&out)
	if err := root.Execute(); err != nil || !strings.Contains(out.String(), "cluster") {
		t.Fatalf("quotad bench: %v\n%s", err, out.String())
	}
	for _, args := range [][]string{{"help", "serve"}, {"help", "admin", "grants", "add"}, {"help"}} {
		var out bytes.Buffer
		root := newRootCmd()
		root.SetArgs(args)
		root.SetOut(&out)
		if err := root.Execute(); err != nil || !strings.Contains(out.String(), "Usage:") {
			t.Errorf("quotad %s: %v\n%s; want the help, exit 0", strings.Join(args, " "), err, out.String())
		}
	}
}

func TestVersion(t *testing.T) {
	build := buildinfo.Read()
	run := func(args ...string) string {
		t.Helper()
		var out bytes.Buffer
		root := newRootCmd()
		root.SetArgs(args)
		root.SetOut(&out)
		root.SetErr(io.Discard)
		if err := root.Execute(); err != nil {
			t.Fatalf("quotad %s: %v", strings.Join(args, " "), err)
		}
		return out.String()
	}
	long := run("version")
	if long != build.String() || !strings.HasPrefix(long, "quotad "+build.Version+"\n") || !strings.Contains(long, "built with go") {
		t.Errorf("quotad version:\n%s", long)
	}
	if got := run("--version"); got != long {
		t.Errorf("quotad --version:\n%s\nwant as quotad version:\n%s", got, long)
	}
	if got := run("version", "--short"); got != build.Short()+"\n" {
		t.Errorf("quotad version --short: %q, want %q", got, build.Short())
	}
}

// --gossip-key is base64 of an AES key; anything else is refused, naming
// the flag and how to make a good one.
func TestParseGossipKeys(t *testing.T) {
	if k, _, err := parseGossipKeys(""); k != nil || err != nil {
		t.Fatalf("empty: %v %v, want no key", k, err)
	}
	if k, _, err := parseGossipKeys("MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=\n"); err != nil || len(k) != 1 || string(k[0]) != "0123456789abcdef0123456789abcdef" {
		t.Fatalf("32 bytes: %q %v", k, err)
	}
	if k, _, err := parseGossipKeys("MDEyMzQ1Njc4OWFiY2RlZg==, ZmVkY2JhOTg3NjU0MzIxMA=="); err != nil || len(k) != 2 || string(k[0]) != "0123456789abcdef" || string(k[1]) != "fedcba9876543210" {
		t.Fatalf("two keys (rotating): %q %v", k, err)
	}
	for in, want := range map[string]string{
		"not base64!":                "--gossip-key: key 1 is not base64",
		"c2hvcnQ=":                   "--gossip-key: key 1 is 5 bytes once decoded, want 16, 24 or 32: make one with openssl rand -base64 32",
		"MDEyMzQ1Njc4OWFiY2RlZg==,,": "--gossip-key: key 2 is 0 bytes",
		// openssl rand -hex 32: 64 hex digits decode as base64 to 48 bytes.
		"MDEyMzQ1Njc4OWFiY2RlZg==," + strings.Repeat("ab", 32): "key 2 is 64 hex digits (openssl rand -hex?), but keys are base64",
	} {
		if _, _, err := parseGossipKeys(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("parseGossipKeys(%q): %v, want %q", in, err, want)
		}
	}
	// openssl rand -hex 16: 32 hex digits decode as base64 to a valid
	// 24-byte key, not the one written. Taken with a warning (a cluster
	// started with it has no other spelling of its key to upgrade to), and
	// named so that serve warns of it.
	if k, hex, err := parseGossipKeys("MDEyMzQ1Njc4OWFiY2RlZg==,3f1a9c0e5b7d2468ace0135792468bdf"); err != nil || len(k) != 2 || len(k[1]) != 24 || !slices.Equal(hex, []int{2}) {
		t.Errorf("a hex key: %d keys, hex %v, %v; want it taken and named", len(k), hex, err)
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
		"an HTTPS certificate without its key": {[]string{"--http-tls-cert", files.Cert}, "HTTPS needs --http-tls-cert and --http-tls-key together"},
		"an admin key without its certificate": {[]string{"--admin-tls-key", files.Key}, "HTTPS needs --admin-tls-cert and --admin-tls-key together"},
		"an admin pair swapped":                {[]string{"--admin-tls-cert", files.Key, "--admin-tls-key", files.Cert}, "--admin-tls: load"},
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

// runQuotad runs quotad ARGS... in-process and returns its error.
func runQuotad(t *testing.T, args ...string) (stderr string, err error) {
	t.Helper()
	var errOut bytes.Buffer
	root := newRootCmd()
	root.SetArgs(args)
	root.SetOut(io.Discard)
	root.SetErr(&errOut)
	err = root.ExecuteContext(context.Background())
	return errOut.String(), err
}

// A bad flag value that came from the environment is reported with the
// variable that set it; the same value typed on the command line is not.
func TestServeNamesEnvInErrors(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("QUOTAD_DATA_DIR", filepath.Join(dir, "n1"))
	t.Setenv("QUOTAD_LEDGER", "sqlite:"+filepath.Join(dir, "ledger.db"))
	t.Setenv("QUOTAD_ADMIN_ADDR", "http://127.0.0.40:20190")
	_, err := runQuotad(t, "serve")
	if err == nil || !strings.Contains(err.Error(), `--admin-addr "http://127.0.0.40:20190" is a URL: want host:port`) ||
		!strings.Contains(err.Error(), "--admin-addr came from the environment variable QUOTAD_ADMIN_ADDR") {
		t.Fatalf("QUOTAD_ADMIN_ADDR=http://...: %v\nwant an error naming --admin-addr and QUOTAD_ADMIN_ADDR", err)
	}
	_, err = runQuotad(t, "serve", "--admin-addr", "127.0.0.1:9090:1")
	if err == nil || !strings.Contains(err.Error(), `--admin-addr "127.0.0.1:9090:1": want host:port`) || strings.Contains(err.Error(), "environment") {
		t.Fatalf("--admin-addr on the command line: %v\nwant an error naming the flag and not the environment", err)
	}
}

// explainEnv names the variable behind a flag that an error names or whose
// value it quotes (errors from package node quote the value), keeps the
// error's chain (exit codes), and leaves other errors alone.
func TestExplainEnv(t *testing.T) {
	fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
	fs.String("admin-addr", "", "")
	fs.String("admin-token", "", "")
	fs.String("rpc-tls", "", "")
	fs.String("typed", "", "")
	fs.StringSlice("join", nil, "")
	fs.String("data-dir", "", "")
	if err := setFromEnv(fs, "data-dir", "QUOTAD_DATA_DIR", "/var/lib/app"); err != nil {
		t.Fatal(err)
	}
	if err := setFromEnv(fs, "join", "QUOTAD_JOIN", "q1:7946,q2:x"); err != nil {
		t.Fatal(err)
	}
	if err := setFromEnv(fs, "admin-addr", "QUOTAD_ADMIN_ADDR", "a:b:c"); err != nil {
		t.Fatal(err)
	}
	if err := setFromEnv(fs, "rpc-tls", "QUOTAD_RPC_TLS", "x"); err != nil {
		t.Fatal(err)
	}
	fs.Set("typed", "a:b:c")
	for in, want := range map[string]string{
		`node: admin address "a:b:c": too many colons`: `node: admin address "a:b:c": too many colons (--admin-addr came from the environment variable QUOTAD_ADMIN_ADDR)`,
		`--admin-addr is bad`:                          `--admin-addr is bad (--admin-addr came from the environment variable QUOTAD_ADMIN_ADDR)`,
		`--rpc-tls-cert is missing`:                    `--rpc-tls-cert is missing`, // another flag
		`--typed "y" and --admin-token are bad`:        `--typed "y" and --admin-token are bad`,
		`ring: seed "q2:x": bad port`:                  `ring: seed "q2:x": bad port (--join came from the environment variable QUOTAD_JOIN)`,                     // a list's entry
		`wal: data dir /var/lib/app is not empty`:      `wal: data dir /var/lib/app is not empty (--data-dir came from the environment variable QUOTAD_DATA_DIR)`, // a path, bare
	} {
		if got := explainEnv(fs, errors.New(in)).Error(); got != want {
			t.Errorf("explainEnv(%q) = %q, want %q", in, got, want)
		}
	}
	ee := &exitError{code: 3, err: errors.New("--admin-addr differs")}
	if got := explainEnv(fs, ee); exitCode(got) != 3 {
		t.Errorf("explainEnv lost the exit code: %v", got)
	}
	if explainEnv(fs, nil) != nil {
		t.Error("explainEnv(nil) is not nil")
	}
}

// The front's and the alerts' flags are checked at start, named in the
// error, whether or not --upstream and --alert-webhook are set.
func TestServeFrontAndAlertFlags(t *testing.T) {
	dir := t.TempDir()
	base := []string{"serve", "--data-dir", filepath.Join(dir, "n1"), "--ledger", "sqlite:" + filepath.Join(dir, "ledger.db"),
		"--rpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--gossip-addr", "127.0.0.1:0"}
	cases := map[string]struct {
		args []string
		want string
	}{
		"bill-on":              {[]string{"--bill-on", "never"}, `--bill-on "never": want success, 2xx or always`},
		"quota-status":         {[]string{"--quota-status", "500"}, "--quota-status 500: want 429, 402 or 403"},
		"max-body-bytes":       {[]string{"--max-body-bytes", "-5"}, "--max-body-bytes -5: want a positive size, or -1 for no limit"},
		"upstream-timeout":     {[]string{"--upstream-timeout", "0"}, "--upstream-timeout 0s: want a positive duration"},
		"body-idle-timeout":    {[]string{"--body-idle-timeout", "0"}, "--body-idle-timeout 0: want a duration such as 60s"},
		"body-timeout":         {[]string{"--body-timeout", "-1s"}, "--body-timeout -1s: want a duration such as 10m, or 0 for no bound"},
		"usage-path":           {[]string{"--usage-path", "nope"}, `--usage-path "nope": want a path starting with /`},
		"alert-thresholds":     {[]string{"--alert-thresholds", "0,150"}, "--alert-thresholds: 0 is not a percentage from 1 to 100"},
		"max-clock-offset":     {[]string{"--max-clock-offset", "100ms"}, "--max-clock-offset 100ms: want at least 250ms"},
		"dedup-max-ids":        {[]string{"--dedup-max-ids", "10"}, "--dedup-max-ids 10: want 1000 to 10000000 Idempotency-Keys remembered per account"},
		"dedup-max-replays":    {[]string{"--dedup-max-replays", "-1"}, "--dedup-max-replays -1: want 0 to 1000000 served retries of one Idempotency-Key, 0 for no bound (default 10)"},
		"test-clock-offset":    {[]string{"--test-clock-offset", "1h"}, "--test-clock-offset is a chaos test's fault: it needs --test-faults"},
		"advertise-host":       {[]string{"--advertise-host", "quotad-0.quotad"}, `--advertise-host "quotad-0.quotad": want this node's IP address`},
		"events off reconcile": {[]string{"--events=false", "--reconcile-interval", "15m"}, "--reconcile-interval 15m0s with --events=false: reconcile checks the ledger's counters against its event log"},
		"node-id comma":        {[]string{"--node-id", "q1,q2"}, `--node-id "q1,q2": want a non-empty id without spaces, commas, slashes or control characters`},
		"node-id too long":     {[]string{"--node-id", strings.Repeat("q", 200)}, "--node-id is 200 bytes: want at most 128"},
		"cors-origins":         {[]string{"--cors-origins", "https://app.example/"}, `--cors-origins: router: CORS origin "https://app.example/": want scheme://host[:port]`},
		"node-id control":      {[]string{"--node-id", "q1\x1b[31m"}, `--node-id "q1\x1b[31m"`},
		"upgrades none and":    {[]string{"--upgrades", "none,websocket"}, `--upgrades "none,websocket": "none" allows no protocol switch and stands alone`},
		"upgrades h2c":         {[]string{"--upgrades", "websocket,h2c"}, "--upgrades: router: upgrade h2c cannot be allowed"},
		"upgrades empty":       {[]string{"--upgrades", ""}, "--upgrades is empty"},
		"http-tls half":        {[]string{"--http-tls-cert", "cert.pem"}, "HTTPS needs --http-tls-cert and --http-tls-key together; --http-tls-key is missing"},
		"settle-interval":      {[]string{"--settle-interval", "1ns"}, "--settle-interval 1ns: want at least 10ms"},
		"snapshot-interval":    {[]string{"--snapshot-interval", "10ms"}, "--snapshot-interval 10ms: want at least 100ms"},
		"ledger-timeout":       {[]string{"--ledger-timeout", "1ms"}, "--ledger-timeout 1ms: want at least 100ms"},
		"settle-timeout":       {[]string{"--settle-timeout", "1ns"}, "--settle-timeout 1ns: want at least 100ms"},
		"drain-timeout":        {[]string{"--drain-timeout", "0"}, "--drain-timeout 0s: want a positive duration"},
		"reconcile-interval":   {[]string{"--reconcile-interval", "1s"}, "--reconcile-interval 1s: want at least 1m0s"},
		"reservation-audit":    {[]string{"--reservation-audit", "10ms"}, "--reservation-audit 10ms: want at least 1s"},
		"upstream port":        {[]string{"--upstream", "http://127.0.0.1:99999"}, `--upstream http://127.0.0.1:99999: port "99999" is not a number from 1 to 65535`},
		"upstream host":        {[]string{"--upstream", "http://:8081"}, "--upstream http://:8081: the URL names no host"},
		"upstream fragment":    {[]string{"--upstream", "http://127.0.0.1:8081/api#v1"}, "a #fragment is never sent"},
		"upstream user":        {[]string{"--upstream", "http://u:secret@127.0.0.1:8081"}, "--upstream http://u:xxxxx@127.0.0.1:8081: the proxy does not send a user and password"},
	}
	for name, tc := range cases {
		for _, upstream := range [][]string{nil, {"--upstream", "http://127.0.0.1:1"}} {
			ctx, cancel := context.WithCancel(context.Background())
			cancel() // NB: a node that starts anyway stops at once, and the error below names no flag
			root := newRootCmd()
			root.SetArgs(append(append(slices.Clone(base), upstream...), tc.args...))
			root.SetOut(io.Discard)
			root.SetErr(io.Discard)
			err := root.ExecuteContext(ctx)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s %v: %v, want an error saying %q", name, upstream, err, tc.want)
			}
		}
	}
}

// --events=false keeps no event log, so the periodic reconcile, which
// checks the counters against it, is off unless asked for (refused above).
func TestServeEventsOffTurnsReconcileOff(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var stderr bytes.Buffer
	root := newRootCmd()
	root.SetArgs([]string{"serve", "--data-dir", filepath.Join(dir, "n1"), "--ledger", "sqlite:" + filepath.Join(dir, "ledger.db"), "--events=false",
		"--rpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--gossip-addr", "127.0.0.1:0"})
	root.SetOut(io.Discard)
	root.SetErr(&stderr)
	root.ExecuteContext(ctx) // NB: stops at once; the config was made first
	if !strings.Contains(stderr.String(), "periodic reconcile is off: --events=false keeps no event log") {
		t.Fatalf("serve --events=false said:\n%s\nwant the periodic reconcile turned off, saying why", stderr.String())
	}
}

// A --join list written with spaces after its commas (as lists often are,
// in QUOTAD_JOIN above all) is read without them: " 127.0.0.1:7947" was
// refused as a host that is no IP address or DNS name.
func TestServeTrimsTheJoinList(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // NB: the node stops at once, after checking its ring's settings
	root := newRootCmd()
	root.SetArgs([]string{"serve", "--data-dir", filepath.Join(dir, "n1"), "--ledger", "sqlite:" + migratedSQLite(t), "--join", "127.0.0.1:7946, 127.0.0.1:7947",
		"--rpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--gossip-addr", "127.0.0.1:0"})
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	if err := root.ExecuteContext(ctx); err != nil && strings.Contains(err.Error(), "join address") {
		t.Fatalf("--join with a space after its comma: %v", err)
	}
}

// A --ledger that can never work is refused before the data dir is
// opened: the dir is not created, nor bound to a node id that a corrected
// command line would then contradict.
func TestServeChecksTheLedgerBeforeTheDataDir(t *testing.T) {
	dir := t.TempDir()
	for ledger, want := range map[string]string{
		"foo":                              "is neither form this quotad accepts",
		"postgres://u:pw@host:notaport/db": "does not parse",
		"sqlite:":                          "want sqlite:/path/to/ledger.db",
	} {
		data := filepath.Join(dir, "n1")
		ctx, cancel := context.WithCancel(context.Background())
		root := newRootCmd()
		root.SetArgs([]string{"serve", "--data-dir", data, "--ledger", ledger, "--rpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
			"--admin-addr", "127.0.0.1:0", "--gossip-addr", "127.0.0.1:0"})
		root.SetOut(io.Discard)
		root.SetErr(io.Discard)
		err := root.ExecuteContext(ctx)
		cancel()
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), ":pw@") {
			t.Errorf("--ledger %q: %v; want an error saying %q, without the password", ledger, err, want)
		}
		if _, err := os.Stat(data); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("--ledger %q: the data dir exists after the refusal (%v)", ledger, err)
		}
	}
}

// A node that joins a cluster on an SQLite path with no ledger there (a
// mistyped --ledger) is refused before anything is created: it made a new
// ledger, became ready and owned accounts that ledger knew nothing of. The
// first node of a cluster (no --join) still creates the ledger.
func TestServeRefusesToJoinOnANewSQLiteLedger(t *testing.T) {
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty.db")
	if err := os.WriteFile(empty, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	// Another program's database: it was migrated into a new ledger, and
	// the node served on it.
	foreign := filepath.Join(dir, "other-app.db")
	db, err := sql.Open("sqlite", foreign)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)"); err != nil {
		t.Fatal(err)
	}
	db.Close()
	before, err := os.ReadFile(foreign)
	if err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{filepath.Join(dir, "ledgr.db"), empty, foreign} {
		data := filepath.Join(dir, "n2")
		root := newRootCmd()
		root.SetArgs([]string{"serve", "--node-id", "n2", "--data-dir", data, "--ledger", "sqlite:" + path, "--join", "127.0.0.1:7946",
			"--rpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--gossip-addr", "127.0.0.1:0"})
		root.SetOut(io.Discard)
		root.SetErr(io.Discard)
		err := root.ExecuteContext(context.Background())
		if err == nil || !strings.Contains(err.Error(), "there is no SQLite ledger at "+path) || !strings.Contains(err.Error(), "without --join") {
			t.Fatalf("--ledger sqlite:%s with --join: %v; want a refusal naming the path", path, err)
		}
		if _, err := os.Stat(data); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the data dir exists after the refusal (%v)", err)
		}
		if path == foreign {
			if after, err := os.ReadFile(foreign); err != nil || !bytes.Equal(after, before) {
				t.Errorf("%s was changed by the refusal (%v)", path, err)
			}
			continue
		}
		if fi, err := os.Stat(path); path != empty && !errors.Is(err, os.ErrNotExist) || path == empty && (err != nil || fi.Size() != 0) {
			t.Errorf("%s was created or changed by the refusal (%v)", path, err)
		}
	}
	if err := checkJoinedSQLite("sqlite:"+filepath.Join(dir, "new.db"), nil); err != nil {
		t.Errorf("the first node (no --join) on a new SQLite ledger: %v, want it allowed", err)
	}
}

// A node stopped while it starts (SIGTERM as a pod is deleted, Ctrl-C) has
// nothing to drain and exits 0; it said "the ledger is unreachable" and
// exited 1 with "become serving: context canceled".
func TestServeStoppedWhileStartingExitsCleanly(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	root := newRootCmd()
	root.SetArgs([]string{"serve", "--node-id", "n1", "--data-dir", filepath.Join(dir, "n1"), "--ledger", "sqlite:" + filepath.Join(dir, "ledger.db"),
		"--rpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--gossip-addr", "127.0.0.1:0", "--ring-preset", "local"})
	var errOut bytes.Buffer
	root.SetOut(io.Discard)
	root.SetErr(&errOut)
	if err := root.ExecuteContext(ctx); err != nil {
		t.Fatalf("serve stopped while starting: %v, want a clean exit\n%s", err, errOut.String())
	}
	if strings.Contains(errOut.String(), "ledger not reached") || strings.Contains(errOut.String(), "unreachable") {
		t.Fatalf("a stop while starting was logged as a ledger problem:\n%s", errOut.String())
	}
}

// quotad serve's secrets can come from files (QUOTAD_<FLAG>_FILE): the
// value is the file's content without its line break, errors name the
// variable and never the secret, and a file that cannot be the secret
// (missing, empty, too large) or a secret set both ways is refused.
func TestServeSecretsFromFiles(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	t.Setenv("QUOTAD_DATA_DIR", filepath.Join(dir, "n1"))
	t.Setenv("QUOTAD_LEDGER", "sqlite:"+filepath.Join(dir, "ledger.db"))
	for name, tc := range map[string]struct {
		env   map[string]string
		wants []string
	}{
		"a short admin token": {map[string]string{"QUOTAD_ADMIN_TOKEN_FILE": write("admin", "tiny-secret\r\n")},
			[]string{"--admin-token is 11 characters", "QUOTAD_ADMIN_TOKEN_FILE"}},
		"a gossip key that is not base64": {map[string]string{"QUOTAD_GOSSIP_KEY_FILE": write("gossip", "not*base64*gossip*key\n")},
			[]string{"--gossip-key", "QUOTAD_GOSSIP_KEY_FILE"}},
		"both ways": {map[string]string{"QUOTAD_RPC_TOKEN": "rpc-token-0123456789abcdef", "QUOTAD_RPC_TOKEN_FILE": write("rpc", "rpc-token-0123456789abcdef\n")},
			[]string{"both QUOTAD_RPC_TOKEN and QUOTAD_RPC_TOKEN_FILE are set"}},
		"a missing file": {map[string]string{"QUOTAD_ALERT_SECRET_FILE": filepath.Join(dir, "nope")},
			[]string{"QUOTAD_ALERT_SECRET_FILE: open " + filepath.Join(dir, "nope")}},
		"an empty file": {map[string]string{"QUOTAD_ALERT_SECRET_FILE": write("empty", "\n")},
			[]string{"QUOTAD_ALERT_SECRET_FILE: " + filepath.Join(dir, "empty") + " is empty"}},
		"a second line": {map[string]string{"QUOTAD_RPC_TOKEN_FILE": write("two-lines", "rpc-token-0123456789abcdef\n\n")},
			[]string{"QUOTAD_RPC_TOKEN_FILE: " + filepath.Join(dir, "two-lines") + " holds more than the secret"}},
		"spaces around it": {map[string]string{"QUOTAD_RPC_TOKEN_FILE": write("spaced", " rpc-token-0123456789abcdef \n")},
			[]string{"holds more than the secret"}},
		"a line break in the variable": {map[string]string{"QUOTAD_ALERT_SECRET": "rpc-token-0123456789abcdef\n"},
			[]string{"QUOTAD_ALERT_SECRET holds more than the secret"}},
		"a space in the variable": {map[string]string{"QUOTAD_RPC_TOKEN": "rpc-token-0123456789abcdef "},
			[]string{"QUOTAD_RPC_TOKEN holds more than the secret"}},
		"a large file": {map[string]string{"QUOTAD_LEDGER_FILE": write("big", strings.Repeat("x", 70<<10)), "QUOTAD_LEDGER": ""},
			[]string{"QUOTAD_LEDGER_FILE: " + filepath.Join(dir, "big") + " is larger than 64 KiB"}},
	} {
		t.Run(name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			if tc.env["QUOTAD_LEDGER"] == "" && tc.env["QUOTAD_LEDGER_FILE"] != "" {
				os.Unsetenv("QUOTAD_LEDGER")
			}
			stderr, err := runQuotad(t, "serve")
			if err == nil {
				t.Fatal("quotad serve started")
			}
			for _, w := range tc.wants {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			for _, secret := range []string{"tiny-secret", "not*base64", "rpc-token-0123"} {
				if strings.Contains(err.Error(), secret) || strings.Contains(stderr, secret) {
					t.Errorf("the secret %q is in the error or on stderr: %v\n%s", secret, err, stderr)
				}
			}
			if strings.Contains(stderr, "_FILE matches no flag") {
				t.Errorf("a _FILE variable warned about as unknown:\n%s", stderr)
			}
		})
	}
	// A secret read from its file reaches the flag, without the line break.
	v, from, ok, err := lookupEnv("QUOTAD_ADMIN_TOKEN", true, false)
	if err != nil || ok {
		t.Fatalf("nothing set: %q %q %v %v", v, from, ok, err)
	}
	t.Setenv("QUOTAD_ADMIN_TOKEN_FILE", write("good", "admin-token-0123456789\n"))
	if v, from, ok, err := lookupEnv("QUOTAD_ADMIN_TOKEN", true, false); err != nil || !ok || v != "admin-token-0123456789" || from != "QUOTAD_ADMIN_TOKEN_FILE" {
		t.Fatalf("from a file: %q %q %v %v", v, from, ok, err)
	}
	if _, _, ok, _ := lookupEnv("QUOTAD_ADMIN_TOKEN", false, false); ok {
		t.Fatal("a flag that is not a secret read a _FILE variable")
	}
}

// A mistyped flag is answered with the closest flag of the command and
// where the flags are listed: "unknown flag: --duraton" said nothing more.
func TestUnknownFlagSuggests(t *testing.T) {
	for args, want := range map[string]string{
		"demo --duraton 2s":           "unknown flag: --duraton: did you mean --duration? (quotad demo --help lists the flags)",
		"serve --data-dri x":          "did you mean --data-dir?",
		"admin plans set p --qouta 5": "did you mean --quota?",
		"demo --zzz":                  "unknown flag: --zzz (quotad demo --help lists the flags)",
	} {
		if _, err := runQuotad(t, strings.Fields(args)...); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("quotad %s: %v, want %q", args, err, want)
		}
	}
}

// quotad migrate says what it did: a new ledger created (a mistyped
// --ledger makes one silently otherwise), or nothing to do.
func TestMigrateSaysWhatItDid(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	run := func() string {
		t.Helper()
		var out bytes.Buffer
		root := newRootCmd()
		root.SetArgs([]string{"migrate", "--ledger", "sqlite:" + path})
		root.SetOut(&out)
		root.SetErr(&out)
		if err := root.ExecuteContext(context.Background()); err != nil {
			t.Fatalf("quotad migrate: %v\n%s", err, out.String())
		}
		return out.String()
	}
	if out := run(); !strings.Contains(out, "created a new ledger, at schema version") || !strings.Contains(out, "check --ledger") {
		t.Errorf("migrate of an empty database says %q", out)
	}
	if out := run(); !strings.Contains(out, "already: nothing to do") {
		t.Errorf("migrate of a migrated ledger says %q", out)
	}
}
