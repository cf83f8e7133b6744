package router

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// batcher coalesces calls to one destination: a call is sent at once while
// fewer than maxInflight calls are in flight; otherwise it waits in the queue,
// and the next call to finish sends everything queued (up to maxBatch) as one
// batch. So batching adds no latency at low load, and under load the batch
// grows to whatever arrived during one round trip.
//
// A caller that finds a free slot and nobody queued sends its own requests
// from its own goroutine, under its own context: that is the common case at
// low load, and it spares the caller waiting for a hand-off to another
// goroutine. Anything queued meanwhile is then sent by a goroutine of the
// batcher's.
type batcher[Req, Rep any] struct {
	maxInflight, maxBatch int
	// send delivers one batch; it returns one reply per request, in order,
	// or an error for all of them.
	send func(ctx context.Context, reqs []Req) ([]Rep, error)
	// ctx bounds every send; canceled by close.
	ctx context.Context
	// group runs the batcher's goroutines, so that the router's Close can
	// wait for them (they end once ctx is canceled and their send returns).
	group *goroutines

	mu       sync.Mutex // protects queue and inflight
	queue    []*call[Req, Rep]
	inflight int

	// orphan, when set, hears each request whose caller left (its ctx
	// ended) while it was on its way in a batch, with the reply that came
	// anyway: the destination applied it for nobody, and the caller was
	// told it failed. Called from a sender goroutine; it must not block.
	// Set before the first call.
	orphan func(Req, Rep)
}

type call[Req, Rep any] struct {
	req  Req
	rep  Rep
	err  error
	done chan struct{}
	// state is callWaiting until deliver or the caller, whichever comes
	// first, moves it to callDelivered or callLeft.
	state atomic.Int32
}

// A call's states.
const (
	callWaiting int32 = iota
	callDelivered
	callLeft
)

func newBatcher[Req, Rep any](ctx context.Context, group *goroutines, maxInflight, maxBatch int, send func(context.Context, []Req) ([]Rep, error)) *batcher[Req, Rep] {
	return &batcher[Req, Rep]{ctx: ctx, group: group, maxInflight: max(1, maxInflight), maxBatch: max(1, maxBatch), send: send}
}

// goroutines is a group of goroutines that wait can wait for: the
// batchers' senders. After wait has begun, start runs f in the caller's
// goroutine instead (a closed batcher fails at once, so it does not block).
type goroutines struct {
	mu      sync.Mutex // protects closed; orders every wg.Add before wg.Wait
	closed  bool
	running counter // the goroutines of start's running (waitIdle)
	wg      sync.WaitGroup
}

// counter counts work in flight, and wakes its waiters when none is left.
type counter struct {
	mu     sync.Mutex // protects n, closed and idle
	n      int
	closed bool            // add refuses (close)
	idle   []chan struct{} // closed when n drops to 0
}

// add counts one in, unless closed.
func (c *counter) add() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.n++
	return true
}

// done counts one add let in out.
func (c *counter) done() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n--; c.n == 0 {
		for _, ch := range c.idle {
			close(ch)
		}
		c.idle = nil
	}
}

// close makes add refuse from now on.
func (c *counter) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
}

// wait waits until none is in flight, or ctx ends: then it returns how
// many still are, and ctx's error.
func (c *counter) wait(ctx context.Context) (int, error) {
	c.mu.Lock()
	if c.n == 0 {
		c.mu.Unlock()
		return 0, nil
	}
	ch := make(chan struct{})
	c.idle = append(c.idle, ch)
	c.mu.Unlock()
	select {
	case <-ch:
		return 0, nil
	case <-ctx.Done():
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.n, ctx.Err()
	}
}

func (g *goroutines) start(f func()) {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		f()
		return
	}
	g.wg.Add(1)
	g.running.add()
	g.mu.Unlock()
	go func() {
		defer g.wg.Done()
		defer g.running.done()
		f()
	}()
}

// waitIdle waits until no goroutine of start's is running, or ctx ends
// (its error). Unlike wait it does not close the group: one started later
// runs as before.
func (g *goroutines) waitIdle(ctx context.Context) error {
	_, err := g.running.wait(ctx)
	return err
}

// wait waits until every goroutine start began has returned.
func (g *goroutines) wait() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
	g.wg.Wait()
}

// do sends req in some batch and waits for its reply or ctx. A caller whose
// ctx ends first gets ctx's error: its request is dropped if it is still
// queued (never sent, so never applied); if it was sent, it may still be
// applied, and its reply then goes to orphan.
func (b *batcher[Req, Rep]) do(ctx context.Context, req Req) (Rep, error) {
	reps, errs := b.doMany(ctx, []Req{req})
	return reps[0], errs[0]
}

