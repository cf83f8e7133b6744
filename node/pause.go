package node

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/ring"
)

// Pauses.
//
// A node whose process stops running (SIGSTOP, a frozen or migrated VM, a
// suspended machine, a stall of the whole process) for longer than the
// gossip failure timeout is declared dead by the others, who take its
// accounts. When it runs again it still sees itself as their owner until
// gossip corrects it, and it decided at once every charge queued in its
// sockets meanwhile, from the state it had before the pause: for accounts
// another node owned by then, with a token bucket of its own beside the new
// owner's (internal/cluster
// TestPausedOwnerDecidesNothingUntilItsRingIsConfirmed: 9 queued charges
// decided that way, and a rate-limited account got 10 through in seconds
// with a burst of 5 at 1/m). Quotas held (the paused node spends only units
// reserved for it in the ledger), rate limits did not.
//
// So a node watches its own running. A ticker reads the clock
// (Config.PauseClock) every pauseBound/pauseTicksPerBound; a gap between two
// ticks longer than pauseBound, or a decision that finds the last tick older
// than that (a charge handled before the ticker ran again), is a pause. The
// gap is the monotonic time passed plus what the wall clock gained on the
// monotonic one meanwhile: Linux's monotonic clock stands still while the
// whole machine is suspended (a laptop's lid, a VM suspended to memory),
// the wall clock does not, and gossip's timers on the other nodes ran on.
// A wall clock stepped forward by more than the bound (an NTP step, an
// operator's date) looks the same and costs one needless hold; a step back
// counts for nothing, and NTP's slewing (at most 0.05 % of a tick) nothing
// that matters (TestPauseGuardSeesASuspendedMachine). From then on the
// engine decides nothing (charges, refunds, usage reads and reservations
// answer quota-unavailable, which clients retry) until the node's view of
// the ring is confirmed: every serving peer in it that answers RingView
// names the same epoch (the same serving set, so the same owners), or no
// peer is left in it (memberlist found them dead: alone, nobody took its
// accounts). A peer that has not taken the node back yet names another
// epoch, and the node keeps holding (pauseLongHoldBounds).
//
// pauseBound is half of ring.Config.MinFailureTimeout, the shortest time in
// which the others can declare the node dead (local preset: 700 ms, so
// 350 ms, ticking every 87.5 ms; lan: 4.5 s, so 2.25 s, every 562.5 ms): any
// pause long enough to lose the accounts is seen, and the ticker must be
// late by more than 260 ms (local) to hold by mistake, which a runnable
// goroutine on a loaded 2-core machine is not. A mistaken hold costs one
// RingView round trip: the peers name the same epoch.

// pauseTicksPerBound is how many ticks fit in pauseBound.
const pauseTicksPerBound = 4

// pauseLongHoldBounds is how many pauseBounds a hold lasts before the node
// says, at WARN, why it is still not confirmed (local: 2.8 s; lan: 18 s),
// and again every pauseLongHoldEvery while it lasts. A hold only ends with
// a confirmation: peers that answer RingView with errors only (they refuse
// this node's --rpc-token or certificate) or that name another epoch (they
// do not count this node as serving, or run another ring layout) leave
// ownership unclear, and a node refuses rather than guesses then.
const pauseLongHoldBounds = 8

// pauseLongHoldEvery spaces the WARNs of a long hold.
const pauseLongHoldEvery = time.Minute

// errPaused is the Hold error while a pause is held against.
var errPaused = errors.New("this node did not run for a while (paused) and decides nothing until a peer confirms its ring view")

// pauseGuard notices pauses of this process and holds decisions until the
// ring is confirmed (see above). Its methods are safe for concurrent use.
type pauseGuard struct {
	// clock is read in every decision (check: BenchmarkPauseCheck).
	clock engine.Clock
	bound int64 // ns: a gap between ticks longer than this is a pause
	// lastTick is the monotonic reading of the last tick, and lastOffset
	// the wall reading minus the monotonic one then, in ns: written by
	// tick (and release), read by check. A reader may find one from a
	// tick and the other from the tick before: each bounds a gap by
	// itself, so either pair measures one no longer than it was.
	lastTick, lastOffset atomic.Int64
	// holding is set while mu.pause.num != 0: check's fast path reads it.
	holding atomic.Bool
	// count is the number of pauses seen (quotaring_pauses_total).
	count atomic.Int64
	// seen receives (without blocking) when a pause begins to be held:
	// the confirm loop wakes.
	seen chan struct{}

	mu sync.Mutex // protects pause and confirmErr
	// confirmErr is why the latest confirmation failed (nil: none did).
	confirmErr error
	// pause is the pause held against; num 0 when none.
	pause struct {
		num uint64
		gap int64 // the longest gap seen while held, ns
		// lastGap is the monotonic reading when the latest gap was seen:
		// a confirmation asked before it does not count.
		lastGap int64
		since   int64 // when the hold began
	}
}

