package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/cluster"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/snapshot"
)

type demoFlags struct {
	dir      string
	keep     bool
	duration time.Duration
	nodes    int
	plain    bool
}

func newDemoCmd() *cobra.Command {
	var f demoFlags
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run a small quotaring cluster on this machine and watch its guarantees hold, with nothing to install",
		Long: `quotad demo starts a cluster of quotad processes on loopback (127.0.0.10, .11,
...), each with its own data dir, sharing one SQLite ledger, in front of a
small sample API. Simulated customers send real HTTP requests with real API
keys through the nodes' proxies:

  free-co   a free plan with a hard monthly quota, which it runs out of
  acme      a paying plan plus prepaid credits; a flaky route gets refunds
  globex    a soft quota: past it, usage is billed as overage
  retry-co  sends every request 3 times with one Idempotency-Key
  spam-co   hammers far past its rate limit

At 40% of the run (of 17 s or more), one node is killed with SIGKILL: its accounts move to the
others (requests are refused quota-unavailable meanwhile, never decided
twice), then it is restarted with its data dir. At the end every node
settles and the demo compares what clients were told with what the ledger
holds: acknowledged against settled units, overshoot past hard limits, lost
usage, and a reconcile of counters against the event log. It exits 1 if
anything is off, 130 when interrupted (it then checks nothing).

While it runs, it prints a proxy address with curl commands and a key of
your own to try, and each node's status page (http://ADMIN/status).

On a terminal the view refreshes in place; otherwise (logs, CI, --plain) it
prints plain lines.`,
		Example: `  go run ./cmd/quotad demo
  quotad demo --duration 30s --nodes 5
  quotad demo --keep --dir /tmp/qdemo     # keep data dirs, node logs and the ledger`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runDemo(cmd.Context(), cmd.OutOrStdout(), f)
		},
	}
	fl := cmd.Flags()
	fl.DurationVar(&f.duration, "duration", 60*time.Second, "how long the customers' traffic runs (10s to 30m); a node is killed at 40% and restarted a while later (from 17s, with 2 or more nodes)")
	fl.IntVar(&f.nodes, "nodes", 3, "quotad processes to run (1 to 9); with 1 there is no failover to show")
	fl.StringVar(&f.dir, "dir", "", "where the data dirs, node logs and the ledger go: a new or empty directory (default: a temp dir), removed at the end unless --keep")
	fl.BoolVar(&f.keep, "keep", false, "keep the directory at the end (it is also kept when the demo fails)")
	fl.BoolVar(&f.plain, "plain", false, "print plain lines even on a terminal (no live view)")
	return cmd
}

func (f demoFlags) validate() error {
	if f.nodes < 1 || f.nodes > 9 {
		return fmt.Errorf("--nodes %d: want 1 to 9", f.nodes)
	}
	if f.duration < 10*time.Second || f.duration > 30*time.Minute {
		return fmt.Errorf("--duration %s: want 10s to 30m", f.duration)
	}
	return nil
}

// demoRun is one run of the demo.
type demoRun struct {
	f      demoFlags
	out    io.Writer
	st     style
	live   bool
	width  int
	step   int
	dir    string
	dsn    string
	cs     []*customer
	api    *demoAPI
	c      *cluster.Cluster
	events *eventLog
	tr     *traffic
	mon    *monitor
	victim *cluster.Node
	// killed and restarted: what the failover did (set by failover, read
	// after it returned)
	killed, restarted bool
	// victimOwned are the demo accounts the victim owned when it was killed.
	victimOwned []string
	// trafficTook is from the first request to the last answer.
	trafficTook time.Duration
	// tryIt is the block of curl commands and addresses shown while the
	// traffic runs.
	tryIt []string
}

func (d *demoRun) title(format string, args ...any) {
	d.step++
	fmt.Fprintf(d.out, "\n%s\n", d.st.bold(fmt.Sprintf("%d. ", d.step)+fmt.Sprintf(format, args...)))
}

func (d *demoRun) say(format string, args ...any) { fmt.Fprintf(d.out, "   "+format+"\n", args...) }

