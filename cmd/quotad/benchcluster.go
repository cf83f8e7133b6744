package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"

	"github.com/quotaring/quotaring/internal/loadgen"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/snapshot"
)

type benchClusterFlags struct {
	nodes       []string
	ledger      string
	setup       bool
	accounts    int
	concurrency string
	duration    time.Duration
	spread      string
	mode        string
	client      string
	inflight    int
	batch       int
	prefix      string
	rpcToken    string
	rpcTLS      router.TLSFiles
	warm        bool
}

func newBenchClusterCmd() *cobra.Command {
	var f benchClusterFlags
	cmd := &cobra.Command{
		Use:   "cluster",
		Short: "Load a running cluster over its internal RPC and print charges/s and latency",
		Long: `Drive a running cluster with charges over the internal gRPC API and print
charges/s and p50/p99/p999 latency per concurrency, with a progress line.

Modes:
  routed  every call goes to one node (--nodes' first), which decides the
          accounts it owns and forwards the others to their owners (one hop)
  direct  the bench learns the ring (RingView) and sends each call to the
          owner of its accounts, like the embedded client

Clients:
  rpc       each call is a gRPC call of its own, as from a hand-written gRPC
            client (no coalescing across callers)
  embedded  calls go through router.Client, the embedded Go client, which
            coalesces concurrent calls to one node into shared RPCs (what a
            Go service embedding quotaring gets). Direct mode: it finds the
            owners itself. Routed mode: router.DialOptions.Gateway, every
            call to --nodes' first, as through a load balancer. One charge
            per call only.

--setup creates the bench plan and accounts in the ledger first (needs
--ledger); the nodes pick them up at their next config refresh.`,
		Example: `  quotad bench cluster --nodes 127.0.0.10:7400,127.0.0.11:7400 --ledger postgres://... --setup \
      --accounts 10000 --concurrency 1,8,64,512 --mode routed --batch 1
  quotad bench cluster --nodes 127.0.0.10:7400 --mode direct --client embedded --concurrency 64,512
  quotad bench cluster --nodes 127.0.0.10:7400 --mode routed --client embedded --concurrency 64,512`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// --ledger given on the command line without --setup did
			// nothing, silently (QUOTAD_LEDGER, set for other commands, is
			// fine).
			if l := cmd.Flags().Lookup("ledger"); l.Changed && l.Annotations[envAnnotation] == nil && !f.setup {
				return fmt.Errorf("--ledger is read only with --setup (to create the bench plan and accounts first): add --setup, or leave --ledger out to bench accounts made before")
			}
			err := runBenchCluster(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), f)
			var exit *exitError
			if err != nil && cmd.Context().Err() != nil && !errors.As(err, &exit) {
				// Ctrl-C before the first row (the setup, the config wait,
				// the warm-up): "context canceled" and exit 1 read as a
				// failure of the cluster.
				return benchInterrupted("cluster")
			}
			return err
		},
	}
	fl := cmd.Flags()
	fl.StringSliceVar(&f.nodes, "nodes", nil, "RPC addresses of nodes (host:port); routed mode calls the first")
	fl.StringVar(&f.ledger, "ledger", "", "the ledger, for --setup")
	fl.BoolVar(&f.setup, "setup", false, "create the bench plan and accounts in the ledger before running")
	fl.IntVar(&f.accounts, "accounts", 10000, "accounts the charges spread over")
	fl.StringVar(&f.concurrency, "concurrency", "1,8,64,512", "comma-separated numbers of concurrent callers")
	fl.DurationVar(&f.duration, "duration", 10*time.Second, "how long each concurrency runs")
	fl.StringVar(&f.spread, "spread", "uniform", "how calls pick accounts: uniform or zipf")
	fl.StringVar(&f.mode, "mode", "routed", "routed (through one node) or direct (to the owner)")
	fl.StringVar(&f.client, "client", "rpc", "rpc (one gRPC call per call) or embedded (router.Client: coalesces concurrent calls; --batch 1; with --mode routed, DialOptions.Gateway)")
	fl.IntVar(&f.inflight, "inflight", 0, "with --client embedded: calls in flight to one node before calls are gathered into the next batch (router.DialOptions.MaxInflight; 0: its default)")
	fl.IntVar(&f.batch, "batch", 1, "charges per call")
	fl.StringVar(&f.rpcToken, "rpc-token", "", "the nodes' --rpc-token, when they have one (of a list, the first); prefer QUOTAD_RPC_TOKEN, which ps does not show")
	registerRPCTLSFlags(fl, &f.rpcTLS, "this client's")
	fl.StringVar(&f.prefix, "account-prefix", "bench-", "account ids are PREFIX1 .. PREFIXN")
	fl.BoolVar(&f.warm, "warm", true, "charge every account once before measuring, so each owner holds a reservation (an account's first charge waits for one ledger round trip)")
	return cmd
}

