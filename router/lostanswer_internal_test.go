package router

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
)

// lostTakeBack is a Charger whose first replay take-back reaches the owner
// but whose answer is lost: the front hears the owner did not answer.
type lostTakeBack struct {
	Charger
	lost atomic.Bool
}

func (c *lostTakeBack) Refund(ctx context.Context, req RefundRequest) (shard.Decision, error) {
	d, err := c.Charger.Refund(ctx, req)
	if err == nil && req.Replay && c.lost.CompareAndSwap(false, true) {
		return shard.Decision{}, fmt.Errorf("%w: the owner did not answer (test: its answer was lost)", ErrUnavailable)
	}
	return d, err
}

// Three requests with one Idempotency-Key through the front, on a real
// engine: the first is charged, the two retries are answered Replayed and
// served. The second fails, and its take-back's answer is lost, so the
// front sends it again; then the first fails (its refund is held for the
// third) and the third is served. The account stays billed once: the
// take-back sent twice counted once. Counted twice, it released the first
// attempt's refund while the third was served, and the account was billed
// nothing.
func TestATakeBackSentAgainAfterALostAnswerCountsOnce(t *testing.T) {
	r := openSelfOwned(t, func(string) bool { return true })
	charger := &lostTakeBack{Charger: r}
	mw, err := Middleware(FrontOptions{Charger: charger, Config: testConfig(t)})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	entered := map[string]chan struct{}{}
	answer := map[string]chan int{}
	for _, n := range []string{"1", "2", "3"} {
		entered[n], answer[n] = make(chan struct{}), make(chan int)
	}
	upstream := mw(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		n := req.Header.Get("X-Attempt")
		mu.Lock()
		close(entered[n])
		mu.Unlock()
		w.WriteHeader(<-answer[n])
	}))
	done := map[string]chan int{}
	send := func(n string) {
		req := newRequest("POST", "/v1/tasks", nil)
		req.Header.Set("Idempotency-Key", "job")
		req.Header.Set("X-Attempt", n)
		done[n] = make(chan int, 1)
		go func() {
			w := httptest.NewRecorder()
			upstream.ServeHTTP(w, req)
			done[n] <- w.Code
		}()
		select {
		case <-entered[n]:
		case <-time.After(10 * time.Second):
			t.Fatalf("attempt %s never reached the upstream", n)
		}
	}
	finish := func(n string, code int) {
		t.Helper()
		answer[n] <- code
		select {
		case got := <-done[n]:
			if got != code {
				t.Fatalf("attempt %s: answered %d, want the upstream's %d", n, got, code)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("attempt %s: no answer", n)
		}
	}
	for _, n := range []string{"1", "2", "3"} {
		send(n)
	}
	finish("2", http.StatusInternalServerError) // its take-back: applied, answer lost, sent again
	if !charger.lost.Load() {
		t.Fatal("the failed replay was not taken back")
	}
	finish("1", http.StatusBadGateway) // its refund waits for the third
	finish("3", http.StatusOK)
	u, _, err := r.cfg.Engine.Usage("acme")
	if err != nil {
		t.Fatal(err)
	}
	if u.Used != 2 {
		t.Fatalf("used %d, want 2: the third attempt was served, so the event stays billed", u.Used)
	}
}
