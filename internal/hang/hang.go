// Package hang is how tests stand in for a dependency that stops answering:
// a SIGSTOPped Postgres, a lock held on its tables. A call that reaches a
// Gate while it is hung neither answers nor fails until its caller gives up
// (its context ends), so the test sees whether the code under test puts a
// bound of its own on the call.
//
// Wrap the dependency and wait at the gate first:
//
//	func (l *hungLedger) Settle(ctx context.Context, b *flush.Batch) (flush.SettleResult, error) {
//		if err := l.gate.Wait(ctx); err != nil {
//			return flush.SettleResult{}, err
//		}
//		return l.Ledger.Settle(ctx, b)
//	}
//
// A caller that never gives up does not hang the test: past NeverCancelled
// the call fails by itself with an error that says so, and the test's
// assertions fail instead.
package hang

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"
)

// NeverCancelled bounds how long a hung call waits for its caller to give
// up before it fails by itself (ErrNeverCancelled).
const NeverCancelled = 10 * time.Second

// ErrNeverCancelled is what a hung call returns when its caller waited
// NeverCancelled without giving up: the code under test put no bound on it.
var ErrNeverCancelled = fmt.Errorf("hung call: the caller waited %s for it and never cancelled it", NeverCancelled)

// Until holds a call until ctx ends (ctx.Err()) or NeverCancelled has
// passed (ErrNeverCancelled): one call that hangs, outside any gate.
func Until(ctx context.Context) error { return hold(ctx, ctx.Done(), nil) }

// hold waits for done (ctx.Err()), release (nil) or NeverCancelled
// (ErrNeverCancelled); a nil channel never fires.
func hold(ctx context.Context, done, release <-chan struct{}) error {
	t := time.NewTimer(NeverCancelled)
	defer t.Stop()
	select {
	case <-done:
		return ctx.Err()
	case <-release:
		return nil
	case <-t.C:
		return ErrNeverCancelled
	}
}

// Gate holds the calls that reach it while it is hung. Its zero value is
// not ready: use New.
type Gate struct {
	// Hung, while true, holds every call that reaches Wait.
	Hung atomic.Bool
	// IgnoreCtx makes a held call blind to its caller giving up (a server
	// that does not see the client go): it waits for Release. Set it
	// before the first call.
	IgnoreCtx bool
	// Entered gets one value per call held, while it has room (100), so a
	// test can wait until a call is in the gate.
	Entered chan struct{}

	release chan struct{}
	once    atomic.Bool // Release closed release
}

// New returns a gate that is not hung.
func New() *Gate {
	return &Gate{Entered: make(chan struct{}, 100), release: make(chan struct{})}
}

// Wait returns nil at once unless the gate is hung; then it holds the call
// until ctx ends (ctx.Err(), unless IgnoreCtx), Release (nil), or
// NeverCancelled has passed (ErrNeverCancelled).
func (g *Gate) Wait(ctx context.Context) error {
	if !g.Hung.Load() {
		return nil
	}
	select {
	case g.Entered <- struct{}{}:
	default:
	}
	done := ctx.Done()
	if g.IgnoreCtx {
		done = nil
	}
	return hold(ctx, done, g.release)
}

// Release lets every held call go on, and every later one: a gate
// released stays open, hung or not. Calling it again does nothing.
func (g *Gate) Release() {
	if g.once.CompareAndSwap(false, true) {
		close(g.release)
	}
}
