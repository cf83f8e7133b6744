// Package waitfor is how tests wait for something another goroutine or
// process makes true: poll a condition until it holds or a deadline
// passes, never sleep a guessed time. Every package's tests that wait use
// it, so a deadline's failure reads the same everywhere:
//
//	waitfor.Cond(t, 5*time.Second, "the refund of the 500", func() bool { return refunds() == 1 })
package waitfor

import (
	"testing"
	"time"
)

// Every is how often Cond polls.
const Every = 10 * time.Millisecond

// Cond polls cond every Every until it holds, or fails the test once
// timeout has passed, naming what it waited for.
func Cond(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(Every)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		<-tick.C
	}
}
