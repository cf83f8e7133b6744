package router

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeSend records the batches a batcher sends; a send blocks until the
// test releases it when hold is set.
type fakeSend struct {
	mu      sync.Mutex
	batches [][]int
	ctxs    []context.Context
	hold    chan struct{} // nil or closed: answer at once
	entered chan struct{} // gets a value as each send starts
}

func (f *fakeSend) send(ctx context.Context, reqs []int) ([]int, error) {
	f.mu.Lock()
	f.batches = append(f.batches, slices.Clone(reqs))
	f.ctxs = append(f.ctxs, ctx)
	hold := f.hold
	f.mu.Unlock()
	if f.entered != nil {
		f.entered <- struct{}{}
	}
	if hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	out := make([]int, len(reqs))
	for i, r := range reqs {
		out[i] = r * 10
	}
	return out, nil
}

type ctxKey struct{}

// A lone caller sends its requests itself, under its own context (no
// hand-off to another goroutine), and gets its replies in order.
func TestBatcherLoneCallerSendsInline(t *testing.T) {
	f := &fakeSend{}
	b := newBatcher(context.Background(), &goroutines{}, 4, 512, f.send)
	ctx := context.WithValue(context.Background(), ctxKey{}, "mine")
	reps, errs := b.doMany(ctx, []int{1, 2, 3})
	if !slices.Equal(reps, []int{10, 20, 30}) || slices.ContainsFunc(errs, func(e error) bool { return e != nil }) {
		t.Fatalf("replies %v, errors %v", reps, errs)
	}
	if len(f.ctxs) != 1 || f.ctxs[0].Value(ctxKey{}) != "mine" {
		t.Fatalf("the lone caller's batch was not sent under its context")
	}
	if b.inflight != 0 {
		t.Fatalf("in flight after the call: %d, want 0 (slot given back)", b.inflight)
	}
}

// A lone caller whose ctx ends while its request is on its way (a charge
// with a short deadline, at a quiet time) gets its ctx's error, and the
// reply, when the owner applied it after all, goes to orphan to be taken
// back. Sent inline under the caller's ctx, the call was cut with nothing
// to take back, and the charge stayed billed.
func TestBatcherLoneCallerThatLeavesIsOrphaned(t *testing.T) {
	f := &fakeSend{hold: make(chan struct{}), entered: make(chan struct{}, 1)}
	b := newBatcher(context.Background(), &goroutines{}, 4, 512, f.send)
	orphans := make(chan [2]int, 1)
	b.orphan = func(req, rep int) { orphans <- [2]int{req, rep} }
	ctx, cancel := context.WithCancel(context.Background())
	left := make(chan error, 1)
	go func() {
		_, err := b.do(ctx, 3)
		left <- err
	}()
	<-f.entered // on its way (applied, say, at the owner)
	cancel()
	if err := <-left; !errors.Is(err, context.Canceled) {
		t.Fatalf("the caller that left: %v, want context.Canceled", err)
	}
	close(f.hold) // the owner's answer arrives
	select {
	case o := <-orphans:
		if o != [2]int{3, 30} {
			t.Fatalf("orphan %v, want [3 30]", o)
		}
	case <-time.After(10 * time.Second): // NB: a deadline, not a wait
		t.Fatal("the reply of the request whose caller left never reached orphan: nothing takes it back")
	}
}

// While the only slot is busy, callers queue, and the slot's holder sends
// everything queued as one batch when its own send ends; a queued caller
// whose context ends gets its context's error, and its request is not sent.
func TestBatcherCoalescesWhileBusy(t *testing.T) {
	f := &fakeSend{hold: make(chan struct{}), entered: make(chan struct{}, 16)}
	b := newBatcher(context.Background(), &goroutines{}, 1, 512, f.send)
	first := make(chan int, 1)
	go func() {
		rep, err := b.do(context.Background(), 1)
		if err != nil {
			t.Error(err)
		}
		first <- rep
	}()
	<-f.entered // the first call holds the slot
	var wg sync.WaitGroup
	got := make([]int, 5)
	for i := range 5 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], _ = b.do(context.Background(), 100+i)
		}()
	}
	gone, cancel := context.WithCancel(context.Background())
	cancelled := make(chan error, 1)
	go func() {
		_, err := b.do(gone, 999)
		cancelled <- err
	}()
	waitQueued(t, b, 6)
	cancel()
	if err := <-cancelled; !errors.Is(err, context.Canceled) {
		t.Fatalf("a queued caller whose context ended: %v, want context.Canceled", err)
	}
	waitQueued(t, b, 5) // its request left the queue: told it failed, it must not be applied
	close(f.hold)       // the first send answers, and every later one at once
	wg.Wait()
	if r := <-first; r != 10 {
		t.Fatalf("first reply %d", r)
	}
	for i, r := range got {
		if r != (100+i)*10 {
			t.Fatalf("queued caller %d got %d", i, r)
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.batches) != 2 || len(f.batches[1]) != 5 || slices.Contains(f.batches[1], 999) {
		t.Fatalf("batches %v, want [1] then the five queued requests in one (not the abandoned 999)", f.batches)
	}
}