func runDemo(ctx context.Context, out io.Writer, f demoFlags) (err error) {
	if err := f.validate(); err != nil {
		return err
	}
	if err := checkLoopback(f.nodes); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("demo: cannot find this program to start nodes from: %w", err)
	}
	d := &demoRun{f: f, out: out}
	if tty, width := terminalWidth(out); tty && !f.plain {
		d.live, d.width, d.st = true, width, style{on: true}
	}
	dir, removeDir, err := demoDir(f.dir)
	if err != nil {
		return err
	}
	d.dir, d.dsn = dir, "sqlite:"+filepath.Join(dir, "ledger.db")
	defer func() {
		switch {
		case err != nil && ctx.Err() != nil && !errors.As(err, new(*exitError)): // Ctrl-C: the nodes are stopped by now
			// NB: not the checks' own failure (exitError: the stop and
			// the comparison run on after a Ctrl-C): that stays exit 1,
			// and its dir is kept.
			err = &exitError{code: 130, err: errors.New("demo: interrupted")}
			if !f.keep {
				removeDir()
			}
		case err != nil:
			fmt.Fprintf(out, "\nThe demo failed; its data dirs, node logs (n1.log, ...) and ledger are kept in %s\n", dir)
		case f.keep:
			fmt.Fprintf(out, "\nKept in %s: data dirs, node logs (n1.log, ...) and the ledger (quotad reconcile --ledger %s).\n", dir, d.dsn)
		default:
			removeDir()
		}
	}()
	fmt.Fprintf(out, "%s\n", d.st.bold(fmt.Sprintf("quotaring demo: %s on this machine, one SQLite ledger, a sample API, 5 customers",
		plural(int64(f.nodes), "quotad process", "quotad processes"))))
	left := "removed at the end; a second Ctrl-C ends at once and leaves it"
	if f.keep {
		left = "kept at the end (--keep)"
	}
	fmt.Fprintf(out, "Everything runs under %s (%s); nothing else is touched.\n", dir, left)

	d.cs = demoCustomers(f.duration)
	if err := d.seed(ctx); err != nil {
		return err
	}
	if d.api, err = startDemoAPI(); err != nil {
		return err
	}
	defer d.api.Close()
	if err := d.startCluster(ctx, self); err != nil {
		return err
	}
	defer func() {
		if d.c != nil { // not stopped by the end phase: an error or an interrupt
			d.c.Stop(context.Background())
		}
	}()
	d.showTryIt()
	if err := d.runTraffic(ctx); err != nil {
		return err
	}
	return d.finish(ctx)
}

// demoDir makes the demo's directory and returns how to remove what the
// demo made there.
func demoDir(dir string) (string, func(), error) {
	if dir == "" {
		dir, err := os.MkdirTemp("", "quotad-demo-")
		if err != nil {
			return "", nil, fmt.Errorf("cannot make the demo's temporary directory (%w): set TMPDIR to a writable directory, or give --dir", err)
		}
		return dir, func() { os.RemoveAll(dir) }, nil
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", nil, err
	}
	entries, err := os.ReadDir(abs)
	switch {
	case errors.Is(err, os.ErrNotExist):
		if err := os.MkdirAll(abs, 0o755); err != nil {
			return "", nil, fmt.Errorf("--dir %s: cannot create it (%w): give a directory this user can create, or leave --dir out for a temporary one", dir, err)
		}
		return abs, func() { os.RemoveAll(abs) }, nil
	case err != nil:
		return "", nil, fmt.Errorf("--dir %s: %w", dir, err)
	case len(entries) > 0:
		return "", nil, fmt.Errorf("--dir %s is not empty: the demo starts from a fresh ledger; give a new or empty directory", dir)
	}
	return abs, func() { // it existed: leave it, empty it
		entries, _ := os.ReadDir(abs)
		for _, e := range entries {
			os.RemoveAll(filepath.Join(abs, e.Name()))
		}
	}, nil
}

