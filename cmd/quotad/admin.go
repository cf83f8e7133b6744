package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/snapshot"
)

// --- quotad serve: the admin API's and the alerts' flags -------------------

// serveAdminFlags are quotad serve's flags for the admin API and the quota
// alerts (node.Config.AdminToken, AlertWebhook, AlertSecret,
// AlertThresholds, AlertLease, AlertGiveUp).
type serveAdminFlags struct {
	webhook, secret string
	thresholds      []int
	lease, giveUp   time.Duration
}

func (af *serveAdminFlags) register(cmd *cobra.Command, token *string) {
	fl := cmd.Flags()
	fl.StringVar(token, "admin-token", "", "bearer token of the admin API (/admin/v1/ on --admin-addr; quotad admin --token); empty disables the API. "+
		"At least 16 random characters (openssl rand -hex 32); prefer QUOTAD_ADMIN_TOKEN or QUOTAD_ADMIN_TOKEN_FILE (a file holding it), which ps does not show")
	fl.StringVar(&af.webhook, "alert-webhook", "", "URL to POST quota alerts to (JSON, signed with --alert-secret); empty sends none")
	fl.StringVar(&af.secret, "alert-secret", "", "HMAC-SHA256 key that signs alerts (X-Quotaring-Signature); required with --alert-webhook, at least 16 characters; prefer QUOTAD_ALERT_SECRET or QUOTAD_ALERT_SECRET_FILE (a file holding it)")
	fl.IntSliceVar(&af.thresholds, "alert-thresholds", []int{80, 100}, "percentages of a period's quota that alert, once per account and month each")
	fl.DurationVar(&af.lease, "alert-lease", 10*time.Minute, "how long a claimed alert may stay undelivered before any node takes it over and tries again (a node's own round of retries ends before half of it); at least 30s")
	fl.DurationVar(&af.giveUp, "alert-give-up", 72*time.Hour, "how long after its first claim an undelivered alert is given up; at least twice --alert-lease")
}

func (af *serveAdminFlags) apply(cfg *node.Config, token string) error {
	if af.lease <= 0 || af.giveUp <= 0 {
		return fmt.Errorf("--alert-lease %s and --alert-give-up %s must be positive durations (such as 10m and 72h)", af.lease, af.giveUp)
	}
	if af.lease < node.MinAlertLease && !cfg.TestFaults {
		return fmt.Errorf("--alert-lease %s: want at least %s: each node's round of tries gets half the lease and one webhook call may take 10s, so a shorter lease cuts a slow receiver's calls short every round and the alert is never delivered (default 10m)", af.lease, node.MinAlertLease)
	}
	if af.webhook != "" {
		if _, err := node.CheckAlertWebhook(af.webhook); err != nil {
			return err
		}
	}
	if af.giveUp < 2*af.lease {
		return fmt.Errorf("--alert-give-up %s is less than twice --alert-lease %s: the sweep that finds an undelivered alert past its lease gives it up first when it is past the give-up age too, so every alert whose first round of retries failed would be given up untried; give up after twice the lease or later (default 72h)", af.giveUp, af.lease)
	}
	// NB: checked without --alert-webhook too, so that adding the webhook
	// later does not turn a node that started into one that does not.
	if err := node.CheckAlertThresholds(af.thresholds); err != nil {
		return err
	}
	cfg.AdminToken, cfg.AlertWebhook, cfg.AlertSecret, cfg.AlertThresholds = token, af.webhook, af.secret, af.thresholds
	cfg.AlertLease, cfg.AlertGiveUp = af.lease, af.giveUp
	return nil
}

// givenEmpty refuses every string flag of cmd given with an empty value
// (--id "$ORDER_ID" with the variable unset), which would read as the
// flag's default: an empty --id made a retried grant a second grant, an
// empty --expires a grant that never lapses, an empty --rate a plan
// without its rate limit, an empty --period the current month. quotad
// admin checks it for every command before it runs. An empty --token has
// its own answer (no token given: set --token or QUOTAD_ADMIN_TOKEN).
func givenEmpty(cmd *cobra.Command) error {
	var err error
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if err == nil && f.Changed && f.Value.Type() == "string" && f.Value.String() == "" && f.Name != "token" {
			err = fmt.Errorf("--%s is empty (an unset variable?): give a value, or leave --%s out for its default", f.Name, f.Name)
		}
	})
	return err
}

// --- quotad admin -------------------------------------------------------------

// adminDefaultTimeout is --timeout's default: longer than the node's own
// bound on a call's work with the ledger (node.AdminLedgerTimeout), after
// which the node answers 503 ("nothing was changed unless a retry shows
// otherwise"). A client bound no longer than the node's would time out
// first, not knowing whether a change was applied.
const adminDefaultTimeout = node.AdminLedgerTimeout + 15*time.Second

// adminClient talks to a node's admin API.
type adminClient struct {
	addr, token string
	// fieldFlags are the running command's own fields named by a flag
	// (grants add's id is its --id), beside the global fieldFlags.
	fieldFlags map[string]string
	caCert     string // a PEM bundle to trust for an https --addr
	json       bool
	timeout    time.Duration
	http       *http.Client
}

// adminEnv are quotad admin's flags with environment twins, and the twins.
// The node's URL is QUOTAD_ADMIN_URL, not QUOTAD_ADMIN_ADDR: that is quotad
// serve's --admin-addr (host:port), and an operator exports both in one
// shell or pod. QUOTAD_ADMIN_TOKEN is shared on purpose: serve's
// --admin-token and admin's --token are the same secret.
// The token may come from a file as well (QUOTAD_ADMIN_TOKEN_FILE, as
// serve's secrets: lookupEnv).
var adminEnv = []struct {
	flag, env string
	secret    bool
}{
	{"addr", "QUOTAD_ADMIN_URL", false},
	{"token", "QUOTAD_ADMIN_TOKEN", true},
	{"json", "QUOTAD_ADMIN_JSON", false},
	{"timeout", "QUOTAD_ADMIN_TIMEOUT", false},
	{"ca-cert", "QUOTAD_ADMIN_CA_CERT", false},
}

