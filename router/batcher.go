package router

import (
	"context"
	"sync"
)

// batcher coalesces calls to one destination: a call is sent at once while
// fewer than maxInflight calls are in flight; otherwise it waits in the queue,
// and the next call to finish sends everything queued (up to maxBatch) as one
// batch. So batching adds no latency at low load, and under load the batch
// grows to whatever arrived during one round trip.
type batcher[Req, Rep any] struct {
	maxInflight, maxBatch int
	// send delivers one batch; it returns one reply per request, in order,
	// or an error for all of them.
	send func(ctx context.Context, reqs []Req) ([]Rep, error)
	// ctx bounds every send; canceled by close.
	ctx context.Context

	mu       sync.Mutex // protects queue and inflight
	queue    []*call[Req, Rep]
	inflight int
}

type call[Req, Rep any] struct {
	req  Req
	rep  Rep
	err  error
	done chan struct{}
}

func newBatcher[Req, Rep any](ctx context.Context, maxInflight, maxBatch int, send func(context.Context, []Req) ([]Rep, error)) *batcher[Req, Rep] {
	return &batcher[Req, Rep]{ctx: ctx, maxInflight: max(1, maxInflight), maxBatch: max(1, maxBatch), send: send}
}

// do sends req in some batch and waits for its reply or ctx. A caller whose
// ctx ends first gets ctx's error; its request may still be applied.
func (b *batcher[Req, Rep]) do(ctx context.Context, req Req) (Rep, error) {
	c := &call[Req, Rep]{req: req, done: make(chan struct{})}
	b.mu.Lock()
	b.queue = append(b.queue, c)
	var batch []*call[Req, Rep]
	if b.inflight < b.maxInflight {
		batch = b.takeLocked()
		b.inflight++
	}
	b.mu.Unlock()
	if batch != nil {
		go b.run(batch)
	}
	select {
	case <-c.done:
		return c.rep, c.err
	case <-ctx.Done():
		var zero Rep
		return zero, ctx.Err()
	}
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
		b.mu.Lock()
		if len(b.queue) == 0 || b.ctx.Err() != nil {
			b.inflight--
			rest := b.queue
			b.queue = nil
			b.mu.Unlock()
			b.fail(rest, b.ctx.Err())
			return
		}
		batch = b.takeLocked()
		b.mu.Unlock()
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
		close(c.done)
	}
}

func (b *batcher[Req, Rep]) fail(calls []*call[Req, Rep], err error) {
	if err == nil {
		err = context.Canceled
	}
	for _, c := range calls {
		c.err = err
		close(c.done)
	}
}
