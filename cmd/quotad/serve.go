package main

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"
	"unicode"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
)

type serveFlags struct {
	// changed names the flags given, on the command line or by their
	// environment twins (warnIneffective).
	changed                                  map[string]bool
	nodeID, dataDir, ledger                  string
	rpcAddr, httpAddr, adminAddr, gossipAddr string
	join                                     []string
	gossipKey, rpcToken                      string
	rpcTLS                                   router.TLSFiles
	advertiseHost                            string
	reconcileInterval                        time.Duration
	reservationAudit                         time.Duration
	reconcileSet                             bool // --reconcile-interval given (flag or QUOTAD_RECONCILE_INTERVAL)
	dedupMaxIDs, dedupMaxReplays             int
	maxClockOffset                           time.Duration
	ringPreset                               string
	settleInterval, snapshotInterval         time.Duration
	walSync, events                          bool
	drainTimeout, settleTimeout              time.Duration
	ledgerTimeout                            time.Duration
	testFaults                               bool
	testClockOffset                          time.Duration
	logLevel, logFormat                      string
	upstream, adminToken                     string
	front                                    frontFlags
	httpTLS, adminTLS                        router.CertFiles
	adminAPI                                 serveAdminFlags // admin.go
}

func newServeCmd() *cobra.Command {
	var f serveFlags
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run a node of the cluster",
		Long: `Run a quotaring node: it joins the cluster (gossip), owns the accounts the
ring gives it, decides their charges from memory, logs every charge to its data
dir before answering, and settles batches into the ledger exactly once.

The ledger is a Postgres DSN (every cluster of more than one host) or a SQLite
file (one machine). With the ledger down the node keeps serving from memory,
its log, its reservations and the config snapshot kept in its data dir, and
settles later.

SIGTERM drains: the node stops taking requests, lets in-flight ones finish,
hands its reservations back, settles everything, leaves the ring and exits 0;
if the final settle fails, it exits 1 and the records stay in the data dir
for the next start. SIGINT (Ctrl-C) and SIGHUP (a closed terminal) do the
same: there is no reload signal (plans, accounts, keys and route weights are
read from the ledger every --snapshot-interval, certificate files when they
change), so a supervisor's reload must not send SIGHUP. The stop takes at
most --drain-timeout + --settle-timeout + 17 s (10 s + 20 s + 17 s by
default): give the supervisor's stop timeout at least that (systemd
TimeoutStopSec, docker --stop-timeout, Kubernetes
terminationGracePeriodSeconds, plus any preStop sleep), or it kills the
final settle.

Every flag can also be set by its environment twin, QUOTAD_ and the flag in
upper case with - as _ (--data-dir is QUOTAD_DATA_DIR); a flag on the
command line wins. Secrets may come from a file named by QUOTAD_<FLAG>_FILE.`,
		Example: `  quotad serve --node-id q1 --data-dir /var/lib/quotad/data --ledger postgres://quotad@db/quotaring \
      --join quotad-gossip.default.svc.cluster.local`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f.reconcileSet = cmd.Flags().Changed("reconcile-interval")
			f.changed = map[string]bool{}
			cmd.Flags().Visit(func(fl *pflag.Flag) { f.changed[fl.Name] = true })
			return runServe(cmd.Context(), cmd.ErrOrStderr(), f)
		},
	}
	host, _ := os.Hostname()
	fl := cmd.Flags()
	fl.StringVar(&f.nodeID, "node-id", host, "this node's id, unique in the cluster and stable across restarts (its data dir remembers it; the default is this host's name)")
	fl.StringVar(&f.dataDir, "data-dir", "", "where the node keeps its log (required; keep it on a persistent volume)")
	fl.StringVar(&f.ledger, "ledger", "", "the ledger: postgres://USER:PASSWORD@HOST:PORT/DB or sqlite:/path/ledger.db (required; a node without --join creates a missing SQLite file and migrates an empty database, a node with --join refuses a missing or empty SQLite file: a cluster shares one ledger)")
	fl.StringVar(&f.rpcAddr, "rpc-addr", ":7400", "internal gRPC address (node to node, embedded clients)")
	fl.StringVar(&f.httpAddr, "http-addr", ":8080", "public HTTP address (the proxy)")
	fl.StringVar(&f.adminAddr, "admin-addr", ":9090", "admin address: /healthz, /readyz, /metrics, /status, /debug/pprof (with --admin-token when set), and the admin API (/admin/v1/, with --admin-token)")
	fl.StringVar(&f.gossipAddr, "gossip-addr", ":7946", "gossip (memberlist) address, TCP and UDP")
	fl.StringVar(&f.advertiseHost, "advertise-host", "", "the IP address other nodes reach this one at, when the addresses listen on all interfaces (\":7400\"): gossip advertises an IP, not a name (in Kubernetes, the pod's IP from the downward API); default: the first private IPv4 address")
	fl.StringSliceVar(&f.join, "join", nil, "the other nodes' gossip addresses (--gossip-addr): a host:port list, or a DNS name with many A records (a headless Service). Leave it empty for the first start of a new cluster's first node (on SQLite it creates the ledger then); from then on give every node, the first included, the others' addresses, so that it finds the cluster again after a restart")
	fl.StringVar(&f.gossipKey, "gossip-key", "", "encrypt and authenticate gossip with this key: base64 of 16, 24 or 32 random bytes (openssl rand -base64 32), the same on every node; empty gossips in plaintext, so keep the gossip port private. KEY,OLD,... while rotating: the first sends, all are accepted. Prefer QUOTAD_GOSSIP_KEY or QUOTAD_GOSSIP_KEY_FILE (a file holding it), which ps does not show")
	fl.StringVar(&f.rpcToken, "rpc-token", "", "a shared secret every call to the internal RPC port must carry (nodes forwarding, embedded clients: router.DialOptions.Token, quotad bench cluster --rpc-token): the same on every node, at least 16 characters (openssl rand -hex 32); empty leaves the RPC port open to whoever reaches it. TOKEN,OLD,... while rotating: the first is sent, all are accepted. Prefer QUOTAD_RPC_TOKEN or QUOTAD_RPC_TOKEN_FILE (a file holding it), which ps does not show")
	registerRPCTLSFlags(fl, &f.rpcTLS, "the node's")
	fl.StringVar(&f.httpTLS.Cert, "http-tls-cert", "", "serve the public port (--http-addr) over HTTPS with this certificate chain (PEM, leaf first), read again when it changes; with --http-tls-key. Empty: plain HTTP (TLS ended by a load balancer in front)")
	fl.StringVar(&f.httpTLS.Key, "http-tls-key", "", "the private key (PEM) of --http-tls-cert")
	fl.StringVar(&f.adminTLS.Cert, "admin-tls-cert", "", "serve the admin port (--admin-addr: the admin API, the status page, /metrics, the probes) over HTTPS with this certificate chain (PEM), read again when it changes; with --admin-tls-key")
	fl.StringVar(&f.adminTLS.Key, "admin-tls-key", "", "the private key (PEM) of --admin-tls-cert")
	fl.StringVar(&f.ringPreset, "ring-preset", ring.PresetLAN, "gossip timings: lan (production) or local (tests on one machine)")
	fl.DurationVar(&f.settleInterval, "settle-interval", time.Second, "how often to settle the log into the ledger (also the span a reservation is sized to cover twice); at least 10ms")
	fl.DurationVar(&f.snapshotInterval, "snapshot-interval", 3*time.Second, "how often to read the config (plans, accounts, keys, weights) from the ledger; at least 100ms")
	fl.BoolVar(&f.walSync, "wal-sync", true, "fsync the log before answering; false is for benchmarks only: a crash then LOSES acknowledged charges")
	fl.BoolVar(&f.events, "events", true, "keep the event log in the ledger (off: daily aggregates only, and no duplicate catch at settle)")
	fl.DurationVar(&f.drainTimeout, "drain-timeout", 10*time.Second, "on SIGTERM, how long in-flight requests may take to finish")
	fl.DurationVar(&f.settleTimeout, "settle-timeout", 20*time.Second, "on SIGTERM, how long handing reservations back and the final settle may take together; at least 100ms")
	fl.DurationVar(&f.ledgerTimeout, "ledger-timeout", flush.DefaultCallTimeout, "how long one settle, heartbeat or background reservation top-up may wait for the ledger's answer: past it the call is cancelled and retried, and the ledger counts as down (quotaring_ledger_up 0, a WARN); at least 100ms")
	fl.DurationVar(&f.reservationAudit, "reservation-audit", time.Minute, "how often this node reads its reservations in the ledger, looking for units reserved for it on accounts it let go, which nobody can spend until it stops or starts (exported as quotaring_reservations_stranded_units, logged at WARN); at least 1s, or 0 to turn it off")
	fl.DurationVar(&f.reconcileInterval, "reconcile-interval", 15*time.Minute, "how often to check the ledger's counters against its event log (exported as quotaring_reconcile_differences); one node, the serving member with the smallest id, runs it; at least 1m, or 0 to turn it off (off by default with --events=false, which keeps no event log, and refused with it)")
	fl.IntVar(&f.dedupMaxIDs, "dedup-max-ids", shard.DefaultParams().DedupMax, fmt.Sprintf("the Idempotency-Keys an owner remembers per account for 24 h, the oldest dropped first (%d to %d); a few hundred bytes of memory each, and for the rest of the month the generation of up to 4 times as many keys it let go, about 140 bytes each, so that a key used again after 24 h is billed again (README: Accounts that send many Idempotency-Keys)", minDedupMaxIDs, maxDedupMaxIDs))
	fl.IntVar(&f.dedupMaxReplays, "dedup-max-replays", shard.DefaultMaxReplays, fmt.Sprintf("the retries of one Idempotency-Key an owner serves again, billed once, before it refuses the next 422 idempotency-replay-limit (0 to %d; 0 serves every retry: one charge then buys any number of runs within 24 h; README: Idempotency)", maxDedupMaxReplays))
	fl.DurationVar(&f.maxClockOffset, "max-clock-offset", node.DefaultMaxClockOffset, "how far this node's clock may stand from the ledger's, or step, before the node warns, holds to its time from before a step, or takes the ledger's time when the other nodes agree with the ledger (README: Months and clocks); at least "+node.MinMaxClockOffset.String())
	fl.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fl.StringVar(&f.logFormat, "log-format", "text", "text or json")
	fl.BoolVar(&f.testFaults, "test-faults", false, "expose fault injection on the admin port (/test/...): for chaos tests only, never in production")
	fl.MarkHidden("test-faults")
	fl.DurationVar(&f.testClockOffset, "test-clock-offset", 0, "start with the wall clock shifted by this much, as if the machine's clock were off (chaos tests only; needs --test-faults)")
	fl.MarkHidden("test-clock-offset")
	f.front.register(cmd, &f.upstream)
	f.adminAPI.register(cmd, &f.adminToken)
	return cmd
}

func newLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		// slog's JSON writes a duration as integer nanoseconds
		// ("took":5000000), which no reader of the log can tell from a
		// count: as text does, "5ms".
		opts.ReplaceAttr = func(_ []string, a slog.Attr) slog.Attr {
			if a.Value.Kind() == slog.KindDuration {
				a.Value = slog.StringValue(a.Value.Duration().String())
			}
			return a
		}
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", format)
}

func (f *serveFlags) config(logger *slog.Logger) (node.Config, error) {
	if f.dataDir == "" {
		return node.Config{}, errors.New("--data-dir is required: the node's log lives there (QUOTAD_DATA_DIR)")
	}
	if f.ledger == "" {
		return node.Config{}, errors.New("--ledger is required: postgres://USER:PASSWORD@HOST:PORT/DB or sqlite:/path/ledger.db (QUOTAD_LEDGER)")
	}
	for i, j := range f.join {
		f.join[i] = strings.TrimSpace(j) // "q1:7946, q2:7946", as lists are often written
	}
	if err := checkJoinedSQLite(f.ledger, f.join); err != nil {
		return node.Config{}, err
	}
	if f.nodeID == "" || strings.ContainsAny(f.nodeID, "/,") || strings.ContainsFunc(f.nodeID, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }) {
		// NB: commas separate ids in --lost-node lists, and a control
		// character would forge lines in logs and the chaos report.
		return node.Config{}, fmt.Errorf("--node-id %q: want a non-empty id without spaces, commas, slashes or control characters, such as q1 or the pod's name", f.nodeID)
	}
	if len(f.nodeID) > ring.MaxNodeIDLen {
		return node.Config{}, fmt.Errorf("--node-id is %d bytes: want at most %d (it travels in every gossip message about the node), such as q1 or the pod's name", len(f.nodeID), ring.MaxNodeIDLen)
	}
	for _, a := range []struct{ flag, v, example string }{{"rpc-addr", f.rpcAddr, ":7400"}, {"http-addr", f.httpAddr, ":8080"},
		{"admin-addr", f.adminAddr, ":9090"}, {"gossip-addr", f.gossipAddr, ":7946"}} {
		if err := checkListenAddr(a.flag, a.v, a.example); err != nil {
			return node.Config{}, err
		}
	}
	if f.advertiseHost != "" && net.ParseIP(f.advertiseHost) == nil {
		return node.Config{}, fmt.Errorf("--advertise-host %q: want this node's IP address, such as 10.0.3.7: gossip advertises an IP, not a host name (in Kubernetes, the pod's IP: status.podIP through the downward API)", f.advertiseHost)
	}
	if f.ringPreset != ring.PresetLAN && f.ringPreset != ring.PresetLocal {
		return node.Config{}, fmt.Errorf("--ring-preset %q: want lan or local", f.ringPreset)
	}
	for _, d := range []struct {
		name   string
		v, min time.Duration
		why    string
	}{
		{"settle-interval", f.settleInterval, minSettleInterval, "a shorter one settles batches of one charge and keeps the ledger busy"},
		{"snapshot-interval", f.snapshotInterval, minSnapshotInterval, "each refresh reads plans, accounts, keys and weights from the ledger"},
		{"ledger-timeout", f.ledgerTimeout, minLedgerTimeout, "a healthy ledger's answer would count as down"},
		{"settle-timeout", f.settleTimeout, minLedgerTimeout, "handing reservations back needs a ledger round trip"},
		{"drain-timeout", f.drainTimeout, time.Millisecond, "a shorter one cuts off every request still running"},
	} {
		switch {
		case d.v <= 0:
			return node.Config{}, fmt.Errorf("--%s %s: want a positive duration such as 1s", d.name, d.v)
		case d.v < d.min:
			return node.Config{}, fmt.Errorf("--%s %s: want at least %s (%s)", d.name, d.v, d.min, d.why)
		}
	}
	if f.testClockOffset != 0 && !f.testFaults {
		return node.Config{}, errors.New("--test-clock-offset is a chaos test's fault: it needs --test-faults")
	}
	if f.maxClockOffset < node.MinMaxClockOffset {
		return node.Config{}, fmt.Errorf("--max-clock-offset %s: want at least %s (a reading of the ledger's clock is off by up to half its round trip); the default is %s", f.maxClockOffset, node.MinMaxClockOffset, node.DefaultMaxClockOffset)
	}
	if f.dedupMaxIDs < minDedupMaxIDs || f.dedupMaxIDs > maxDedupMaxIDs {
		return node.Config{}, fmt.Errorf("--dedup-max-ids %d: want %d to %d Idempotency-Keys remembered per account (default %d)", f.dedupMaxIDs, minDedupMaxIDs, maxDedupMaxIDs, shard.DefaultParams().DedupMax)
	}
	if f.dedupMaxReplays < 0 || f.dedupMaxReplays > maxDedupMaxReplays {
		return node.Config{}, fmt.Errorf("--dedup-max-replays %d: want 0 to %d served retries of one Idempotency-Key, 0 for no bound (default %d)", f.dedupMaxReplays, maxDedupMaxReplays, shard.DefaultMaxReplays)
	}
	if f.reconcileInterval < 0 || f.reconcileInterval > 0 && f.reconcileInterval < minReconcileInterval {
		return node.Config{}, fmt.Errorf("--reconcile-interval %s: want at least %s (each run reads the month's whole event log), such as 15m, or 0 to turn it off", f.reconcileInterval, minReconcileInterval)
	}
	if f.reservationAudit < 0 || f.reservationAudit > 0 && f.reservationAudit < time.Second {
		return node.Config{}, fmt.Errorf("--reservation-audit %s: want at least 1s (each audit reads this node's reservations from the ledger), such as 1m, or 0 to turn it off", f.reservationAudit)
	}
	reconcile := f.reconcileInterval
	if !f.events && reconcile > 0 {
		// Reconcile checks the counters against the event log, which
		// --events=false does not keep: every run would report every
		// counter as a difference (an ERROR and a firing alert).
		if f.reconcileSet {
			return node.Config{}, fmt.Errorf("--reconcile-interval %s with --events=false: reconcile checks the ledger's counters against its event log, which --events=false does not keep; leave --reconcile-interval at 0", reconcile)
		}
		reconcile = 0
		logger.Info("periodic reconcile is off: --events=false keeps no event log to check the counters against")
	}
	gossipKeys, hexKeys, err := parseGossipKeys(f.gossipKey)
	if err != nil {
		return node.Config{}, err
	}
	for _, i := range hexKeys {
		// Warned, not refused: a cluster started with such a key runs on
		// it (every node reads the same string the same way), and a key
		// has no other spelling to upgrade to; it rotates as any key.
		logger.Warn(fmt.Sprintf("--gossip-key: key %d is hex digits (openssl rand -hex?), which decode as base64 to another key than the one written: "+
			"it works while every node has the same string, but make the next key with openssl rand -base64 32 and rotate to it (README, \"Rotating\")", i))
	}
	rpcTokens, err := parseRPCTokens(f.rpcToken)
	if err != nil {
		return node.Config{}, err
	}
	if err := checkRPCTLSFlags(f.rpcTLS); err != nil {
		return node.Config{}, err
	}
	for _, c := range []struct {
		flag  string
		files router.CertFiles
	}{{"--http-tls", f.httpTLS}, {"--admin-tls", f.adminTLS}} {
		if c.files.Enabled() && (c.files.Cert == "" || c.files.Key == "") {
			missing := c.flag + "-key"
			if c.files.Cert == "" {
				missing = c.flag + "-cert"
			}
			return node.Config{}, fmt.Errorf("HTTPS needs %s-cert and %s-key together; %s is missing", c.flag, c.flag, missing)
		}
	}
	return node.Config{HTTPTLS: f.httpTLS, AdminTLS: f.adminTLS, ID: f.nodeID, DataDir: f.dataDir, Ledger: f.ledger,
		RPCAddr: f.rpcAddr, HTTPAddr: f.httpAddr, AdminAddr: f.adminAddr, GossipAddr: f.gossipAddr,
		Join: f.join, GossipKeys: gossipKeys, RPCTokens: rpcTokens, RPCTLS: f.rpcTLS, AdvertiseHost: f.advertiseHost, ReconcileInterval: reconcileInterval(reconcile), ReservationAudit: reconcileInterval(f.reservationAudit), RingPreset: f.ringPreset, SettleInterval: f.settleInterval, SnapshotInterval: f.snapshotInterval,
		NoSync: !f.walSync, EventsOff: !f.events, DrainTimeout: f.drainTimeout, SettleTimeout: f.settleTimeout, LedgerTimeout: f.ledgerTimeout,
		MaxClockOffset: f.maxClockOffset, DedupMaxIDs: f.dedupMaxIDs, DedupMaxReplays: dedupMaxReplays(f.dedupMaxReplays), TestFaults: f.testFaults, TestClockOffset: f.testClockOffset, Logger: logger}, nil
}