func newPauseGuard(clock engine.Clock, bound time.Duration) *pauseGuard {
	g := &pauseGuard{clock: clock, bound: int64(bound), seen: make(chan struct{}, 1)}
	mono, off := g.read()
	g.lastTick.Store(mono)
	g.lastOffset.Store(off)
	return g
}

// read returns the monotonic reading now and the wall clock's offset from
// it, in ns.
func (g *pauseGuard) read() (mono, off int64) {
	now := g.clock.Now()
	return now.Mono, now.Wall - now.Mono
}

// mono is the monotonic reading now.
func (g *pauseGuard) mono() int64 { return g.clock.Now().Mono }

// gap is how long this process may not have run, from the last tick to a
// reading (mono, off): the monotonic time between the two, plus what the
// wall clock gained on the monotonic one (a suspended machine).
func (g *pauseGuard) gap(mono, off int64) int64 {
	return mono - g.lastTick.Load() + max(off-g.lastOffset.Load(), 0)
}

// every is the tick interval.
func (g *pauseGuard) every() time.Duration {
	return time.Duration(g.bound / pauseTicksPerBound)
}

// tick notes that this process runs; when the gap since the last tick is a
// pause it holds, and reports the gap and whether a new hold began (the
// confirm loop logs it).
func (g *pauseGuard) tick() (gap time.Duration, began bool) {
	now, off := g.read()
	d := now - g.lastTick.Swap(now) + max(off-g.lastOffset.Swap(off), 0)
	if d <= g.bound {
		return 0, false
	}
	return time.Duration(d), g.noteGap(now, d)
}

// check is the engine's Hold: errPaused while a pause is held, or when the
// last tick is older than the bound (the ticker has not run since a pause).
func (g *pauseGuard) check() error {
	if !g.holding.Load() {
		now, off := g.read()
		d := g.gap(now, off)
		if d <= g.bound {
			return nil
		}
		g.noteGap(now, d)
	}
	return errPaused
}

// noteGap holds against a gap of d ns seen at now; it reports whether a new
// hold began (and wakes the confirm loop then).
func (g *pauseGuard) noteGap(now, d int64) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	p := &g.pause
	p.lastGap = max(p.lastGap, now)
	if p.num != 0 {
		p.gap = max(p.gap, d)
		return false
	}
	p.num, p.gap, p.since = uint64(g.count.Add(1)), d, now
	g.holding.Store(true)
	select {
	case g.seen <- struct{}{}:
	default:
	}
	return true
}

// held returns the pause held against (num 0: none) and when its
// confirmation may begin to count.
func (g *pauseGuard) held() (num uint64, gap time.Duration) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.pause.num, time.Duration(g.pause.gap)
}

// setLastErr notes why the latest confirmation failed (nil: it did not).
func (g *pauseGuard) setLastErr(err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.confirmErr = err
}

// lastErr is why the latest confirmation failed, or nil.
func (g *pauseGuard) lastErr() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.confirmErr
}

// heldFor is how long pause num has been held at the monotonic reading now
// (0 when it is not the one held).
func (g *pauseGuard) heldFor(num uint64, now int64) time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.pause.num != num {
		return 0
	}
	return time.Duration(now - g.pause.since)
}

// release ends the hold of pause num after a confirmation asked at the
// monotonic reading asked, unless a gap was seen since (the process paused
// again while it asked) or another pause is held. It reports whether it
// released, and for how long the node held.
func (g *pauseGuard) release(num uint64, asked int64) (bool, time.Duration) {
	g.mu.Lock()
	defer g.mu.Unlock()
	p := &g.pause
	if p.num != num || p.lastGap > asked {
		return false, 0
	}
	// NB: the ticker may not have run since the pause (it is the confirm
	// loop that answered): a tick now, or check would hold again at once.
	now, off := g.read()
	if g.gap(now, off) > g.bound {
		g.lastTick.Store(now)
		g.lastOffset.Store(off)
	}
	held := time.Duration(now - p.since)
	p.num = 0
	g.holding.Store(false)
	return true, held
}

// pauseLoop ticks the guard until ctx ends, logging each pause seen.
func (n *Node) pauseLoop(ctx context.Context) {
	g := n.pause
	t := time.NewTicker(g.every())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		g.tick()
	}
}