func newAdminCmd() *cobra.Command {
	c := &adminClient{}
	cmd := &cobra.Command{
		Use:   "admin",
		Short: "Manage plans, accounts, API keys, grants and route weights through a node's admin API; export a month's usage",
		Long: `quotad admin talks to the admin API of any node (its --admin-addr, under
/admin/v1/) with the token the node was started with (--admin-token).

Changes are stored in the ledger at once; every node applies them at its next
config refresh (--snapshot-interval, 3s by default), so allow a few seconds
before a new key or plan is in force everywhere.

Output is a table for people, or the API's JSON with --json for scripts.
Errors are the server's explanation of what to fix.

The environment twins of --addr, --token, --json, --timeout and --ca-cert are
QUOTAD_ADMIN_URL, QUOTAD_ADMIN_TOKEN, QUOTAD_ADMIN_JSON, QUOTAD_ADMIN_TIMEOUT and
QUOTAD_ADMIN_CA_CERT. A node serving its admin port over HTTPS (--admin-tls-cert)
takes an https:// --addr.
QUOTAD_ADMIN_TOKEN is also what quotad serve reads for --admin-token, while
QUOTAD_ADMIN_ADDR is only quotad serve's --admin-addr (host:port), so both
commands' settings can be exported in one shell. The flags of quotad admin's
commands (--units, --plan, --quota, --period, ...) have no environment twins:
they describe one change, which a QUOTAD_UNITS left in a shell must not
repeat. Give them on the command line; a QUOTAD_UNITS gets a warning.`,
		Example: `  export QUOTAD_ADMIN_URL=http://127.0.0.1:9090 QUOTAD_ADMIN_TOKEN=...
  quotad admin plans set pro --rate 10/s --burst 20 --quota 100000 --hard
  quotad admin accounts set acme --plan pro
  quotad admin keys create acme
  quotad admin grants add acme --units 5000 --expires 2027-01-01
  quotad admin routes set --default 1 'GET /v1/tasks=1' 'POST /v1/exports=25'
  quotad admin accounts show acme
  quotad admin usage --period 2026-06 --csv`,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			warnUnknownEnv(cmd.ErrOrStderr(), cmd.Root(), os.Environ())
			if err := givenEmpty(cmd); err != nil {
				return err
			}
			return c.init(cmd.Flags())
		},
	}
	pf := cmd.PersistentFlags()
	pf.StringVar(&c.addr, "addr", "http://127.0.0.1:9090", "the URL of a node's admin port (its --admin-addr); environment: QUOTAD_ADMIN_URL")
	pf.StringVar(&c.token, "token", "", "the admin token (the node's --admin-token); prefer QUOTAD_ADMIN_TOKEN or QUOTAD_ADMIN_TOKEN_FILE (a file holding it), which ps does not show")
	pf.BoolVar(&c.json, "json", false, "print the API's JSON answer instead of a table")
	pf.DurationVar(&c.timeout, "timeout", adminDefaultTimeout, "how long to wait for the node's answer; keep it longer than the node's own bound on the ledger (30s), so that a slow ledger's 503 arrives rather than a timeout that cannot say whether a change was applied")
	pf.StringVar(&c.caCert, "ca-cert", "", "for an https --addr (a node with --admin-tls-cert): the CA certificate (PEM) to trust, when the node's certificate is not from one the system trusts; environment: QUOTAD_ADMIN_CA_CERT")
	cmd.AddCommand(newAdminPlansCmd(c), newAdminAccountsCmd(c), newAdminKeysCmd(c), newAdminGrantsCmd(c), newAdminRoutesCmd(c),
		&cobra.Command{
			Use:   "reservations",
			Short: "List the units each node holds reserved, per account and grant",
			Long: `List the reservations in the ledger: units of hard-limited grants that a node
may spend without asking the ledger. A node that is gone for good keeps its
reservations frozen until it comes back or 'quotad revoke --node ID' frees them.

Beside the rows of the node that answers (--addr), it prints what that node
holds of each grant itself (HELD BY), marks the grants that differ, and ends
with a line comparing the two: the node holds what the ledger reserves for it;
or the units it counts in doubt (reservations whose answer it never got) cover
the difference; or some units look stranded, reserved for it and spendable by
nobody until it stops or starts; or it holds units no grant backs. A
reservation or hand-back on its way differs for a moment: run it again before
reporting a difference. Ask each node to compare its own.`,
			Args: noArgs,
			RunE: func(cmd *cobra.Command, _ []string) error { return c.reservations(cmd) },
		},
		&cobra.Command{
			Use:   "nodes",
			Short: "List the nodes the ledger knows, their settled marks, ring state and build",
			Long: `List every (node, incarnation) the ledger knows: its settled mark, its last
heartbeat, its state in the answering node's view of the ring (latest
incarnation only), and the quotad build it registered with (quotad version
--short; "(older quotad)" for one registered by a build before builds were
recorded). During a rolling upgrade this shows which nodes still run the old
build.`,
			Args: noArgs,
			RunE: func(cmd *cobra.Command, _ []string) error { return c.nodes(cmd) },
		},
		newAdminAlertsCmd(c), newAdminUsageCmd(c))
	return cmd
}

// init binds the environment twins (adminEnv: quotad admin's own names, not
// the root's QUOTAD_<FLAG>, so that QUOTAD_ADMIN_TOKEN serves both serve and
// admin).
func (c *adminClient) init(fs *pflag.FlagSet) error {
	var errs []error
	unset := map[string]bool{} // flags whose variable did not parse: their value is no one's
	for _, e := range adminEnv {
		f := fs.Lookup(e.flag)
		if f == nil || f.Changed {
			continue
		}
		v, from, ok, err := lookupEnv(e.env, e.secret, true) // empty counts as unset
		if err != nil {
			errs = append(errs, err)
			unset[e.flag] = true
		} else if ok {
			if err := setFromEnv(fs, e.flag, from, v); err != nil {
				errs = append(errs, err)
				unset[e.flag] = true
			}
		} else if old := os.Getenv("QUOTAD_ADMIN_ADDR"); e.flag == "addr" && strings.Contains(old, "://") {
			// Before QUOTAD_ADMIN_URL, quotad admin read QUOTAD_ADMIN_ADDR. A
			// URL there is meant for quotad admin; going to the default node
			// instead could change the wrong cluster.
			errs = append(errs, fmt.Errorf("QUOTAD_ADMIN_ADDR=%s is a URL, but QUOTAD_ADMIN_ADDR is quotad serve's --admin-addr (host:port): "+
				"quotad admin reads the node's URL from QUOTAD_ADMIN_URL; export QUOTAD_ADMIN_URL=%s and unset QUOTAD_ADMIN_ADDR (or give --addr)", old, old))
		}
	}
	if c.addr == "" {
		errs = append(errs, errors.New("--addr is empty: give a node's admin address, such as http://127.0.0.1:9090"))
	} else if !strings.Contains(c.addr, "://") {
		c.addr = "http://" + c.addr
	}
	c.addr = strings.TrimRight(c.addr, "/")
	if c.timeout <= 0 && !unset["timeout"] {
		errs = append(errs, fmt.Errorf("--timeout %s: want a positive duration, such as 30s", c.timeout))
	}
	c.http = &http.Client{Timeout: c.timeout}
	if c.caCert != "" {
		tr, err := trustingTransport(c.caCert)
		if err != nil {
			errs = append(errs, err)
		} else {
			c.http.Transport = tr
		}
		if !strings.HasPrefix(c.addr, "https://") {
			errs = append(errs, fmt.Errorf("--ca-cert is set but --addr %s is not https://: the token would travel in the clear; use the node's https:// URL", c.addr))
		}
	}
	return errors.Join(errs...)
}

// trustingTransport is an HTTP transport that trusts the CA certificates in
// the PEM file at path (and only those).
func trustingTransport(path string) (*http.Transport, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--ca-cert: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("--ca-cert %s holds no PEM certificate (want the CA's certificate, BEGIN CERTIFICATE)", path)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	return tr, nil
}

// problem is the part of an RFC 9457 answer the client shows.
type problem struct {
	Type   string `json:"type"`
	Status int    `json:"status"`
	Detail string `json:"detail"`
	Title  string `json:"title"`
	Field  string `json:"field"`
}

