// Package logsample keeps a log line that every request or every retry of
// an outage would write down to one per interval, counting the ones it held
// back, so that the first line of an outage is seen at once and the log
// does not drown:
//
//	var undecided logsample.Sampler // one per component, not per process
//	if ok, held := undecided.Allow(time.Now(), time.Second); ok {
//		log.Warn("charge undecided", "err", err, "similar_lines_held_back", held)
//	}
package logsample

import (
	"sync"
	"time"
)

// Sampler lets one line per interval through. The zero value is ready; it
// is safe for concurrent use.
type Sampler struct {
	mu   sync.Mutex // protects next and held
	next time.Time
	held int
}

// Allow reports whether a line may go out at now, letting one through per
// every, and how many were held back since the last one that did.
func (s *Sampler) Allow(now time.Time, every time.Duration) (ok bool, held int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if now.Before(s.next) {
		s.held++
		return false, 0
	}
	held, s.held = s.held, 0
	s.next = now.Add(every)
	return true, held
}
