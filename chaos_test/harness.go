package chaos

import (
	"context"
	crand "crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/cluster"
	"github.com/quotaring/quotaring/internal/faultproxy"
	"github.com/quotaring/quotaring/internal/pgtest"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/wal"
)

// Config describes a run. Zero values take the defaults in brackets.
type Config struct {
	Nodes    int           // nodes at the start [5]
	Duration time.Duration // of the fault schedule; the workload runs throughout [10m]
	Faults   []Fault       // [all]
	Seed     uint64
	// Out is the directory the report goes to (report.json, history.json,
	// report.svg, report.md); empty writes nothing.
	Out string
	// Binary is the quotad to run; empty builds ./cmd/quotad from the
	// source tree this package was compiled from.
	Binary string
	// Dir holds the nodes' data dirs and logs: a new or empty directory.
	// Empty makes a temporary one, removed at the end unless Keep, or the
	// run found a violation or failed once its nodes had started (the
	// report names it: the node logs are what a violation is traced in).
	Dir  string
	Keep bool
	// Workers are the workload's goroutines [16]; Rate the operations per
	// second they send in all [150].
	Workers int
	Rate    float64
	// SettleInterval is the nodes' --settle-interval [500ms].
	SettleInterval time.Duration
	// FirstIP is the first node's last address byte: node i listens on
	// Subnet.(FirstIP+i) [100].
	FirstIP int
	// Subnet is the first three bytes of the nodes' loopback addresses
	// [a random 127.x.y, so that runs at the same time on one machine never
	// meet: a node rejoins its last known members by address].
	Subnet string
	// Progress gets a line per fault and every ProgressEvery [10s]; nil is
	// silent.
	Progress      io.Writer
	ProgressEvery time.Duration
}

// Defaults of the workload and the nodes (quotad chaos's flags).
const (
	defaultWorkers        = 16
	defaultRate           = 150
	defaultSettleInterval = 500 * time.Millisecond
)

// command is the quotad chaos command that runs this plan and workload
// again. The seed fixes each client's choices only for the same workers
// and rate (the hard quotas are sized from the rate too), and the nodes'
// settle interval shapes what they do: those that differ from the
// command's defaults are named.
func (c *Config) command() string {
	faults := joinFaults(c.Faults)
	if slices.Equal(c.Faults, AllFaults) {
		faults = "all"
	}
	s := fmt.Sprintf("quotad chaos --nodes %d --duration %s --faults %s --seed %d", c.Nodes, c.Duration, faults, c.Seed)
	if c.Workers != defaultWorkers {
		s += fmt.Sprintf(" --workers %d", c.Workers)
	}
	if c.Rate != defaultRate {
		s += " --rate " + strconv.FormatFloat(c.Rate, 'g', -1, 64)
	}
	if c.SettleInterval != defaultSettleInterval {
		s += " --settle-interval " + c.SettleInterval.String()
	}
	return s
}

func (c *Config) defaults() error {
	if c.Nodes == 0 {
		c.Nodes = 5
	}
	if c.Duration == 0 {
		c.Duration = 10 * time.Minute
	}
	if len(c.Faults) == 0 {
		c.Faults = slices.Clone(AllFaults)
	}
	if c.Workers == 0 {
		c.Workers = defaultWorkers
	}
	if c.Rate == 0 {
		c.Rate = defaultRate
	}
	if c.SettleInterval == 0 {
		c.SettleInterval = defaultSettleInterval
	}
	if c.FirstIP == 0 {
		c.FirstIP = 100
	}
	if c.Subnet == "" {
		c.Subnet = fmt.Sprintf("127.%d.%d", 1+rand.IntN(254), 1+rand.IntN(254))
	}
	if ip := net.ParseIP(c.Subnet + ".1"); ip == nil || !ip.IsLoopback() {
		return fmt.Errorf("chaos: subnet %q: want the first three bytes of a loopback address, such as 127.0.0", c.Subnet)
	}
	if c.ProgressEvery == 0 {
		c.ProgressEvery = 10 * time.Second
	}
	if c.Workers < 1 || c.Rate <= 0 || c.SettleInterval < 0 || c.FirstIP < 2 || c.Nodes > MaxNodes(c.FirstIP) {
		return fmt.Errorf("chaos: Workers (--workers), Rate (--rate), SettleInterval (--settle-interval) and FirstIP (--first-ip) must be positive, and Nodes (--nodes) at most %d with FirstIP %d", MaxNodes(c.FirstIP), c.FirstIP)
	}
	return nil
}

