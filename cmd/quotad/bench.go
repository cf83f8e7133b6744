package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/internal/classic"
	"github.com/quotaring/quotaring/internal/loadgen"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
)

func newBenchCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure throughput and latency",
		Long:  "Measure throughput and latency. Results print as a table; BENCHMARKS.md records runs with their commands.",
	}
	cmd.AddCommand(newBenchEngineCmd(), newBenchClusterCmd(), newBenchProxyCmd(), newBenchUpstreamCmd())
	return cmd
}

type benchEngineFlags struct {
	duration    time.Duration
	concurrency string
	accounts    int
	targets     string
	dir         string
}

func newBenchEngineCmd() *cobra.Command {
	var f benchEngineFlags
	cmd := &cobra.Command{
		Use:   "engine",
		Short: "Charge the single-node engine in-process, and the classic one-transaction-per-charge design beside it",
		Long: `Charge the engine in-process from many goroutines and print charges/s,
p50/p99/p999 latency and, with the log on Sync, fsyncs per 1,000 charges.

Targets:
  engine         the engine with its log on pebble.Sync (the only mode that keeps
                 every acknowledged charge through kill -9; the default)
  engine-nosync  the log on pebble.NoSync: for comparison only, it LOSES
                 acknowledged charges on a crash
  sqlite-memory  the classic design: one SQL transaction per charge
                 (INSERT OR IGNORE the event, UPDATE ... WHERE used + n <= quota)
                 on SQLite in memory
  sqlite-file    the same on a file (WAL journal, synchronous=FULL)

Every charge is one unit on one of --accounts accounts with hard quotas
large enough never to refuse, with a generated event id.`,
		Example: "  quotad bench engine --duration 5s --concurrency 1,64,512",
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBenchEngine(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), f)
		},
	}
	fl := cmd.Flags()
	fl.DurationVar(&f.duration, "duration", 5*time.Second, "how long each target runs at each concurrency")
	fl.StringVar(&f.concurrency, "concurrency", "1,64,512", "comma-separated numbers of concurrent callers")
	fl.IntVar(&f.accounts, "accounts", 1000, "accounts the charges spread over")
	fl.StringVar(&f.targets, "targets", "engine,engine-nosync,sqlite-memory,sqlite-file", "comma-separated targets (see above)")
	fl.StringVar(&f.dir, "dir", "", "where to put the logs and databases (default: a temp dir, removed after)")
	return cmd
}

func parseInts(s, what string) ([]int, error) {
	var out []int
	for _, p := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil || n <= 0 || n > maxBenchConcurrency {
			return nil, fmt.Errorf("--%s %q: want comma-separated numbers from 1 to %d, such as 1,64,512", what, s, maxBenchConcurrency)
		}
		out = append(out, n)
	}
	return out, nil
}

// The bounds of the bench commands' sizes: past them a typo (an extra
// zero or three) would start millions of goroutines, build a 4 MB call
// gRPC refuses, or spend the run making account ids.
const (
	maxBenchConcurrency = 100_000
	maxBenchBatch       = 10_000
	maxBenchAccounts    = 10_000_000
)

var benchTargets = map[string]bool{"engine": true, "engine-nosync": true, "sqlite-memory": true, "sqlite-file": true}