// fieldFlags are the flags of quotad admin's commands that set an API
// field of another name: a problem naming the field is shown naming the
// flag the user typed ("--quota: -5 is negative", not "monthly_quota: ...").
var fieldFlags = map[string]string{"monthly_quota": "--quota", "starts_at": "--starts", "expires_at": "--expires",
	"units": "--units", "burst": "--burst", "rate": "--rate", "plan": "--plan", "default": "--default"}

// do calls the API. On success it returns the raw answer and, when out is
// not nil, decodes it there; on failure an error carrying the server's
// problem detail.
func (c *adminClient) do(ctx context.Context, method, path string, body, out any) ([]byte, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.addr+path, rd)
	if err != nil {
		return nil, fmt.Errorf("--addr %q: %v", c.addr, err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json")
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		var unknownCA x509.UnknownAuthorityError
		var badCert *tls.CertificateVerificationError
		switch {
		case errors.As(err, &unknownCA) || errors.As(err, &badCert):
			return nil, fmt.Errorf("the admin API at %s presented a certificate this command does not trust: %w (give the CA that issued it with --ca-cert or QUOTAD_ADMIN_CA_CERT)", c.addr, err)
		}
		if timedOut(err) {
			return nil, c.timeoutError(method, path, err)
		}
		return nil, fmt.Errorf("cannot reach the admin API at %s (is a node's --admin-addr there? set --addr or QUOTAD_ADMIN_URL): %w", c.addr, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 32<<20))
	if err != nil {
		if timedOut(err) {
			return nil, c.timeoutError(method, path, err)
		}
		return nil, fmt.Errorf("%s %s: reading the answer: %w", method, path, err)
	}
	if resp.StatusCode >= 300 {
		var p problem
		if strings.HasPrefix(resp.Header.Get("Content-Type"), "application/problem+json") && json.Unmarshal(raw, &p) == nil && p.Detail != "" {
			msg := p.Detail
			flag, ok := fieldFlags[p.Field]
			if f, mine := c.fieldFlags[p.Field]; mine {
				flag, ok = f, true
			}
			if ok && strings.HasPrefix(msg, p.Field+": ") {
				msg = flag + ": " + strings.TrimPrefix(msg, p.Field+": ")
			}
			if resp.Header.Get(node.AdminAPIHeader) == "" && (isFrontProblem(p.Type) || p.Title == node.NoFrontTitle) {
				msg += fmt.Sprintf(" (this answer came from a node's public HTTP port, --http-addr: point --addr or QUOTAD_ADMIN_URL at its admin port, --admin-addr, not %s)", c.addr)
			} else if resp.StatusCode == http.StatusUnauthorized && c.token == "" {
				msg += " (no token given: set --token or QUOTAD_ADMIN_TOKEN)"
			}
			return nil, fmt.Errorf("%s (HTTP %d)", msg, resp.StatusCode)
		}
		snippet := strings.TrimSpace(string(raw[:min(len(raw), 200)]))
		if resp.StatusCode == http.StatusBadRequest && strings.Contains(snippet, "HTTP request to an HTTPS server") {
			// Go's TLS server answers a plaintext request this way.
			return nil, fmt.Errorf("the admin port at %s serves HTTPS (the node has --admin-tls-cert): use https:// in --addr or QUOTAD_ADMIN_URL", c.addr)
		}
		return nil, fmt.Errorf("%s %s%s: HTTP %d %s (is --addr a node's admin address?)", method, c.addr, path, resp.StatusCode, snippet)
	}
	if resp.Header.Get(node.AdminAPIHeader) == "" {
		// Not marked as the admin API's: a node older than the mark, or
		// another server answering JSON at --addr. An older node's answer
		// holds only fields this command knows; anything else is refused
		// rather than printed as an empty success.
		if err := decodeStrict(raw, out); err != nil {
			return nil, fmt.Errorf("%s %s%s: the answer is not the quotad admin API's (%v): is --addr (or QUOTAD_ADMIN_URL) a node's admin address, --admin-addr?",
				method, c.addr, path, err)
		}
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			return nil, fmt.Errorf("%s %s: unexpected answer: %v", method, path, err)
		}
	}
	return raw, nil
}

// timedOut reports whether err is --timeout running out (or the command's
// context's deadline).
func timedOut(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
}

// timeoutError says that the node did not answer within --timeout: it was
// reached or may have been, so a change may have been applied.
func (c *adminClient) timeoutError(method, path string, err error) error {
	if method == http.MethodGet {
		return fmt.Errorf("%s %s%s: no answer within --timeout %s (%v): the node or its ledger is slow; retry, or raise --timeout (QUOTAD_ADMIN_TIMEOUT)",
			method, c.addr, path, c.timeout, err)
	}
	return fmt.Errorf("%s %s%s: no answer within --timeout %s (%v): the change may or may not have been applied; "+
		"look before retrying (quotad admin accounts show, plans list, routes show; a grant retried with the same --id is safe), "+
		"and give a --timeout longer than the node's %s bound on the ledger (default %s)",
		method, c.addr, path, c.timeout, err, node.AdminLedgerTimeout, adminDefaultTimeout)
}

// decodeStrict decodes raw into a new value of out's type, refusing a
// member out does not have; with out nil, raw must be JSON.
func decodeStrict(raw []byte, out any) error {
	if out == nil {
		if len(bytes.TrimSpace(raw)) > 0 && !json.Valid(raw) {
			return errors.New("not JSON")
		}
		return nil
	}
	fresh := reflect.New(reflect.TypeOf(out).Elem()).Interface()
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	return dec.Decode(fresh)
}

// isFrontProblem reports whether a problem type is one the HTTP front
// (the public port) answers, never the admin API.
func isFrontProblem(typ string) bool {
	switch typ {
	case router.ProblemUnknownKey, router.ProblemQuotaExceeded, router.ProblemRateLimited, router.ProblemQuotaUnavailable:
		return true
	}
	return false
}

// run calls the API and prints: the raw JSON with --json, else table(out).
func (c *adminClient) run(cmd *cobra.Command, method, path string, body, out any, table func(w io.Writer)) error {
	raw, err := c.do(cmd.Context(), method, path, body, out)
	if err != nil {
		return err
	}
	if c.json {
		_, err := cmd.OutOrStdout().Write(raw)
		return err
	}
	tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
	table(tw)
	return tw.Flush()
}

// refreshNote ends every change's message.
const refreshNote = "nodes apply it at their next config refresh (a few seconds)"

// pathID escapes an id for a path segment: an account named "team#42"
// must not become the account "team" and a fragment, nor one named "." or
// ".." a dot-segment that the node's mux cleans away (PathEscape leaves
// dots alone), which sent `accounts show .` to the list of accounts.
func pathID(id string) string {
	if id == "." || id == ".." {
		return strings.Repeat("%2E", len(id))
	}
	return url.PathEscape(id)
}