// checkDirs makes Dir and Out before anything starts, and refuses what
// would spoil the run. A Dir that holds anything may hold an earlier run's
// data dirs: the nodes would open them (their old incarnations and
// settled marks against a new ledger) and the checks would report what
// they did as violations of G2, G4, SEQ, RES and LIVE. An Out that cannot
// be written was found only after the whole run, when the report was
// lost with its verdicts.
func (c *Config) checkDirs() error {
	if c.Dir != "" {
		if err := os.MkdirAll(c.Dir, 0o755); err != nil {
			return fmt.Errorf("chaos: --dir: %w", err)
		}
		ents, err := os.ReadDir(c.Dir)
		if err != nil {
			return fmt.Errorf("chaos: --dir: %w", err)
		}
		if len(ents) > 0 {
			return fmt.Errorf("chaos: --dir %s is not empty: want a new or empty directory (the nodes would open the data dirs an earlier run left there)", c.Dir)
		}
	}
	if c.Out != "" {
		if err := os.MkdirAll(c.Out, 0o755); err != nil {
			return fmt.Errorf("chaos: --out: %w", err)
		}
		f, err := os.CreateTemp(c.Out, ".chaos-write-test-*")
		if err != nil {
			return fmt.Errorf("chaos: --out %s: the report could not be written there: %w", c.Out, err)
		}
		f.Close()
		os.Remove(f.Name())
		// An earlier run's report must not stand for this one when this
		// one ends without a report (a setup error, an early Ctrl-C): a
		// passing report.md stayed beside a run that failed.
		for _, name := range reportFiles() {
			if err := os.Remove(filepath.Join(c.Out, name)); err != nil && !os.IsNotExist(err) {
				return fmt.Errorf("chaos: --out %s: remove the earlier run's %s: %w", c.Out, name, err)
			}
		}
	}
	return nil
}

// Timeouts of the harness's own waits.
const (
	callTimeout     = 3 * time.Second  // one charge or refund
	httpTimeout     = 5 * time.Second  // one request through the proxy
	convergeTimeout = 90 * time.Second // the ring after a heal
	settleTimeout   = 90 * time.Second // every log settled
	afterHeal       = 5 * time.Second  // load after the final heal
)

// harness is one run. The nemesis goroutine owns the cluster (c, removed,
// paused, pgDown); the workload reads the nodes through nodes.
type harness struct {
	cfg  Config
	plan *Plan
	logf func(format string, args ...any)

	dir     string
	pg      *pgtest.Server
	proxy   *faultproxy.Proxy
	dsn     string // the ledger, direct (seeding, revoke, checks)
	ledger  flush.Ledger
	c       *cluster.Cluster
	nodes   atomic.Pointer[[]*cluster.Node] // the members the workload may use
	removed map[string]bool                 // scaled down for good
	paused  map[string]bool
	pgDown  bool
	// unrevoked holds nodes whose disk was lost while their revoke could
	// not reach the ledger: a new incarnation refuses to start while the
	// old one holds reservations, so they wait for the revoke. Like
	// removed and paused, only the plan's goroutine (and the heal after it)
	// touches it.
	unrevoked map[string]bool

	hist     *cluster.History
	conns    *cluster.Conns
	client   *router.Client
	gateway  *router.Client // DialOptions.Gateway: every call through a node, which forwards
	http     *http.Client
	upstream *http.Server
	alerts   *alertSink // the quota alerts' webhook, on the upstream's server
	acct     accounts

	// gossipKey (base64), rpcToken and rpcTLS (mutual TLS, made in setup)
	// lock the nodes' internal ports; tlsClient is rpcTLS's client side.
	gossipKey, rpcToken string
	rpcTLS              router.TLSFiles
	tlsClient           *tls.Config
	// adminToken turns the nodes' admin API on (and guards /test/): the
	// harness reads a node's own reservations there (keepHoldEvidence).
	adminToken string

	mu     sync.Mutex // protects the fields below
	active []*Episode // faults on now (progress lines)
	// activeSince is when each episode of active began (the interrupted
	// report shows the ones still on).
	activeSince map[*Episode]int64
	// interruptAt is when the run's context ended (Ctrl-C), if it did:
	// the load then takes seconds to stop.
	interruptAt    int64
	wasInterrupted bool
	windows        []cluster.Window
	lost           []cluster.LostCharge
	starts         []int64
	revoked        int64
	live           []cluster.Violation // liveness failures: nodes that did not come back
	notes          []string

	// keepWhy, when set, keeps a temporary dir at the end, and says why.
	keepWhy string
}

