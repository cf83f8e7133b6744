package node

import (
	"context"
	crand "crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/buildinfo"
	"github.com/quotaring/quotaring/internal/logsample"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/wal"
)

// Config configures a node. Zero durations take the defaults in brackets.
type Config struct {
	ID      string // unique in the cluster; the data dir remembers it
	DataDir string
	// Ledger is a Postgres DSN (postgres://...) or a SQLite path
	// (sqlite:/path/ledger.db or a path ending in .db).
	Ledger string
	// Listen addresses, host:port (port 0: any free port).
	RPCAddr, HTTPAddr, AdminAddr, GossipAddr string
	// AdvertiseHost is the IP address other nodes reach this one at, for
	// listeners on every address (":7400"); empty: the first private IPv4.
	// An IP, since gossip (memberlist) advertises one.
	AdvertiseHost string
	// Join lists seeds (host:port or DNS names); empty for the first node.
	Join []string
	// GossipKeys encrypt and authenticate gossip: the first is the one the
	// node sends with (ring.Config.SecretKey), all are accepted
	// (OtherKeys, for a rotation); 16, 24 or 32 bytes each, the same on
	// every node; none gossips in plaintext.
	GossipKeys [][]byte
	// RPCTokens, when set, are what every call to this node's RPC port
	// must carry one of; the first is sent with every call it forwards
	// (router's auth.go). The same on every node and in every embedded
	// client; at least 16 characters each. More than one is for a
	// rotation.
	RPCTokens []string
	// RPCTLS, when its files are set, makes the RPC port mutual TLS: the
	// node presents RPCTLS.Cert, requires a client certificate from
	// RPCTLS.CA, and forwards over TLS (router's tls.go). The same CA on
	// every node and in every embedded client's DialOptions.TLS.
	RPCTLS router.TLSFiles
	// HTTPTLS and AdminTLS, when set, serve the public front and the admin
	// port over HTTPS with their certificate and key (read again when they
	// change); clients are not asked for certificates there.
	HTTPTLS, AdminTLS router.CertFiles
	// RingPreset is "lan" (production) or "local" (loopback tests) ["lan"].
	RingPreset string
	// SettleInterval between settles [1s]; SnapshotInterval between config
	// reads [3s].
	SettleInterval, SnapshotInterval time.Duration
	// NoSync logs with pebble.NoSync: benchmarks only, loses acknowledged
	// charges on a crash.
	NoSync bool
	// EventsOff keeps aggregates only in the ledger (no event log, no
	// duplicate catch at settle).
	EventsOff bool
	// DrainTimeout bounds waiting for in-flight calls at shutdown [10s];
	// SettleTimeout the hand-back of reservations and the final settle
	// together [20s].
	DrainTimeout, SettleTimeout time.Duration
	// LedgerTimeout bounds each call of the settle loop to the ledger (a
	// settle's batch, a heartbeat) [flush.DefaultCallTimeout, 10s]: a call
	// that has not answered by then is cancelled and retried, and the
	// ledger counts as down (quotaring_ledger_up 0) from then on. It
	// bounds the engine's background reservation top-ups and release
	// retries too (engine.Options.LedgerTimeout), and every reservation
	// call; a charge waits for a reservation at most
	// engine.DefaultReserveTimeout (2 s) whatever it is.
	LedgerTimeout time.Duration
	// LedgerRetry is the wait between attempts to reach the ledger when it is
	// down [2s].
	LedgerRetry time.Duration
	// MaxClockOffset is how far the node's clock may stand from the
	// ledger's, or step against its monotonic clock, before the node warns,
	// holds to its time from before the step, or takes the ledger's time
	// (clock.go) [1s; at least MinMaxClockOffset].
	MaxClockOffset time.Duration
	// ReconcileInterval is how often the node checks the ledger's counters
	// against its event log and exports the number of differences
	// (quotaring_reconcile_differences) [15m], when it is the serving member
	// with the smallest id (one node of the ring does it); negative turns it
	// off.
	ReconcileInterval time.Duration
	// ReservationAudit is how often the node looks in the ledger for units
	// reserved for it on accounts it has let go (audit.go) and exports them
	// (quotaring_reservations_stranded_units) [1m]; negative turns it off.
	ReservationAudit time.Duration
	// DedupMaxIDs bounds the client event ids (Idempotency-Keys) an owner
	// remembers per account for the dedup window; the oldest go first
	// [100,000]; each takes a few hundred bytes of memory: see README,
	// "Accounts that send many Idempotency-Keys".
	DedupMaxIDs int
	// DedupMaxReplays bounds the retries of one Idempotency-Key an owner
	// serves (billed once, run again) before it refuses the next
	// (shard.ReplayLimit, 422 idempotency-replay-limit) [10]; negative bounds
	// none. See README, "Idempotency".
	DedupMaxReplays int
	// TestFaults exposes fault injection on the admin port (/test/...): for
	// the chaos tests only.
	TestFaults bool
	// afterClockCheck, when set (tests in this package), runs in Start
	// right after the clock check before the node takes accounts.
	afterClockCheck func(*Node)
	// wrapLedger, when set (tests in this package), wraps the ledger the
	// node opens, before anything uses it.
	wrapLedger func(flush.Ledger) flush.Ledger
	// TestClockOffset shifts the system clock from the start, as if the
	// machine's clock were off (tests and chaos: a node started with its
	// clock off, which no step reveals). Not with Clock.
	TestClockOffset time.Duration
	// Clock defaults to the system clock (with a test offset behind
	// TestFaults), watched for steps (engine.SteadyClock, clock.go). A
	// given clock is taken as it is: tests drive time through it.
	Clock engine.Clock
	// PauseClock is the monotonic clock the pause guard reads to notice
	// that this process did not run (pause.go) [its own engine.SystemClock].
	// Not Clock: a test that moves Clock by hand moves the time accounts
	// are decided at, not the process's running; tests of the guard give
	// it a clock of its own.
	PauseClock engine.Clock
	Logger     *slog.Logger
	// Front, when set, builds the public HTTP handler (package router's
	// proxy); nil serves 404 problem answers.
	Front func(*Node) (http.Handler, error)

	// The admin API (adminapi.go) and quota alerts (alerts.go).
	//
	// AdminToken is the bearer token of the admin API under /admin/v1/ on
	// the admin port; empty disables the API (every call answers 403).
	AdminToken string
	// AlertWebhook is the URL quota alerts are POSTed to; empty sends and
	// records none. AlertSecret signs them (required with a webhook).
	AlertWebhook, AlertSecret string
	// AlertThresholds are the percentages of a period's quota that alert,
	// once per account, period and threshold each [80, 100].
	AlertThresholds []int
	// AlertRetry is the first wait before a failed webhook is retried; it
	// doubles per attempt, with jitter, for 8 attempts [2s].
	AlertRetry time.Duration
	// AlertLease is how long a claimed alert may stay undelivered before any
	// node takes it over and tries again [10m]; a node's own round of
	// retries ends before half of it. AlertGiveUp is how long after its
	// first claim an undelivered alert is given up [72h].
	AlertLease, AlertGiveUp time.Duration
}

