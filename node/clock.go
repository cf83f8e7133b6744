package node

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/shard"
)

// Each node decides an account's month from its own wall clock (G5, G9), so
// the nodes' clocks must agree; nothing in the cluster makes them. Three
// things keep a node's clock honest (the tolerance is Config.MaxClockOffset,
// "max" below):
//
//   - Steps. The system clock is read through an engine.SteadyClock: when
//     it steps by more than max against the monotonic clock (a month's
//     jump, a VM resumed, a wrong NTP source), the node keeps the time it
//     had before the step, counted on by the monotonic clock, checks the
//     new reading against the ledger's at once, and follows it only if the
//     two agree within max (or the clock comes back by itself). A node
//     whose clock jumped a month ahead so goes on billing in this month,
//     with the others.
//   - Offsets. A node compares the clock it bills by with the ledger's, the
//     one clock every node reaches, exports the difference
//     (quotaring_clock_offset_seconds), logs a warning while it is past
//     max, and gossips its verdict (ring.Meta.Clock). It goes on serving: a
//     node that stopped for its clock would move its accounts onto the
//     others whenever the ledger's clock, not its own, was the wrong one.
//   - The odd one out. A node whose clock is off the ledger's while more of
//     the other members agree with the ledger than not takes the ledger's
//     time (measured at the middle of the round trip, counted on by the
//     monotonic clock) until its own clock agrees again: that covers a node
//     started with its clock already off, which no step reveals. Alone, or
//     when the others are off too, it only warns: the ledger's clock may be
//     the wrong one, and every node following it would move into another
//     month together.
const (
	clockCheckEvery = 15 * time.Second
	// DefaultMaxClockOffset is Config.MaxClockOffset's default. NTP keeps
	// clocks within milliseconds; a second off is a clock nobody keeps.
	DefaultMaxClockOffset = time.Second
	// MinMaxClockOffset is the least Config.MaxClockOffset takes: a reading
	// is off by up to half its round trip (maxClockRTT), and a tolerance
	// below that would find good clocks off.
	MinMaxClockOffset = maxClockRTT / 2
	// maxClockRTT: a reading whose round trip took longer than this says
	// too little about the offset, and is not used.
	maxClockRTT = 500 * time.Millisecond
)

// ledgerClock is the part of flush.Ledger the check needs.
type ledgerClock interface {
	Clock(ctx context.Context) (time.Time, error)
}

// ledgerNow is the ledger's clock, to compare with the times the ledger
// wrote by it (heartbeats, handoffs): this node's clock may be off, and a
// clock an hour ahead would find every other node's heartbeat stale. It is
// this node's clock when the ledger does not answer.
func ledgerNow(ctx context.Context, l ledgerClock) time.Time {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if at, err := l.Clock(ctx); err == nil {
		return at
	}
	return time.Now()
}

// measureClockOffset reads the ledger's clock once and returns how far wall
// (this node's reading, Unix ns) is ahead of it, negative when behind,
// taken at the middle of the round trip, and the round trip.
func measureClockOffset(ctx context.Context, l ledgerClock, wall func() int64) (offset, rtt time.Duration, err error) {
	start := time.Now()
	at, err := l.Clock(ctx)
	rtt = time.Since(start)
	if err != nil {
		return 0, rtt, err
	}
	return time.Duration(wall() - int64(rtt/2) - at.UnixNano()), rtt, nil
}

// clockLoop checks the clocks every clockCheckEvery, when the steady clock
// saw a step and when woken (Node.clockWake), until the node stops. Start
// ran the first check (Node.checkClock).
func (n *Node) clockLoop(ctx context.Context) {
	var stepped <-chan struct{}
	if n.steady != nil {
		stepped = n.steady.Stepped()
	}
	first := clockCheckEvery
	n.clockMu.Lock()
	off := n.watch.off
	n.clockMu.Unlock()
	if off {
		// The others' verdicts may not have reached this node when Start
		// checked: look again soon.
		first = time.Second
	}
	t := time.NewTimer(first)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-stepped:
		case <-n.clockWake:
		}
		t.Reset(clockCheckEvery)
		n.checkClock(ctx)
	}
}

// checkClock runs one check of n.watch, with the ledger when it is reached
// and the other members' verdicts from the ring.
func (n *Node) checkClock(ctx context.Context) {
	n.clockMu.Lock()
	defer n.clockMu.Unlock()
	n.checkClockLocked(ctx)
}