// Run starts a cluster, runs the workload and the plan's faults, heals,
// settles, drains and checks. The error is for a run that could not be
// done (no Postgres, a node that never started); the guarantees' verdicts
// are in the report (Report.Violated).
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	plan, err := NewPlan(cfg.Seed, cfg.Nodes, cfg.Duration, cfg.Faults)
	if err != nil {
		return nil, err
	}
	if len(cfg.Faults) > 0 && len(plan.Episodes) == 0 {
		// It ran its whole duration without a fault and passed: a chaos
		// test that tested nothing.
		return nil, fmt.Errorf("chaos: no fault of --faults %s fits this run, so it would test nothing: %s", joinFaults(cfg.Faults), plan.whyMissing(plan.Missing()))
	}
	if m := plan.Unplanned(); len(m) > 0 {
		// It ran without them and passed, "every invariant held", the
		// plan's note on stderr alone.
		fix := "give a longer --duration, or leave them out of --faults"
		if d := plan.FittingDuration(); d > 0 {
			fix = fmt.Sprintf("give --duration %s or more (for this seed), or leave them out of --faults", d)
		}
		return nil, fmt.Errorf("chaos: the plan of --seed %d has no episode of %s, so the run would pass without trying them: %s; %s",
			cfg.Seed, joinFaults(m), plan.whyMissing(m), fix)
	}
	if fi, err := os.Stat(cfg.Binary); err != nil || fi.IsDir() || fi.Mode().Perm()&0o111 == 0 {
		// Checked before Postgres starts and anything is written to --dir
		// (still empty, so the same --dir serves the next run) or removed
		// from --out (an earlier run's report): a typo failed at the first
		// node's start and left --dir in use.
		if err == nil {
			err = errors.New("not an executable file")
		}
		return nil, fmt.Errorf("chaos: --binary %s: want a quotad executable (%v)", cfg.Binary, err)
	}
	if err := cfg.checkDisk(); err != nil {
		return nil, err
	}
	if err := cfg.checkDirs(); err != nil {
		return nil, err
	}
	// The cluster runs with its internal ports locked, as the README
	// advises for production: the faults then also exercise forwarding
	// and gossip with the RPC token, mutual TLS and the gossip key.
	gossipKey, rpcToken := cluster.NewSecrets()
	h := &harness{cfg: cfg, plan: plan, removed: map[string]bool{}, paused: map[string]bool{}, unrevoked: map[string]bool{}, conns: &cluster.Conns{Token: rpcToken},
		gossipKey: gossipKey, rpcToken: rpcToken, adminToken: crand.Text(),
		http: &http.Client{Timeout: httpTimeout, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}}
	h.logf = func(format string, args ...any) {
		if cfg.Progress != nil {
			fmt.Fprintf(cfg.Progress, "chaos: "+format+"\n", args...)
		}
	}
	defer h.close()
	h.logf("%s", strings.TrimRight(plan.String(), "\n"))
	if err := h.setup(ctx); err != nil {
		// Interrupted before the load: nothing was recorded, so nothing
		// is kept (a cluster of 100 nodes kept 6.9 GB, as "the run
		// failed").
		if h.c != nil && ctx.Err() == nil {
			h.keepWhy = "the run failed"
		}
		return nil, err
	}
	rep, err := h.run(ctx)
	if err != nil && h.keepWhy == "" {
		h.keepWhy = "the run failed"
	}
	return rep, err
}