// The bounds of --dedup-max-ids: fewer than a thousand would forget a
// busy account's keys within seconds; ten million would hold gigabytes of
// one account's keys in memory.
const (
	minDedupMaxIDs = 1_000
	maxDedupMaxIDs = 10_000_000
	// A million served retries of one request is no bound worth the name;
	// 0 says "none" plainly.
	maxDedupMaxReplays = 1_000_000
)

// checkListenAddr checks a listen address flag before the node starts, so
// that a bad one is reported by its flag's name.
func checkListenAddr(flag, addr, example string) error {
	if strings.Contains(addr, "://") {
		hint := ""
		if flag == "admin-addr" {
			hint = " (QUOTAD_ADMIN_ADDR is this flag; quotad admin reads a node's URL from QUOTAD_ADMIN_URL)"
		}
		return fmt.Errorf("--%s %q is a URL: want host:port, such as %s or 127.0.0.1%s%s", flag, addr, example, example, hint)
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return fmt.Errorf("--%s %q: want host:port, such as %s or 127.0.0.1%s (port 0 picks a free one)", flag, addr, example, example)
	}
	return nil
}

// parseGossipKeys decodes --gossip-key: "" is none; otherwise a comma list
// of standard base64 AES keys, the one to send first.
// hexKeys are the 1-based positions of keys that look like hex (32 hex
// digits, from openssl rand -hex 16, decode as base64 to a valid 24-byte
// key that is not the one written): serve warns of them.
func parseGossipKeys(s string) (keys [][]byte, hexKeys []int, err error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil, nil
	}
	for i, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		key, err := base64.StdEncoding.DecodeString(part)
		if err != nil {
			return nil, nil, fmt.Errorf("--gossip-key: key %d is not base64 (%v): make one with openssl rand -base64 32", i+1, err)
		}
		switch {
		case len(key) != 16 && len(key) != 24 && len(key) != 32 && isHexKey(part):
			return nil, nil, fmt.Errorf("--gossip-key: key %d is %d hex digits (openssl rand -hex?), but keys are base64: make one with openssl rand -base64 32", i+1, len(part))
		case len(key) != 16 && len(key) != 24 && len(key) != 32:
			return nil, nil, fmt.Errorf("--gossip-key: key %d is %d bytes once decoded, want 16, 24 or 32: make one with openssl rand -base64 32", i+1, len(key))
		case isHexKey(part):
			hexKeys = append(hexKeys, i+1)
		}
		keys = append(keys, key)
	}
	return keys, hexKeys, nil
}

