package node

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/engine"
)

// Each node decides an account's month from its own wall clock (G5, G9), so
// the nodes' clocks must agree; nothing in the cluster makes them. Two
// things keep a node's clock honest:
//
//   - Steps. The system clock is read through an engine.SteadyClock: when
//     it steps by more than maxClockOffset against the monotonic clock (a
//     month's jump, a VM resumed, a wrong NTP source), the node keeps the
//     time it had before the step, counted on by the monotonic clock,
//     checks the new reading against the ledger's at once, and follows it
//     only if the two agree within maxClockOffset (or the clock comes back
//     by itself). A node whose clock jumped a month ahead so goes on billing
//     in this month, with the others.
//   - Offsets. A node compares the clock it bills by with the ledger's, the
//     one clock every node reaches, exports the difference
//     (quotaring_clock_offset_seconds) and logs a warning while it is past
//     maxClockOffset. It warns and goes on serving: a node that stopped for
//     its clock would move its accounts onto the others whenever the
//     ledger's clock, not its own, was the wrong one. Nor does it follow the
//     ledger's clock: with a wrong ledger clock every node would follow it
//     into another month.
const (
	clockCheckEvery = 15 * time.Second
	// maxClockOffset is the offset past which the node warns. NTP keeps
	// clocks within milliseconds; a second off is a clock nobody keeps.
	maxClockOffset = time.Second
	// maxClockRTT: a reading whose round trip took longer than this says
	// too little about the offset, and is not used.
	maxClockRTT = 500 * time.Millisecond
)

// ledgerClock is the part of flush.Ledger the check needs.
type ledgerClock interface {
	Clock(ctx context.Context) (time.Time, error)
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

// clockLoop checks the clocks at once, every clockCheckEvery and when the
// steady clock saw a step, until the node stops.
func (n *Node) clockLoop(ctx context.Context) {
	w := &clockWatch{steady: n.steady, clock: n.clock, log: n.log, offset: &n.clockOffset, step: &n.clockStep}
	var stepped <-chan struct{}
	if n.steady != nil {
		stepped = n.steady.Stepped()
	}
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-stepped:
		}
		t.Reset(clockCheckEvery)
		var l ledgerClock
		if fl := n.Ledger(); fl != nil {
			l = fl
		}
		w.check(ctx, l)
	}
}

// clockWatch is what clockLoop keeps between checks; it warns once when
// the offset goes past maxClockOffset or a step is held against, and says
// so when that is over.
type clockWatch struct {
	steady *engine.SteadyClock // nil: the clock is taken as it is
	clock  engine.Clock        // the clock the node bills by
	log    *slog.Logger
	// offset and step receive the readings (Node.clockOffset, clockStep).
	offset, step *atomic.Int64

	off  bool          // the last offset was past maxClockOffset
	held time.Duration // the step held against at the last check
}

// check reads the clocks once; l is nil while the ledger is not reached.
func (w *clockWatch) check(ctx context.Context, l ledgerClock) {
	var step time.Duration // the system clock less the one the node bills by
	raw := w.clock.Now
	if w.steady != nil {
		step = w.steady.Track()
		raw = w.steady.Raw
	}
	d, ok := time.Duration(0), false // the system clock less the ledger's
	if l != nil {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		var rtt time.Duration
		var err error
		d, rtt, err = measureClockOffset(cctx, l, func() int64 { return raw().Wall })
		cancel()
		// Out of reach: the settler and the refresher report it.
		ok = err == nil && rtt <= maxClockRTT
	}
	switch {
	case step != 0 && ok && d.Abs() <= maxClockOffset:
		w.steady.Trust()
		w.log.Info("this node's clock stepped by "+signed(step)+" and now agrees with the ledger's: following it",
			"offset", signed(d))
		step = 0
	case step != 0 && w.held == 0:
		w.log.Warn("this node's clock stepped by "+signed(step)+" against its monotonic clock, and "+ledgerSays(d, ok)+": "+
			"the node keeps the time it had before the step, counted on by the monotonic clock, so that it bills in the same month as the others, "+
			"and follows the clock again once it is within "+maxClockOffset.String()+" of the ledger's; fix the clock (NTP: chronyc tracking, timedatectl)",
			"step", signed(step))
	case step == 0 && w.held != 0:
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
	case d.Abs() > maxClockOffset && !w.off:
		w.off = true
		way := "ahead of"
		if d < 0 {
			way = "behind"
		}
		w.log.Warn("this node's clock is "+d.Abs().Round(time.Millisecond).String()+" "+way+" the ledger's: "+
			"each node decides an account's month from its own clock, so across a month's end this one bills in another month than the others, "+
			"and an account it bills in a later month stays there; synchronise the clocks (NTP: chronyc tracking, timedatectl)",
			"offset", d.Round(time.Millisecond).String())
	case d.Abs() <= maxClockOffset && w.off:
		w.off = false
		w.log.Info("this node's clock is within "+maxClockOffset.String()+" of the ledger's again", "offset", d.Round(time.Millisecond).String())
	}
}

// ledgerSays describes the ledger's view of a stepped clock for the warning.
func ledgerSays(d time.Duration, ok bool) string {
	if !ok {
		return "the ledger's clock, out of reach, cannot confirm the new reading"
	}
	return "the new reading is " + signed(d) + " from the ledger's clock"
}

// signed formats d to the millisecond with its sign.
func signed(d time.Duration) string {
	s := d.Round(time.Millisecond).String()
	if d > 0 {
		s = "+" + s
	}
	return s
}