// Node is one running quotad.
type Node struct {
	cfg     Config
	log     *slog.Logger
	clock   engine.Clock
	sys     *engine.SystemClock // nil when cfg.Clock was given
	steady  *engine.SteadyClock // over sys; nil when cfg.Clock was given
	wal     *wal.Log
	eng     *engine.Engine
	ring    atomic.Pointer[ring.Ring]
	router  *router.Router
	faults  *router.Faults
	gossipF *ring.FaultTransport
	grpcSrv *grpc.Server
	httpSrv *http.Server
	// httpInflight counts the front's requests being handled (cutOff).
	httpInflight atomic.Int64
	// cutHTTP cancels every public request's context with router.ErrCutOff
	// (cutOff), so the front refunds them as cut off, not as clients that
	// left.
	cutHTTP context.CancelCauseFunc
	admin   *http.Server
	lis     struct{ rpc, http, admin net.Listener }
	// rpcTLS are the RPC port's server and forwarding TLS configs; nil
	// without Config.RPCTLS.
	rpcTLS struct{ server, client *tls.Config }
	// httpTLS and adminTLS are the HTTPS configs of the public front and
	// the admin port; nil: plain HTTP.
	httpTLS, adminTLS *tls.Config
	// serveMu serialises serveOnceConfigured; serving (written under it,
	// read without it) says whether that made this node a serving member
	// (Start, or awaitServable later).
	serveMu sync.Mutex
	serving atomic.Bool
	// peerAuthMu protects peerRefusal: why the serving peers refused this
	// node's RPC calls at the last probePeers (peerauth.go), or "", and
	// fwdRefusal: why they refuse its forwards now that it serves
	// (forwardRefusal, forwardauth.go), or "".
	peerAuthMu  sync.Mutex
	peerRefusal string
	fwdRefusal  string
	// fwdAuth hears the outcome of every forwarded call (forwardauth.go).
	fwdAuth forwardAuth
	// rpcRefusedCalls counts the calls the RPC port refused for their
	// token, and refusedLog samples their log lines (rpcRefused).
	rpcRefusedCalls atomic.Int64
	refusedLog      logsample.Sampler
	// unreachedLog samples "ledger not reached" (reachLedger).
	unreachedLog logsample.Sampler
	// rpcHandshakeFailures counts the TLS handshakes the RPC port failed,
	// and handshakeLog samples their log lines (rpcHandshakeFailed).
	rpcHandshakeFailures atomic.Int64
	handshakeLog         logsample.Sampler
	// audits counts the reservation audit's rounds (audit.go), for tests;
	// stranded is its last finding (nil before the first), for /status.
	audits   atomic.Int64
	stranded atomic.Pointer[strandFinding]
	reg      *prometheus.Registry
	metrics  *metrics

	// chargeHooks hear every answered charge (set before Start returns,
	// read-only afterwards).
	chargeHooks []func(account string, d *shard.Decision, err error)
	// alerts sends quota alerts (alerts.go); nil without AlertWebhook.
	alerts *alerter

	ledger    atomic.Pointer[ledgerBox]
	mu        sync.Mutex // protects settler and refresher (set once the ledger is reached)
	settler   *flush.Settler
	refresher *flush.Refresher

	started time.Time
	// keptConfigRead is when an earlier process on this data dir last read
	// the config snapshot from the ledger (metaConfigRead; zero when not
	// known). Set at the data dir's open, then only read.
	keptConfigRead time.Time
	build          buildinfo.Info // this binary's (logged, exported, recorded in the ledger)
	// process names this process in the ledger (fence.go); startRecorded
	// is set once the ledger has it.
	process       string
	startRecorded atomic.Bool
	// fenced is closed when a later process started as this node id
	// (fence.go); fenceOnce closes it.
	fenced    chan struct{}
	fenceOnce sync.Once
	// fenceCause is what StopFenced returns; written once, before fenced
	// closes, and read after.
	fenceCause  error
	fenceChecks atomic.Int64 // checks that read the ledger (tests)
	// ledgerRefused is the settled mark conflict with which the ledger
	// refused this data dir (flush.ErrMarkConflict), once it did: the
	// ledger was reached, and the log can never settle into it.
	ledgerRefused atomic.Pointer[error]
	ready         atomic.Bool
	// warnedIncarnations is set once a new data dir was checked against
	// the ledger's earlier incarnations of this node id (ledger.go).
	warnedIncarnations atomic.Bool
	// clockOffset is this clock minus the ledger's at the last check, in ns
	// (clockLoop): the clock the node bills by (steady's, not the system
	// clock's while steady holds through a step).
	clockOffset atomic.Int64
	// clockStep is how far the system clock stands from the one steady
	// holds to, in ns, at the last check; 0 while it follows it.
	clockStep atomic.Int64
	// watch is the clock checks' state (clock.go); clockWake asks
	// clockLoop for a check now (tests). clockMu serializes the checks
	// and guards watch: Start's, clockLoop's, and awaitServable's before a
	// node that waited takes accounts.
	clockMu   sync.Mutex
	watch     *clockWatch
	clockWake chan struct{}
	// pause notices pauses of this process and holds every decision after
	// one until the ring view is confirmed (pause.go); set in openEngine.
	pause *pauseGuard
	// crashAfterCommit arms the test failpoint of the settler (TestFaults).
	crashAfterCommit atomic.Bool
	draining         atomic.Bool
	// leaving is set when the draining node gives its accounts up (owns
	// answers false from then on): at once, or, for the last serving
	// member, once its in-flight requests are done (Shutdown).
	leaving atomic.Bool
	// drainTable is the ring's table when this node announced draining:
	// the accounts it owned then (drainOwns).
	drainTable atomic.Pointer[ring.Table]
	ctx        context.Context // canceled by Shutdown: stops background loops
	cancel     context.CancelFunc
	wg         sync.WaitGroup
}