// isHexKey reports whether s is 32, 48 or 64 hex digits: a key of 16, 24
// or 32 bytes written in hex. Random base64 of that length is hex digits
// alone with a chance of 1 in 4^32.
func isHexKey(s string) bool {
	if len(s) != 32 && len(s) != 48 && len(s) != 64 {
		return false
	}
	return strings.IndexFunc(s, func(r rune) bool { return !strings.ContainsRune("0123456789abcdefABCDEF", r) }) < 0
}

// parseRPCTokens splits --rpc-token: "" is none; otherwise a comma list,
// the token to send first.
func parseRPCTokens(s string) ([]string, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var tokens []string
	for i, part := range strings.Split(s, ",") {
		tok := strings.TrimSpace(part)
		if err := router.CheckRPCToken(tok); err != nil || tok == "" {
			return nil, fmt.Errorf("--rpc-token: token %d is %d characters; use at least %d random ones (openssl rand -hex 32)", i+1, len(tok), router.MinRPCTokenLen)
		}
		tokens = append(tokens, tok)
	}
	return tokens, nil
}

func runServe(ctx context.Context, logTo io.Writer, f serveFlags) error {
	logger, err := newLogger(logTo, f.logLevel, f.logFormat)
	if err != nil {
		return err
	}
	cfg, err := f.config(logger)
	if err != nil {
		return err
	}
	if cfg.Front, err = f.front.build(f.upstream); err != nil {
		return err
	}
	f.warnIneffective(logger)
	if err := f.adminAPI.apply(&cfg, f.adminToken); err != nil {
		return err
	}
	n, err := node.Start(ctx, cfg)
	if err != nil {
		if ctx.Err() != nil && errors.Is(err, context.Canceled) {
			// SIGTERM or Ctrl-C while it started (a pod deleted as it
			// came up): a stop asked for, not a failure. Start undid what
			// it had done. A refusal that came with the signal (a mark
			// conflict, a newer schema) still fails.
			logger.Info("stopped while starting: nothing to drain", "detail", err)
			return nil
		}
		return err
	}
	budget := cfg.DrainTimeout + cfg.SettleTimeout + 10*time.Second
	select {
	case <-ctx.Done(): // SIGTERM or SIGINT
	case <-n.Fenced():
		// Another process started as this --node-id: stop without handing
		// anything back, and exit 1 (node/fence.go).
		sctx, cancel := context.WithTimeout(context.Background(), budget)
		defer cancel()
		return n.StopFenced(sctx)
	}
	logger.Info("signal received: draining", "signal", signalName(ctx))
	sctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()
	return n.Shutdown(sctx)
}