func runBenchCluster(ctx context.Context, out, progress io.Writer, f benchClusterFlags) error {
	concs, err := parseInts(f.concurrency, "concurrency")
	if err != nil {
		return err
	}
	switch {
	case len(f.nodes) == 0:
		return fmt.Errorf("--nodes is required: the RPC address of at least one node")
	case f.accounts <= 0 || f.accounts > maxBenchAccounts:
		return fmt.Errorf("--accounts %d: want 1 to %d", f.accounts, maxBenchAccounts)
	case f.batch <= 0 || f.batch > maxBenchBatch:
		return fmt.Errorf("--batch %d: want 1 to %d charges per call", f.batch, maxBenchBatch)
	case f.duration <= 0:
		return fmt.Errorf("--duration %s: want a positive duration, such as 10s", f.duration)
	case f.spread != "uniform" && f.spread != "zipf":
		return fmt.Errorf("--spread %q: want uniform or zipf", f.spread)
	case f.mode != "routed" && f.mode != "direct":
		return fmt.Errorf("--mode %q: want routed or direct", f.mode)
	case f.client != "rpc" && f.client != "embedded":
		return fmt.Errorf("--client %q: want rpc or embedded", f.client)
	case f.inflight < 0 || (f.inflight > 0 && f.client != "embedded"):
		return fmt.Errorf("--inflight %d: a positive number, with --client embedded only", f.inflight)
	case f.setup && f.ledger == "":
		return fmt.Errorf("--setup needs --ledger: the ledger (a Postgres DSN or a SQLite path) to create the bench plan and accounts in")
	case f.client == "embedded" && f.batch != 1:
		return fmt.Errorf("--client embedded charges one unit of work per call (its batching is the coalescing of concurrent calls): use --batch 1, or --client rpc for --batch %d", f.batch)
	}
	for _, a := range f.nodes {
		// Checked before any load, so that a typo is named by its flag and
		// not by gRPC's warm-up error ("missing port in address").
		if _, port, err := net.SplitHostPort(a); err != nil || port == "" || port == "0" || strings.Contains(a, "://") {
			return fmt.Errorf("--nodes %q: want a node's RPC address, host:port (its --rpc-addr, such as 127.0.0.1:7400), not a URL", a)
		}
	}
	if err := checkRPCTLSFlags(f.rpcTLS); err != nil {
		return err
	}
	var tlsConf *tls.Config
	if f.rpcTLS.Enabled() {
		if tlsConf, err = f.rpcTLS.ClientConfig(); err != nil {
			return err
		}
	}
	f.rpcToken, _, _ = strings.Cut(f.rpcToken, ",") // the token to send of a rotation's list
	f.rpcToken = strings.TrimSpace(f.rpcToken)
	accounts := make([]string, f.accounts)
	for i := range accounts {
		accounts[i] = fmt.Sprintf("%s%d", f.prefix, i+1)
	}
	if f.setup {
		if err := setupBenchAccounts(ctx, progress, f.ledger, accounts); err != nil {
			return err
		}
	}
	conns := map[string]pb.QuotaClient{}
	var closers []*grpc.ClientConn
	defer func() {
		for _, c := range closers {
			c.Close()
		}
	}()
	dial := func(addr string) (pb.QuotaClient, error) {
		if c, ok := conns[addr]; ok {
			return c, nil
		}
		cc, err := grpc.NewClient("passthrough:///"+addr, router.NodeDialOptions(f.rpcToken, tlsConf)...)
		if err != nil {
			return nil, err
		}
		closers = append(closers, cc)
		conns[addr] = pb.NewQuotaClient(cc)
		return conns[addr], nil
	}
	first, err := dial(f.nodes[0])
	if err != nil {
		return err
	}
	if f.setup {
		if err := waitConfig(ctx, f.ledger, f.nodes, dial); err != nil {
			return err
		}
	}
	var owners func(account string) string
	var embedded *router.Client
	if f.client == "embedded" {
		opts := router.DialOptions{MaxInflight: f.inflight, Token: f.rpcToken, TLS: tlsConf}
		seeds := f.nodes
		if f.mode == "routed" {
			// Every call to the first node, which forwards: as a program
			// that reaches the cluster through one load-balanced address.
			opts.Gateway, seeds = true, f.nodes[:1]
		}
		if embedded, err = opts.Dial(ctx, seeds...); err != nil {
			return fmt.Errorf("embedded client: %w", err)
		}
		defer embedded.Close()
	} else if f.mode == "direct" {
		if owners, err = ownerTable(ctx, first); err != nil {
			return router.ExplainTLSMismatch(err, tlsConf != nil)
		}
		for _, a := range accounts {
			if _, err := dial(owners(a)); err != nil {
				return err
			}
		}
	}
	if f.warm {
		if err := warmAccounts(ctx, progress, first, accounts); err != nil {
			return router.ExplainTLSMismatch(err, tlsConf != nil)
		}
	}
	client := f.client
	if f.client == "embedded" && f.mode == "routed" {
		client = "embedded (Gateway, through " + f.nodes[0] + ")"
	}
	fmt.Fprintf(out, "quotad bench cluster: %d accounts (%s), mode %s, client %s, %d charges per call, %s per run\n\n", f.accounts, f.spread, f.mode, client, f.batch, f.duration)
	fmt.Fprintf(out, "%6s %12s %12s %10s %10s %10s %8s\n", "conc", "charges/s", "calls/s", "p50", "p99", "p999", "errors")
	var failed int64
	for _, c := range concs {
		pick := picker(f.spread, len(accounts), c)
		rep, err := loadgen.Run(ctx, loadgen.Config{Concurrency: c, Duration: f.duration, Warmup: f.duration / 10, Progress: progress,
			Interactive: isTerminal(progress), Label: fmt.Sprintf("x%d", c)}, func(ctx context.Context, w int, i int64) (int, error) {
			if embedded != nil {
				return 1, embeddedCall(ctx, embedded, accounts[pick(w)])
			}
			reqs := make([]*pb.ChargeRequest, f.batch)
			for k := range reqs {
				reqs[k] = &pb.ChargeRequest{Account: accounts[pick(w)], Route: "POST /bench", Units: 1}
			}
			return f.batch, benchCall(ctx, f.mode, first, owners, conns, reqs)
		})
		stopped := ""
		if err != nil {
			if rep.Calls+rep.Errors == 0 {
				if loadgen.Ended(ctx) {
					return benchInterrupted("cluster")
				}
				return err
			}
			stopped = fmt.Sprintf("   (stopped after %s)", rep.Elapsed.Round(100*time.Millisecond))
		}
		fmt.Fprintf(out, "%6d %12.0f %12.0f %10s %10s %10s %8d%s\n", c, rep.OpsPerSec, rep.CallsPerSec, fmtDur(rep.P50), fmtDur(rep.P99), fmtDur(rep.P999), rep.Errors, stopped)
		if err != nil && loadgen.Ended(ctx) {
			return benchInterrupted("cluster") // Ctrl-C: the row so far is printed, the rest not run
		}
		if err != nil {
			return err
		}
		if rep.Errors > 0 {
			failed += rep.Errors
			fmt.Fprintf(out, "       first error: %v\n", rep.FirstErr)
		}
	}
	if failed > 0 {
		// The figures count only the calls that succeeded; a run with
		// failures is no measurement to record, and a script must see it.
		return fmt.Errorf("%d calls failed (see above): the figures count only the calls that succeeded", failed)
	}
	return nil
}