// checkClockLocked is checkClock. REQUIRES: n.clockMu held.
func (n *Node) checkClockLocked(ctx context.Context) {
	var l ledgerClock
	if fl := n.Ledger(); fl != nil {
		l = fl
	}
	n.watch.check(ctx, l)
}

// confirmClock is the check before a node takes accounts (Start, or
// awaitServable for a node that waited): it checks the clock, and when it
// is off the ledger's it waits for the other members' verdicts
// (awaitPeerClocks) and checks again, so that where they side with the
// ledger the node bills by the ledger's time from its first account on.
// It reports whether that settled the question: false when the clock was
// off with no other member to ask (alone, no --join), which Start asks
// again if others reach the node before it serves.
func (n *Node) confirmClock(ctx context.Context) (settled bool) {
	n.clockMu.Lock()
	defer n.clockMu.Unlock()
	n.checkClockLocked(ctx)
	if !n.watch.off {
		return true
	}
	if n.awaitPeerClocks(ctx) {
		n.checkClockLocked(ctx)
		return true
	}
	return false
}

// peerClocks counts the other alive members whose last verdict on their
// clock was that it agrees with the ledger's, and that it is off.
func (n *Node) peerClocks() (agree, off int) {
	agree, off, _ = n.countPeerClocks()
	return agree, off
}

// countPeerClocks counts the other alive members in this node's view, and
// those of them whose clock agrees with the ledger's and is off.
func (n *Node) countPeerClocks() (agree, off, others int) {
	r := n.Ring()
	if r == nil {
		return 0, 0, 0
	}
	for _, m := range r.View().Members {
		if m.ID == n.cfg.ID {
			continue
		}
		others++
		switch m.Clock {
		case ring.ClockAgrees:
			agree++
		case ring.ClockOff:
			off++
		}
	}
	return agree, off, others
}

// peerClockWait bounds how long a starting node whose clock is off waits
// for the other members' verdicts to reach it.
const peerClockWait = 3 * time.Second

// awaitPeerClocks waits until every other member in this node's view has
// a verdict on its clock, or peerClockWait; it reports whether any other
// member is in view. A node just joined may not have applied the others'
// meta yet, and without their verdicts it would bill by its own off clock
// until the next check. A node without --join and alone does not wait.
func (n *Node) awaitPeerClocks(ctx context.Context) bool {
	r := n.Ring()
	if r == nil || len(n.cfg.Join) == 0 && len(r.View().Members) <= 1 {
		return false // the first node, or one alone: nobody to wait for
	}
	ctx, cancel := context.WithTimeout(ctx, peerClockWait)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		agree, off, others := n.countPeerClocks()
		if others > 0 && agree+off == others {
			return true
		}
		select {
		case <-ctx.Done():
			return others > 0
		case <-tick.C:
		}
	}
}

// publishClock gossips this node's verdict.
func (n *Node) publishClock(ctx context.Context, v ring.ClockVerdict) {
	r := n.Ring()
	if r == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := r.SetClock(ctx, v); err != nil && !errors.Is(err, ring.ErrUnconfirmed) {
		n.log.Warn("could not gossip this node's clock verdict; the others see the last one", "verdict", v.String(), "err", err)
	}
}

// clockWatch is what the clock checks keep between them; it warns once when
// the offset goes past max, a step is held against or the node takes the
// ledger's time, and says so when that is over.
type clockWatch struct {
	steady *engine.SteadyClock // nil: the clock is taken as it is
	clock  engine.Clock        // the clock the node bills by
	log    *slog.Logger
	// offset and step receive the readings (Node.clockOffset, clockStep).
	offset, step *atomic.Int64
	// peers counts the other members' verdicts (agree, off); publish
	// gossips this node's. Either may be nil (tests).
	peers   func() (agree, off int)
	publish func(context.Context, ring.ClockVerdict)

	max time.Duration // Config.MaxClockOffset

	off       bool          // the last offset was past max
	held      time.Duration // the step held against at the last check
	following bool          // the node bills by the ledger's time (Anchor)
	verdict   ring.ClockVerdict
}