func (h *harness) setup(ctx context.Context) error {
	var err error
	if h.dir = h.cfg.Dir; h.dir == "" {
		if h.dir, err = os.MkdirTemp("", "quotaring-chaos-"); err != nil {
			return err
		}
	}
	bin := h.cfg.Binary
	if bin == "" {
		h.logf("building quotad")
		if bin, err = cluster.Build(ctx, h.dir); err != nil {
			return err
		}
	}
	if h.pg, err = pgtest.Start(ctx, pgtest.Options{}); err != nil {
		return fmt.Errorf("chaos: start Postgres from the local binaries: %w", err)
	}
	if h.dsn, err = h.pg.NewDatabase(ctx, "chaos"); err != nil {
		return err
	}
	if h.proxy, err = faultproxy.New("127.0.0.1:0", h.pg.Addr()); err != nil {
		return err
	}
	nodeDSN := strings.Replace(h.dsn, h.pg.Addr(), h.proxy.Addr(), 1)
	if h.ledger, err = flush.Open(ctx, h.dsn, nil); err != nil {
		return err
	}
	if err := h.ledger.Migrate(ctx); err != nil {
		return err
	}
	if err := h.seed(ctx); err != nil {
		return err
	}
	up, err := h.startUpstream()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(h.dir, "nodes"), 0o755); err != nil {
		return err
	}
	if h.rpcTLS, h.tlsClient, err = cluster.NewTLS(filepath.Join(h.dir, "tls")); err != nil {
		return err
	}
	h.conns.TLS = h.tlsClient
	h.logf("starting %d nodes on %s.%d-%d (data dirs and logs in %s)", h.cfg.Nodes, h.cfg.Subnet, h.cfg.FirstIP, h.cfg.FirstIP+h.cfg.Nodes-1, h.dir)
	h.c, err = cluster.Start(ctx, cluster.Options{Binary: bin, Nodes: h.cfg.Nodes, Ledger: nodeDSN, Dir: filepath.Join(h.dir, "nodes"),
		Args: []string{"--upstream", up, "--snapshot-interval", "1s",
			"--alert-webhook", up + alertPath, "--alert-secret", h.alerts.secret, "--alert-lease", alertLease.String(),
			"--reservation-audit", reservationAudit.String()}, TestFaults: true, SettleInterval: h.cfg.SettleInterval, FirstIP: h.cfg.FirstIP, Subnet: h.cfg.Subnet,
		GossipKey: h.gossipKey, RPCToken: h.rpcToken, RPCTLS: h.rpcTLS, AdminToken: h.adminToken})
	if err != nil {
		return err
	}
	h.publishNodes()
	if err := h.converge(ctx); err != nil {
		return err
	}
	if err := h.waitConfig(ctx); err != nil {
		return err
	}
	var seeds []string
	for _, n := range h.c.Nodes {
		seeds = append(seeds, n.RPC)
	}
	h.client, err = router.DialOptions{CallTimeout: callTimeout, RefreshInterval: time.Second, Token: h.rpcToken, TLS: h.tlsClient}.Dial(ctx, seeds...)
	if err != nil {
		return err
	}
	h.gateway, err = router.DialOptions{CallTimeout: callTimeout, RefreshInterval: time.Second, Token: h.rpcToken, TLS: h.tlsClient, Gateway: true}.Dial(ctx, seeds...)
	return err
}

// close stops everything the run started, whatever state it is in.
func (h *harness) close() {
	if h.client != nil {
		h.client.Close()
	}
	if h.gateway != nil {
		h.gateway.Close()
	}
	h.conns.Close()
	if h.c != nil {
		for _, n := range h.c.Nodes {
			if h.paused[n.ID] {
				n.Resume()
			}
		}
		h.c.Stop(context.Background())
	}
	if h.upstream != nil {
		h.upstream.Close()
	}
	if h.ledger != nil {
		h.ledger.Close()
	}
	if h.proxy != nil {
		h.proxy.Close()
	}
	if h.pg != nil {
		if h.keptDir() != "" && h.dsn != "" {
			h.dumpLedger()
		}
		h.pg.Close()
	}
	if h.cfg.Dir == "" && h.dir != "" {
		switch {
		case h.keepWhy != "":
			h.logf("%s: the data dirs and node logs (nodes/n1.log, ...) are kept in %s; remove it when done", h.keepWhy, h.dir)
		case !h.cfg.Keep:
			os.RemoveAll(h.dir)
		}
	}
}

// dumpLedger writes the run's ledger to ledger.sql in the kept dir, so that
// a violation can be read in the ledger's own rows after Postgres is gone
// (the events, their refunds and replays, the grants). Postgres is started
// again first if a ledger-down fault left it stopped.
func (h *harness) dumpLedger() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	path := filepath.Join(h.dir, "ledger.sql")
	err := h.pg.Start(ctx)
	if err == nil {
		err = h.pg.Dump(ctx, dbName(h.dsn), path)
	}
	if err != nil {
		h.logf("the ledger could not be kept: %v", err)
		return
	}
	h.logf("the ledger is kept in %s (load it with: createdb chaos && psql -d chaos -f %s)", path, path)
}

