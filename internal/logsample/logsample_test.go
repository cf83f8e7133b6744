package logsample

import (
	"testing"
	"time"
)

// One line per interval, whatever the rate of calls, with the count held
// back: an outage wrote one "charge undecided" line per request.
func TestSamplerLetsOneLinePerInterval(t *testing.T) {
	var s Sampler
	t0 := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	if ok, held := s.Allow(t0, time.Second); !ok || held != 0 {
		t.Fatalf("first line: %v, %d", ok, held)
	}
	for i := range 99 {
		if ok, _ := s.Allow(t0.Add(time.Duration(i)*time.Millisecond), time.Second); ok {
			t.Fatalf("line %d within the second went out", i+2)
		}
	}
	if ok, held := s.Allow(t0.Add(time.Second), time.Second); !ok || held != 99 {
		t.Fatalf("a second later: %v, held back %d; want true, 99", ok, held)
	}
}