type ledgerBox struct{ l flush.Ledger }

func (c *Config) defaults() error {
	if c.ID == "" || c.DataDir == "" || c.Ledger == "" {
		return errors.New("node: --node-id, --data-dir and --ledger are required")
	}
	// Before the data dir is opened (and bound to the node id): a --ledger
	// that can never work must not leave a data dir behind.
	if err := flush.CheckLedger(c.Ledger); err != nil {
		return fmt.Errorf("node: %w: %w", errLedgerAddress, err)
	}
	if c.RingPreset == "" {
		c.RingPreset = ring.PresetLAN
	}
	for _, d := range []*time.Duration{&c.SettleInterval, &c.DrainTimeout, &c.SettleTimeout, &c.LedgerTimeout, &c.SnapshotInterval, &c.LedgerRetry, &c.MaxClockOffset} { // ReconcileInterval and ReservationAudit < 0 mean off
		if *d < 0 {
			return fmt.Errorf("node: durations must not be negative (got %s)", *d)
		}
	}
	setDefault(&c.SettleInterval, time.Second)
	setDefault(&c.SnapshotInterval, 3*time.Second)
	setDefault(&c.DrainTimeout, 10*time.Second)
	setDefault(&c.SettleTimeout, 20*time.Second)
	setDefault(&c.LedgerTimeout, flush.DefaultCallTimeout)
	setDefault(&c.LedgerRetry, 2*time.Second)
	setDefault(&c.ReconcileInterval, 15*time.Minute)
	setDefault(&c.ReservationAudit, auditEvery)
	if c.TestClockOffset != 0 && c.Clock != nil {
		return errors.New("node: TestClockOffset shifts the system clock: not with Config.Clock")
	}
	setDefault(&c.MaxClockOffset, DefaultMaxClockOffset)
	if c.MaxClockOffset < MinMaxClockOffset {
		return fmt.Errorf("node: --max-clock-offset %s: want at least %s (a reading of the ledger's clock is off by up to half its round trip)", c.MaxClockOffset, MinMaxClockOffset)
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	for name, a := range map[string]*string{"rpc": &c.RPCAddr, "http": &c.HTTPAddr, "admin": &c.AdminAddr, "gossip": &c.GossipAddr} {
		if *a == "" {
			return fmt.Errorf("node: the %s listen address is required (host:port; port 0 picks a free one)", name)
		}
		if _, _, err := net.SplitHostPort(*a); err != nil {
			return fmt.Errorf("node: %s address %q: %v (want host:port)", name, *a, err)
		}
	}
	return nil
}

func setDefault(d *time.Duration, v time.Duration) {
	if *d == 0 {
		*d = v
	}
}

// Start brings a node up (see the package doc). On error everything it
// started is stopped again.
func Start(ctx context.Context, cfg Config) (_ *Node, err error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	n := &Node{cfg: cfg, log: cfg.Logger.With("node", cfg.ID), reg: prometheus.NewRegistry(), started: time.Now(), build: buildinfo.Read(),
		process: crand.Text(), fenced: make(chan struct{})}
	n.log.Info("starting", "version", n.build.Short(), "go", n.build.GoVersion)
	n.metrics = newMetrics(n)
	n.ctx, n.cancel = context.WithCancel(context.Background())
	defer func() {
		if err != nil {
			n.abortStart()
		}
	}()
	// The admin API's token and the quota alerts (adminapi.go, alerts.go).
	if err := checkAdminToken(cfg.AdminToken); err != nil {
		return nil, err
	}
	for _, tok := range cfg.RPCTokens {
		if err := router.CheckRPCToken(tok); err != nil {
			return nil, fmt.Errorf("node: %w", err)
		}
	}
	if err := n.loadRPCTLS(); err != nil {
		return nil, err
	}
	if err := n.loadHTTPSTLS(); err != nil {
		return nil, err
	}
	if err := n.startAlerts(); err != nil {
		return nil, err
	}
	if err := n.listen(); err != nil {
		return nil, err
	}
	rc, err := n.ringConfig()
	if err != nil {
		return nil, err
	}
	if err := n.openEngine(pauseBound(rc)); err != nil {
		return nil, err
	}
	if err := n.checkNotStale(); err != nil {
		return nil, err
	}
	// The ledger in two halves, with the ring joined between them: reached
	// and this start recorded, then (once a peer has said it settles into
	// the same ledger: checkSharedLedger) settled into and read.
	ledgerDown := func(err error) error {
		if errors.Is(err, flush.ErrSchemaTooNew) || errors.Is(err, flush.ErrMarkConflict) || errors.Is(err, errLedgerAddress) || errors.Is(err, errNodeIDInUse) ||
			errors.Is(err, errEarlierIncarnationHolds) {
			return fmt.Errorf("node: %w", err) // waiting will not fix these
		}
		if ctx.Err() != nil { // stopped while it tried: the ledger may be fine
			return fmt.Errorf("node: start interrupted: %w", context.Cause(ctx))
		}
		if n.eng.Snapshot() == nil {
			n.log.Warn("the ledger is unreachable and this data dir keeps no config snapshot: not ready until the ledger answers")
		} else {
			n.log.Warn("the ledger is unreachable: serving from the config snapshot kept in the data dir, settling later (G8)")
		}
		n.goLoop(n.retryLedger)
		return nil
	}
	reached, err := n.reachLedger(ctx, true)
	if err != nil {
		if err := ledgerDown(err); err != nil {
			return nil, err
		}
	}
	if err := n.joinRing(rc); err != nil {
		if reached != nil {
			// Registered: with nothing unsettled, it records a clean stop,
			// so that the next start does not wait for this one.
			n.markStoppedOn(ctx, reached.l)
			reached.l.Close()
		}
		return nil, err
	}
	if reached != nil {
		if err := n.checkSharedLedger(ctx, reached.l); err != nil {
			reached.l.Close()
			n.ledgerFailed(err, true)
			return nil, fmt.Errorf("node: %w", err) // before anything is settled into it or read from it
		}
		if ok, err := n.useLedger(ctx, reached, true); !ok {
			if err := ledgerDown(err); err != nil {
				return nil, err
			}
		}
	}
	// The clock before the accounts: a node started with its clock off the
	// ledger's, where the others agree with the ledger, takes the ledger's
	// time before it decides anything (clock.go).
	clockSettled := n.confirmClock(ctx)
	if n.cfg.afterClockCheck != nil {
		n.cfg.afterClockCheck(n)
	}
	if err := n.serve(); err != nil {
		return nil, err
	}
	if n.notServableExceptPeers() == "" {
		n.probePeers(ctx)
	}
	if why := n.notServable(); why != "" {
		n.log.Warn("not taking accounts yet: " + why + "; it stays a member of the ring that owns nothing, and the other nodes serve every account meanwhile")
		n.goLoop(n.awaitServable)
	} else {
		if _, _, others := n.countPeerClocks(); !clockSettled && others > 0 {
			// The check found the clock off and nobody to ask (a first
			// node restarted without --join, alone then), and the others
			// reached it since: ask them now. It took accounts by its own
			// clock, a month ahead, until the clock loop's next check: the
			// accounts it charged moved into that month for good, and
			// the client ids they remembered expired there (retries
			// billed twice: chaos seed 81).
			n.confirmClock(ctx)
		}
		if err := n.serveOnceConfigured(ctx); err != nil {
			return nil, err
		}
	}
	n.goLoop(n.fenceLoop)
	n.goLoop(n.forgetNotOwned)
	if n.cfg.ReconcileInterval > 0 {
		n.goLoop(n.reconcileLoop)
	}
	if n.cfg.ReservationAudit > 0 {
		n.goLoop(n.auditLoop)
	}
	n.goLoop(n.clockLoop)
	n.goLoop(n.keepConfigReadLoop)
	n.ready.Store(true)
	n.log.Info("serving", "rpc", n.RPCAddr(), "http", n.HTTPAddr(), "admin", n.AdminAddr(), "gossip", n.GossipAddr(),
		"http_tls", n.httpTLS != nil, "admin_tls", n.adminTLS != nil, "incarnation", n.wal.Incarnation())
	return n, nil
}

func (n *Node) listen() error {
	if err := distinctPorts([][2]string{{"--rpc-addr", n.cfg.RPCAddr}, {"--http-addr", n.cfg.HTTPAddr},
		{"--admin-addr", n.cfg.AdminAddr}, {"--gossip-addr", n.cfg.GossipAddr}}); err != nil {
		return err
	}
	for _, l := range []struct {
		to         *net.Listener
		addr, what string
	}{
		{&n.lis.rpc, n.cfg.RPCAddr, "RPC (quotad serve --rpc-addr)"},
		{&n.lis.http, n.cfg.HTTPAddr, "HTTP (--http-addr)"},
		{&n.lis.admin, n.cfg.AdminAddr, "the admin port (--admin-addr)"},
	} {
		lis, err := net.Listen("tcp", l.addr)
		if err != nil {
			for _, open := range []net.Listener{n.lis.rpc, n.lis.http, n.lis.admin} {
				if open != nil {
					open.Close()
				}
			}
			return fmt.Errorf("node: listen for %s on %s: %w", l.what, l.addr, err)
		}
		*l.to = lis
	}
	return nil
}

// distinctPorts refuses two of a node's listen addresses (flag, address)
// on one port of one host (an unspecified host is every host): the second
// listener failed with "address already in use", which read as another
// process's doing.
func distinctPorts(addrs [][2]string) error {
	for i, a := range addrs {
		ha, pa, err := net.SplitHostPort(a[1])
		if err != nil || pa == "0" || pa == "" {
			continue
		}
		for _, b := range addrs[:i] {
			hb, pb, err := net.SplitHostPort(b[1])
			if err != nil || pb != pa {
				continue
			}
			if ha == hb || anyHost(ha) || anyHost(hb) {
				return fmt.Errorf("node: %s %s and %s %s are one port: give each its own", b[0], b[1], a[0], a[1])
			}
		}
	}
	return nil
}

// anyHost reports whether a listen host stands for every address.
func anyHost(h string) bool {
	ip := net.ParseIP(h)
	return h == "" || ip != nil && ip.IsUnspecified()
}

// openEngine opens the data dir and the engine over it, and starts the
// pause guard (pause.go) with pauseBound, which the engine asks before every
// decision.
func (n *Node) openEngine(pauseBound time.Duration) error {
	var err error
	n.wal, err = wal.Open(wal.Options{Dir: n.cfg.DataDir, NodeID: n.cfg.ID, NoSync: n.cfg.NoSync, Logger: n.log.With("component", "wal"),
		OnCommit: n.metrics.onCommit})
	if err != nil {
		return fmt.Errorf("node: open the data dir: %w", err)
	}
	n.loadConfigRead()
	if n.cfg.NoSync {
		n.log.Warn("the log is not synced before answering (--wal-sync=false): a crash, even a kill -9 of this process, loses acknowledged charges; for benchmarks only, never in production")
	}
	if n.cfg.TestFaults {
		n.log.Warn("fault injection is on (--test-faults): whoever reaches the admin port (with the admin token, when the node has one) can block this node's traffic, shift its clock and crash it through /test/...; for chaos tests only, never in production")
	}
	n.clock = n.cfg.Clock
	if n.clock == nil {
		n.sys = engine.NewSystemClock()
		n.sys.SetOffset(n.cfg.TestClockOffset)
		n.steady = engine.NewSteadyClock(n.sys, n.cfg.MaxClockOffset)
		n.clock = n.steady
	}
	n.watch = &clockWatch{steady: n.steady, clock: n.clock, log: n.log, offset: &n.clockOffset, step: &n.clockStep, max: n.cfg.MaxClockOffset,
		peers: n.peerClocks, publish: n.publishClock}
	n.clockWake = make(chan struct{}, 1)
	// NB: ticking from here on, before anything can be decided: a guard
	// started later would find its first tick old and hold at once.
	pc := n.cfg.PauseClock
	if pc == nil {
		pc = engine.NewSystemClock()
	}
	n.pause = newPauseGuard(pc, pauseBound)
	n.goLoop(n.pauseLoop)
	n.goLoop(n.confirmLoop)
	n.eng, err = engine.Open(engine.Options{
		Log: n.wal, Clock: n.clock, Reserver: (*nodeReserver)(n), ReserveWindow: n.cfg.SettleInterval,
		LedgerTimeout: n.cfg.LedgerTimeout, // top-ups and release retries, bounded as settles are
		Params:        shard.Params{DedupMax: n.cfg.DedupMaxIDs, MaxReplays: int32(max(-1, min(n.cfg.DedupMaxReplays, 1<<30)))},
		Owns:          n.owns, Tenure: n.tenure, MayRefund: n.drainOwns, Hold: n.pause.check, Logger: n.log.With("component", "engine"), OnCharge: n.onCharge,
		SettleSoon: n.settleSoon,
		// From a node's letting accounts go (announcing draining) to its
		// last settle, with a cluster's nodes configured alike; the
		// settle intervals for a live owner that lost them.
		ReseedWindow: n.cfg.DrainTimeout + n.cfg.SettleTimeout + 2*n.cfg.SettleInterval,
	})
	if err != nil {
		return fmt.Errorf("node: recover the engine: %w", err)
	}
	return nil
}

// settleSoon asks the settler, once the ledger is reached, to settle now
// (engine.Options.SettleSoon).
func (n *Node) settleSoon() {
	if s := n.Settler(); s != nil {
		s.Kick()
	}
}

// onCharge hears every charge the engine answered: metrics, and (when
// configured) the quota alerts.
func (n *Node) onCharge(account string, d *shard.Decision, err error, took time.Duration) {
	n.metrics.onCharge(account, d, err, took)
	for _, h := range n.chargeHooks {
		h(account, d, err)
	}
}

// owns is the engine's ownership check: serving, and the owner in this
// node's view of the ring.
func (n *Node) owns(account string) bool {
	r := n.ring.Load()
	if r == nil || n.leaving.Load() {
		return false
	}
	m, ok := r.Owner(account)
	return ok && m.ID == n.cfg.ID
}

// tenure is the engine's Tenure: the ring's, 0 while the node leaves (it
// owns nothing then; see owns).
func (n *Node) tenure(account string) uint64 {
	r := n.ring.Load()
	if r == nil || n.leaving.Load() {
		return 0
	}
	return r.Tenure(account)
}

// drainOwns is the engine's MayRefund: while this node drains and no
// member serves account (the whole cluster stopping at once: every node
// announced draining, so nobody owns anything), the accounts it owned when
// it announced draining are still its to refund. Their requests in flight
// finish during the drain, and one whose upstream failed was refunded
// through the account's owner: there was none, and the charge stood,
// billed. Charges stay refused (owns).
func (n *Node) drainOwns(account string) bool {
	r, t := n.ring.Load(), n.drainTable.Load()
	if r == nil || t == nil || !n.draining.Load() {
		return false
	}
	if _, ok := r.Owner(account); ok {
		return false // a serving member owns it: refunds go there
	}
	m, ok := t.Owner(account)
	return ok && m.ID == n.cfg.ID
}

// ringConfig is the ring's config from the node's, checked (a --join
// entry that is not an address) and with the gossip port found free, before
// the node touches the ledger: a start that fails after registering left an
// incarnation the ledger heard from, and the next node waited for it.
// joinRing then adds the advertised addresses and joins.
func (n *Node) ringConfig() (ring.Config, error) {
	rc := ring.DefaultConfig()
	if n.cfg.RingPreset == ring.PresetLocal {
		rc = ring.LocalConfig()
	}
	host, portStr, _ := net.SplitHostPort(n.cfg.GossipAddr)
	port, _ := strconv.Atoi(portStr)
	if host == "" {
		host = "0.0.0.0"
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		rc.AdvertiseAddr = n.advertiseHost()
		if port == 0 { // memberlist would pick one, but the ring must advertise it
			p, err := freeGossipPort(host)
			if err != nil {
				return rc, err
			}
			port = p
		}
	}
	rc.NodeID, rc.BindAddr, rc.BindPort, rc.Join = n.cfg.ID, host, port, n.cfg.Join
	if len(n.cfg.GossipKeys) > 0 {
		rc.SecretKey, rc.OtherKeys = n.cfg.GossipKeys[0], n.cfg.GossipKeys[1:]
	}
	if err := rc.Validate(); err != nil {
		return rc, fmt.Errorf("node: the ring's settings (--join, --gossip-addr, --gossip-key): %w", err)
	}
	if port != 0 && !n.cfg.TestFaults {
		if err := gossipPortFree(host, port); err != nil {
			return rc, fmt.Errorf("node: listen for gossip (--gossip-addr) on %s: %w", n.cfg.GossipAddr, err)
		}
	}
	return rc, nil
}

// gossipPortFree reports whether memberlist can bind host:port, TCP and
// UDP, by binding both and letting go.
func gossipPortFree(host string, port int) error {
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	defer l.Close()
	u, err := net.ListenPacket("udp", addr)
	if err != nil {
		return err
	}
	return u.Close()
}

// joinRing starts gossip with rc (ringConfig's) and joins the ring.
func (n *Node) joinRing(rc ring.Config) error {
	host, port := rc.BindAddr, rc.BindPort
	rc.Meta = ring.Meta{RPCAddr: n.advertised(n.RPCAddr()), HTTPAddr: n.advertised(n.HTTPAddr()), AdminAddr: n.advertised(n.AdminAddr()),
		State: ring.StateJoining}
	rc.Logger = n.log.With("component", "ring")
	if n.cfg.TestFaults {
		t, err := ring.NewFaultNetTransport(host, port, rc.Logger)
		if err != nil {
			return fmt.Errorf("node: listen for gossip (--gossip-addr) on %s: %w", n.cfg.GossipAddr, err)
		}
		n.gossipF, rc.Transport = t, t
		n.faults = router.NewFaults()
	}
	r, err := ring.New(rc)
	if err != nil && (errors.Is(err, syscall.EADDRINUSE) || strings.Contains(err.Error(), "address already in use")) { // memberlist does not wrap it
		return fmt.Errorf("node: listen for gossip (--gossip-addr) on %s: %w", n.cfg.GossipAddr, err)
	}
	if err != nil {
		return fmt.Errorf("node: join the ring: %w", err)
	}
	lockAttrs := []any{"gossip_encrypted", len(n.cfg.GossipKeys) > 0, "rpc_token_required", n.rpcToken() != "", "rpc_mutual_tls", n.rpcTLS.server != nil}
	if n.portsLocked() {
		n.log.Info("internal ports locked", lockAttrs...)
	} else {
		var open []string
		if len(n.cfg.GossipKeys) == 0 {
			open = append(open, "gossip is plaintext and unauthenticated (set --gossip-key)")
		}
		if n.rpcToken() == "" && n.rpcTLS.server == nil {
			open = append(open, "the RPC port takes any caller (set --rpc-token and/or --rpc-tls-*)")
		}
		n.log.Warn("internal ports not locked: "+strings.Join(open, "; ")+"; keep --gossip-addr and --rpc-addr reachable only by the cluster and its embedded clients",
			lockAttrs...)
	}
	n.router, err = router.New(router.Config{Engine: n.eng, Ring: r, Faults: n.faults, Token: n.rpcToken(), TLS: n.rpcTLS.client,
		Logger: n.log.With("component", "router"), LedgerStart: n.ledgerStart, OnForward: n.onForward})
	if err != nil {
		n.ring.Store(r) // for abortStart to leave it
		return err
	}
	n.goLoop(n.reprobeRefusing)
	// NB: after the router: a goroutine that loads the ring (retryLedger's
	// checkSharedLedger) then reads n.router sees it set.
	n.ring.Store(r)
	changes, cancel := r.Subscribe(64)
	n.goLoop(func(ctx context.Context) {
		defer cancel()
		n.followRing(ctx, changes)
	})
	return nil
}

func (n *Node) serve() error {
	// Stream workers reuse warm goroutines: a goroutine per unary call spent
	// about a tenth of a busy node's CPU growing and copying stacks.
	opts := append([]grpc.ServerOption{grpc.NumStreamWorkers(uint32(4 * runtime.GOMAXPROCS(0)))}, // NB: shared write buffers are grpc's default now
		router.ServerAuthNotify(n.rpcRefused, n.cfg.RPCTokens...)...)
	if n.rpcTLS.server != nil {
		opts = append(opts, grpc.Creds(handshakeNotify{credentials.NewTLS(n.rpcTLS.server), n.rpcHandshakeFailed}))
	}
	n.grpcSrv = grpc.NewServer(opts...)
	pb.RegisterQuotaServer(n.grpcSrv, n.router.Server())
	n.serveLogged("the RPC port (--rpc-addr)", func() error { return n.grpcSrv.Serve(n.lis.rpc) })
	front := http.Handler(http.HandlerFunc(noFront))
	if n.cfg.Front != nil {
		h, err := n.cfg.Front(n)
		if err != nil {
			return err
		}
		front = h
	}
	inner := front
	front = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.httpInflight.Add(1)
		defer n.httpInflight.Add(-1)
		inner.ServeHTTP(w, r)
	})
	base, cut := context.WithCancelCause(context.Background())
	n.cutHTTP = cut
	n.httpSrv = &http.Server{Handler: front, ReadHeaderTimeout: 10 * time.Second,
		// An idle keep-alive connection (anyone's: a key is only read with
		// a request) is closed after this; it was kept for ever.
		IdleTimeout: publicIdleTimeout,
		BaseContext: func(net.Listener) context.Context { return base },
		ErrorLog:    slog.NewLogLogger(serverErrorLog(n.log.With("component", "http")), slog.LevelWarn)}
	n.httpSrv.Protocols = frontProtocols(n.httpTLS != nil)
	n.admin = &http.Server{Handler: n.adminHandler(), ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout: publicIdleTimeout, // a Prometheus scraper's or a dashboard's idle connection, as on the public port
		ErrorLog:    slog.NewLogLogger(serverErrorLog(n.log.With("component", "admin-http")), slog.LevelWarn)}
	for _, s := range []struct {
		srv  *http.Server
		lis  net.Listener
		tls  *tls.Config
		what string
	}{{n.httpSrv, n.lis.http, n.httpTLS, "the public port (--http-addr)"}, {n.admin, n.lis.admin, n.adminTLS, "the admin port (--admin-addr)"}} {
		if s.tls == nil {
			n.serveLogged(s.what, func() error { return s.srv.Serve(s.lis) })
			continue
		}
		// ServeTLS offers HTTP/2 by ALPN along with HTTP/1.1.
		s.srv.TLSConfig = s.tls
		n.serveLogged(s.what, func() error { return s.srv.ServeTLS(s.lis, "", "") })
	}
	return nil
}