// benchCall sends one call's charges: routed through the first node, or
// grouped by owner in direct mode.
func benchCall(ctx context.Context, mode string, first pb.QuotaClient, owners func(string) string, conns map[string]pb.QuotaClient, reqs []*pb.ChargeRequest) error {
	groups := map[pb.QuotaClient][]*pb.ChargeRequest{first: reqs}
	if mode == "direct" {
		groups = map[pb.QuotaClient][]*pb.ChargeRequest{}
		for _, r := range reqs {
			c := conns[owners(r.Account)]
			groups[c] = append(groups[c], r)
		}
	}
	send := func(c pb.QuotaClient, rs []*pb.ChargeRequest) error {
		rep, err := c.Charge(ctx, &pb.ChargeBatch{Charges: rs, Route: mode == "routed"})
		if err != nil {
			return err
		}
		for _, r := range rep.Replies {
			switch {
			case r.Error != nil:
				return fmt.Errorf("%s: %s", r.Error.Code, r.Error.Message)
			case r.WrongOwner != nil:
				return fmt.Errorf("wrong owner: %s owns it now (the ring moved during the bench)", r.WrongOwner.OwnerId)
			case r.Decision.Reason != pb.Reason_OK:
				return fmt.Errorf("refused: %s", r.Decision.Reason)
			}
		}
		return nil
	}
	if len(groups) == 1 {
		for c, rs := range groups {
			return send(c, rs)
		}
	}
	// The owners at once, as a routed node fans a batch out: one after
	// another, a direct call cost the sum of the owners' round trips, and
	// direct looked slower than routed at 100 charges a call.
	errs := make(chan error, len(groups))
	for c, rs := range groups {
		go func() { errs <- send(c, rs) }()
	}
	var firstErr error
	for range groups {
		if err := <-errs; err != nil && firstErr == nil {
			firstErr = err
		}
	}
	return firstErr
}

