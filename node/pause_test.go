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
// engine's Hold, under the account's lock) when no pause is held: a
// monotonic clock reading and two atomic loads. "now" reads it through
// Clock.Now, as the guard first did (the wall clock too).
//
//	go test ./node -run '^$' -bench PauseCheck -benchtime 2s
func BenchmarkPauseCheck(b *testing.B) {
	for _, via := range []string{"mono", "now"} {
		b.Run(via, func(b *testing.B) {
			c := engine.NewSystemClock()
			g := newPauseGuard(c, time.Hour) // NB: no tick can be late by an hour here
			if via == "now" {
				g.mono = func() int64 { return c.Now().Mono }
			}
			for b.Loop() {
				if err := g.check(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