// serverErrorLog is the handler for an http.Server's ErrorLog (through
// slog.NewLogLogger at warn): it routes the server's own error lines (a handler's
// panic, a failed accept, a TLS handshake that failed) into the node's
// structured log instead of the standard logger, at warn. Failed
// handshakes are at debug: on an HTTPS port any scanner or plaintext
// client makes one.
func serverErrorLog(l *slog.Logger) slog.Handler { return serverLogHandler{l.Handler()} }

// serverLogHandler lowers the TLS handshake lines to debug.
type serverLogHandler struct{ slog.Handler }

func (h serverLogHandler) Handle(ctx context.Context, r slog.Record) error {
	if strings.Contains(r.Message, "TLS handshake error") {
		r.Level = slog.LevelDebug
		if !h.Handler.Enabled(ctx, r.Level) {
			return nil
		}
	}
	return h.Handler.Handle(ctx, r)
}

// freeGossipPort finds a port free for both TCP and UDP on host.
func freeGossipPort(host string) (int, error) {
	for range 20 {
		l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			return 0, fmt.Errorf("node: find a gossip port on %s: %w", host, err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		u, err := net.ListenPacket("udp", net.JoinHostPort(host, strconv.Itoa(port)))
		l.Close()
		if err == nil {
			u.Close()
			return port, nil
		}
	}
	return 0, fmt.Errorf("node: no port on %s free for both TCP and UDP", host)
}

// advertised is the address others reach a listener at: the listener's own,
// unless it listens on every address (":7400", "0.0.0.0:7400"), then the
// advertise host with its port.
func (n *Node) advertised(listen string) string {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return listen
	}
	if ip := net.ParseIP(host); host != "" && (ip == nil || !ip.IsUnspecified()) {
		return listen
	}
	return net.JoinHostPort(n.advertiseHost(), port)
}

