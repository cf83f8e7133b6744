package loadgen

import (
	"context"
	"sync"
	"time"
)

// OpenLoop calls fn(i) for i in [0, n), the i-th at start + i/rate seconds,
// each in a goroutine of its own: open loop, so a slow answer does not hold
// back the next request (a closed loop, Run, would measure less load when the
// system slows down). It waits for every call that started, and returns how
// many left more than a millisecond after their time (the generator short of
// CPU) and ctx's error if it ended before all n were sent.
func OpenLoop(ctx context.Context, rate, n int, fn func(i int)) (late int, err error) {
	interval := time.Second / time.Duration(rate)
	var wg sync.WaitGroup
	defer wg.Wait()
	start := time.Now()
	timer := time.NewTimer(0)
	defer timer.Stop()
	<-timer.C
	for i := 0; i < n; i++ {
		if w := time.Until(start.Add(time.Duration(i) * interval)); w > 0 {
			timer.Reset(w)
			select {
			case <-ctx.Done():
				return late, ctx.Err()
			case <-timer.C:
			}
		} else if -w > time.Millisecond {
			late++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn(i)
		}()
	}
	return late, nil
}