func runBenchEngine(ctx context.Context, out, progress io.Writer, f benchEngineFlags) error {
	concs, err := parseInts(f.concurrency, "concurrency")
	if err != nil {
		return err
	}
	if f.accounts <= 0 || f.accounts > maxBenchAccounts {
		return fmt.Errorf("--accounts %d: want 1 to %d", f.accounts, maxBenchAccounts)
	}
	if f.duration <= 0 {
		return fmt.Errorf("--duration %s: want a positive duration, such as 5s", f.duration)
	}
	targets := strings.Split(f.targets, ",")
	for _, t := range targets {
		if !benchTargets[t] {
			return fmt.Errorf("--targets: unknown target %q (want engine, engine-nosync, sqlite-memory, sqlite-file)", t)
		}
	}
	dir := f.dir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "quotad-bench-"); err != nil {
			return err
		}
		defer os.RemoveAll(dir)
	}
	interactive := isTerminal(progress)
	fmt.Fprintf(out, "quotad bench engine: %d accounts, %s per run, GOMAXPROCS=%d\n\n", f.accounts, f.duration, runtimeProcs())
	fmt.Fprintf(out, "%-14s %6s %12s %10s %10s %10s %14s\n", "target", "conc", "charges/s", "p50", "p99", "p999", "fsyncs/1k")
	results := map[string]loadgen.Report{}
	var failed int64
	for _, target := range targets {
		for _, c := range concs {
			rep, fsyncs, err := benchOne(ctx, target, c, f, filepath.Join(dir, fmt.Sprintf("%s-%d", target, c)), progress, interactive)
			stopped := ""
			switch {
			case err != nil && loadgen.Ended(ctx) && rep.Calls+rep.Errors > 0:
				stopped = fmt.Sprintf("   (stopped after %s)", rep.Elapsed.Round(100*time.Millisecond))
			case err != nil && loadgen.Ended(ctx):
				return benchInterrupted("engine")
			case err != nil:
				return fmt.Errorf("%s at concurrency %d: %w", target, c, err)
			}
			results[fmt.Sprint(target, c)] = rep
			fs := "-"
			if fsyncs >= 0 {
				fs = fmt.Sprintf("%.1f", fsyncs)
			}
			fmt.Fprintf(out, "%-14s %6d %12.0f %10s %10s %10s %14s%s\n", target, c, rep.OpsPerSec, fmtDur(rep.P50), fmtDur(rep.P99), fmtDur(rep.P999), fs, stopped)
			if stopped != "" {
				return benchInterrupted("engine") // the row so far is printed, the rest not run
			}
			if rep.Errors > 0 {
				failed += rep.Errors
				fmt.Fprintf(out, "  %d errors, first: %v\n", rep.Errors, rep.FirstErr)
			}
		}
	}
	printRatios(out, results, concs)
	if failed > 0 {
		return fmt.Errorf("%d charges failed (see above): the figures count only the charges that succeeded", failed)
	}
	return nil
}

func printRatios(out io.Writer, r map[string]loadgen.Report, concs []int) {
	lo, hi := slices.Min(concs), slices.Max(concs) // NB: --concurrency 64,1 compared 1 against 64
	fmt.Fprintln(out)
	if a, b := r[fmt.Sprint("engine", hi)], r[fmt.Sprint("engine", lo)]; a.Ops > 0 && b.Ops > 0 && hi != lo {
		fmt.Fprintf(out, "engine (Sync) at %d callers vs %d: %.0fx the charges/s (group commit)\n", hi, lo, a.OpsPerSec/b.OpsPerSec)
	}
	for _, c := range concs {
		e := r[fmt.Sprint("engine", c)]
		for _, base := range []string{"sqlite-file", "sqlite-memory"} {
			if b := r[fmt.Sprint(base, c)]; e.Ops > 0 && b.Ops > 0 {
				fmt.Fprintf(out, "engine (Sync) vs %s at %d callers: %.1fx the charges/s\n", base, c, e.OpsPerSec/b.OpsPerSec)
			}
		}
	}
}

func fmtDur(d time.Duration) string {
	switch {
	case d >= time.Millisecond:
		return fmt.Sprintf("%.2fms", float64(d)/1e6)
	default:
		return fmt.Sprintf("%.1fµs", float64(d)/1e3)
	}
}

// benchOne runs one target at one concurrency. fsyncs is per 1,000 charges,
// or -1 where it does not apply.
// benchInterrupted is the error of a bench that Ctrl-C (or SIGTERM)
// stopped, once it printed what it had measured: exit 130, as a shell's.
func benchInterrupted(which string) error {
	return &exitError{code: 130, err: fmt.Errorf("bench %s: interrupted", which)}
}

