package engine

import (
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/shard"
)

// Clock reads the two clocks a decision needs. Implementations must be safe
// for concurrent use.
type Clock interface {
	Now() shard.Now
}

// SystemClock is the real clock: the wall reading from time.Now, the
// monotonic one from time.Since a fixed start. Offset shifts the wall
// reading: it exists for the chaos tests' clock skew and month jumps
// (libfaketime does not reach Go programs).
//
// The wall reading may step back (an NTP correction, a month's jump put
// right). Nothing at the node level stands still for it: each account keeps
// its own latest reading (shard.Account), so its period never goes back and
// its records stay in order, while accounts it did not decide meanwhile
// follow the corrected clock. A node-wide floor would leave a node whose
// clock ran a month ahead for seconds billing every account it takes over
// in that later month until the calendar catches up. A node reads it
// through a SteadyClock, which holds against such steps in the first place.
type SystemClock struct {
	start  time.Time
	offset atomic.Int64 // ns added to the wall reading
}

// NewSystemClock starts a system clock.
func NewSystemClock() *SystemClock { return &SystemClock{start: time.Now()} }

// SetOffset shifts the wall reading by d (tests and chaos only).
func (c *SystemClock) SetOffset(d time.Duration) { c.offset.Store(int64(d)) }

// Now implements Clock. Both readings come from one time.Now: they are of
// the same instant (the pause guard compares them), and it costs one read
// of the system clocks, not two.
func (c *SystemClock) Now() shard.Now {
	t := time.Now()
	return shard.Now{Wall: t.UnixNano() + c.offset.Load(), Mono: int64(t.Sub(c.start))}
}

// ManualClock is a clock tests move by hand.
type ManualClock struct {
	wall, mono atomic.Int64
}

// NewManualClock starts at wall.
func NewManualClock(wall time.Time) *ManualClock {
	c := &ManualClock{}
	c.wall.Store(wall.UnixNano())
	return c
}

// Now implements Clock.
func (c *ManualClock) Now() shard.Now { return shard.Now{Wall: c.wall.Load(), Mono: c.mono.Load()} }

// Advance moves both clocks forward by d.
func (c *ManualClock) Advance(d time.Duration) {
	c.wall.Add(int64(d))
	c.mono.Add(int64(d))
}

// SetWall sets the wall reading only (a jump), leaving the monotonic one.
func (c *ManualClock) SetWall(t time.Time) { c.wall.Store(t.UnixNano()) }