// frontFlags configure the public HTTP front: the proxy to --upstream
// (router.NewProxy).
type frontFlags struct {
	usagePath, billOn string
	quotaStatus       int
	maxBodyBytes      int64
	upstreamTimeout   time.Duration
	bodyIdleTimeout   time.Duration
	bodyTimeout       time.Duration
	stripAPIKey       bool
	chargePreflights  bool
	corsOrigins       []string
	trustForwarded    bool
	upgrades          []string
}

func (ff *frontFlags) register(cmd *cobra.Command, upstream *string) {
	fl := cmd.Flags()
	fl.StringVar(upstream, "upstream", "", "the API to proxy to on --http-addr: http://host:port[/base], https://..., or h2c://host:port for a gRPC server without TLS; empty serves no front (404)")
	fl.StringVar(&ff.usagePath, "usage-path", "/v1/usage", "path that answers the caller's usage as JSON (GET and HEAD), never proxied")
	fl.IntVar(&ff.quotaStatus, "quota-status", http.StatusTooManyRequests, "status of a quota-exceeded refusal: 429, 402 or 403 (rate limits are always 429)")
	fl.StringVar(&ff.billOn, "bill-on", router.BillOnSuccess, "when a request keeps its charge: success (refund 5xx, upstream failures and gRPC errors), 2xx (refund anything but 2xx/3xx) or always")
	fl.Int64Var(&ff.maxBodyBytes, "max-body-bytes", router.DefaultMaxBodyBytes, "largest request body; larger is refused with 413 and not charged (-1: no limit)")
	fl.DurationVar(&ff.upstreamTimeout, "upstream-timeout", 30*time.Second, "how long to wait for the upstream's response headers before answering 504 and refunding")
	fl.DurationVar(&ff.bodyIdleTimeout, "body-idle-timeout", router.DefaultBodyIdleTimeout, "cut off a request body that sends nothing for this long: 408 and refund (gRPC calls exempt); -1s: never")
	fl.DurationVar(&ff.bodyTimeout, "body-timeout", 0, "cut off a request body not sent in full within this long of the request's headers, however steadily it trickles: 408 and refund (gRPC calls exempt); set it above the slowest upload you serve; 0: no bound")
	fl.BoolVar(&ff.stripAPIKey, "strip-api-key-header", false, "remove the header the API key came from before proxying: X-Api-Key, or Authorization when the key was its Bearer token")
	fl.BoolVar(&ff.chargePreflights, "charge-preflights", false, "treat CORS preflights (OPTIONS with Origin and Access-Control-Request-Method) as any request: they then need an API key, which browsers never send with them; only for an API no browser calls across origins. Default: they reach the upstream uncharged")
	fl.StringSliceVar(&ff.corsOrigins, "cors-origins", nil, "browser origins the front answers CORS for itself (comma-separated, such as https://app.example.com, or * for any): it answers their preflights, and every answer to them (its own 429s, 401s and usage answers included, which a page cannot read otherwise) carries Access-Control-Allow-Origin and exposes the quota headers. Default: none, CORS is the upstream's")
	fl.StringSliceVar(&ff.upgrades, "upgrades", []string{"websocket"}, "protocols a client may switch to through the proxy (the Upgrade header's names, comma-separated), or none. After the switch the proxy relays bytes and bills the connection once, as one request: allow only protocols that serve one request's worth over it, such as tcp for Docker's attach. Other offers are taken out and the request is served without switching; h2c is never allowed")
	fl.BoolVar(&ff.trustForwarded, "trust-forwarded-headers", false, "keep the client's X-Forwarded-For/-Host/-Proto, X-Real-IP and Forwarded (set it behind a load balancer that sets them); otherwise they are replaced, since clients can forge them")
	cmd.Example += `

  # the proxy in front of an API on port 8081
  quotad serve --node-id q1 --data-dir ./q1 --ledger sqlite:./ledger.db --upstream http://127.0.0.1:8081`
}