func benchOne(ctx context.Context, target string, conc int, f benchEngineFlags, dir string, progress io.Writer, interactive bool) (loadgen.Report, float64, error) {
	cfg := loadgen.Config{Concurrency: conc, Duration: f.duration, Warmup: f.duration / 10, Progress: progress,
		Interactive: interactive, Label: fmt.Sprintf("%s x%d", target, conc)}
	accounts := make([]string, f.accounts)
	for i := range accounts {
		accounts[i] = fmt.Sprintf("acct-%d", i+1)
	}
	switch target {
	case "sqlite-memory", "sqlite-file":
		path := ":memory:"
		if target == "sqlite-file" {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return loadgen.Report{}, 0, err
			}
			path = filepath.Join(dir, "classic.db")
		}
		s, err := classic.Open(path)
		if err != nil {
			return loadgen.Report{}, 0, err
		}
		defer s.Close()
		for _, a := range accounts {
			if err := s.SetQuota(ctx, a, 1<<60); err != nil {
				return loadgen.Report{}, 0, err
			}
		}
		// Event ids unique to this run: a file left by an earlier run in
		// --dir holds ids of the same form, and the store answers an id it
		// has for a retry, without the write (the SQLite figures doubled
		// on a second run in one --dir).
		run := strconv.FormatInt(time.Now().UnixNano(), 36)
		rep, err := loadgen.Run(ctx, cfg, func(ctx context.Context, w int, i int64) (int, error) {
			charged, err := s.Charge(ctx, accounts[(int(i)*conc+w)%len(accounts)], fmt.Sprintf("%s-w%d-%d", run, w, i), 1)
			if err == nil && !charged {
				err = errors.New("the event id was charged already: answered without a write (a bug of the bench)")
			}
			return 1, err
		})
		return rep, -1, err
	}
	l, err := wal.Open(wal.Options{Dir: dir, NodeID: "bench", NoSync: target == "engine-nosync"})
	if err != nil {
		return loadgen.Report{}, 0, err
	}
	defer l.Close()
	e, err := engine.Open(engine.Options{Log: l})
	if err != nil {
		return loadgen.Report{}, 0, err
	}
	defer e.Close()
	if err := e.SetSnapshot(benchSnapshot(accounts), engine.AllSettled); err != nil {
		return loadgen.Report{}, 0, err
	}
	stopSettle := settleEvery(ctx, e, time.Second)
	before := l.Stats()
	// After the warm-up: its fsyncs were counted against the run's charges
	// alone (1,098 per 1,000 at one caller, where each charge is one).
	cfg.AfterWarmup = func() { before = l.Stats() }
	rep, err := loadgen.Run(ctx, cfg, func(ctx context.Context, w int, i int64) (int, error) {
		res, err := e.Charge(ctx, accounts[(int(i)*conc+w)%len(accounts)], shard.Charge{Route: "GET /v1/tasks", Units: 1})
		if err == nil && res.Reason != shard.OK {
			err = fmt.Errorf("refused: %s", res.Reason)
		}
		return 1, err
	})
	stopSettle()
	after := l.Stats()
	fsyncs := -1.0
	if target == "engine" && rep.Ops > 0 {
		fsyncs = float64(after.Fsyncs-before.Fsyncs) / float64(rep.Ops) * 1000
	}
	return rep, fsyncs, err
}

func benchSnapshot(accounts []string) *snapshot.Snapshot {
	s := &snapshot.Snapshot{Version: 1, Plans: []snapshot.Plan{{ID: "bench", MonthlyQuota: 1 << 60, Hard: true}}, Routes: snapshot.Routes{Default: 1}}
	for _, a := range accounts {
		s.Accounts = append(s.Accounts, snapshot.Account{ID: a, Plan: "bench"})
	}
	if err := s.Build(); err != nil {
		panic(err) // a bug: the bench config is fixed
	}
	return s
}

// settleEvery stands in for the ledger during a bench: it truncates the log
// up to what is durable every interval, as a node's settler would.
func settleEvery(ctx context.Context, e *engine.Engine, every time.Duration) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				e.Settle(ctx, e.Log().DurableSeq())
			}
		}
	}()
	return func() { cancel(); <-done }
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}