// dbName is the database a DSN names.
func dbName(dsn string) string {
	u, err := url.Parse(dsn)
	if err != nil {
		return ""
	}
	return strings.TrimPrefix(u.Path, "/")
}

// startUpstream serves the API the proxy fronts: 200 for everything but
// /v1/fail, which answers 503 (the front then refunds the charge). Every
// answer carries X-Chaos-Upstream, so a client tells the upstream's answers
// from the front's.
func (h *harness) startUpstream() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	h.alerts = newAlertSink()
	h.upstream = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && r.URL.Path == alertPath {
			h.alerts.ServeHTTP(w, r)
			return
		}
		w.Header().Set(upstreamHeader, "1")
		if r.URL.Path == "/v1/fail" {
			http.Error(w, "upstream failure (on purpose)", http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, "ok\n")
	})}
	go h.upstream.Serve(l)
	return "http://" + l.Addr().String(), nil
}

const upstreamHeader = "X-Chaos-Upstream"

func (h *harness) publishNodes() {
	var ns []*cluster.Node
	for _, n := range h.c.Nodes {
		if !h.removed[n.ID] {
			ns = append(ns, n)
		}
	}
	h.nodes.Store(&ns)
}

func (h *harness) node(id string) *cluster.Node {
	for _, n := range h.c.Nodes {
		if n.ID == id {
			return n
		}
	}
	return nil
}

func (h *harness) converge(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, convergeTimeout)
	defer cancel()
	if err := h.c.WaitConverged(ctx); err != nil {
		return fmt.Errorf("chaos: the ring did not converge: %w", err)
	}
	return nil
}

// waitConfig waits until every running node serves the config version the
// ledger has now (the seeded accounts and keys).
func (h *harness) waitConfig(ctx context.Context) error {
	snap, err := h.ledger.Snapshot(ctx, time.Now())
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, convergeTimeout)
	defer cancel()
	if err := h.c.WaitConfig(ctx, h.conns, snap.Version); err != nil {
		return fmt.Errorf("chaos: the nodes never all loaded config version %d: %w", snap.Version, err)
	}
	return nil
}

// window records a fault's window (history time) from start to now.
func (h *harness) window(kind Fault, node string, start int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.windows = append(h.windows, cluster.Window{Kind: string(kind), Node: node, Start: start, End: h.hist.Now()})
}

// started records that a node process started (G7: its buckets start full).
func (h *harness) started() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.starts = append(h.starts, h.hist.Now())
}

func (h *harness) liveness(node, detail string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.live = append(h.live, cluster.Violation{Detail: node + ": " + detail})
	h.logf("LIVENESS: %s: %s", node, detail)
}

func (h *harness) note(format string, args ...any) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.notes = append(h.notes, fmt.Sprintf(format, args...))
}

