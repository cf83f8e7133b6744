package engine

import (
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/shard"
)

// SteadyClock keeps a wall clock that steps from carrying the node into
// another month. A wall clock can jump (a VM resumed, an operator's date
// command, a broken NTP source) while the monotonic clock counts on
// undisturbed, so wall minus monotonic (the base) is constant except when
// the wall clock steps or is slewed. SteadyClock remembers a trusted base
// and, while the raw clock's base is more than MaxStep away from it,
// answers the trusted base plus the monotonic reading: the time the node
// had before the step, counted on. The raw clock is followed again when it
// comes back within MaxStep, or when the caller, having checked it against
// another clock (the node checks with the ledger's), calls Trust.
//
// Slow changes (NTP slewing, a few hundred parts per million at most) are
// taken in by Track, which the caller runs every few seconds: it moves the
// trusted base to the raw one while they are within MaxStep.
//
// Without it a node whose clock jumped a month ahead for seconds bills the
// accounts it decides meanwhile in that month, and they stay there (a
// period never goes back, G9) while the rest of the cluster is still in
// this one.
type SteadyClock struct {
	raw     Clock
	maxStep int64
	// base is the trusted wall minus monotonic reading, in ns.
	base atomic.Int64
	// noticed is set by the first Now that sees the raw clock stepped
	// away, so that only it signals stepped; Track, Trust and Anchor
	// clear it.
	noticed atomic.Bool
	stepped chan struct{}
}

// NewSteadyClock trusts raw as it reads now and holds to that reading when
// raw later steps by more than maxStep.
func NewSteadyClock(raw Clock, maxStep time.Duration) *SteadyClock {
	c := &SteadyClock{raw: raw, maxStep: int64(maxStep), stepped: make(chan struct{}, 1)}
	r := raw.Now()
	c.base.Store(r.Wall - r.Mono)
	return c
}

// Now implements Clock: the raw reading while it is within MaxStep of the
// trusted one, the trusted one otherwise.
func (c *SteadyClock) Now() shard.Now {
	r := c.raw.Now()
	b := c.base.Load()
	if c.near(r.Wall - r.Mono - b) {
		return r
	}
	if !c.noticed.Load() && c.noticed.CompareAndSwap(false, true) {
		select {
		case c.stepped <- struct{}{}:
		default:
		}
	}
	return shard.Now{Wall: b + r.Mono, Mono: r.Mono}
}

// Raw reads the clock SteadyClock watches.
func (c *SteadyClock) Raw() shard.Now { return c.raw.Now() }

// Stepped receives when a Now found the raw clock stepped away from the
// trusted one, once per step, so the caller can check it at once.
func (c *SteadyClock) Stepped() <-chan struct{} { return c.stepped }

// Track takes in a slow change: when the raw clock is within MaxStep of the
// trusted one it becomes the trusted one. It returns how far the raw clock
// stands from the trusted one when it does not (positive when ahead), 0
// when it does.
func (c *SteadyClock) Track() time.Duration {
	r := c.raw.Now()
	d := r.Wall - r.Mono - c.base.Load()
	if c.near(d) {
		c.Anchor(r.Mono, r.Wall)
		return 0
	}
	return time.Duration(d)
}

// near reports whether a base d ns from the trusted one is within MaxStep.
func (c *SteadyClock) near(d int64) bool { return d <= c.maxStep && d >= -c.maxStep }

// Anchor makes the trusted clock read wall at the monotonic reading mono
// (the caller measured the time elsewhere: the node takes the ledger's when
// its own clock is the odd one out). The raw clock is followed again when it
// comes within MaxStep of that, or on Trust.
func (c *SteadyClock) Anchor(mono, wall int64) {
	c.base.Store(wall - mono)
	c.noticed.Store(false)
}

// Trust follows the raw clock from now on, however far it stepped: the
// caller found it right.
func (c *SteadyClock) Trust() {
	r := c.raw.Now()
	c.Anchor(r.Mono, r.Wall)
}