// check reads the clocks once; l is nil while the ledger is not reached.
func (w *clockWatch) check(ctx context.Context, l ledgerClock) {
	var step time.Duration // the system clock less the one the node bills by
	raw := w.clock.Now
	if w.steady != nil {
		step = w.steady.Track()
		raw = w.steady.Raw
	}
	var at shard.Now                 // the system clock's reading the offset is of
	d, ok := time.Duration(0), false // the system clock less the ledger's
	if l != nil {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		var rtt time.Duration
		var err error
		d, rtt, err = measureClockOffset(cctx, l, func() int64 { at = raw(); return at.Wall })
		cancel()
		// Out of reach: the settler and the refresher report it.
		ok = err == nil && rtt <= maxClockRTT
	}
	was := w.held
	switch {
	case step != 0 && ok && d.Abs() <= w.max:
		w.steady.Trust()
		if w.following {
			w.log.Info("this node's clock agrees with the ledger's again: following it", "offset", signed(d))
		} else {
			w.log.Info("this node's clock stepped by "+signed(step)+" and now agrees with the ledger's: following it", "offset", signed(d))
		}
		step, was, w.following = 0, 0, false
	case step == 0 && w.following:
		w.log.Info("this node's clock agrees with the ledger's time it followed: following its own again")
		was, w.following = 0, false
	}
	if w.steady != nil && ok && (d-step).Abs() > w.max && w.peers != nil {
		if agree, off := w.peers(); agree > off {
			w.steady.Anchor(at.Mono, at.Wall-int64(d))
			step, w.following = d, true
			w.log.Warn("this node's clock is "+aheadOf(d)+" the ledger's, and "+
				strconv.Itoa(agree)+" of the other members agree with the ledger's ("+strconv.Itoa(off)+" do not): "+
				"the node bills by the ledger's time, counted on by its monotonic clock, until its own clock agrees again; "+
				"fix the clock (NTP: chronyc tracking, timedatectl)", "offset", signed(d))
		}
	}
	switch {
	case step != 0 && was == 0 && !w.following:
		w.log.Warn("this node's clock stepped by "+signed(step)+" against its monotonic clock, and "+ledgerSays(d, ok)+": "+
			"the node keeps the time it had before the step, counted on by the monotonic clock, so that it bills in the same month as the others, "+
			"and follows the clock again once it is within "+w.max.String()+" of the ledger's; fix the clock (NTP: chronyc tracking, timedatectl)",
			"step", signed(step))
	case step == 0 && was != 0:
		w.log.Info("this node's clock is back where it was before its step: following it")
	}
	w.held = step
	w.step.Store(int64(step))
	if !ok {
		return
	}
	d -= step // the clock the node bills by
	w.offset.Store(int64(d))
	switch {
	case d.Abs() > w.max && !w.off:
		w.off = true
		w.log.Warn("this node's clock is "+aheadOf(d)+" the ledger's: "+
			"each node decides an account's month from its own clock, so across a month's end this one bills in another month than the others, "+
			"and an account it bills in a later month stays there; synchronise the clocks (NTP: chronyc tracking, timedatectl)",
			"offset", d.Round(time.Millisecond).String())
	case d.Abs() <= w.max && w.off:
		w.off = false
		w.log.Info("this node's clock is within "+w.max.String()+" of the ledger's again", "offset", d.Round(time.Millisecond).String())
	}
	v := ring.ClockAgrees
	if w.off {
		v = ring.ClockOff
	}
	if v != w.verdict && w.publish != nil {
		w.publish(ctx, v)
	}
	w.verdict = v
}

// ledgerSays describes the ledger's view of a stepped clock for the warning.
func ledgerSays(d time.Duration, ok bool) string {
	if !ok {
		return "the ledger's clock, out of reach, cannot confirm the new reading"
	}
	return "the new reading is " + signed(d) + " from the ledger's clock"
}

// aheadOf says how far a clock d ahead of another is, "1.5s ahead of" or
// "1.5s behind", to the millisecond.
func aheadOf(d time.Duration) string {
	if d < 0 {
		return d.Abs().Round(time.Millisecond).String() + " behind"
	}
	return d.Round(time.Millisecond).String() + " ahead of"
}

// signed formats d to the millisecond with its sign.
func signed(d time.Duration) string {
	s := d.Round(time.Millisecond).String()
	if d > 0 {
		s = "+" + s
	}
	return s
}
