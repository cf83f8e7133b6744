package node

import (
	"errors"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/ring"
)

// The pause guard on a clock the test moves: ticks and decisions within
// the bound hold nothing; a decision made after a pause, before the ticker
// ran again, holds (and wakes the confirm loop); the ticker's late tick
// joins that pause; a confirmation asked before the last gap seen does not
// end it, one asked after does; and a gap the ticker sees first holds too.
func TestPauseGuardHoldsFromAGapUntilAConfirmationAfterIt(t *testing.T) {
	c := engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	const bound = 350 * time.Millisecond
	g := newPauseGuard(c, bound)
	for range 20 {
		c.Advance(g.every())
		if gap, began := g.tick(); gap != 0 || began {
			t.Fatalf("a tick %s after the last one: gap %s, began %v", g.every(), gap, began)
		}
		if err := g.check(); err != nil {
			t.Fatalf("a decision between ticks: %v", err)
		}
	}
	c.Advance(bound)
	if err := g.check(); err != nil {
		t.Fatalf("a decision the bound after the last tick: %v", err)
	}

	c.Advance(time.Second) // SIGSTOP ... SIGCONT: a charge runs before the ticker
	if err := g.check(); !errors.Is(err, errPaused) {
		t.Fatalf("a decision after a pause of %s: %v, want errPaused", bound+time.Second, err)
	}
	select {
	case <-g.seen:
	default:
		t.Fatal("the confirm loop was not woken")
	}
	num, _ := g.held()
	asked := c.Now().Mono // a confirmation asked now ...
	c.Advance(time.Millisecond)
	if gap, began := g.tick(); began || gap < bound+time.Second {
		t.Fatalf("the ticker's late tick: gap %s, began %v; want the same pause, seen by it too", gap, began)
	}
	if n, gap := g.held(); n != num || gap < bound+time.Second {
		t.Fatalf("held pause %d (gap %s), want %d", n, gap, num)
	}
	if ok, _ := g.release(num, asked); ok {
		t.Fatal("released by a confirmation asked before the tick's gap")
	}
	if err := g.check(); !errors.Is(err, errPaused) {
		t.Fatalf("after a refused release: %v", err)
	}
	if ok, held := g.release(num, c.Now().Mono); !ok || held != time.Millisecond {
		t.Fatalf("release after a confirmation asked after the gap: %v (held %s)", ok, held)
	}
	if err := g.check(); err != nil {
		t.Fatalf("after the release: %v", err)
	}

	c.Advance(2 * time.Second) // the ticker sees this one first
	if _, began := g.tick(); !began {
		t.Fatal("the ticker did not begin a hold after a gap of 2s")
	}
	if err := g.check(); !errors.Is(err, errPaused) {
		t.Fatalf("after the ticker's gap: %v", err)
	}
	if got := g.count.Load(); got != 2 {
		t.Fatalf("%d pauses counted, want 2", got)
	}
}