func (n *Node) logPause(gap time.Duration) {
	n.log.Warn("this process did not run for "+gap.Round(time.Millisecond).String()+" (paused: SIGSTOP, a frozen VM, a suspended machine, a stalled process; or the wall clock stepped forward); "+
		"the others may have declared it dead and taken its accounts: deciding nothing (quota-unavailable) until a peer confirms its ring view",
		"paused_for", gap, "pause_bound", time.Duration(n.pause.bound))
}

// confirmLoop ends each hold of the pause guard once ConfirmRing agrees,
// asking again every tick meanwhile, until ctx ends.
func (n *Node) confirmLoop(ctx context.Context) {
	g := n.pause
	retry := time.NewTimer(0)
	defer retry.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-g.seen:
		}
		if num, gap := g.held(); num != 0 {
			n.logPause(gap)
		}
		var warned bool    // a long-hold WARN was logged for this hold
		var lastWarn int64 // monotonic reading of the last one
		for {
			num, gap := g.held()
			if num == 0 {
				break
			}
			if n.confirmAfterPause(ctx, num, gap) {
				break
			}
			now := g.mono()
			if held := g.heldFor(num, now); held >= pauseLongHoldBounds*time.Duration(g.bound) && (!warned || now-lastWarn >= int64(pauseLongHoldEvery)) {
				warned, lastWarn = true, now
				n.log.Warn("still deciding nothing after a pause: no peer has confirmed this node's ring view "+
					"(peers that refuse its RPC calls: check --rpc-token and --rpc-tls-* and /readyz; peers that see another ring: "+
					"the ring's ERROR lines about another layout; peers cut off: the network)",
					"paused_for", gap, "held_for", held.Round(time.Millisecond), "last_answer", g.lastErr())
			}
			retry.Reset(g.every())
			select {
			case <-ctx.Done():
				return
			case <-retry.C:
			}
		}
	}
}

// confirmAfterPause asks the peers once (ConfirmRing) and releases pause
// num when they agree; it reports whether the hold ended.
func (n *Node) confirmAfterPause(ctx context.Context, num uint64, gap time.Duration) bool {
	g := n.pause
	asked := g.mono()
	by, err := n.ConfirmRing(ctx)
	g.setLastErr(err)
	if err != nil {
		n.log.Debug("ring view not confirmed yet after a pause", "err", err)
		return false
	}
	ok, held := g.release(num, asked)
	if ok {
		n.log.Info("ring view confirmed after a pause: deciding again", "paused_for", gap, "held_for", held, "confirmed_by", by)
	}
	return ok
}

// ConfirmRing asks every serving peer in this node's view for the epoch of
// its own, at once, and returns nil when every peer that answered names
// this node's (by names them), or when no peer is left in the view, or when
// this node serves nothing. It is the step that ends a hold after a pause
// (confirmLoop), exported for tests.
func (n *Node) ConfirmRing(ctx context.Context) (by []string, err error) {
	r := n.Ring()
	if r == nil || !n.isServing() {
		return nil, nil // owns nothing: nothing to confirm
	}
	epoch := r.Epoch()
	peers := n.servingPeers()
	if len(peers) == 0 {
		return nil, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Duration(n.pause.bound))
	defer cancel()
	type answer struct {
		m     ring.Meta
		epoch uint64
		err   error
	}
	answers := atOnce(peers, func(m ring.Meta) answer { // within ctx's bound above
		e, err := n.router.PeerEpoch(ctx, m.RPCAddr)
		return answer{m: m, epoch: e, err: err}
	})
	var differ []string
	for _, a := range answers {
		switch {
		case a.err != nil:
		case a.epoch != epoch:
			differ = append(differ, fmt.Sprintf("%s (epoch %d)", a.m.ID, a.epoch))
		default:
			by = append(by, a.m.ID)
		}
	}
	switch {
	case len(differ) > 0:
		return nil, fmt.Errorf("peers see another ring than this node's (epoch %d): %v", epoch, differ)
	case len(by) == 0:
		return nil, fmt.Errorf("no serving peer answered (%d asked)", len(peers))
	case r.Epoch() != epoch:
		return nil, fmt.Errorf("this node's ring changed while it asked (epoch %d, now %d)", epoch, r.Epoch())
	}
	return by, nil
}

// pauseBound is the gap that counts as a pause for a ring config: half
// its shortest failure timeout (see above).
func pauseBound(rc ring.Config) time.Duration {
	return rc.MinFailureTimeout() / 2
}