// run is the run proper: workload, faults, heal, settle, drain, check.
func (h *harness) run(ctx context.Context) (*Report, error) {
	h.hist = cluster.NewHistory()
	began := time.Now()
	// Say at once what an interrupt does: stopping takes a few seconds.
	defer context.AfterFunc(ctx, func() {
		at := h.hist.Now()
		h.mu.Lock()
		h.interruptAt, h.wasInterrupted = at, true
		h.mu.Unlock()
		h.logf("%s interrupted: stopping the load, then the nodes and Postgres; no check will run", clock(time.Duration(at)))
	})()
	wctx, stopLoad := context.WithCancel(ctx)
	load := h.startWorkload(wctx, ctx)
	progress := h.startProgress(wctx)
	err := h.runPlan(ctx)
	if err == nil {
		h.logf("%s all faults done; healing everything", clock(time.Duration(h.hist.Now())))
		err = h.healAll(ctx)
	}
	if err == nil {
		// Load on a healed cluster: retries land, moved accounts settle in.
		select {
		case <-time.After(afterHeal):
		case <-ctx.Done():
		}
	}
	stopLoad()
	load.Wait()
	progress.Wait()
	if ctx.Err() != nil {
		return h.interrupted(ctx, began)
	}
	if err != nil {
		return nil, err
	}
	h.logf("%s load stopped after %d operations; waiting for every log to settle", clock(time.Duration(h.hist.Now())), h.hist.Len())
	sctx, cancel := context.WithTimeout(ctx, settleTimeout)
	done := h.phase("waiting for every log to settle")
	if err := h.c.WaitSettled(sctx); err != nil && ctx.Err() == nil {
		h.liveness("cluster", "logs not settled within "+settleTimeout.String()+" of the heal: "+err.Error())
	}
	done()
	cancel()
	if ctx.Err() != nil {
		return h.interrupted(ctx, began)
	}
	holds := h.readHolds(ctx)
	done = h.phase("waiting for the quota alerts to be delivered")
	h.waitAlerts(ctx)
	done()
	alerts := h.alertResult(ctx)
	if ctx.Err() != nil {
		return h.interrupted(ctx, began)
	}
	done = h.phase("draining the nodes (SIGTERM)")
	logs := h.drain(ctx)
	done()
	if ctx.Err() != nil {
		return h.interrupted(ctx, began)
	}
	st, err := cluster.ReadLedger(ctx, h.ledger, h.acct.ids())
	if err != nil {
		return nil, err
	}
	in := &cluster.CheckInput{Ops: h.hist.Ops(), Accounts: h.acct.limits, Ledger: st, Logs: logs, Lost: h.lost, Starts: h.starts,
		Faults: h.windows, Holds: holds, Strands: h.auditStrands()}
	for _, w := range h.windows {
		if w.Kind == string(LedgerDown) {
			in.LedgerDown = append(in.LedgerDown, w)
		}
	}
	results := cluster.Check(in)
	results = append(results, alerts, h.livenessResult())
	if len(cluster.Failed(results)) > 0 {
		h.keepWhy = "invariants violated"
	}
	rep := h.report(in, results, began)
	if h.cfg.Out != "" {
		if err := rep.Write(h.cfg.Out, in.Ops); err != nil {
			return rep, fmt.Errorf("chaos: write the report to %s: %w", h.cfg.Out, err)
		}
	}
	return rep, nil
}

// phase logs that what is still going on, every ProgressEvery, until the
// function it returns is called: after the load stops, the settle wait (up
// to 90 s), the alerts' (60 s) and the drain were silent.
func (h *harness) phase(what string) (done func()) {
	start := time.Now()
	ctx, cancel := context.WithCancel(context.Background())
	wg := h.every(ctx, func() {
		h.logf("%s still %s (%s so far)", clock(time.Duration(h.hist.Now())), what, time.Since(start).Round(time.Second))
	})
	return func() { cancel(); wg.Wait() }
}

// interrupted ends a run whose ctx ended once the workload had begun: no
// check runs (the cluster was neither healed nor drained), but what was
// recorded so far (every operation, the faults applied, the plan) goes to
// Out, and the data dirs and node logs are kept. The error wraps ctx's.
func (h *harness) interrupted(ctx context.Context, began time.Time) (*Report, error) {
	h.keepWhy = "interrupted"
	h.mu.Lock()
	now := h.hist.Now()
	if h.wasInterrupted {
		now = h.interruptAt // the load and the faults took a while to stop after it
	}
	// The faults still on go into the faults as applied, up to the
	// interrupt: they were missing, and the answers they caused unexplained.
	for _, e := range h.active {
		// NB: an episode may have begun just after the interrupt (the
		// plan's timer and ctx ended together): no window ends before it
		// starts.
		h.windows = append(h.windows, cluster.Window{Kind: string(e.Fault), Node: e.Node, Start: h.activeSince[e], End: max(now, h.activeSince[e])})
	}
	h.mu.Unlock()
	at := time.Duration(now)
	ops := h.hist.Ops()
	if on := h.activeNames(); on != "none" {
		h.note("faults still on when the run was interrupted (in the faults as applied up to %s): %s", clock(at), on)
	}
	rep := h.report(&cluster.CheckInput{Ops: ops, Accounts: h.acct.limits}, nil, began)
	rep.Interrupted = fmt.Sprintf("interrupted at %s of %s, after %d operations: no check was run", clock(at), clock(h.cfg.Duration), len(ops))
	err := fmt.Errorf("chaos: %s: %w", rep.Interrupted, context.Cause(ctx))
	if h.cfg.Out != "" {
		if werr := rep.Write(h.cfg.Out, ops); werr != nil {
			err = fmt.Errorf("%w (and the partial report could not be written to %s: %v)", err, h.cfg.Out, werr)
		}
	}
	return rep, err
}