// seed writes the plans, accounts, keys (their hashes), credits and route
// weights to the ledger before any node starts, as an operator would with
// quotad admin.
func (d *demoRun) seed(ctx context.Context) error {
	d.title("The ledger: plans, accounts, API keys, credits and route weights")
	d.say("%s, written before any node starts, as an operator would with quotad admin", d.dsn)
	l, err := flush.Open(ctx, d.dsn, nil)
	if err != nil {
		return err
	}
	defer l.Close()
	if err := l.Migrate(ctx); err != nil {
		return err
	}
	now := time.Now().UTC()
	for _, c := range d.cs {
		if err := l.UpsertPlan(ctx, c.Plan); err != nil {
			return fmt.Errorf("demo: plan %s: %w", c.Plan.ID, err)
		}
		if err := l.UpsertAccount(ctx, c.ID, c.Plan.ID); err != nil {
			return fmt.Errorf("demo: account %s: %w", c.ID, err)
		}
		if err := l.AddKey(ctx, snapshot.Key{ID: c.ID + "-key", Hash: snapshot.HashKey(c.Key), Account: c.ID}); err != nil {
			return fmt.Errorf("demo: key of %s: %w", c.ID, err)
		}
		if c.Credits > 0 {
			g := snapshot.Grant{ID: "prepaid", Units: c.Credits, StartsAt: now.Add(-time.Hour), ExpiresAt: now.AddDate(0, 0, 90)}
			if err := l.AddGrant(ctx, c.ID, g); err != nil {
				return fmt.Errorf("demo: credits of %s: %w", c.ID, err)
			}
		}
	}
	if _, err := l.SetRoutes(ctx, 1, demoRoutes); err != nil {
		return err
	}
	for _, c := range d.cs {
		rate := "no rate limit"
		if c.Plan.Rate != "" {
			rate = fmt.Sprintf("%s burst %d", c.Plan.Rate, c.Plan.Burst)
		}
		units := fmt.Sprintf("%s/month", node.Thousands(c.Plan.MonthlyQuota))
		if c.Credits > 0 {
			units += fmt.Sprintf(" +%s prepaid", node.Thousands(c.Credits))
		}
		d.say("%-9s %-13s %-24s %-14s %s", c.ID, c.planText(), units, rate, d.st.dim(c.About))
	}
	d.say("units per route: GET /v1/tasks 1, POST /v1/tasks 2, POST /v1/exports 10, GET /v1/reports 5")
	d.say("API keys are stored as SHA-256 hashes; the plaintexts live only in this process")
	return nil
}

// checkLoopback makes sure the nodes' addresses can be bound: every
// 127.0.0.x answers on Linux, while macOS routes only 127.0.0.1 until
// aliases are added.
func checkLoopback(nodes int) error {
	var missing []string
	for i := range nodes {
		ip := fmt.Sprintf("127.0.0.%d", 10+i)
		l, err := net.Listen("tcp", ip+":0")
		if err != nil {
			missing = append(missing, ip)
			continue
		}
		l.Close()
	}
	if len(missing) == 0 {
		return nil
	}
	var cmds []string
	for _, ip := range missing {
		cmds = append(cmds, "sudo ifconfig lo0 alias "+ip+" up")
	}
	return fmt.Errorf("demo: the nodes listen on 127.0.0.10 and up, and %s cannot be bound here (macOS routes only 127.0.0.1 "+
		"on loopback until aliases are added):\n  %s", strings.Join(missing, ", "), strings.Join(cmds, "\n  "))
}

