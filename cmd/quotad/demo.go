package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
)

type demoFlags struct {
	dir        string
	keep       bool
	duration   time.Duration
	crashChild bool
}

func newDemoCmd() *cobra.Command {
	var f demoFlags
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Show the guarantees at work on this machine, with nothing to install",
		Long: `Run quotaring's engine on a local data dir and show, step by step:
exact quotas under concurrency, a retry billed once, a refund, a month rolling
over at 00:00 UTC, and a real crash (SIGKILL) with nothing acknowledged lost.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if f.crashChild {
				return demoCrashChild(cmd.Context(), f.dir, cmd.OutOrStdout())
			}
			return runDemo(cmd.Context(), cmd.OutOrStdout(), f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.dir, "dir", "", "data directory (default: a temp dir, removed at the end unless --keep)")
	fl.BoolVar(&f.keep, "keep", false, "keep the data directory")
	fl.DurationVar(&f.duration, "duration", 3*time.Second, "how long the throughput step runs")
	fl.BoolVar(&f.crashChild, "crash-child", false, "internal: the process the demo kills")
	fl.MarkHidden("crash-child")
	return cmd
}

type demo struct {
	out  io.Writer
	step int
}

func (d *demo) title(s string) {
	d.step++
	fmt.Fprintf(d.out, "\n%d. %s\n", d.step, s)
}

func (d *demo) say(format string, args ...any) { fmt.Fprintf(d.out, "   "+format+"\n", args...) }

func demoSnapshot() *snapshot.Snapshot {
	s := &snapshot.Snapshot{Version: 1,
		Plans: []snapshot.Plan{
			{ID: "free", MonthlyQuota: 20, Hard: true, Rate: "5/s", Burst: 100},
			{ID: "pro", MonthlyQuota: 60, Hard: true},
			{ID: "crash", MonthlyQuota: 1 << 40, Hard: true},
		},
		Accounts: []snapshot.Account{{ID: "free-co", Plan: "free"}, {ID: "pro-co", Plan: "pro"}, {ID: "crash-co", Plan: "crash"}},
		Routes: snapshot.Routes{Default: 1, Weights: map[string]int64{
			"GET /v1/tasks": 1, "POST /v1/tasks": 2, "POST /v1/exports": 25,
		}},
	}
	if err := s.Build(); err != nil {
		panic(err)
	}
	return s
}

func runDemo(ctx context.Context, out io.Writer, f demoFlags) error {
	dir := f.dir
	if dir == "" {
		var err error
		if dir, err = os.MkdirTemp("", "quotad-demo-"); err != nil {
			return err
		}
		if !f.keep {
			defer os.RemoveAll(dir)
		}
	}
	d := &demo{out: out}
	fmt.Fprintf(out, "quotaring demo: one node's exact engine (data dir %s)\n", dir)
	clock := engine.NewManualClock(time.Date(2026, 6, 28, 12, 0, 0, 0, time.UTC))
	l, err := wal.Open(wal.Options{Dir: filepath.Join(dir, "node"), NodeID: "demo"})
	if err != nil {
		return err
	}
	defer l.Close()
	e, err := engine.Open(engine.Options{Log: l, Clock: clock})
	if err != nil {
		return err
	}
	defer e.Close()
	s := demoSnapshot()
	if err := e.SetSnapshot(s); err != nil {
		return err
	}
	for _, step := range []func(context.Context, *demo, *engine.Engine, *engine.ManualClock, *snapshot.Snapshot) error{
		demoExact, demoRetry, demoWeights, demoRollover,
	} {
		if err := step(ctx, d, e, clock, s); err != nil {
			return err
		}
	}
	if err := demoCrash(ctx, d, filepath.Join(dir, "crash")); err != nil {
		return err
	}
	return demoSpeed(ctx, d, f.duration)
}

func demoExact(ctx context.Context, d *demo, e *engine.Engine, _ *engine.ManualClock, _ *snapshot.Snapshot) error {
	d.title("Exact quota under concurrency")
	d.say("100 clients of free-co (hard quota: 20 units a month) send GET /v1/tasks at once.")
	var wg sync.WaitGroup
	counts := make(map[shard.Reason]int)
	var mu sync.Mutex
	var firstErr error
	for i := 0; i < 100; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := e.Charge(ctx, "free-co", shard.Charge{Route: "GET /v1/tasks", Units: 1})
			mu.Lock()
			defer mu.Unlock()
			if err != nil && firstErr == nil {
				firstErr = err
			}
			counts[res.Reason]++
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	u, _, _ := e.Usage("free-co")
	d.say("-> %d ok, %d quota_exceeded; the counter reads %d of %d. Never 21.", counts[shard.OK], counts[shard.QuotaExceeded], u.Used, u.Limit)
	if counts[shard.OK] != 20 {
		return fmt.Errorf("demo: %d charges went through a quota of 20", counts[shard.OK])
	}
	return nil
}

func demoRetry(ctx context.Context, d *demo, e *engine.Engine, _ *engine.ManualClock, _ *snapshot.Snapshot) error {
	d.title("A retry is billed once")
	d.say("pro-co sends POST /v1/tasks (2 units) five times with Idempotency-Key: order-42.")
	var answers []string
	for i := 0; i < 5; i++ {
		res, err := e.Charge(ctx, "pro-co", shard.Charge{EventID: "order-42", ClientID: true, Route: "POST /v1/tasks", Units: 2})
		if err != nil {
			return err
		}
		answers = append(answers, res.Reason.String())
	}
	u, _, _ := e.Usage("pro-co")
	d.say("-> %s; billed %d units once.", strings.Join(answers, ", "), u.Used)
	d.title("A refund, once")
	r1, err := e.Refund(ctx, "pro-co", "order-42", nil)
	if err != nil {
		return err
	}
	r2, err := e.Refund(ctx, "pro-co", "order-42", nil)
	if err != nil {
		return err
	}
	u, _, _ = e.Usage("pro-co")
	d.say("The upstream failed, so order-42 is refunded twice: %s, then %s; used is back to %d.", r1.Reason, r2.Reason, u.Used)
	return nil
}

func demoWeights(ctx context.Context, d *demo, e *engine.Engine, clock *engine.ManualClock, s *snapshot.Snapshot) error {
	d.title("Route weights against a monthly quota (pro-co: 60 units, it is 28 June 12:00 UTC)")
	for _, r := range []string{"GET /v1/tasks", "POST /v1/tasks", "POST /v1/exports", "POST /v1/exports", "POST /v1/exports", "GET /v1/tasks"} {
		method, path, _ := strings.Cut(r, " ")
		route, units := s.Routes.Match(method, path)
		res, err := e.Charge(ctx, "pro-co", shard.Charge{Route: route, Units: units})
		if err != nil {
			return err
		}
		extra := ""
		if res.Reason == shard.QuotaExceeded {
			extra = fmt.Sprintf("  Retry-After: %d s (00:00 UTC on 1 July)", res.RetryAfter/1e9)
		}
		d.say("%-18s %2d units -> %-15s %2d left%s", r, units, res.Reason, res.Remaining, extra)
	}
	return nil
}

func demoRollover(ctx context.Context, d *demo, e *engine.Engine, clock *engine.ManualClock, _ *snapshot.Snapshot) error {
	d.title("The month rolls over at 00:00:00 UTC on the 1st")
	for _, t := range []time.Time{time.Date(2026, 6, 30, 23, 59, 59, 0, time.UTC), time.Date(2026, 7, 1, 0, 0, 0, 0, time.UTC)} {
		clock.SetWall(t)
		res, err := e.Charge(ctx, "pro-co", shard.Charge{Route: "GET /v1/tasks", Units: 1})
		if err != nil {
			return err
		}
		d.say("%s  GET /v1/tasks -> %s, %d of %d left", t.Format(time.RFC3339), res.Reason, res.Remaining, res.Limit)
	}
	clock.SetWall(time.Date(2026, 6, 15, 0, 0, 0, 0, time.UTC))
	u, _, _ := e.Usage("pro-co")
	d.say("The wall clock jumps back to 15 June: the account stays in %s (periods never go back).", u.Period)
	return nil
}

func demoCrash(ctx context.Context, d *demo, dir string) error {
	d.title("A real crash: kill -9 while charging")
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, self, "demo", "--crash-child", "--dir", dir)
	cmd.Stderr = os.Stderr
	pipe, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	acked := map[string]bool{}
	sc := bufio.NewScanner(pipe)
	killed := false
	for sc.Scan() {
		if id, ok := strings.CutPrefix(sc.Text(), "ack "); ok {
			acked[id] = true
		}
		if !killed && len(acked) >= 5000 {
			cmd.Process.Signal(syscall.SIGKILL)
			killed = true
		}
	}
	werr := cmd.Wait()
	if !killed {
		return fmt.Errorf("demo: the charging process ended by itself: %v", werr)
	}
	d.say("A child process charged crash-co from 64 goroutines; it was killed with SIGKILL")
	d.say("after %d acknowledged charges. Reopening its data dir...", len(acked))
	l, err := wal.Open(wal.Options{Dir: dir, NodeID: "demo-crash"})
	if err != nil {
		return err
	}
	defer l.Close()
	e, err := engine.Open(engine.Options{Log: l})
	if err != nil {
		return err
	}
	defer e.Close()
	var rec shard.Record
	inLog := map[string]bool{}
	err = l.Scan(0, l.DurableSeq(), func(_ uint64, p []byte) error {
		if err := rec.Decode(p); err != nil {
			return err
		}
		inLog[rec.EventID] = true
		return nil
	})
	if err != nil {
		return err
	}
	lost := 0
	for id := range acked {
		if !inLog[id] {
			lost++
		}
	}
	u, _, _ := e.Usage("crash-co")
	d.say("-> recovered %d charges (counter %d): %d acknowledged lost; %d durable but unanswered", len(inLog), u.Used, lost, len(inLog)-len(acked))
	d.say("   (those were in flight when the process died; a client retry with the same id is replayed, not billed twice).")
	if lost > 0 {
		return fmt.Errorf("demo: %d acknowledged charges were lost", lost)
	}
	return nil
}

// demoCrashChild charges as fast as it can, printing each acknowledged event.
func demoCrashChild(ctx context.Context, dir string, out io.Writer) error {
	if dir == "" {
		return errors.New("--crash-child needs --dir")
	}
	l, err := wal.Open(wal.Options{Dir: dir, NodeID: "demo-crash"})
	if err != nil {
		return err
	}
	e, err := engine.Open(engine.Options{Log: l})
	if err != nil {
		return err
	}
	if err := e.SetSnapshot(demoSnapshot()); err != nil {
		return err
	}
	w := bufio.NewWriter(out)
	var mu sync.Mutex // protects w
	var wg sync.WaitGroup
	for g := 0; g < 64; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ctx.Err() == nil && i < 1_000_000; i++ {
				id := fmt.Sprintf("g%d-%d", g, i)
				if res, err := e.Charge(ctx, "crash-co", shard.Charge{EventID: id, ClientID: true, Units: 1}); err != nil || res.Reason != shard.OK {
					return
				}
				mu.Lock()
				fmt.Fprintln(w, "ack", id)
				w.Flush()
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return nil
}

func demoSpeed(ctx context.Context, d *demo, dur time.Duration) error {
	d.title(fmt.Sprintf("Speed: %s of charges from 64 callers, log on Sync, against one SQL transaction per charge", dur))
	f := benchEngineFlags{duration: dur, accounts: 1000}
	dir, err := os.MkdirTemp("", "quotad-demo-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	eng, fs, err := benchOne(ctx, "engine", 64, f, filepath.Join(dir, "engine"), nil, false)
	if err != nil {
		return err
	}
	cl, _, err := benchOne(ctx, "sqlite-file", 64, f, filepath.Join(dir, "sqlite"), nil, false)
	if err != nil {
		return err
	}
	d.say("engine:                   %9.0f charges/s, p99 %s, %.1f fsyncs per 1,000 charges", eng.OpsPerSec, fmtDur(eng.P99), fs)
	d.say("classic (SQLite, a file): %9.0f charges/s, p99 %s", cl.OpsPerSec, fmtDur(cl.P99))
	d.say("-> %.0fx the throughput, every charge still durable before it is answered.", eng.OpsPerSec/cl.OpsPerSec)
	fmt.Fprintln(d.out, "\nNext: quotad bench engine (full sweep).")
	return nil
}