// embeddedCall charges one unit through the embedded client.
func embeddedCall(ctx context.Context, c *router.Client, account string) error {
	res, err := c.Charge(ctx, router.ChargeRequest{Account: account, Route: "POST /bench", Units: 1})
	switch {
	case err != nil:
		return err
	case !res.Reason.Accepted():
		return fmt.Errorf("refused: %s", res.Reason)
	}
	return nil
}

// ownerTable reads the ring from a node: account -> owner RPC address.
func ownerTable(ctx context.Context, c pb.QuotaClient) (func(string) string, error) {
	v, err := c.RingView(ctx, &pb.RingViewRequest{})
	if err != nil {
		return nil, fmt.Errorf("ring view: %w", err)
	}
	layout := ring.DefaultLayout()
	if int(v.PartitionCount) != layout.PartitionCount {
		return nil, fmt.Errorf("the cluster uses %d partitions, this quotad %d", v.PartitionCount, layout.PartitionCount)
	}
	return func(account string) string {
		i := v.Owners[layout.Partition(account)]
		if i < 0 {
			return ""
		}
		return v.Members[i].RpcAddr
	}, nil
}

// picker returns a per-worker account chooser: worker w alone calls it
// with w, so each worker's generators are its own, made up front (a lock
// taken for every pick, 100 a call at --batch 100, was load generator
// cost on the cores the cluster uses).
func picker(spread string, n, workers int) func(w int) int {
	rngs := make([]*rand.Rand, workers)
	zipfs := make([]*rand.Zipf, workers)
	for w := range workers {
		rngs[w] = rand.New(rand.NewPCG(uint64(w), 42))
		if spread == "zipf" && n > 1 {
			zipfs[w] = rand.NewZipf(rngs[w], 1.1, 1, uint64(n-1))
		}
	}
	return func(w int) int {
		if z := zipfs[w]; z != nil {
			return int(z.Uint64())
		}
		return rngs[w].IntN(n)
	}
}