// doMany sends reqs like do, queued together so they travel in as few
// batches as fit (with other callers' requests), and waits for all of them
// or ctx. It returns one reply and one error per request, in order.
func (b *batcher[Req, Rep]) doMany(ctx context.Context, reqs []Req) ([]Rep, []error) {
	reps, errs := make([]Rep, len(reqs)), make([]error, len(reqs))
	if err := ctx.Err(); err != nil {
		// Ended already (a refresh after WrongOwner used up the deadline):
		// queued, the batch went out under b.ctx and the owner applied the
		// calls for a caller gone, whose client then took them back.
		for i := range errs {
			errs[i] = &notSentError{err}
		}
		return reps, errs
	}
	b.mu.Lock()
	// NB: only a caller whose ctx cannot end sends inline. Sent under a ctx
	// that ends mid-call, the RPC was cut with its outcome unknown, and no
	// reply reached orphan: a charge the owner applied stayed billed while
	// its caller was told it failed (a review: 60 of 2,000 charges with
	// 0-3 ms deadlines). A batch sent by the batcher's goroutine, under
	// b.ctx, gets its reply, which orphan takes back for a caller that left.
	if ctx.Done() == nil && b.inflight < b.maxInflight && len(b.queue) == 0 && len(reqs) <= b.maxBatch {
		b.inflight++
		b.mu.Unlock()
		got, err := b.send(ctx, reqs) // NB: ctx cannot end: its error is the send's own
		if err == nil && len(got) != len(reqs) {
			err = errShortReply
		}
		b.next()
		for i := range reqs {
			if err != nil {
				errs[i] = err
			} else {
				reps[i] = got[i]
			}
		}
		return reps, errs
	}
	calls := make([]*call[Req, Rep], len(reqs))
	for i, r := range reqs {
		calls[i] = &call[Req, Rep]{req: r, done: make(chan struct{})}
	}
	b.queue = append(b.queue, calls...)
	var batch []*call[Req, Rep]
	if b.inflight < b.maxInflight {
		batch = b.takeLocked()
		b.inflight++
	}
	b.mu.Unlock()
	if batch != nil {
		b.group.start(func() { b.run(batch) })
	}
	for i, c := range calls {
		select {
		case <-c.done:
			reps[i], errs[i] = c.rep, c.err
		case <-ctx.Done():
			switch {
			case b.drop(c):
				errs[i] = &notSentError{ctx.Err()}
			case c.state.CompareAndSwap(callWaiting, callLeft):
				errs[i] = ctx.Err() // on its way: its reply goes to orphan
			default:
				<-c.done // delivered as the caller left: the reply is its
				reps[i], errs[i] = c.rep, c.err
			}
		}
	}
	return reps, errs
}

// drop takes c out of the queue if it is still there, and reports whether
// it was: its caller left with an error, so it must not be applied after
// (a charge the caller was told failed, billed by the owner later). A call
// not in the queue any more is in a batch on its way.
func (b *batcher[Req, Rep]) drop(c *call[Req, Rep]) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if i := slices.Index(b.queue, c); i >= 0 {
		b.queue = slices.Delete(b.queue, i, i+1)
		return true
	}
	return false
}

// notSentError is the error of a call its caller's ctx ended while it was
// still queued, or that was still queued when the batcher closed: taken out
// of the queue, it was never sent, so it certainly was not applied. It
// wraps ctx's error.
type notSentError struct{ err error }

func (e *notSentError) Error() string { return "not sent (still queued): " + e.err.Error() }
func (e *notSentError) Unwrap() error { return e.err }

// ctxEnded is ctx's error, or DeadlineExceeded once its deadline has passed
// even if its timer has not fired yet.
func ctxEnded(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
		return context.DeadlineExceeded
	}
	return nil
}

// takeLocked removes up to maxBatch queued calls. REQUIRES: b.mu held.
func (b *batcher[Req, Rep]) takeLocked() []*call[Req, Rep] {
	n := min(len(b.queue), b.maxBatch)
	batch := make([]*call[Req, Rep], n)
	copy(batch, b.queue)
	rest := copy(b.queue, b.queue[n:])
	clear(b.queue[rest:])
	b.queue = b.queue[:rest]
	return batch
}

// run sends batches until the queue is empty, then gives its slot back.
func (b *batcher[Req, Rep]) run(batch []*call[Req, Rep]) {
	for {
		b.deliver(batch)
		if batch = b.take(); batch == nil {
			return
		}
	}
}

// take is for the holder of an in-flight slot whose send ended: it returns
// the next batch to send, or gives the slot back and returns nil when
// nothing is queued (or the batcher closed: then it fails what is queued).
func (b *batcher[Req, Rep]) take() []*call[Req, Rep] {
	b.mu.Lock()
	if len(b.queue) == 0 || b.ctx.Err() != nil {
		b.inflight--
		rest := b.queue
		b.queue = nil
		b.mu.Unlock()
		b.fail(rest, b.ctx.Err())
		return nil
	}
	batch := b.takeLocked()
	b.mu.Unlock()
	return batch
}

// next is take for a caller that sent inline: what is queued goes on in a
// goroutine of the batcher's, so the caller can return.
func (b *batcher[Req, Rep]) next() {
	if batch := b.take(); batch != nil {
		b.group.start(func() { b.run(batch) })
	}
}

func (b *batcher[Req, Rep]) deliver(batch []*call[Req, Rep]) {
	reqs := make([]Req, len(batch))
	for i, c := range batch {
		reqs[i] = c.req
	}
	reps, err := b.send(b.ctx, reqs)
	if err == nil && len(reps) != len(batch) {
		err = errShortReply
	}
	for i, c := range batch {
		if err != nil {
			c.err = err
		} else {
			c.rep = reps[i]
		}
		if !c.state.CompareAndSwap(callWaiting, callDelivered) && err == nil && b.orphan != nil {
			b.orphan(c.req, c.rep)
		}
		close(c.done)
	}
}

// fail ends calls that were never sent with err (a notSentError).
func (b *batcher[Req, Rep]) fail(calls []*call[Req, Rep], err error) {
	if err == nil {
		err = context.Canceled
	}
	for _, c := range calls {
		c.err = &notSentError{err}
		close(c.done)
	}
}