// advertiseHost is Config.AdvertiseHost, or the host's first private IPv4
// address (what memberlist picks too), or 127.0.0.1.
func (n *Node) advertiseHost() string {
	if n.cfg.AdvertiseHost != "" {
		return n.cfg.AdvertiseHost
	}
	addrs, _ := net.InterfaceAddrs()
	var public string
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok || ipn.IP.To4() == nil || ipn.IP.IsLoopback() || ipn.IP.IsLinkLocalUnicast() {
			continue
		}
		if ipn.IP.IsPrivate() {
			return ipn.IP.String()
		}
		if public == "" {
			public = ipn.IP.String()
		}
	}
	if public != "" {
		return public
	}
	return "127.0.0.1"
}

// NoFrontTitle is the title of what the public port of a node without
// --upstream answers every request (404 problem+json): quotad admin pointed
// there by mistake tells it from the admin API by it.
const NoFrontTitle = "no upstream configured"

func noFront(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(http.StatusNotFound)
	fmt.Fprintf(w, `{"type":"about:blank","title":%q,"status":404,"detail":"this node serves no HTTP front: start it with --upstream"}`, NoFrontTitle)
}

// goLoop runs fn in a goroutine that Shutdown stops and waits for.
func (n *Node) goLoop(fn func(ctx context.Context)) {
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		fn(n.ctx)
	}()
}