func (d *demoRun) startCluster(ctx context.Context, self string) error {
	d.title("%s on loopback, one data dir each, in front of the sample API on %s", plural(int64(d.f.nodes), "quotad process", "quotad processes"), d.api.addr)
	t0 := time.Now()
	// The internal ports locked as in production: gossip encrypted with a
	// shared key, RPC over mutual TLS (a throwaway CA of the demo's) and
	// calls refused without the shared token.
	gossipKey, rpcToken := cluster.NewSecrets()
	rpcTLS, _, err := cluster.NewTLS(filepath.Join(d.dir, "tls"))
	if err != nil {
		return err
	}
	c, err := cluster.Start(ctx, cluster.Options{Binary: self, Nodes: d.f.nodes, Ledger: d.dsn, Dir: d.dir,
		SettleInterval: time.Second, GossipKey: gossipKey, RPCToken: rpcToken, RPCTLS: rpcTLS,
		// NB: the cluster package logs at debug for tests; at the demo's
		// rates that is megabytes of JSON for nothing.
		Args: []string{"--upstream", "http://" + d.api.addr, "--log-level", "info",
			"--alert-webhook", "http://" + d.api.addr + demoAlertPath, "--alert-secret", d.api.alertSecret}})
	if err != nil {
		return err
	}
	d.c = c
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if err := c.WaitConverged(wctx); err != nil {
		for _, n := range c.Nodes {
			fmt.Fprintf(d.out, "--- %s (%s) log ends:\n%s\n", n.ID, n.LogPath, n.LogTail(15))
		}
		return fmt.Errorf("demo: the cluster did not form: %w", err)
	}
	d.events = &eventLog{}
	if !d.live {
		d.events.plain = d.out
	}
	var proxies []string
	for _, n := range c.Nodes {
		proxies = append(proxies, n.HTTP)
	}
	d.tr = newTraffic(proxies, d.events)
	d.mon = newMonitor(c, d.cs, d.tr, d.events)
	d.mon.tick(ctx)
	d.say("one ring after %.1fs (gossip: memberlist; ring: consistent hashing over 1,021 partitions)", time.Since(t0).Seconds())
	d.say("internal ports locked: gossip encrypted with a shared --gossip-key, RPC over mutual TLS (--rpc-tls-*, the demo's own CA) with the shared --rpc-token")
	for _, n := range c.Nodes {
		d.say("%-3s pid %-7d proxy %-21s status http://%s/status  owns %s",
			n.ID, n.PID(), n.HTTP, n.Admin, strings.Join(orNone(d.mon.ownedBy(n.ID)), ", "))
	}
	d.say("node logs: %s", filepath.Join(d.dir, "n1.log")+", ...")
	return nil
}

func orNone(s []string) []string {
	if len(s) == 0 {
		return []string{"none of the demo accounts"}
	}
	return s
}

func (d *demoRun) showTryIt() {
	var you *customer
	for _, c := range d.cs {
		if c.hand {
			you = c
		}
	}
	n := d.c.Nodes[0] // never killed: the others joined through it
	d.tryIt = []string{
		d.st.bold("TRY IT") + " with your own key (account \"you\": 1,000 units/month, hard; left out of the totals); send the last one twice",
		fmt.Sprintf("  curl -i -H 'X-Api-Key: %s' http://%s/v1/tasks", you.Key, n.HTTP),
		fmt.Sprintf("  curl -H 'X-Api-Key: %s' http://%s/v1/usage", you.Key, n.HTTP),
		fmt.Sprintf("  curl -i -X POST -H 'X-Api-Key: %s' -H 'Idempotency-Key: order-1' http://%s/v1/tasks", you.Key, n.HTTP),
		fmt.Sprintf("%s http://%s/status  (every node has one)", d.st.bold("STATUS PAGE"), n.Admin),
	}
	d.title("Try it by hand while it runs")
	for _, l := range d.tryIt[1:] {
		d.say("%s", strings.TrimSpace(l))
	}
	d.say("(the key works until the demo ends; it prints these again in its view)")
}

// failoverPlan says when the victim is killed and restarted (offsets into
// the traffic), or ok false when there is nothing to fail over to.
func failoverPlan(nodes int, dur time.Duration) (kill, restart time.Duration, ok bool) {
	if nodes < 2 {
		return 0, 0, false
	}
	kill = dur * 4 / 10
	restart = kill + max(6*time.Second, dur/5)
	if restart > dur-4*time.Second {
		return 0, 0, false
	}
	return kill, restart, true
}

// pickVictim chooses the node to kill: never n1 (the others joined
// through it), preferably the owner of free-co (its reservation freezes:
// the hard quota's story) and not the owner of acme (whose flaky route
// refunds: a refund in flight to a node being killed cannot complete, and
// the client could not know it was billed).
func (d *demoRun) pickVictim() *cluster.Node {
	var best *cluster.Node
	bestScore := -1 << 30
	for _, n := range d.c.Nodes[1:] {
		score := 0
		for _, a := range d.mon.ownedBy(n.ID) {
			switch a {
			case "free-co":
				score += 3
			case "acme":
				score -= 10
			default:
				score++
			}
		}
		if score > bestScore {
			best, bestScore = n, score
		}
	}
	return best
}