// alertKeyArgs checks resend's ACCOUNT PERIOD THRESHOLD before the call.
func alertKeyArgs(cmd *cobra.Command, args []string) error {
	if len(args) != 3 {
		return fmt.Errorf("want ACCOUNT PERIOD THRESHOLD (such as: acme 2026-06 80), got %d arguments", len(args))
	}
	if err := oneID("account")(cmd, args[:1]); err != nil {
		return err
	}
	if _, err := node.ParseMonth(args[1]); err != nil {
		return fmt.Errorf("period %v", err)
	}
	if _, err := node.ParseThreshold(args[2]); err != nil {
		return fmt.Errorf("threshold %v", err)
	}
	return nil
}

// oneID takes exactly one argument, an id as the admin API accepts it (1 to
// 200 printable characters, no spaces or slashes), and says so before
// asking a node, which would answer an unroutable path with a bare 404.
func oneID(what string) cobra.PositionalArgs {
	return func(_ *cobra.Command, args []string) error {
		if len(args) != 1 {
			return fmt.Errorf("want one %s, got %d arguments", what, len(args))
		}
		id := args[0]
		if id == "" || len(id) > 200 || strings.ContainsFunc(id, func(c rune) bool { return c <= ' ' || c == '/' || c == 0x7f }) {
			return fmt.Errorf("%s %q: want 1 to 200 characters without spaces, slashes or control characters", what, id)
		}
		if what == "key id" && strings.HasPrefix(id, node.KeyPrefix) {
			return fmt.Errorf("%q is an API key itself; revoke takes the key's id (key_..., printed when the key was made, and by quotad admin accounts show ACCOUNT)", id)
		}
		return nil
	}
}

// newOrStoredID checks the id of a plan, account or grant to create or
// change, named what, as the admin API checks a new one (snapshot.CheckID:
// printable UTF-8 without spaces, slashes, format, control or blank
// characters, in NFC),
// before the call; an id the rules refuse is let through when the ledger
// has it already (path answers 200, and stored, when set, says so of its
// answer): one stored before a rule (an id in NFD, as macOS writes names)
// can still be changed, or its grant retried, as the API allows.
func (c *adminClient) newOrStoredID(cmd *cobra.Command, what, path, id string, stored func([]byte) bool) error {
	err := snapshot.CheckID(id)
	if err == nil {
		return nil
	}
	if raw, gerr := c.do(cmd.Context(), "GET", path, nil, nil); gerr == nil && (stored == nil || stored(raw)) {
		return nil
	}
	return fmt.Errorf("%s %v", what, err)
}

// --- plans ------------------------------------------------------------------

func newAdminPlansCmd(c *adminClient) *cobra.Command {
	cmd := &cobra.Command{Use: "plans", Short: "Create, change and list plans (rate, burst, monthly quota, hard or soft)"}
	var rate string
	var burst, quota int64
	var hard, soft bool
	set := &cobra.Command{
		Use:   "set ID --quota UNITS (--hard | --soft) [--rate N/PERIOD] [--burst N]",
		Short: "Create a plan or change it (every account on it follows)",
		Long: `Create a plan or replace its settings. Every account on the plan follows,
including the current month's quota (a lower quota can leave an account over it:
it is refused until the next month under --hard).

--rate is TOKENS/PERIOD: 10/s, 600/m, 5/h or 100/1m30s, or none for no rate
limit. --burst defaults to one period's worth of tokens.
Every setting is replaced: when the plan exists with a rate, or a burst of its
own, and --rate (or --burst, for the same rate) is not given, the command
refuses and shows the value to give to keep it, rather than remove it.
--hard refuses requests past the monthly quota; --soft lets them through and
records the overage for billing.`,
		Example: `  quotad admin plans set pro --rate 10/s --burst 20 --quota 100000 --hard
  quotad admin plans set credits-only --quota 0 --hard --rate none
  quotad admin plans set metered --rate 50/s --quota 1000000 --soft`,
		Args: oneID("plan id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := c.newOrStoredID(cmd, "plan id", "/admin/v1/plans/"+pathID(args[0]), args[0], nil); err != nil {
				return err
			}
			for _, f := range []struct {
				name string
				v    bool
			}{{"hard", hard}, {"soft", soft}} {
				if cmd.Flags().Changed(f.name) && !f.v {
					// --soft=false made a soft plan: hard was its default.
					return fmt.Errorf("--%s=false: say what the plan is, --hard or --soft", f.name)
				}
			}
			if quota < 0 {
				return fmt.Errorf("--quota %d: want 0 or more", quota)
			}
			if burst < 0 {
				return fmt.Errorf("--burst %d: want 0 or more", burst)
			}
			if err := c.keepsPlanRate(cmd, args[0], rate, cmd.Flags().Changed("burst")); err != nil {
				return err
			}
			body := map[string]any{"monthly_quota": quota, "hard": hard}
			if rate != "" && rate != "none" {
				body["rate"] = rate
			}
			if cmd.Flags().Changed("burst") {
				body["burst"] = burst
			}
			var p snapshot.Plan
			return c.run(cmd, "PUT", "/admin/v1/plans/"+pathID(args[0]), body, &p, func(w io.Writer) {
				fmt.Fprintf(w, "plan %s set: %s; %s\n", p.ID, describePlan(p), refreshNote)
			})
		},
	}
	fl := set.Flags()
	fl.StringVar(&rate, "rate", "", "requests allowed per period: 10/s, 600/m, 5/h, or none (needed to change a plan that has a rate)")
	fl.Int64Var(&burst, "burst", 0, "requests allowed at once (default: one period's worth of --rate)")
	fl.Int64Var(&quota, "quota", 0, "units per calendar month (UTC); 0 for a plan that runs on granted credits only")
	fl.BoolVar(&hard, "hard", false, "refuse requests past the monthly quota")
	fl.BoolVar(&soft, "soft", false, "let requests past the monthly quota through and record the overage")
	set.MarkFlagRequired("quota")
	set.MarkFlagsOneRequired("hard", "soft")
	set.MarkFlagsMutuallyExclusive("hard", "soft")

	list := &cobra.Command{
		Use:   "list",
		Short: "List the plans",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var out struct{ Plans []snapshot.Plan }
			return c.run(cmd, "GET", "/admin/v1/plans", nil, &out, func(w io.Writer) {
				fmt.Fprintln(w, "PLAN\tRATE\tBURST\tMONTHLY QUOTA\tLIMIT")
				for _, p := range out.Plans {
					fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%s\n", p.ID, orDash(p.Rate), burstText(p), p.MonthlyQuota, hardText(p.Hard))
				}
			})
		},
	}
	cmd.AddCommand(set, list)
	return cmd
}