// check validates the front's flags, with or without --upstream: a value
// that would be refused once --upstream is added is refused now, naming
// the flag.
func (ff *frontFlags) check() error {
	if !strings.HasPrefix(ff.usagePath, "/") {
		return fmt.Errorf("--usage-path %q: want a path starting with /, such as /v1/usage", ff.usagePath)
	}
	switch ff.quotaStatus {
	case http.StatusTooManyRequests, http.StatusPaymentRequired, http.StatusForbidden:
	default:
		return fmt.Errorf("--quota-status %d: want 429, 402 or 403", ff.quotaStatus)
	}
	switch ff.billOn {
	case router.BillOnSuccess, router.BillOn2xx, router.BillOnAlways:
	default:
		return fmt.Errorf("--bill-on %q: want success, 2xx or always", ff.billOn)
	}
	if ff.upstreamTimeout <= 0 {
		return fmt.Errorf("--upstream-timeout %s: want a positive duration such as 30s", ff.upstreamTimeout)
	}
	if ff.bodyIdleTimeout == 0 {
		return fmt.Errorf("--body-idle-timeout 0: want a duration such as 60s, or a negative one (-1s) for no bound")
	}
	if ff.bodyTimeout < 0 {
		return fmt.Errorf("--body-timeout %s: want a duration such as 10m, or 0 for no bound", ff.bodyTimeout)
	}
	if ff.maxBodyBytes == 0 || ff.maxBodyBytes < -1 {
		return fmt.Errorf("--max-body-bytes %d: want a positive size, or -1 for no limit", ff.maxBodyBytes)
	}
	if err := (router.FrontOptions{CORSOrigins: ff.corsOrigins}).Check(); err != nil {
		return fmt.Errorf("--cors-origins: %w", err)
	}
	switch none := slices.IndexFunc(ff.upgrades, func(p string) bool { return strings.EqualFold(p, "none") }); {
	case len(ff.upgrades) == 0:
		return errors.New(`--upgrades is empty: give the protocols to allow, such as websocket, or "none" to allow no protocol switch`)
	case none >= 0 && len(ff.upgrades) > 1:
		return fmt.Errorf(`--upgrades %q: "none" allows no protocol switch and stands alone; drop it, or the protocols`, strings.Join(ff.upgrades, ","))
	case none < 0:
		if err := (router.FrontOptions{Upgrades: ff.upgrades}).Check(); err != nil {
			return fmt.Errorf("--upgrades: %w", err)
		}
	}
	return nil
}

