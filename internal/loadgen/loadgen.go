// Package loadgen drives a function from many goroutines for a while and
// reports throughput and latency percentiles, printing a progress line as it
// goes. quotad bench uses it for every target (the engine in-process, the
// classic SQL design, a running cluster), so their figures compare.
//
//	rep, err := loadgen.Run(ctx, loadgen.Config{Concurrency: 64, Duration: 10 * time.Second, Progress: os.Stderr},
//		func(ctx context.Context, worker int, i int64) (ops int, err error) { ...; return 1, nil })
//	fmt.Println(rep)
//
// Run is a closed loop (each goroutine waits for its answer before the next
// call), right for throughput. Latency at a given rate wants an open loop,
// OpenLoop: requests leave on schedule however slow the answers are (quotad
// bench proxy, router's BenchmarkProxyLatency).
package loadgen

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"
)

// Config says how hard and how long to drive.
type Config struct {
	Concurrency int           // goroutines (default 1)
	Duration    time.Duration // how long (default 5 s)
	Warmup      time.Duration // run this long first without measuring
	// Progress, when set, gets a line every ProgressEvery (default 1 s),
	// rewritten in place with \r when Interactive.
	Progress      io.Writer
	ProgressEvery time.Duration
	Interactive   bool
	Label         string
	// AfterWarmup, when set, runs between the warm-up and the measured
	// run: a bench reads its own counters there (a log's fsyncs), so that
	// the warm-up's are not divided by the run's operations.
	AfterWarmup func()
}

// ErrNothingMeasured is Run's error for a run that recorded no call at all,
// neither a success nor a failure: too short to measure anything. Its rows
// of zeros were printed as a result.
var ErrNothingMeasured = errors.New("loadgen: the run recorded no call (too short a duration to measure anything)")

// Func does one call. It returns how many operations the call carried (a
// batched call may carry many; 0 is counted as 1).
type Func func(ctx context.Context, worker int, i int64) (ops int, err error)

// Report is the outcome of a run. Calls, Ops, their rates and the latency
// percentiles count the calls that succeeded; Errors counts those that failed.
type Report struct {
	Label          string
	Calls, Ops     int64
	Errors         int64
	FirstErr       error
	Elapsed        time.Duration
	CallsPerSec    float64
	OpsPerSec      float64
	P50, P99, P999 time.Duration
	Max            time.Duration
}

func (r Report) String() string {
	return fmt.Sprintf("%-18s %10.0f ops/s %10.0f calls/s  p50 %-9s p99 %-9s p999 %-9s errors %d",
		r.Label, r.OpsPerSec, r.CallsPerSec, round(r.P50), round(r.P99), round(r.P999), r.Errors)
}

func round(d time.Duration) time.Duration {
	switch {
	case d > 10*time.Millisecond:
		return d.Round(100 * time.Microsecond)
	case d > 100*time.Microsecond:
		return d.Round(time.Microsecond)
	}
	return d.Round(100 * time.Nanosecond)
}

// Run drives fn until cfg.Duration passes or ctx ends.
func Run(ctx context.Context, cfg Config, fn Func) (Report, error) {
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = 1
	}
	if cfg.Duration <= 0 {
		cfg.Duration = 5 * time.Second
	}
	if cfg.ProgressEvery <= 0 {
		cfg.ProgressEvery = time.Second
	}
	// A worker's call index i counts its warm-up's calls too: the run's
	// went back to 0, and a Func building ids from (worker, i) repeated
	// the warm-up's (a store that takes a repeated id for a retry answers
	// it without the write, which flattered its figures).
	next := make([]int64, cfg.Concurrency)
	if cfg.Warmup > 0 {
		wctx, cancel := context.WithTimeout(ctx, cfg.Warmup)
		drive(wctx, cfg.Concurrency, fn, &Histogram{}, newCounters(cfg.Concurrency), next)
		cancel()
	}
	if cfg.AfterWarmup != nil {
		cfg.AfterWarmup()
	}
	runCtx, cancel := context.WithTimeout(ctx, cfg.Duration)
	defer cancel()
	var hist Histogram
	c := newCounters(cfg.Concurrency)
	start := time.Now()
	done := make(chan struct{})
	var pwg sync.WaitGroup
	if cfg.Progress != nil {
		pwg.Add(1)
		go func() {
			defer pwg.Done()
			progress(cfg, c, start, done)
		}()
	}
	drive(runCtx, cfg.Concurrency, fn, &hist, c, next)
	close(done)
	pwg.Wait()
	elapsed := time.Since(start)
	rep := Report{Label: cfg.Label, Calls: c.calls(), Ops: c.ops(), Errors: c.errors(), Elapsed: elapsed,
		P50: hist.Quantile(0.50), P99: hist.Quantile(0.99), P999: hist.Quantile(0.999), Max: hist.Max()}
	if e := c.firstErr.Load(); e != nil {
		rep.FirstErr = *e
	}
	rep.CallsPerSec = float64(rep.Calls) / elapsed.Seconds()
	rep.OpsPerSec = float64(rep.Ops) / elapsed.Seconds()
	if Ended(ctx) {
		return rep, endedErr(ctx)
	}
	if rep.Calls == 0 && rep.Errors == 0 {
		return rep, ErrNothingMeasured
	}
	return rep, nil
}

