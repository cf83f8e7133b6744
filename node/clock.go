package node

import (
	"context"
	"time"
)

// Each node decides an account's month from its own wall clock (G5, G9), so
// the nodes' clocks must agree; nothing in the cluster makes them. A node
// compares its clock with the ledger's, the one clock every node reaches,
// exports the difference (quotaring_clock_offset_seconds) and logs a warning
// while it is past maxClockOffset. It warns and goes on serving: a node
// that stopped for its clock would move its accounts onto the others
// whenever the ledger's clock, not its own, was the wrong one.
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

// clockLoop checks the offset at once and every clockCheckEvery until the
// node stops; it warns once when the offset goes past maxClockOffset and
// says so when it is back within.
func (n *Node) clockLoop(ctx context.Context) {
	t := time.NewTimer(0)
	defer t.Stop()
	off := false // the last reading was past maxClockOffset
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		t.Reset(clockCheckEvery)
		l := n.Ledger()
		if l == nil {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		d, rtt, err := measureClockOffset(cctx, l, func() int64 { return n.clock.Now().Wall })
		cancel()
		if err != nil || rtt > maxClockRTT {
			continue // the settler and the refresher report a ledger out of reach
		}
		n.clockOffset.Store(int64(d))
		switch {
		case d.Abs() > maxClockOffset && !off:
			off = true
			way := "ahead of"
			if d < 0 {
				way = "behind"
			}
			n.log.Warn("this node's clock is "+d.Abs().Round(time.Millisecond).String()+" "+way+" the ledger's: "+
				"each node decides an account's month from its own clock, so across a month's end this one bills in another month than the others, "+
				"and an account it bills in a later month stays there; synchronise the clocks (NTP: chronyc tracking, timedatectl)",
				"offset", d.Round(time.Millisecond).String())
		case d.Abs() <= maxClockOffset && off:
			off = false
			n.log.Info("this node's clock is within "+maxClockOffset.String()+" of the ledger's again", "offset", d.Round(time.Millisecond).String())
		}
	}
}