// serveLogged runs a server's Serve in a goroutine that ends when the
// server is stopped or closed (the node's stop), and logs at ERROR why it
// ended otherwise: the error was dropped, and a port that stopped
// accepting (a failed accept) left the node saying it was ready.
func (n *Node) serveLogged(what string, serve func() error) {
	go func() {
		err := serve()
		if err == nil || errors.Is(err, http.ErrServerClosed) || errors.Is(err, grpc.ErrServerStopped) {
			return
		}
		n.log.Error(what+" stopped serving: restart the node", "err", err)
	}()
}

// Accessors.
func (n *Node) ID() string             { return n.cfg.ID }
func (n *Node) Engine() *engine.Engine { return n.eng }
func (n *Node) Ring() *ring.Ring       { return n.ring.Load() }

// notServable says why this node must not own accounts yet, or "".
//
//   - No config snapshot (neither the ledger nor the data dir gave one):
//     owning partitions would answer every account in them
//     quota-unavailable, through every node of the cluster; one pod with a
//     wrong --ledger took a share of the customers offline.
//   - Alone in its ring while a peer refused its gossip (ring.Refusal): the
//     gossip keys differ, so there is a cluster it is locked out of, and
//     serving alone would decide that cluster's accounts a second time.
//   - Not serving yet, and serving peers refused its RPC calls at the last
//     probePeers (its --rpc-token or RPC certificate is not the cluster's):
//     it would fail every charge it forwards, and every one forwarded to
//     it (peerauth.go).
func (n *Node) notServable() string {
	if why := n.notServableExceptPeers(); why != "" {
		return why
	}
	if !n.isServing() {
		return n.peerRefusalReason()
	}
	return ""
}

