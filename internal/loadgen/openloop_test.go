package loadgen

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

// Every call runs, each once, and a call that blocks does not hold back the
// ones after it (open loop): all n start while the first is still blocked.
func TestOpenLoopDoesNotWaitForAnswers(t *testing.T) {
	const n = 50
	var started atomic.Int64
	release := make(chan struct{})
	seen := make([]atomic.Int64, n)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if _, err := OpenLoop(context.Background(), 10_000, n, func(i int) {
			seen[i].Add(1)
			if started.Add(1) == 1 {
				<-release
			}
		}); err != nil {
			t.Errorf("OpenLoop: %v", err)
		}
	}()
	deadline := time.Now().Add(10 * time.Second)
	for started.Load() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d calls started while the first was blocked", started.Load(), n)
		}
		time.Sleep(time.Millisecond)
	}
	close(release)
	<-done
	for i := range seen {
		if c := seen[i].Load(); c != 1 {
			t.Fatalf("call %d ran %d times", i, c)
		}
	}
}

// A cancelled context stops the sending and OpenLoop says so.
func TestOpenLoopStopsWithItsContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var calls atomic.Int64
	_, err := OpenLoop(ctx, 100, 1000, func(int) {
		if calls.Add(1) == 3 {
			cancel()
		}
	})
	if err != context.Canceled || calls.Load() >= 1000 {
		t.Fatalf("after cancel: err %v with %d calls, want context.Canceled well before 1000", err, calls.Load())
	}
}