// keepsPlanRate refuses to replace plan id's rate limit, or its own burst,
// by leaving out --rate or --burst: plans set replaces every setting, and
// `plans set big --quota 1000000 --hard`, meant to raise a quota, removed
// the rate limit that protects the upstream. rate is --rate ("" when not
// given); burstGiven whether --burst was.
func (c *adminClient) keepsPlanRate(cmd *cobra.Command, id, rate string, burstGiven bool) error {
	if rate != "" && burstGiven {
		return nil
	}
	var out struct{ Plans []snapshot.Plan }
	if _, err := c.do(cmd.Context(), "GET", "/admin/v1/plans", nil, &out); err != nil {
		return err
	}
	i := slices.IndexFunc(out.Plans, func(p snapshot.Plan) bool { return p.ID == id })
	if i < 0 {
		return nil // a new plan
	}
	old := out.Plans[i]
	switch {
	case rate == "" && old.Rate != "":
		if _, err := snapshot.ParseRate(old.Rate); err != nil {
			// Stored before rates were read strictly ("1e3/s"): giving it
			// again would be refused.
			return fmt.Errorf("plan %s has the rate limit %s, in a form new plans refuse (%v), which plans set would remove: give --rate with the rate you want, or --rate none", id, old.Rate, err)
		}
		return fmt.Errorf("plan %s has the rate limit %s (burst %s), which plans set would remove: give --rate %s to keep it (and --burst), or --rate none to remove it", id, old.Rate, burstText(old), old.Rate)
	case !burstGiven && old.Burst != 0 && (rate == old.Rate || rate == "" && old.Rate == ""):
		return fmt.Errorf("plan %s has the burst %d, which plans set would reset to one period's worth of %s: give --burst %d to keep it, or --burst 0 for the default", id, old.Burst, old.Rate, old.Burst)
	}
	return nil
}

func describePlan(p snapshot.Plan) string {
	rate := "no rate limit"
	if p.Rate != "" {
		rate = "rate " + p.Rate + ", burst " + burstText(p)
	}
	return fmt.Sprintf("%s, %d units a month, %s", rate, p.MonthlyQuota, hardText(p.Hard))
}

func burstText(p snapshot.Plan) string {
	switch {
	case p.Rate == "":
		return "-"
	case p.Burst == 0:
		return "default"
	}
	return strconv.FormatInt(p.Burst, 10)
}

func hardText(hard bool) string {
	if hard {
		return "hard"
	}
	return "soft"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// --- accounts ---------------------------------------------------------------

func newAdminAccountsCmd(c *adminClient) *cobra.Command {
	cmd := &cobra.Command{Use: "accounts", Short: "Create accounts, move them between plans, show their keys, grants and usage"}
	var plan string
	set := &cobra.Command{
		Use:     "set ID --plan PLAN",
		Short:   "Create an account or move it to another plan",
		Example: `  quotad admin accounts set acme --plan pro`,
		Args:    oneID("account id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := c.newOrStoredID(cmd, "account id", "/admin/v1/accounts/"+pathID(args[0]), args[0], nil); err != nil {
				return err
			}
			var out struct{ ID, Plan string }
			return c.run(cmd, "PUT", "/admin/v1/accounts/"+pathID(args[0]), map[string]string{"plan": plan}, &out, func(w io.Writer) {
				fmt.Fprintf(w, "account %s is on plan %s; %s\n", out.ID, out.Plan, refreshNote)
			})
		},
	}
	set.Flags().StringVar(&plan, "plan", "", "the plan's id (create it with quotad admin plans set)")
	set.MarkFlagRequired("plan")

	var period string
	show := &cobra.Command{
		Use:   "show ID",
		Short: "Show an account: plan, keys, grants (used and reserved units) and settled usage",
		Long: `Show an account as the ledger has it: its plan, its keys (ids and hashes; the
plaintext is never stored), its grants with their used (settled) and reserved
units, and its settled usage by route for a month (the current one by default).
Settled figures trail the charges by up to one settle interval.`,
		Example: `  quotad admin accounts show acme
  quotad admin accounts show acme --period 2026-05 --json`,
		Args: oneID("account id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			path := "/admin/v1/accounts/" + pathID(args[0])
			if period != "" {
				if _, err := node.ParseMonth(period); err != nil {
					return fmt.Errorf("--period %v", err)
				}
				path += "?period=" + period
			}
			var v node.AccountView
			return c.run(cmd, "GET", path, nil, &v, func(w io.Writer) { printAccount(w, &v) })
		},
	}
	show.Flags().StringVar(&period, "period", "", "the month of the usage shown, such as 2026-06 (default: the current one)")

	list := &cobra.Command{
		Use:   "list",
		Short: "List the accounts and their plans",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var out struct{ Accounts []struct{ ID, Plan string } }
			return c.run(cmd, "GET", "/admin/v1/accounts", nil, &out, func(w io.Writer) {
				fmt.Fprintln(w, "ACCOUNT\tPLAN")
				for _, a := range out.Accounts {
					fmt.Fprintf(w, "%s\t%s\n", a.ID, a.Plan)
				}
			})
		},
	}
	cmd.AddCommand(set, show, list)
	return cmd
}

func printAccount(w io.Writer, v *node.AccountView) {
	fmt.Fprintf(w, "account\t%s\n", v.ID)
	fmt.Fprintf(w, "plan\t%s (%s)\n", v.Plan.ID, describePlan(v.Plan))
	fmt.Fprintf(w, "usage\t%d units settled in %s\n", v.Usage.Units, v.Usage.Period)
	fmt.Fprintln(w)
	fmt.Fprintln(w, "KEY ID\tSHA-256")
	for _, k := range v.Keys {
		fmt.Fprintf(w, "%s\t%s\n", k.ID, k.Hash)
	}
	if len(v.Keys) == 0 {
		fmt.Fprintln(w, "(none)\t")
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "GRANT\tKIND\tUNITS\tUSED\tRESERVED\tSTARTS\tEXPIRES")
	for _, g := range v.Grants {
		kind, expires := "credits", "never"
		if g.Monthly {
			kind = "monthly " + g.Period
		}
		if !g.ExpiresAt.IsZero() {
			expires = g.ExpiresAt.Format(time.RFC3339)
		}
		fmt.Fprintf(w, "%s\t%s\t%d\t%d\t%d\t%s\t%s\n", g.ID, kind, g.Units, g.Used, g.Reserved, g.StartsAt.Format(time.RFC3339), expires)
	}
	if len(v.Grants) == 0 {
		fmt.Fprintln(w, "(none yet: the month's grant appears with the first charge)")
	}
	if len(v.Usage.ByRoute) > 0 {
		fmt.Fprintln(w)
		fmt.Fprintln(w, "ROUTE\tUNITS")
		routes := make([]string, 0, len(v.Usage.ByRoute))
		for r := range v.Usage.ByRoute {
			routes = append(routes, r)
		}
		slices.Sort(routes)
		for _, r := range routes {
			fmt.Fprintf(w, "%s\t%d\n", r, v.Usage.ByRoute[r])
		}
	}
}

// --- keys -------------------------------------------------------------------