// notServableExceptPeers is notServable but for the probe of the peers,
// which is worth making only once nothing else holds the node back.
func (n *Node) notServableExceptPeers() string {
	if n.eng.Snapshot() == nil {
		return "no config yet (the ledger has not been reached and the data dir keeps no snapshot)"
	}
	if r := n.Ring(); r != nil && len(r.View().Members) <= 1 {
		if addr, err := r.Refusal(); err != nil {
			return fmt.Sprintf("the node at %s answered but refused this node's gossip (%v): the gossip keys differ; give every node the same --gossip-key (QUOTAD_GOSSIP_KEY)",
				addr, strings.TrimSpace(err.Error()))
		}
		if n.isServing() {
			return ""
		}
		if peers := n.peersHeard(); peers != "" {
			return fmt.Sprintf("alone in the ring while the ledger heard from %s in the last %s: serving now would make this node the owner of every account beside them; "+
				"waiting until they join it or --join reaches them (give every node --join with the others' gossip addresses, or a DNS name that lists them)",
				peers, aloneWindow)
		}
	}
	return ""
}

// aloneWindow is how recently another node must have written to the ledger
// (a settle or a heartbeat, at least every flush.HeartbeatEvery while it
// runs) for a node alone in its ring to wait for it rather than serve.
const aloneWindow = 30 * time.Second