// A suspended machine: Linux's monotonic clock stands still while it
// sleeps, so the gap between two ticks shows nothing, but the wall clock
// gains on it by the time it slept (and the other nodes' gossip ran on).
// A decision after the wake holds, as the ticker's next tick does; a wall
// clock stepped back, or slewed by NTP, holds nothing.
func TestPauseGuardSeesASuspendedMachine(t *testing.T) {
	c := engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	const bound = 350 * time.Millisecond
	g := newPauseGuard(c, bound)
	wall := func() time.Time { return time.Unix(0, c.Now().Wall) }

	for range 40 { // NTP slewing at 0.05 %, and a step back of a minute
		c.Advance(g.every())
		c.SetWall(wall().Add(g.every() / 2000))
		if gap, began := g.tick(); gap != 0 || began {
			t.Fatalf("a slewed tick: gap %s, began %v", gap, began)
		}
	}
	c.SetWall(wall().Add(-time.Minute))
	c.Advance(g.every())
	if gap, began := g.tick(); gap != 0 || began {
		t.Fatalf("a tick after the wall clock stepped back: gap %s, began %v", gap, began)
	}
	if err := g.check(); err != nil {
		t.Fatalf("a decision after the wall clock stepped back: %v", err)
	}

	c.Advance(g.every() / 2)
	c.SetWall(wall().Add(bound - g.every())) // slept less than the bound, with the time since the tick
	if err := g.check(); err != nil {
		t.Fatalf("a decision after a sleep shorter than the bound: %v", err)
	}
	c.Advance(g.every() / 2)
	if gap, began := g.tick(); gap != 0 || began {
		t.Fatalf("the tick after a short sleep: gap %s, began %v", gap, began)
	}

	c.Advance(time.Millisecond)
	c.SetWall(wall().Add(30 * time.Second)) // the lid closed for 30 s
	if err := g.check(); !errors.Is(err, errPaused) {
		t.Fatalf("a decision after the machine slept 30s: %v, want errPaused", err)
	}
	num, gap := g.held()
	if num == 0 || gap < 30*time.Second {
		t.Fatalf("held pause %d with gap %s, want one of 30s or more", num, gap)
	}
	if _, began := g.tick(); began {
		t.Fatal("the tick after the wake began a second hold; want the same pause")
	}
	if ok, _ := g.release(num, c.Now().Mono); !ok {
		t.Fatal("not released by a confirmation asked after the wake")
	}
	if err := g.check(); err != nil {
		t.Fatalf("after the release: %v", err)
	}

	c.SetWall(wall().Add(time.Minute)) // asleep again; the ticker sees it first
	c.Advance(time.Millisecond)
	if gap, began := g.tick(); !began || gap < time.Minute {
		t.Fatalf("the ticker after a minute's sleep: gap %s, began %v; want a hold of a minute or more", gap, began)
	}
	if err := g.check(); !errors.Is(err, errPaused) {
		t.Fatalf("after the ticker saw the sleep: %v", err)
	}
	if got := g.count.Load(); got != 2 {
		t.Fatalf("%d pauses counted, want 2", got)
	}
}

// The bound is half the shortest failure timeout of the ring preset: any
// pause that can lose the accounts is seen, with room for a late ticker.
func TestPauseBoundFromTheRingPreset(t *testing.T) {
	for _, c := range []struct {
		rc   ring.Config
		want time.Duration
	}{{ring.LocalConfig(), 350 * time.Millisecond}, {ring.DefaultConfig(), 2250 * time.Millisecond}} {
		if got := pauseBound(c.rc); got != c.want {
			t.Errorf("%s: pause bound %s, want %s", c.rc.Preset, got, c.want)
		}
	}
}

// heldFor measures the hold of the pause held, and nothing for another; the
// confirm loop warns by it while no peer confirms (pauseLongHoldBounds).
func TestPauseGuardHeldFor(t *testing.T) {
	c := engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	g := newPauseGuard(c, 350*time.Millisecond)
	if d := g.heldFor(1, c.Now().Mono); d != 0 {
		t.Fatalf("held for %s with no pause", d)
	}
	c.Advance(time.Second)
	if err := g.check(); !errors.Is(err, errPaused) {
		t.Fatalf("after a gap: %v", err)
	}
	num, _ := g.held()
	c.Advance(3 * time.Second)
	if d := g.heldFor(num, c.Now().Mono); d != 3*time.Second {
		t.Fatalf("held for %s, want 3s", d)
	}
	if d := g.heldFor(num+1, c.Now().Mono); d != 0 {
		t.Fatalf("pause %d held for %s; it is not the one held", num+1, d)
	}
	g.setLastErr(errors.New("no serving peer answered"))
	if err := g.lastErr(); err == nil || err.Error() != "no serving peer answered" {
		t.Fatalf("last confirmation error: %v", err)
	}
}

// BenchmarkPauseCheck is what the pause guard adds to every decision (the
// engine's Hold, under the account's lock) when no pause is held: one read
// of the system clock (its wall and monotonic readings) and three atomic
// loads.
//
//	go test ./node -run '^$' -bench PauseCheck -benchtime 2s
func BenchmarkPauseCheck(b *testing.B) {
	g := newPauseGuard(engine.NewSystemClock(), time.Hour) // NB: no tick can be late by an hour here
	for b.Loop() {
		if err := g.check(); err != nil {
			b.Fatal(err)
		}
	}
}
