package shard

import "math/bits"

// Bucket is a token bucket in exact integer arithmetic.
//
// Credit is counted in "token·ns / Per" units: one token is worth Per credit
// and the bucket gains Tokens credit per elapsed nanosecond, so over any
// window t a continuously hammered bucket that started full admits exactly
// Burst + floor(t·Tokens/Per) requests, with no float rounding. Plan.Validate
// keeps Burst·Per under 2^62, so nothing here overflows.
//
// A new bucket is full. Time comes from the monotonic reading only (G9).
type Bucket struct {
	credit int64
	per    int64 // the Rate.Per the credit counts in: a token is worth per credit
	last   int64 // Now.Mono of the last refill
	init   bool
}

func capacity(p *Plan) int64 { return p.Burst * int64(p.Rate.Per) }

// refill brings the bucket up to mono. A monotonic reading that goes back
// (which a real monotonic clock never does) adds nothing.
func (b *Bucket) refill(p *Plan, mono int64) {
	c := capacity(p)
	if !b.init {
		b.credit, b.per, b.last, b.init = c, int64(p.Rate.Per), mono, true
		return
	}
	elapsed := mono - b.last
	if elapsed <= 0 {
		return
	}
	b.last = mono
	if b.credit >= c {
		b.credit = c
		return
	}
	need := c - b.credit
	if elapsed >= (need+p.Rate.Tokens-1)/p.Rate.Tokens {
		b.credit = c
		return
	}
	b.credit += elapsed * p.Rate.Tokens
}

// allow reports whether one token is there, and if not, the ns until it is.
func (b *Bucket) allow(p *Plan) (bool, int64) {
	per := int64(p.Rate.Per)
	if b.credit >= per {
		return true, 0
	}
	return false, (per - b.credit + p.Rate.Tokens - 1) / p.Rate.Tokens
}

func (b *Bucket) take(p *Plan) { b.credit -= int64(p.Rate.Per) }

// reconfigure carries the credit over to a new plan: the tokens left are
// kept (rounded down) when the rate's period changed, since credit counts
// in the period's unit (10/m with one token left, read as 10/s, had ten),
// and fitted under a (possibly smaller) new capacity.
func (b *Bucket) reconfigure(p *Plan) {
	c := capacity(p)
	if per := int64(p.Rate.Per); per != b.per && b.per > 0 {
		// credit·per/b.per in 128 bits: credit and per are each under 2^62.
		hi, lo := bits.Mul64(uint64(b.credit), uint64(per))
		if hi >= uint64(b.per) {
			b.credit = c // the quotient overflows: far above any capacity
		} else if q, _ := bits.Div64(hi, lo, uint64(b.per)); q > uint64(c) {
			b.credit = c
		} else {
			b.credit = int64(q)
		}
		b.per = per
	}
	if b.credit > c {
		b.credit = c
	}
}

// fill writes the bucket's view into d for the RateLimit headers.
func (b *Bucket) fill(p *Plan, d *Decision) {
	per := int64(p.Rate.Per)
	d.RateBurst = p.Burst
	d.RateRemaining = b.credit / per
	d.RateReset = (capacity(p) - b.credit + p.Rate.Tokens - 1) / p.Rate.Tokens
	d.RateWindow = capacity(p) / p.Rate.Tokens
}