// peersHeard names the other nodes the ledger heard from in the last
// aloneWindow, or "" when there are none or the ledger cannot say.
//
// A node alone in its ring that took accounts would own every account: a
// restarted first node (no --join), or one whose seeds did not answer,
// made a second cluster beside the running one until gossip merged them,
// and for that while two nodes decided the same accounts (the chaos
// harness's rolling restart: a period answered in the next month, G9).
// With the others recently alive it waits; with none it is the first
// node, or the others are gone, and it serves. With the ledger out of reach
// it cannot tell, and serves as before (G8).
func (n *Node) peersHeard() string {
	l := n.Ledger()
	if l == nil {
		return ""
	}
	ctx, cancel := context.WithTimeout(n.ctx, 2*time.Second)
	defer cancel()
	rows, err := l.Nodes(ctx)
	if err != nil {
		return ""
	}
	since := ledgerNow(ctx, l).Add(-aloneWindow) // heartbeats are the ledger's times
	var ids []string
	for id, x := range flush.LatestRunning(rows) {
		if id != n.cfg.ID && x.Heartbeat.After(since) {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return strings.Join(ids, ", ")
}

// isServing reports whether serveOnceConfigured made this node serving.
// It does not wait for a serveOnceConfigured in progress (readyz calls it).
func (n *Node) isServing() bool { return n.serving.Load() }

// awaitServable makes the node serving once notServable clears (the ledger
// answered; a join succeeded), logging each new reason meanwhile.
func (n *Node) awaitServable(ctx context.Context) {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	last := n.notServable()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if n.notServableExceptPeers() == "" {
			n.probePeers(ctx) // right before serving, and again while peers refuse
		}
		why := n.notServable()
		if why == "" {
			// The clock check at Start may have found nobody to ask about
			// a clock off the ledger's (this node was alone), or no ledger:
			// check again, asking the members in view, before the first
			// account. Until clockLoop's next check it decided by its own
			// clock: a node restarted a month ahead moved the accounts it
			// charged into that month for good, and their client ids
			// expired there (a retry was billed twice: chaos seed 56).
			n.confirmClock(ctx)
			if err := n.serveOnceConfigured(ctx); err != nil {
				n.log.Error("could not become serving; restart this node", "err", err)
			} else {
				n.log.Info("taking accounts now")
			}
			return
		}
		if why != last {
			n.log.Warn("still not taking accounts: " + why)
			last = why
		}
	}
}

// serveOnceConfigured makes this node a serving member of the ring, once
// (Start, or awaitServable when notServable cleared late).
func (n *Node) serveOnceConfigured(ctx context.Context) error {
	n.serveMu.Lock()
	defer n.serveMu.Unlock()
	r := n.Ring()
	if n.serving.Load() || r == nil || n.draining.Load() {
		return nil
	}
	if err := r.SetState(ctx, ring.StateServing); errors.Is(err, ring.ErrUnconfirmed) {
		// Serving locally already; the peers learn it by gossip. Refusing
		// to start here made a node on a loaded machine exit for nothing.
		n.log.Warn("became serving, but the announcement was not confirmed in time: peers learn it by gossip", "err", err)
	} else if err != nil {
		return fmt.Errorf("node: become serving: %w", err)
	}
	n.serving.Store(true)
	return nil
}

// portsLocked reports whether gossip is encrypted and RPC calls need the
// token or a client certificate (--gossip-key, and --rpc-token or
// --rpc-tls-*).
func (n *Node) portsLocked() bool {
	return len(n.cfg.GossipKeys) > 0 && (n.rpcToken() != "" || n.rpcTLS.server != nil)
}

// loadRPCTLS reads Config.RPCTLS's files, if any, into n.rpcTLS; renewed
// certificates are read again at handshakes, and logged.
func (n *Node) loadRPCTLS() error {
	f := n.cfg.RPCTLS
	if !f.Enabled() {
		return nil
	}
	// The host the others dial, when known before the port is opened: an
	// IP, given or advertised. A host name in --rpc-addr is resolved when
	// the port opens, and the others check the IP it listens on, which is
	// not known here: not checked then (a false refusal would stop a
	// working node).
	if host, _, err := net.SplitHostPort(n.advertised(n.cfg.RPCAddr)); err == nil && net.ParseIP(host) != nil {
		f.SelfHost = host
	}
	f.OnReload = func(err error) {
		if err != nil {
			n.log.Error("RPC TLS: the changed certificate, key or CA bundle did not load; the previous set stays in use", "err", err)
			return
		}
		n.log.Info("RPC TLS: certificate and CA bundle reloaded", "cert", f.Cert, "ca", f.CA)
	}
	var err error
	if n.rpcTLS.server, n.rpcTLS.client, err = f.Configs(); err != nil {
		return fmt.Errorf("node: %w", err)
	}
	return nil
}

// loadHTTPSTLS reads Config.HTTPTLS's and Config.AdminTLS's files, if
// any; renewed certificates are read again at handshakes, and logged.
func (n *Node) loadHTTPSTLS() error {
	for _, p := range []struct {
		files router.CertFiles
		what  string
		cfg   **tls.Config
	}{{n.cfg.HTTPTLS, "--http-tls", &n.httpTLS}, {n.cfg.AdminTLS, "--admin-tls", &n.adminTLS}} {
		if !p.files.Enabled() {
			continue
		}
		f, what := p.files, p.what
		f.OnReload = func(err error) {
			if err != nil {
				n.log.Error(what+": the changed certificate or key did not load; the previous pair stays in use", "err", err)
				return
			}
			n.log.Info(what+": certificate reloaded", "cert", f.Cert)
		}
		cfg, err := f.ServerConfig(what)
		if err != nil {
			return fmt.Errorf("node: %w", err)
		}
		*p.cfg = cfg
	}
	return nil
}

// AdminScheme is "https" when the admin port serves TLS, else "http".
func (n *Node) AdminScheme() string {
	if n.adminTLS != nil {
		return "https"
	}
	return "http"
}

// rpcToken is the RPC token this node sends: the first of RPCTokens.
func (n *Node) rpcToken() string {
	if len(n.cfg.RPCTokens) == 0 {
		return ""
	}
	return n.cfg.RPCTokens[0]
}

func (n *Node) Router() *router.Router         { return n.router }
func (n *Node) Registry() *prometheus.Registry { return n.reg }
func (n *Node) RPCAddr() string                { return n.lis.rpc.Addr().String() }
func (n *Node) HTTPAddr() string               { return n.lis.http.Addr().String() }
func (n *Node) AdminAddr() string              { return n.lis.admin.Addr().String() }

// GossipAddr is where memberlist listens (known once the ring is up).
func (n *Node) GossipAddr() string {
	if r := n.Ring(); r != nil {
		return r.Self().GossipAddr
	}
	return n.cfg.GossipAddr
}

// Ledger is the ledger, or nil while it has not been reached.
func (n *Node) Ledger() flush.Ledger {
	if b := n.ledger.Load(); b != nil {
		return b.l
	}
	return nil
}

// Ready reports whether the node serves: joined and owning its share of the
// ring (notServable), state loaded, a snapshot.
func (n *Node) Ready() bool {
	if !n.ready.Load() || n.draining.Load() || n.eng.Snapshot() == nil {
		return false
	}
	return n.isServing() && n.forwardRefusal() == ""
}

// publicIdleTimeout is how long the public port keeps an idle keep-alive
// connection open.
const publicIdleTimeout = 2 * time.Minute

// frontProtocols are HTTP/1 and HTTP/2 without TLS (h2c, prior knowledge),
// so gRPC clients can call through the front to an h2c:// upstream.
func frontProtocols(https bool) *http.Protocols {
	p := new(http.Protocols)
	p.SetHTTP1(true)
	if https {
		p.SetHTTP2(true)
	} else {
		p.SetUnencryptedHTTP2(true)
	}
	return p
}

// FrontOptions are the parts of the public HTTP front this node supplies:
// its router charges, its engine's snapshot resolves keys and route weights,
// its metrics hear every answer, and its logger. The caller adds the policy
// (bill-on, quota status, limits) and builds the front in Config.Front, e.g.
// router.NewProxy(upstream, n.FrontOptions()).
func (n *Node) FrontOptions() router.FrontOptions {
	return router.FrontOptions{Charger: n.router, Config: n.eng, Logger: n.log.With("component", "front"),
		Now: func() time.Time { return time.Unix(0, n.clock.Now().Wall) },
		OnRequest: func(code int, added time.Duration) {
			n.metrics.HTTPRequests.WithLabelValues(strconv.Itoa(code)).Inc()
			n.metrics.ProxySeconds.Observe(added.Seconds())
		}}
}
