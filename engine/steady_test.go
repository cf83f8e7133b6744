package engine

import (
	"testing"
	"time"
)

func TestSteadyClockHoldsThroughAStepUntilTrusted(t *testing.T) {
	start := time.Date(2026, 6, 30, 23, 59, 50, 0, time.UTC)
	raw := NewManualClock(start)
	c := NewSteadyClock(raw, time.Second)
	wall := func() time.Time { return time.Unix(0, c.Now().Wall).UTC() }
	stepped := func() bool {
		select {
		case <-c.Stepped():
			return true
		default:
			return false
		}
	}

	raw.Advance(5 * time.Second)
	if got, want := wall(), start.Add(5*time.Second); !got.Equal(want) {
		t.Fatalf("an undisturbed clock reads %v, want %v", got, want)
	}
	// A slew within the bound is followed at once and taken in by Track.
	raw.SetWall(start.Add(5*time.Second + 400*time.Millisecond))
	if got, want := wall(), start.Add(5*time.Second+400*time.Millisecond); !got.Equal(want) || stepped() {
		t.Fatalf("a 400 ms change reads %v (stepped %v), want %v followed", got, stepped(), want)
	}
	if d := c.Track(); d != 0 {
		t.Fatalf("Track after a 400 ms change = %v, want 0", d)
	}
	raw.SetWall(start.Add(5*time.Second + 1200*time.Millisecond)) // 800 ms from the tracked base
	if d := c.Track(); d != 0 {
		t.Fatalf("Track after a second 800 ms change = %v, want 0 (the first was taken in)", d)
	}

	// The raw clock jumps into July: the node stays in June, counting on
	// from the monotonic clock, and says so once.
	base := start.Add(5*time.Second + 1200*time.Millisecond)
	raw.SetWall(time.Date(2026, 7, 1, 1, 0, 0, 0, time.UTC))
	if got := wall(); !got.Equal(base) {
		t.Fatalf("after a jump into July the clock reads %v, want %v (before the jump)", got, base)
	}
	if !stepped() {
		t.Fatal("a step was not signalled")
	}
	raw.Advance(2 * time.Second)
	if got, want := wall(), base.Add(2*time.Second); !got.Equal(want) {
		t.Fatalf("2 s after the jump the clock reads %v, want %v", got, want)
	}
	if stepped() {
		t.Fatal("a step was signalled twice")
	}
	if d := c.Track(); d < time.Hour {
		t.Fatalf("Track after the jump = %v, want the jump", d)
	}

	// Put right: followed again.
	raw.SetWall(base.Add(2*time.Second + 100*time.Millisecond))
	if got, want := wall(), base.Add(2*time.Second+100*time.Millisecond); !got.Equal(want) {
		t.Fatalf("put right, the clock reads %v, want %v", got, want)
	}
	if d := c.Track(); d != 0 {
		t.Fatalf("Track after the clock was put right = %v, want 0", d)
	}

	// A step the caller confirmed is followed.
	july := time.Date(2026, 7, 1, 0, 0, 1, 0, time.UTC)
	raw.SetWall(july)
	if got := wall(); got.Month() != time.June {
		t.Fatalf("an unconfirmed step reads %v, want June", got)
	}
	if !stepped() {
		t.Fatal("the second step was not signalled")
	}
	c.Trust()
	if got := wall(); !got.Equal(july) {
		t.Fatalf("a trusted step reads %v, want %v", got, july)
	}
	if raw := time.Unix(0, c.Raw().Wall).UTC(); !raw.Equal(july) {
		t.Fatalf("Raw = %v, want %v", raw, july)
	}
}

func TestSteadyClockAnchoredToAnotherClock(t *testing.T) {
	start := time.Date(2026, 7, 1, 1, 0, 0, 0, time.UTC) // a clock 70 minutes ahead
	raw := NewManualClock(start)
	c := NewSteadyClock(raw, time.Second)
	ledger := time.Date(2026, 6, 30, 23, 50, 0, 0, time.UTC)
	c.Anchor(raw.Now().Mono, ledger.UnixNano())
	raw.Advance(3 * time.Second)
	if got, want := time.Unix(0, c.Now().Wall).UTC(), ledger.Add(3*time.Second); !got.Equal(want) {
		t.Fatalf("anchored clock reads %v, want %v", got, want)
	}
	if d := c.Track(); d != start.Sub(ledger) {
		t.Fatalf("Track = %v, want the raw clock's %v ahead", d, start.Sub(ledger))
	}
	// The raw clock put right comes within MaxStep: followed again.
	raw.SetWall(ledger.Add(3*time.Second + 200*time.Millisecond))
	if d := c.Track(); d != 0 {
		t.Fatalf("Track after the raw clock was put right = %v, want 0", d)
	}
}

// BenchmarkClockNow: what reading the clock costs a decision, the system
// clock alone and through the steady clock a node uses.
func BenchmarkClockNow(b *testing.B) {
	sys := NewSystemClock()
	for _, c := range []struct {
		name  string
		clock Clock
	}{{"system", sys}, {"steady", NewSteadyClock(sys, time.Second)}} {
		b.Run(c.name, func(b *testing.B) {
			b.RunParallel(func(pb *testing.PB) {
				var sink int64
				for pb.Next() {
					sink += c.clock.Now().Wall
				}
				_ = sink
			})
		})
	}
}

// A step back is held like a step forward: a raw clock put back an hour
// (into May, here) reads on from the monotonic clock, and the step is
// signalled for the node to check with the ledger. Followed, the node
// would open accounts new to it in the month before, and bill them there.
func TestSteadyClockHoldsThroughAStepBack(t *testing.T) {
	start := time.Date(2026, 6, 1, 0, 30, 0, 0, time.UTC)
	raw := NewManualClock(start)
	c := NewSteadyClock(raw, time.Second)
	raw.SetWall(start.Add(-time.Hour))
	if got := time.Unix(0, c.Now().Wall).UTC(); !got.Equal(start) {
		t.Fatalf("after a step back an hour the clock reads %v, want %v (before the step)", got, start)
	}
	select {
	case <-c.Stepped():
	default:
		t.Fatal("a step back was not signalled")
	}
	if d := c.Track(); d != -time.Hour {
		t.Fatalf("Track after the step back = %v, want -1h", d)
	}
}