func newAdminKeysCmd(c *adminClient) *cobra.Command {
	cmd := &cobra.Command{Use: "keys", Short: "Create and revoke API keys"}
	create := &cobra.Command{
		Use:   "create ACCOUNT",
		Short: "Create an API key for an account and print it, once",
		Long: `Create an API key (qr_live_ followed by 43 random characters) for an account.
The key is printed once: quotaring stores only its SHA-256 hash and cannot show
it again. Hand it to the customer now, or create another later.

The reminder goes to stderr, so that
  quotad admin keys create acme --json | jq -r .key
prints the key alone.`,
		Example: `  quotad admin keys create acme`,
		Args:    oneID("account id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			var k node.NewKey
			err := c.run(cmd, "POST", "/admin/v1/accounts/"+pathID(args[0])+"/keys", nil, &k, func(w io.Writer) {
				fmt.Fprintf(w, "account\t%s\nkey id\t%s\nkey\t%s\n", k.Account, k.KeyID, k.Key)
			})
			if err == nil {
				fmt.Fprintf(cmd.ErrOrStderr(), "\nStore this key now: it is shown only once (the ledger keeps its SHA-256 hash, not the key).\n"+
					"It works on every node within a few seconds; revoke it with: quotad admin keys revoke %s\n", k.KeyID)
			}
			return err
		},
	}
	revoke := &cobra.Command{
		Use:     "revoke KEY_ID",
		Short:   "Revoke an API key (by its id, not the key itself)",
		Example: `  quotad admin keys revoke key_5xq2m7d3kq0a4g8r`,
		Args:    oneID("key id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return c.run(cmd, "DELETE", "/admin/v1/keys/"+pathID(args[0]), nil, nil, func(w io.Writer) {
				fmt.Fprintf(w, "key %s revoked; %s\n", args[0], refreshNote)
			})
		},
	}
	cmd.AddCommand(create, revoke)
	return cmd
}

// --- grants -----------------------------------------------------------------

// parseWhen reads RFC 3339 or a date (midnight UTC) and returns RFC 3339.
func parseWhen(flag, s string) (string, error) {
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t.UTC().Format(time.RFC3339Nano), nil // NB: RFC3339 dropped a fraction of a second
	}
	if t, err := time.Parse("2006-01-02", s); err == nil {
		return t.Format(time.RFC3339), nil
	}
	return "", fmt.Errorf("--%s %q: want a date (2027-01-01, midnight UTC) or an RFC 3339 time (2027-01-01T00:00:00Z)", flag, s)
}

func newAdminGrantsCmd(c *adminClient) *cobra.Command {
	cmd := &cobra.Command{Use: "grants", Short: "Grant credits to accounts"}
	var units int64
	var starts, expires, id string
	add := &cobra.Command{
		Use:   "add ACCOUNT --units N [--starts T] [--expires T] [--id ID]",
		Short: "Grant an account units to spend (bought credits)",
		Long: `Grant an account units to spend between --starts (default now) and --expires
(default never). A charge spends from the active grant that expires soonest,
the month's quota included; of a credit and the month's quota that expire
together (--expires on the first of a month), the quota goes first.`,
		Example: `  quotad admin grants add acme --units 5000
  quotad admin grants add acme --units 100000 --starts 2026-07-01 --expires 2027-07-01 --id order-1234`,
		Args: oneID("account id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if units < 1 {
				return fmt.Errorf("--units %d: want 1 or more units to grant", units)
			}
			body := map[string]any{"units": units}
			for _, f := range []struct{ flag, val, field string }{{"starts", starts, "starts_at"}, {"expires", expires, "expires_at"}} {
				if f.val != "" {
					t, err := parseWhen(f.flag, f.val)
					if err != nil {
						return err
					}
					body[f.field] = t
				}
			}
			if id != "" {
				stored := func(raw []byte) bool { // the account has a grant of this id: a retry
					var v node.AccountView
					return json.Unmarshal(raw, &v) == nil && slices.ContainsFunc(v.Grants, func(g node.GrantView) bool { return !g.Monthly && g.ID == id })
				}
				if err := c.newOrStoredID(cmd, "--id", "/admin/v1/accounts/"+pathID(args[0]), id, stored); err != nil {
					return err
				}
				body["id"] = id
			}
			c.fieldFlags = map[string]string{"id": "--id"} // the grant's id; elsewhere an id is an argument
			var g struct {
				Account   string     `json:"account"`
				ID        string     `json:"id"`
				Units     int64      `json:"units"`
				StartsAt  time.Time  `json:"starts_at"`
				ExpiresAt *time.Time `json:"expires_at"`
				Created   *bool      `json:"created"` // absent from an older node's answer
			}
			return c.run(cmd, "POST", "/admin/v1/accounts/"+pathID(args[0])+"/grants", body, &g, func(w io.Writer) {
				until := "never expires"
				if g.ExpiresAt != nil {
					until = "until " + g.ExpiresAt.Format(time.RFC3339)
				}
				if g.Created != nil && !*g.Created {
					fmt.Fprintf(w, "grant %s was there already, the same: %d units for %s from %s, %s; nothing changed\n", g.ID, g.Units, g.Account, g.StartsAt.Format(time.RFC3339), until)
					return
				}
				fmt.Fprintf(w, "grant %s: %d units for %s from %s, %s; %s\n", g.ID, g.Units, g.Account, g.StartsAt.Format(time.RFC3339), until, refreshNote)
			})
		},
	}
	fl := add.Flags()
	fl.Int64Var(&units, "units", 0, "units granted (required)")
	fl.StringVar(&starts, "starts", "", "when the units become spendable (default now)")
	fl.StringVar(&expires, "expires", "", "when unspent units lapse (default never)")
	fl.StringVar(&id, "id", "", "the grant's id, such as an order number; unique per account (default generated). With it a retry is safe: the same grant again changes nothing, another under the id is refused")
	add.MarkFlagRequired("units")
	cmd.AddCommand(add)
	return cmd
}

// --- routes -----------------------------------------------------------------

