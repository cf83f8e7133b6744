package loadgen

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

func TestHistogramQuantiles(t *testing.T) {
	var h Histogram
	for i := 1; i <= 1000; i++ {
		h.Record(time.Duration(i) * time.Microsecond)
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 500 * time.Microsecond}, {0.99, 990 * time.Microsecond}, {0.999, 999 * time.Microsecond}} {
		got := h.Quantile(c.q)
		if diff := float64(got-c.want) / float64(c.want); diff < -0.05 || diff > 0.05 {
			t.Errorf("q%.3f = %v, want %v within 5%%", c.q, got, c.want)
		}
	}
}

// Each worker's first call fails. (Not its fourth: on a loaded machine a
// worker that started late had not made four calls when the run ended, and
// the test read 3 errors, not 4. A worker's first call starts with the run,
// but one that ends after the run did is not counted: 1 to 4.)
func TestRunCountsOpsAndErrors(t *testing.T) {
	boom := errors.New("boom")
	rep, err := Run(context.Background(), Config{Concurrency: 4, Duration: 200 * time.Millisecond}, func(ctx context.Context, w int, i int64) (int, error) {
		if i == 0 {
			return 10, boom
		}
		return 10, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Calls == 0 || rep.Ops != rep.Calls*10 || rep.Errors < 1 || rep.Errors > 4 || !errors.Is(rep.FirstErr, boom) {
		t.Fatalf("%+v", rep)
	}
}

// A call that fails carried nothing: a cluster that refuses every call must
// not report charges/s or a latency.
func TestFailedCallsAreNotThroughput(t *testing.T) {
	boom := errors.New("boom")
	rep, err := Run(context.Background(), Config{Concurrency: 2, Duration: 20 * time.Millisecond}, func(ctx context.Context, w int, i int64) (int, error) {
		return 100, boom
	})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Errors == 0 || rep.Calls != 0 || rep.Ops != 0 || rep.OpsPerSec != 0 || rep.P50 != 0 || !errors.Is(rep.FirstErr, boom) {
		t.Fatalf("%+v", rep)
	}
}

// pastDeadline is a context whose deadline has passed but whose timer has
// not fired yet: Err is still nil, as it is for a moment on a busy machine.
type pastDeadline struct{ context.Context }

func (pastDeadline) Deadline() (time.Time, bool) { return time.Now().Add(-time.Millisecond), true }

// A run whose caller's deadline passed is stopped, even before the
// context's timer says so: bench cluster printed such a row as a full
// measurement (and ran its next row, of nothing) in about one run in eight.
func TestRunPastItsCallersDeadlineIsStopped(t *testing.T) {
	ctx := pastDeadline{context.Background()}
	if !Ended(ctx) {
		t.Fatal("Ended: a context past its deadline has ended")
	}
	_, err := Run(ctx, Config{Concurrency: 2, Duration: time.Second}, func(ctx context.Context, w int, i int64) (int, error) {
		return 1, ctx.Err()
	})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run = %v, want context.DeadlineExceeded", err)
	}
}

// The measured run's call indices never repeat the warm-up's (a store that
// takes a repeated event id for a retry answers it without a write, which
// flattered its figures), AfterWarmup runs between the two, and a run
// that recorded no call at all is an error, not a row of zeros.
func TestWarmupIndicesHookAndEmptyRuns(t *testing.T) {
	var mu sync.Mutex
	seen := map[int64]string{}
	phase := "warm-up"
	hooks := 0
	_, err := Run(context.Background(), Config{Concurrency: 1, Duration: 50 * time.Millisecond, Warmup: 50 * time.Millisecond,
		AfterWarmup: func() { mu.Lock(); phase = "run"; hooks++; mu.Unlock() }},
		func(ctx context.Context, w int, i int64) (int, error) {
			mu.Lock()
			defer mu.Unlock()
			if p, dup := seen[i]; dup && p != phase {
				t.Errorf("index %d in the %s and the %s", i, p, phase)
			}
			seen[i] = phase
			return 1, nil
		})
	if err != nil || hooks != 1 {
		t.Fatalf("Run: %v, AfterWarmup ran %d times, want once", err, hooks)
	}
	if _, err := Run(context.Background(), Config{Duration: time.Nanosecond}, func(ctx context.Context, w int, i int64) (int, error) {
		<-ctx.Done() // every call ends with the run: none recorded
		return 1, ctx.Err()
	}); !errors.Is(err, ErrNothingMeasured) {
		t.Errorf("a run that recorded no call: %v, want ErrNothingMeasured", err)
	}
}