func setupBenchAccounts(ctx context.Context, progress io.Writer, dsn string, accounts []string) error {
	l, err := openLedger(ctx, dsn)
	if err != nil {
		return err
	}
	defer l.Close()
	if err := l.Migrate(ctx); err != nil {
		return err
	}
	if err := l.UpsertPlan(ctx, snapshot.Plan{ID: "bench", MonthlyQuota: 1 << 50, Hard: true}); err != nil {
		return err
	}
	for i, a := range accounts {
		if err := l.UpsertAccount(ctx, a, "bench"); err != nil {
			return err
		}
		if (i+1)%1000 == 0 {
			fmt.Fprintf(progress, "setup: %d of %d accounts\n", i+1, len(accounts))
		}
	}
	fmt.Fprintf(progress, "setup: %d accounts on plan bench; nodes see them at their next config refresh\n", len(accounts))
	return nil
}

// waitConfig waits (bounded) until every node serves the ledger's config
// version, so that the accounts --setup created are known everywhere: nodes
// read the config every few seconds.
func waitConfig(ctx context.Context, dsn string, nodes []string, dial func(string) (pb.QuotaClient, error)) error {
	l, err := openLedger(ctx, dsn)
	if err != nil {
		return err
	}
	snap, err := l.Snapshot(ctx, time.Now())
	l.Close()
	if err != nil {
		return err
	}
	deadline := time.Now().Add(60 * time.Second)
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for _, addr := range nodes {
		c, err := dial(addr)
		if err != nil {
			return err
		}
		for {
			rep, err := c.Config(ctx, &pb.ConfigRequest{})
			if err == nil && rep.Version >= snap.Version {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("node %s did not load config version %d within 60s of --setup (is --snapshot-interval very long?)", addr, snap.Version)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-t.C:
			}
		}
	}
	return nil
}

// warmAccounts charges every account once through the first node, 100 per
// call from 16 callers, so that the measured runs see owners that hold
// reservations (steady state) rather than first charges.
func warmAccounts(ctx context.Context, progress io.Writer, c pb.QuotaClient, accounts []string) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	t0 := time.Now()
	next := make(chan int)
	errc := make(chan error, 16)
	go func() {
		defer close(next)
		for i := 0; i < len(accounts); i += 100 {
			select {
			case next <- i:
			case <-ctx.Done():
				return
			}
		}
	}()
	for w := 0; w < 16; w++ {
		go func() {
			for i := range next {
				var reqs []*pb.ChargeRequest
				for _, a := range accounts[i:min(i+100, len(accounts))] {
					reqs = append(reqs, &pb.ChargeRequest{Account: a, Route: "warm", Units: 1})
				}
				if err := benchCall(ctx, "routed", c, nil, nil, reqs); err != nil {
					if strings.Contains(err.Error(), "UNKNOWN_ACCOUNT") {
						err = fmt.Errorf("%w: the cluster has no account %s: create the bench accounts once with --setup --ledger DSN, or give the --account-prefix they were made with", err, reqs[0].Account)
					}
					errc <- fmt.Errorf("warm-up: %w", err)
					for range next {
					}
					return
				}
			}
			errc <- nil
		}()
	}
	// Every worker's answer, the first error kept: returning at the first
	// left the producer and the other workers charging the cluster.
	var first error
	for w := 0; w < 16; w++ {
		if err := <-errc; err != nil && first == nil {
			first = err
			cancel() // the producer stops; the workers drain what is queued
		}
	}
	if first != nil {
		return first
	}
	fmt.Fprintf(progress, "warm-up: %d accounts charged once in %s\n", len(accounts), time.Since(t0).Round(time.Millisecond))
	return nil
}