func newAdminRoutesCmd(c *adminClient) *cobra.Command {
	cmd := &cobra.Command{Use: "routes", Short: "Set and show the units each route costs"}
	var def int64
	var clearAll bool
	set := &cobra.Command{
		Use:   "set [--default UNITS] 'METHOD /pattern=UNITS'... | set --clear [--default UNITS]",
		Short: "Replace the route weights with a new version",
		Long: `Replace the whole route table with a new version (it is not merged with the
old one). Patterns are Go http.ServeMux patterns: "POST /v1/exports",
"GET /v1/tasks/{id}", "/v1/files/" (a prefix); the most specific pattern wins.
Methods are upper case ("GET", not "get") and followed by one space; write a
space inside a path as %20. A pattern matches the path alone, never a ?query.
A pattern that cannot mean what it says is refused.
A weight of 0 rate-limits a route without billing it. Requests that match no
pattern cost --default. With no patterns the command refuses, unless --clear
says that every route is to cost --default.`,
		Example: `  quotad admin routes set --default 1 'GET /v1/tasks=1' 'POST /v1/tasks=2' 'POST /v1/exports=25'

  # the same table, with health checks free (list every route: the table is replaced)
  quotad admin routes set --default 1 'GET /v1/tasks=1' 'POST /v1/tasks=2' 'POST /v1/exports=25' 'GET /v1/health=0'

  # no patterns: every request costs 1
  quotad admin routes set --clear --default 1`,
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			switch {
			case len(args) == 0 && !clearAll:
				return errors.New("no patterns given: that would replace the route table with an empty one, and every route would cost --default; list every pattern ('METHOD /pattern=UNITS'), or pass --clear if an empty table is what you want")
			case len(args) > 0 && clearAll:
				return errors.New("--clear sets an empty route table: give it no patterns")
			}
			weights := make(map[string]int64, len(args))
			for _, a := range args {
				i := strings.LastIndex(a, "=")
				if i < 0 {
					return fmt.Errorf("%q: want 'METHOD /pattern=UNITS', such as 'POST /v1/exports=25'", a)
				}
				n, err := strconv.ParseInt(strings.TrimSpace(a[i+1:]), 10, 64)
				if err != nil {
					return fmt.Errorf("%q: the units after = must be a whole number", a)
				}
				p := strings.TrimSpace(a[:i])
				if _, dup := weights[p]; dup {
					return fmt.Errorf("%q is given twice", p)
				}
				weights[p] = n
			}
			if !cmd.Flags().Changed("default") {
				// The table is replaced, its default too: a free default
				// (0) went back to 1 when a pattern was added.
				var old node.RoutesView
				if _, err := c.do(cmd.Context(), "GET", "/admin/v1/routes", nil, &old); err != nil {
					return err
				}
				if old.Default != def {
					return fmt.Errorf("the active route table's default is %d, which routes set would change to %d: give --default %d to keep it (or the one you want)", old.Default, def, old.Default)
				}
			}
			var v node.RoutesView
			return c.run(cmd, "PUT", "/admin/v1/routes", map[string]any{"default": def, "weights": weights}, &v, func(w io.Writer) {
				fmt.Fprintf(w, "route weights version %d is active: %d patterns, default %d; %s\n", v.Version, len(v.Weights), v.Default, refreshNote)
			})
		},
	}
	set.Flags().Int64Var(&def, "default", 1, "units for requests that match no pattern (needed when the active table's default is not 1)")
	set.Flags().BoolVar(&clearAll, "clear", false, "set an empty table (no patterns): every request costs --default")
	show := &cobra.Command{
		Use:   "show",
		Short: "Show the active route weights",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var v node.RoutesView
			return c.run(cmd, "GET", "/admin/v1/routes", nil, &v, func(w io.Writer) {
				fmt.Fprintf(w, "version %d, default %d\n\nPATTERN\tUNITS\n", v.Version, v.Default)
				patterns := make([]string, 0, len(v.Weights))
				for p := range v.Weights {
					patterns = append(patterns, p)
				}
				slices.Sort(patterns)
				for _, p := range patterns {
					fmt.Fprintf(w, "%s\t%d\n", p, v.Weights[p])
				}
			})
		},
	}
	cmd.AddCommand(set, show)
	return cmd
}

// --- cluster ----------------------------------------------------------------

// reservationRow is a row of GET /admin/v1/reservations: units of an
// account's grant reserved for (or held by) a node.
type reservationRow struct {
	Node, Account, Grant string
	Units                int64
}

func (c *adminClient) reservations(cmd *cobra.Command) error {
	var out struct {
		Reservations []reservationRow
		// Node, HeldHere and InDoubtHere are the answering node's own
		// allowances (absent from an older quotad's answer), UnsettledHere
		// what its charges not settled yet spent of its reservations.
		Node          string
		HeldHere      []reservationRow `json:"held_here"`
		UnsettledHere []reservationRow `json:"unsettled_here"`
		InDoubtHere   int64            `json:"in_doubt_here"`
	}
	return c.run(cmd, "GET", "/admin/v1/reservations", nil, &out, func(w io.Writer) {
		printReservations(w, out.Node, out.Reservations, out.HeldHere, out.UnsettledHere, out.InDoubtHere)
	})
}