// frontOnly are the flags that configure the HTTP front, which only
// --upstream serves.
var frontOnly = []string{"usage-path", "quota-status", "bill-on", "max-body-bytes", "upstream-timeout", "body-idle-timeout", "body-timeout",
	"strip-api-key-header", "charge-preflights", "cors-origins", "upgrades", "trust-forwarded-headers"}

// warnIneffective logs the settings given (flag or environment twin) that
// do nothing, or cut requests off, as they stand: they were taken without a
// word (a review set --bill-on and --advertise-host to no effect, and an
// --upstream-timeout above --drain-timeout that cut long requests off at
// every stop).
func (f *serveFlags) warnIneffective(logger *slog.Logger) {
	var given []string
	for _, name := range frontOnly {
		if f.changed[name] {
			given = append(given, "--"+name)
		}
	}
	if f.upstream == "" && len(given) > 0 {
		logger.Warn("settings of the HTTP front given without --upstream have no effect: the node serves no front", "ignored", strings.Join(given, " "),
			"what_to_do", "give --upstream (QUOTAD_UPSTREAM), or drop them")
	}
	if f.upstream != "" && f.front.upstreamTimeout > f.drainTimeout && (f.changed["upstream-timeout"] || f.changed["drain-timeout"]) {
		logger.Warn("--upstream-timeout is longer than --drain-timeout: a stop cuts off the proxied requests that run longer than the drain (refunded)",
			"upstream_timeout", f.front.upstreamTimeout, "drain_timeout", f.drainTimeout, "what_to_do", "raise --drain-timeout to at least --upstream-timeout (and the supervisor's stop timeout with it)")
	}
	if f.changed["advertise-host"] {
		unspecified := false
		for _, a := range []string{f.rpcAddr, f.httpAddr, f.adminAddr, f.gossipAddr} {
			if host, _, err := net.SplitHostPort(a); err == nil {
				ip := net.ParseIP(host)
				unspecified = unspecified || host == "" || ip != nil && ip.IsUnspecified()
			}
		}
		if !unspecified {
			logger.Warn("--advertise-host has no effect: every address names its host, which the others reach this node at", "advertise_host", f.advertiseHost,
				"what_to_do", "drop it, or listen on all addresses (--rpc-addr :7400 ...) and advertise this one")
		}
	}
}

// build returns node.Config.Front, or nil without --upstream. It validates
// the flags now, so a bad value fails before the node starts.
func (ff *frontFlags) build(upstream string) (func(*node.Node) (http.Handler, error), error) {
	if err := ff.check(); err != nil {
		return nil, err
	}
	if upstream == "" {
		return nil, nil
	}
	u, err := url.Parse(upstream)
	if err != nil {
		return nil, fmt.Errorf("--upstream %q: want an absolute http://, https:// or h2c:// URL, such as http://127.0.0.1:8081", upstream)
	}
	if err := router.CheckUpstream(u); err != nil {
		return nil, fmt.Errorf("--%w", err)
	}
	opts := func(o router.FrontOptions) router.FrontOptions {
		o.UsagePath, o.QuotaStatus, o.BillOn = ff.usagePath, ff.quotaStatus, ff.billOn
		o.MaxBodyBytes, o.UpstreamTimeout, o.StripAPIKeyHeader = ff.maxBodyBytes, ff.upstreamTimeout, ff.stripAPIKey
		o.TrustForwarded, o.ChargePreflights, o.CORSOrigins = ff.trustForwarded, ff.chargePreflights, ff.corsOrigins
		o.BodyIdleTimeout, o.BodyTimeout = ff.bodyIdleTimeout, ff.bodyTimeout
		if len(ff.upgrades) == 1 && strings.EqualFold(ff.upgrades[0], "none") {
			o.NoUpgrades = true
		} else {
			o.Upgrades = ff.upgrades
		}
		return o
	}
	if err := opts(router.FrontOptions{}).Check(); err != nil {
		return nil, err
	}
	return func(n *node.Node) (http.Handler, error) { return router.NewProxy(u, opts(n.FrontOptions())) }, nil
}