func (h *harness) livenessResult() cluster.Result {
	r := cluster.Result{ID: "LIVE", Name: "nodes come back, drain and exit 0; the ring converges", Verdict: cluster.Held}
	r.Count = len(h.live)
	if r.Count > 0 {
		r.Verdict = cluster.Violated
		r.Violations = h.live[:min(len(h.live), 10)]
	}
	r.Summary = fmt.Sprintf("%d node starts after the first, every node drained with SIGTERM at the end", len(h.starts))
	if r.Count > 0 {
		// It said every node drained beside a node that exited 9 on SIGTERM.
		r.Summary = fmt.Sprintf("%d node starts after the first; %d failures to come back, converge or drain and exit 0 (below)", len(h.starts), r.Count)
	}
	return r
}

// healAll ends every fault still on (the plan heals its own; this is the
// safety net) and waits for one ring. It fails only when Postgres cannot be
// started again: a node that is not running or a ring that does not
// converge is a LIVE violation, and the run goes on to its checks.
func (h *harness) healAll(ctx context.Context) error {
	if h.pgDown {
		if err := h.pg.Start(ctx); err != nil {
			return err
		}
		h.pgDown = false
	}
	h.proxy.SetLatency(0)
	for _, n := range *h.nodes.Load() {
		if h.paused[n.ID] {
			n.Resume()
			delete(h.paused, n.ID)
		}
		if !n.Running() {
			if h.unrevoked[n.ID] {
				if !h.revokeLost(ctx, n) {
					h.liveness(n.ID, "its lost disk's reservations could not be revoked at the final heal, so it cannot start again")
					continue
				}
			} else {
				h.liveness(n.ID, "not running at the final heal; its log ends:\n"+n.LogTail(15))
			}
			h.start(ctx, n)
		}
	}
	for _, n := range *h.nodes.Load() {
		n.Heal(ctx)
		n.SetClockOffset(ctx, 0)
	}
	// A ring that does not converge is a LIVE violation, not the end of the
	// run: the drain and the checks of what was charged still run, so the
	// operator gets the report with every verdict.
	if err := h.converge(ctx); err != nil && ctx.Err() == nil {
		h.liveness("cluster", err.Error()+" after the final heal")
	}
	return nil
}

// drain sends SIGTERM to every node (a drained node hands its reservations
// back and settles everything) and reads every data dir afterwards.
func (h *harness) drain(ctx context.Context) []cluster.LogState {
	for _, e := range h.c.Stop(ctx) {
		if e.Code != 0 {
			h.liveness(e.Node.ID, fmt.Sprintf("exited %d on SIGTERM (%v, killed: %v); its log ends:\n%s", e.Code, e.Err, e.Killed, e.Node.LogTail(15)))
		}
	}
	var logs []cluster.LogState
	for _, n := range h.c.Nodes {
		l, err := wal.Open(wal.Options{Dir: n.DataDir, AnyNode: true, ReadOnly: true})
		if err != nil {
			h.note("could not read the data dir of %s after the drain: %v", n.ID, err)
			continue
		}
		logs = append(logs, cluster.LogState{Node: l.NodeID(), Incarnation: l.Incarnation(), Settled: l.SettledSeq(), Durable: l.DurableSeq()})
		l.Close()
	}
	return logs
}

// measureLoss reads what a killed node's log holds unsettled: what losing
// its disk loses.
func measureLoss(dir string) ([]cluster.LostCharge, error) {
	l, err := wal.Open(wal.Options{Dir: dir, AnyNode: true, ReadOnly: true})
	if err != nil {
		return nil, err
	}
	defer l.Close()
	var out []cluster.LostCharge
	var rec shard.Record
	err = l.Scan(l.SettledSeq(), l.DurableSeq(), func(seq uint64, p []byte) error {
		if err := rec.Decode(p); err != nil {
			return err
		}
		if rec.Type != shard.RecCharge && rec.Type != shard.RecRefund || rec.Kept {
			return nil // a kept refund returned nothing; replays move no units
		}
		out = append(out, cluster.LostCharge{Node: l.NodeID(), Incarnation: l.Incarnation(), Seq: seq, Account: rec.Account,
			EventID: rec.EventID, Units: rec.Units, Reset: rec.Period.End() / int64(time.Second), Refund: rec.Type == shard.RecRefund})
		return nil
	})
	return out, err
}

// keptDir is where the data dirs and logs stay after the run, or "" when
// they are removed.
func (h *harness) keptDir() string {
	if h.cfg.Dir != "" || h.cfg.Keep || h.keepWhy != "" {
		return h.dir
	}
	return ""
}