// printReservations prints the ledger's reservations with, on the rows of
// self (the node that answered), what that node holds itself and what its
// charges not settled yet spent of them (which the ledger counts reserved
// until they settle; a row of its own where the ledger has none), and a
// last line comparing the two. self is empty for an older quotad's
// answer: the ledger's rows only.
func printReservations(w io.Writer, self string, ledger, held, unsettled []reservationRow, doubt int64) {
	if self == "" {
		fmt.Fprintln(w, "NODE\tACCOUNT\tGRANT\tUNITS")
		var total int64
		for _, r := range ledger {
			fmt.Fprintf(w, "%s\t%s\t%s\t%d\n", r.Node, r.Account, r.Grant, r.Units)
			total += r.Units
		}
		fmt.Fprintf(w, "\t\ttotal\t%d\n", total)
		return
	}
	type key struct{ account, grant string }
	here, spent := map[key]int64{}, map[key]int64{}
	for _, h := range held {
		here[key{h.Account, h.Grant}] += h.Units
	}
	for _, u := range unsettled {
		spent[key{u.Account, u.Grant}] += u.Units
	}
	fmt.Fprintf(w, "NODE\tACCOUNT\tGRANT\tUNITS\tHELD BY %s\tUNSETTLED\t\n", self)
	var total, reserved, holds, spentAll int64
	differ := 0
	row := func(node, account, grant string, units int64, held, spent string, differs bool) {
		mark := ""
		if differs {
			mark, differ = "differs", differ+1
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%s\t%s\t%s\n", node, account, grant, units, held, spent, mark)
	}
	for _, r := range ledger {
		total += r.Units
		if r.Node != self {
			row(r.Node, r.Account, r.Grant, r.Units, "-", "-", false)
			continue
		}
		k := key{r.Account, r.Grant}
		h, s := here[k], spent[k]
		delete(here, k)
		delete(spent, k)
		reserved, holds, spentAll = reserved+r.Units, holds+h+s, spentAll+s
		row(r.Node, r.Account, r.Grant, r.Units, strconv.FormatInt(h, 10), strconv.FormatInt(s, 10), h+s != r.Units)
	}
	for _, rs := range [][]reservationRow{held, unsettled} { // here, no row in the ledger
		for _, x := range rs {
			k := key{x.Account, x.Grant}
			h, s := here[k], spent[k]
			if h == 0 && s == 0 {
				continue
			}
			delete(here, k)
			delete(spent, k)
			holds, spentAll = holds+h+s, spentAll+s
			row(self, x.Account, x.Grant, 0, strconv.FormatInt(h, 10), strconv.FormatInt(s, 10), true)
		}
	}
	fmt.Fprintf(w, "\t\ttotal\t%d\t%d\t%d\t\n", total, holds-spentAll, spentAll)
	if spentAll != 0 {
		fmt.Fprintf(w, "%s's charges not settled yet spent %d of its reserved units (UNSETTLED): the ledger counts them reserved until they settle, so they count as held here.\n", self, spentAll)
	}
	const again = "Run this again: a difference that stays is no reservation or hand-back on its way"
	switch extra := reserved - holds; {
	case differ == 0:
		fmt.Fprintf(w, "%s (the node that answered) holds what the ledger reserves for it: %d units.\n", self, reserved)
	case extra > 0 && extra <= doubt:
		fmt.Fprintf(w, "%s (the node that answered) holds %d of the %d units the ledger reserves for it; the %d units it counts in doubt "+
			"(reservations whose answer it never got) cover the difference: they return to the grants when %s stops or starts.\n",
			self, holds, reserved, doubt, self)
	case extra > 0:
		fmt.Fprintf(w, "%s (the node that answered) holds %d of the %d units the ledger reserves for it, %d in doubt: %d units look stranded, "+
			"spendable by nobody until %s stops or starts. %s; report it with %s's log.\n",
			self, holds, reserved, doubt, extra-doubt, self, again, self)
	case extra < 0:
		fmt.Fprintf(w, "%s (the node that answered) holds %d units and the ledger reserves %d for it: %d units no grant backs. %s; report it with %s's log.\n",
			self, holds, reserved, -extra, again, self)
	default:
		fmt.Fprintf(w, "%s (the node that answered) holds the %d units the ledger reserves for it, spread differently over %d grants. %s; report it with %s's log.\n",
			self, reserved, differ, again, self)
	}
	fmt.Fprintln(w, "Each node compares only its own (ask another with --addr); a node gone for good keeps its reservations until 'quotad revoke --node ID'.")
}

func (c *adminClient) nodes(cmd *cobra.Command) error {
	var out struct{ Nodes []node.NodeView }
	return c.run(cmd, "GET", "/admin/v1/nodes", nil, &out, func(w io.Writer) {
		fmt.Fprintln(w, "NODE\tINCARNATION\tSTATE\tSETTLED SEQ\tLAST HEARTBEAT\tBUILD\tADMIN ADDR")
		for _, n := range out.Nodes {
			state := n.State
			if state == "" {
				state = "-"
			}
			build := n.Build
			if build == "" {
				build = "(older quotad)"
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%s\t%s\t%s\n", n.Node, n.Incarnation, state, n.SettledSeq, n.HeartbeatAt.Format(time.RFC3339), build, orDash(n.AdminAddr))
		}
	})
}

func newAdminAlertsCmd(c *adminClient) *cobra.Command {
	var account, period, state string
	var limit int
	cmd := &cobra.Command{
		Use:   "alerts",
		Short: "List the quota alerts in the ledger and where their delivery stands",
		Long: `List the quota alerts the ledger records: one per account, month and threshold,
with the figures the webhook carries and its delivery: pending (claimed by a node,
not delivered yet: retried, and taken over by another node after the lease),
delivered, given_up (refused by the receiver with a 3xx or a 4xx other than
429, or undelivered for the give-up age), or legacy (recorded by a quotad
before delivery was tracked). At most --limit alerts are listed, by account,
month and threshold.`,
		Example: `  quotad admin alerts --account acme
  quotad admin alerts --state pending
  quotad admin alerts --period 2026-06 --limit 5000 --json`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// Checked here too, so a typo is named before the network is.
			switch state {
			case "", "pending", "delivered", "given_up", "legacy":
			default:
				return fmt.Errorf("--state %q: want pending, delivered, given_up or legacy", state)
			}
			if _, err := node.ParseMonth(period); period != "" && err != nil {
				return fmt.Errorf("--period %v", err)
			}
			if limit < 1 || limit > 10000 {
				return fmt.Errorf("--limit \"%d\": want a number from 1 to 10000", limit)
			}
			v := url.Values{}
			for name, val := range map[string]string{"account": account, "period": period, "state": state} {
				if val != "" {
					v.Set(name, val)
				}
			}
			v.Set("limit", strconv.Itoa(limit))
			var out struct {
				Alerts    []node.AlertView
				Truncated bool
			}
			return c.run(cmd, "GET", "/admin/v1/alerts?"+v.Encode(), nil, &out, func(w io.Writer) {
				fmt.Fprintln(w, "ACCOUNT\tPERIOD\tTHRESHOLD\tUSED/LIMIT\tSTATE\tATTEMPTS\tCROSSED\tFINISHED\tLAST ERROR")
				for _, a := range out.Alerts {
					finished := "-"
					if a.FinishedAt != nil {
						finished = a.FinishedAt.UTC().Format(time.RFC3339)
					}
					fmt.Fprintf(w, "%s\t%s\t%d%%\t%d/%d\t%s\t%d\t%s\t%s\t%s\n", a.Account, a.Period, a.Threshold, a.Used, a.Limit,
						a.State, a.Attempts, a.CrossedAt.UTC().Format(time.RFC3339), finished, orDash(a.LastError))
				}
				if out.Truncated {
					fmt.Fprintf(w, "... more than %d: narrow with --account, --period or --state, or raise --limit\n", limit)
				}
			})
		},
	}
	cmd.AddCommand(&cobra.Command{
		Use:   "resend ACCOUNT PERIOD THRESHOLD",
		Short: "Send a delivered or given-up quota alert again",
		Long: `Make an alert pending again: the next sweep of a node with a webhook (within a
tenth of --alert-lease, a minute by default) takes it over and sends it, with
retries, as if it had just been claimed. Use it after fixing a receiver that
refused alerts (given_up), or when a receiver lost one it had taken.`,
		Example: `  quotad admin alerts resend acme 2026-06 80`,
		Args:    alertKeyArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var out node.AlertView
			path := "/admin/v1/alerts/" + pathID(args[0]) + "/" + url.PathEscape(args[1]) + "/" + url.PathEscape(strings.TrimSuffix(args[2], "%")) + "/resend"
			return c.run(cmd, "POST", path, nil, &out, func(w io.Writer) {
				fmt.Fprintf(w, "the %s %d%% alert of %s is pending again (%s so far): a node with a webhook sends it at its next sweep\n",
					out.Period, out.Threshold, out.Account, plural(int64(out.Attempts), "attempt", "attempts"))
			})
		},
	})
	cmd.AddCommand(&cobra.Command{
		Use:   "test",
		Short: "Send a signed test alert to the webhook now, and say what the receiver answered",
		Long: `Ask the node (--addr) to send one test alert to its --alert-webhook, signed
with its --alert-secret as real alerts are, and print what the receiver answered
and what that means for real alerts. Run it after setting up or changing a
receiver, before a real alert is given up for a wrong secret or path.

The test alert is for the account "quotaring-test" and carries "test": true;
it is sent once (no retries), is not recorded in the ledger, and does not count
toward any quota. It exits 1 unless the receiver answered 2xx.`,
		Example: `  quotad admin alerts test
  quotad admin --addr http://10.0.0.7:9090 alerts test --json`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var out node.AlertTest
			err := c.run(cmd, "POST", "/admin/v1/alerts/test", nil, &out, func(w io.Writer) {
				answer := fmt.Sprintf("answered %d", out.Status)
				if out.Status == 0 {
					answer = "did not answer (" + out.Error + ")"
				}
				fmt.Fprintf(w, "test alert to %s: the receiver %s in %.1f ms\n%s\n", out.Webhook, answer, out.TookMS, out.Hint)
			})
			if err == nil && !out.OK {
				return errors.New("the test alert was not accepted (see above)")
			}
			return err
		},
	})
	fl := cmd.Flags()
	fl.StringVar(&account, "account", "", "only this account's alerts")
	fl.StringVar(&period, "period", "", "only this month's alerts (2026-06)")
	fl.StringVar(&state, "state", "", "only alerts in this state: pending, delivered, given_up or legacy")
	fl.IntVar(&limit, "limit", 1000, "at most this many alerts (1 to 10000)")
	return cmd
}