// counters are the run's totals, kept per worker (padded to its own cache
// line) so that hundreds of workers do not contend on one counter; the
// totals are sums.
type counters struct {
	workers  []workerCounts
	firstErr atomic.Pointer[error]
}

type workerCounts struct {
	calls, ops, errors atomic.Int64
	_                  [40]byte // pad to a 64-byte cache line
}

func newCounters(n int) *counters { return &counters{workers: make([]workerCounts, n)} }

func (c *counters) sum(f func(*workerCounts) *atomic.Int64) int64 {
	var n int64
	for i := range c.workers {
		n += f(&c.workers[i]).Load()
	}
	return n
}

func (c *counters) calls() int64 {
	return c.sum(func(w *workerCounts) *atomic.Int64 { return &w.calls })
}
func (c *counters) ops() int64 { return c.sum(func(w *workerCounts) *atomic.Int64 { return &w.ops }) }
func (c *counters) errors() int64 {
	return c.sum(func(w *workerCounts) *atomic.Int64 { return &w.errors })
}

// drive runs n workers until ctx ends; worker w's first call has index
// next[w], and next[w] is its next index when drive returns.
func drive(ctx context.Context, n int, fn Func, hist *Histogram, c *counters, next []int64) {
	var wg sync.WaitGroup
	for w := 0; w < n; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var local Histogram
			defer hist.Merge(&local)
			i := next[w]
			defer func() { next[w] = i }()
			for ; !Ended(ctx); i++ {
				t0 := time.Now()
				ops, err := fn(ctx, w, i)
				if err != nil && Ended(ctx) {
					i++    // its index is spent: the call may have done its work
					return // cut short by the end of the run: not an error
				}
				wc := &c.workers[w]
				if err != nil {
					// A failed call is no throughput and no latency: a
					// refused charge answers fast, and counting it would
					// flatter both figures.
					wc.errors.Add(1)
					c.firstErr.CompareAndSwap(nil, &err)
					continue
				}
				local.Record(time.Since(t0))
				wc.calls.Add(1)
				wc.ops.Add(int64(max(ops, 1)))
			}
		}()
	}
	wg.Wait()
}

// Ended reports whether ctx is done or past its deadline: a call may see
// its deadline pass (gRPC checks it itself) before ctx's timer fires, and
// a caller that asks ctx.Err() in that moment would take a run cut short
// for a whole one.
func Ended(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	d, ok := ctx.Deadline()
	return ok && !time.Now().Before(d)
}

// endedErr is ctx's error once Ended: DeadlineExceeded while the timer
// has not fired yet.
func endedErr(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return context.DeadlineExceeded
}

func progress(cfg Config, c *counters, start time.Time, done <-chan struct{}) {
	t := time.NewTicker(cfg.ProgressEvery)
	defer t.Stop()
	var lastOps int64
	last := start
	for {
		select {
		case <-done:
			if cfg.Interactive {
				fmt.Fprint(cfg.Progress, "\r\033[K")
			}
			return
		case now := <-t.C:
			ops := c.ops()
			rate := float64(ops-lastOps) / now.Sub(last).Seconds()
			lastOps, last = ops, now
			line := fmt.Sprintf("%s %5.1fs/%s  %10.0f ops/s  %d ops  %d errors", cfg.Label,
				now.Sub(start).Seconds(), cfg.Duration, rate, ops, c.errors())
			if cfg.Interactive {
				fmt.Fprint(cfg.Progress, "\r\033[K"+line)
			} else {
				fmt.Fprintln(cfg.Progress, line)
			}
		}
	}
}

// Histogram records durations in log-linear buckets (16 per power of two, so
// about 4 % resolution) from 1 ns to hours. Merge is safe for concurrent use;
// Record is not (each worker keeps its own).
type Histogram struct {
	mu     sync.Mutex // protects counts, n and max during Merge and reads
	counts [64 * 16]int64
	n      int64
	max    time.Duration
}

func bucketOf(d time.Duration) int {
	v := uint64(max(d, 1))
	exp := bits.Len64(v) - 1 // v in [2^exp, 2^(exp+1))
	if exp < 4 {
		return int(v)
	}
	frac := (v >> (exp - 4)) & 15
	return exp*16 + int(frac)
}

func bucketValue(b int) time.Duration {
	exp, frac := b/16, b%16
	if exp < 4 {
		return time.Duration(b)
	}
	lo := (uint64(16) + uint64(frac)) << (exp - 4)
	return time.Duration(lo + (uint64(1)<<(exp-4))/2)
}

// Record adds one duration.
func (h *Histogram) Record(d time.Duration) {
	h.counts[bucketOf(d)]++
	h.n++
	h.max = max(h.max, d)
}

// Merge adds o into h.
func (h *Histogram) Merge(o *Histogram) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	h.max = max(h.max, o.max)
}

// Count is the number of durations recorded.
func (h *Histogram) Count() int64 { h.mu.Lock(); defer h.mu.Unlock(); return h.n }

// Max is the largest duration recorded.
func (h *Histogram) Max() time.Duration { h.mu.Lock(); defer h.mu.Unlock(); return h.max }

// Quantile is the q-quantile (0..1) to the histogram's resolution.
func (h *Histogram) Quantile(q float64) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.n == 0 {
		return 0
	}
	rank := int64(math.Ceil(q * float64(h.n)))
	var seen int64
	for i, c := range h.counts {
		seen += c
		if seen >= rank && c > 0 {
			return min(bucketValue(i), h.max)
		}
	}
	return h.max
}