func (d *demoRun) runTraffic(ctx context.Context) error {
	kill, restart, failover := failoverPlan(d.f.nodes, d.f.duration)
	via := fmt.Sprintf("the %d nodes' proxies", d.f.nodes)
	if d.f.nodes == 1 {
		via = "the node's proxy"
	}
	d.title("Traffic for %.0fs through %s", d.f.duration.Seconds(), via)
	if failover {
		d.victim = d.pickVictim()
		d.say("at t=%.0fs %s is killed with SIGKILL; at t=%.0fs it restarts with its data dir", kill.Seconds(), d.victim.ID, restart.Seconds())
	} else {
		d.say("(no node is killed: %s)", map[bool]string{true: "one node has nothing to fail over to", false: "--duration is too short for a kill and a restart"}[d.f.nodes < 2])
	}
	if !d.live {
		d.say("plain output: a status line every %s, events as they happen", plainEvery(d.f.duration))
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	start := time.Now()
	d.events.start, d.tr.start = start, start
	d.api.events.Store(d.events) // the alert webhook logs from here on
	d.events.add("traffic starts: %d customers through the proxies of %s", len(d.cs)-1, nodeIDs(d.c.Nodes))
	for _, c := range d.cs {
		d.tr.run(c, stop, &wg)
	}
	scriptDone := make(chan struct{})
	go func() {
		defer close(scriptDone)
		if failover {
			d.failover(ctx, start, kill, restart)
		}
	}()
	err := d.watch(ctx, start, stop)
	if ctx.Err() != nil {
		d.tr.stopRetrying(time.Now()) // interrupted: no more retries
	} else {
		d.tr.stopRetrying(time.Now().Add(20 * time.Second))
	}
	d.mon.setPhase("traffic stopped; requests in doubt are retried with their keys")
	wg.Wait()
	d.trafficTook = time.Since(start)
	<-scriptDone
	d.mon.tick(context.WithoutCancel(ctx))
	d.mon.mu.Lock()
	d.mon.average = min(time.Since(start), d.f.duration).Seconds()
	d.mon.mu.Unlock()
	d.mon.setPhase("the end: charges/s and refused/s are averages over the run")
	d.showFinalView(time.Since(start))
	if err != nil {
		return err
	}
	return ctx.Err()
}

func plainEvery(dur time.Duration) time.Duration {
	return max(5*time.Second, (dur / 6).Round(time.Second))
}

func nodeIDs(ns []*cluster.Node) string {
	var ids []string
	for _, n := range ns {
		ids = append(ids, n.ID)
	}
	return strings.Join(ids, ", ")
}

// watch samples and shows the cluster until the traffic's time is up, then
// closes stop.
func (d *demoRun) watch(ctx context.Context, start time.Time, stop chan struct{}) error {
	defer close(stop)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	every := plainEvery(d.f.duration)
	nextPlain := every
	if d.live {
		fmt.Fprint(d.out, "\x1b[?25l\x1b[2J") // hide the cursor, clear once
		defer fmt.Fprint(d.out, "\x1b[?25h")
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		elapsed := time.Since(start)
		d.mon.tick(ctx)
		if d.live {
			d.drawLive(elapsed)
		} else if elapsed >= nextPlain-100*time.Millisecond {
			for _, l := range d.mon.plainLines(elapsed) {
				fmt.Fprintln(d.out, "   "+l)
			}
			nextPlain += every
		}
		if elapsed >= d.f.duration {
			return nil
		}
	}
}

func (d *demoRun) drawLive(elapsed time.Duration) {
	lines := d.mon.frame(d.st, nil, min(elapsed, d.f.duration), d.f.duration, d.tryIt, 8, d.width)
	var b strings.Builder
	b.WriteString("\x1b[H")
	for _, l := range lines {
		b.WriteString(cut(l, d.width-1))
		b.WriteString("\x1b[K\n")
	}
	b.WriteString("\x1b[J")
	io.WriteString(d.out, b.String())
}

// showFinalView prints the view once more as it stands after the traffic:
// on a terminal in place of the live one; otherwise as the record of the
// run in the log.
func (d *demoRun) showFinalView(elapsed time.Duration) {
	if d.live {
		d.drawLive(elapsed)
		return
	}
	d.title("The view at the end (on a terminal it refreshes in place while the traffic runs)")
	for _, l := range d.mon.frame(d.st, nil, min(elapsed, d.f.duration), d.f.duration, nil, 0, 0) {
		fmt.Fprintln(d.out, "   "+l)
	}
}

// failover kills the victim with SIGKILL, follows its accounts to their new
// owners, and restarts it with its data dir.
func (d *demoRun) failover(ctx context.Context, start time.Time, kill, restart time.Duration) {
	v := d.victim
	if !sleepUntil(ctx, start.Add(kill)) {
		return
	}
	owned := d.mon.ownedBy(v.ID)
	d.victimOwned = owned
	unsettled := d.mon.node(d.indexOf(v)).unsettled
	for _, c := range d.cs {
		c.resetSeen("quota-unavailable") // show the refusals the kill causes
	}
	d.events.add("SIGKILL %s (pid %d), no warning: it owns %s; its log holds ~%.0f records not yet settled",
		v.ID, v.PID(), strings.Join(orNone(owned), ", "), unsettled)
	t0 := time.Now()
	if err := v.Kill(); err != nil {
		d.events.add("could not kill %s: %v", v.ID, err)
		return
	}
	d.killed = true
	d.mon.setKilled(v.ID)
	d.mon.setPhase("%s was killed (SIGKILL)", v.ID)
	// The survivors notice through gossip; until then, calls to the dead
	// owner fail and the front answers quota-unavailable.
	for ctx.Err() == nil && time.Since(t0) < 30*time.Second {
		if d.survivorsDropped(ctx, v.ID) {
			d.events.add("the others declared %s dead after %.1fs and took its partitions", v.ID, time.Since(t0).Seconds())
			d.events.add("%s's reserved units stay frozen in the ledger until it returns: nobody can spend them twice", v.ID)
			d.mon.setPhase("%s is down; its accounts moved", v.ID)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !sleepUntil(ctx, start.Add(restart)) {
		return
	}
	t1 := time.Now()
	d.events.add("restarting %s with its data dir (its log, its incarnation)", v.ID)
	d.mon.setPhase("%s restarting", v.ID)
	if err := v.Start(ctx); err != nil {
		d.events.add("could not restart %s: %v", v.ID, err)
		return
	}
	d.mon.setKilled("")
	rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if err := v.WaitReady(rctx); err != nil {
		d.events.add("%s did not get ready: %v", v.ID, err)
		return
	}
	d.restarted = true
	settled := scrapeMetrics(ctx, v)["quotaring_settle_batch_records_sum"]
	d.events.add("%s ready after %.1fs: it replayed its log and settled its %.0f unsettled records before serving",
		v.ID, time.Since(t1).Seconds(), settled)
	if err := d.c.WaitConverged(rctx); err == nil {
		d.events.add("one ring again: %s serves its partitions (%s)", v.ID, strings.Join(orNone(d.ownersAfter(ctx, v.ID)), ", "))
	}
	d.mon.setPhase("%s", "")
}

func (d *demoRun) ownersAfter(ctx context.Context, id string) []string {
	d.mon.tick(ctx)
	return d.mon.ownedBy(id)
}

func (d *demoRun) indexOf(n *cluster.Node) int {
	for i, o := range d.c.Nodes {
		if o == n {
			return i
		}
	}
	return 0
}

// survivorsDropped reports whether every running node's ring has left id
// out of its serving members.
func (d *demoRun) survivorsDropped(ctx context.Context, id string) bool {
	for _, n := range d.c.Nodes {
		if n.ID == id || !n.Running() {
			continue
		}
		v, err := n.RingView(ctx)
		if err != nil {
			return false
		}
		for _, m := range v.Members {
			if m.Id == id && m.State == "serving" {
				return false
			}
		}
	}
	return true
}

func sleepUntil(ctx context.Context, t time.Time) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(time.Until(t)):
		return true
	}
}