func waitQueued(t *testing.T, b *batcher[int, int], n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b.mu.Lock()
		q := len(b.queue)
		b.mu.Unlock()
		if q == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d calls queued, want %d", q, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// The batcher's own goroutines stop with its context, and the group's wait
// (what Router.Close calls) returns only after they have.
func TestBatcherGoroutinesAreWaitedFor(t *testing.T) {
	var ended atomic.Bool
	entered := make(chan struct{}, 1)
	send := func(ctx context.Context, reqs []int) ([]int, error) {
		entered <- struct{}{}
		<-ctx.Done()
		ended.Store(true)
		return nil, ctx.Err()
	}
	ctx, cancel := context.WithCancel(context.Background())
	g := &goroutines{}
	b := newBatcher(ctx, g, 1, 1, send)
	errs := make(chan []error, 1)
	go func() {
		_, e := b.doMany(context.Background(), []int{1, 2}) // two batches of one: sent by a goroutine of the batcher's
		errs <- e
	}()
	<-entered
	cancel()
	g.wait()
	if !ended.Load() {
		t.Fatal("wait returned while the batcher's goroutine was still sending")
	}
	for _, err := range <-errs {
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("a call of a closed batcher: %v, want context.Canceled", err)
		}
	}
}

// A caller whose context ends while its request is on its way in a batch
// (sent under the batcher's context, not the caller's) is told it failed,
// and the reply that comes anyway goes to orphan: the destination applied
// it for nobody. A caller that stays gets its reply; none is orphaned.
func TestBatcherOrphansAnswersOfCallersThatLeft(t *testing.T) {
	hold1, hold2 := make(chan struct{}), make(chan struct{})
	f := &fakeSend{hold: hold1, entered: make(chan struct{}, 16)}
	b := newBatcher(context.Background(), &goroutines{}, 1, 512, f.send)
	var mu sync.Mutex
	var orphans [][2]int
	b.orphan = func(req, rep int) {
		mu.Lock()
		defer mu.Unlock()
		orphans = append(orphans, [2]int{req, rep})
	}
	first := make(chan error, 1)
	go func() {
		_, err := b.do(context.Background(), 1)
		first <- err
	}()
	<-f.entered // the first call holds the only slot: the next ones queue
	gone, cancel := context.WithCancel(context.Background())
	left := make(chan error, 1)
	go func() {
		_, err := b.do(gone, 7)
		left <- err
	}()
	stays := make(chan int, 1)
	go func() {
		rep, _ := b.do(context.Background(), 8)
		stays <- rep
	}()
	waitQueued(t, b, 2)
	f.mu.Lock()
	f.hold = hold2 // the next send waits for hold2
	f.mu.Unlock()
	close(hold1) // the first send answers; the queued two go out together
	<-f.entered  // and are on their way
	cancel()     // 7's caller leaves while it is in flight
	if err := <-left; !errors.Is(err, context.Canceled) {
		t.Fatalf("the caller that left: %v, want context.Canceled", err)
	}
	close(hold2)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if rep := <-stays; rep != 80 {
		t.Fatalf("the caller that stayed got %d, want 80", rep)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(orphans) != 1 || orphans[0] != [2]int{7, 70} {
		t.Fatalf("orphans %v, want [[7 70]] (the left caller's request, applied for nobody)", orphans)
	}
}

// A caller whose context has ended is not queued: its batch would go out
// under the batcher's own context, and the owner apply calls for a caller
// gone (a rate-limit token spent, a charge the client must take back).
func TestBatcherSendsNothingForAnEndedContext(t *testing.T) {
	f := &fakeSend{}
	b := newBatcher(context.Background(), &goroutines{}, 4, 512, f.send)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, errs := b.doMany(ctx, []int{1, 2})
	for i, err := range errs {
		var ns *notSentError
		if !errors.As(err, &ns) || !errors.Is(err, context.Canceled) {
			t.Errorf("call %d with an ended context: %v; want not sent, canceled", i, err)
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.batches) != 0 {
		t.Fatalf("batches sent for an ended context: %v", f.batches)
	}
}