// dedupMaxReplays maps the flag's 0 (no bound) to node.Config's negative,
// whose 0 is the default.
func dedupMaxReplays(n int) int {
	if n == 0 {
		return -1
	}
	return n
}

// The least --settle-interval, --snapshot-interval, --ledger-timeout (and
// --settle-timeout) and --reconcile-interval serve takes: below them a node
// spends itself and the ledger on bookkeeping, or reads a healthy ledger as
// down. A nanosecond is a typo ("1" read as 1ns is refused by the flag
// parser, "1ns" is not).
const (
	minSettleInterval    = 10 * time.Millisecond
	minSnapshotInterval  = 100 * time.Millisecond
	minLedgerTimeout     = 100 * time.Millisecond
	minReconcileInterval = time.Minute
)

// reconcileInterval maps the flag's 0 (off) to node.Config's negative
// (--reconcile-interval's and --reservation-audit's).
func reconcileInterval(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

// registerRPCTLSFlags adds --rpc-tls-cert, -key, -ca and -server-name (whose
// certificate: "the node's" or "this client's").
func registerRPCTLSFlags(fl *pflag.FlagSet, f *router.TLSFiles, whose string) {
	presented := "presented as both server and client certificate" // a node serves and dials
	if whose != "the node's" {
		presented = "presented as its client certificate"
	}
	fl.StringVar(&f.Cert, "rpc-tls-cert", "", "mutual TLS on the internal RPC: "+whose+" certificate chain (PEM), "+presented+"; read again when it changes. With --rpc-tls-key and --rpc-tls-ca")
	fl.StringVar(&f.Key, "rpc-tls-key", "", "the private key (PEM) of --rpc-tls-cert")
	fl.StringVar(&f.CA, "rpc-tls-ca", "", "the CA bundle (PEM) every node's and embedded client's certificate must chain to; the same everywhere; read again with the certificate when either changes (rotate a CA with both in the bundle, new certificates, then the new alone)")
	fl.StringVar(&f.ServerName, "rpc-tls-server-name", "", "the name every node's certificate carries, checked when dialling nodes; empty: the address dialled (nodes advertise IPs, so their certificates then need IP SANs)")
}

// checkRPCTLSFlags names the flags missing for RPC TLS: the three files go
// together, and a server name alone turns nothing on.
func checkRPCTLSFlags(f router.TLSFiles) error {
	if !f.Enabled() {
		if f.ServerName != "" {
			return errors.New("--rpc-tls-server-name is set without --rpc-tls-cert, --rpc-tls-key and --rpc-tls-ca: give all three to turn RPC TLS on")
		}
		return nil
	}
	var missing []string
	for _, x := range []struct{ flag, v string }{{"--rpc-tls-cert", f.Cert}, {"--rpc-tls-key", f.Key}, {"--rpc-tls-ca", f.CA}} {
		if x.v == "" {
			missing = append(missing, x.flag)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("RPC TLS needs --rpc-tls-cert, --rpc-tls-key and --rpc-tls-ca together; missing %s", strings.Join(missing, ", "))
	}
	return nil
}

// checkJoinedSQLite refuses a node that joins a cluster (--join) on an
// SQLite ledger file that does not exist yet, or is empty. The node would
// create a new ledger there, become ready, and own its share of accounts
// that ledger knows nothing of: their customers were refused as unknown
// keys, or as quota-unavailable while it "loaded its config", for as long
// as it ran, with no warning (a mistyped path). A cluster's nodes share one
// ledger, which exists once its first node started; the first node (no
// --join) still creates it.
func checkJoinedSQLite(ledger string, join []string) error {
	path, ok := flush.SQLitePath(ledger)
	if !ok || len(join) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	fi, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err == nil && fi.Size() == 0:
	case err == nil:
		// A file with no ledger schema (another program's database, or one
		// a read-only command once opened) was migrated into a new ledger.
		if v, err := flush.SQLiteSchemaVersion(ctx, path); err != nil || v > 0 {
			return nil // a ledger, or not readable: opening it says what is wrong
		}
	default:
		return nil // not readable: opening it says what is wrong
	}
	return fmt.Errorf("--ledger %q: there is no SQLite ledger at %s (no file, an empty one, or one without quotaring's schema), and --join names a cluster to join: "+
		"the nodes of a cluster share one ledger, which holds its accounts, and a node on a new one would own accounts it knows nothing of. "+
		"Check the path against the other nodes' --ledger; to start a new cluster, start its first node without --join (it creates the "+
		"ledger), or create it with quotad migrate --ledger %q", ledger, path, ledger)
}
