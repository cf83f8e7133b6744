package node

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
)

// slowClaimLedger commits the first RecordAlert, then answers it only
// after hold (a reply lost or late: the caller's attempt fails), so the
// node's claim wins on a later attempt, with the ledger's claimed_at from
// the first.
type slowClaimLedger struct {
	flush.Ledger
	hold time.Duration

	mu    sync.Mutex
	calls int
}

func (l *slowClaimLedger) RecordAlert(ctx context.Context, a flush.AlertRecord) (bool, error) {
	won, err := l.Ledger.RecordAlert(ctx, a)
	l.mu.Lock()
	l.calls++
	first := l.calls == 1
	l.mu.Unlock()
	if !first || err != nil {
		return won, err
	}
	t := time.NewTimer(l.hold) // the reply is late (fault injection, not a wait for the test)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
	return false, context.DeadlineExceeded
}

// pairReceiver holds a call from node A (path /a) until node B (path /b)
// calls, then takes both: a call A still makes after B took the alert
// over is a second delivery.
type pairReceiver struct {
	mu    sync.Mutex
	got   []string // the path of each call taken
	bCame chan struct{}
	once  sync.Once
}

func (p *pairReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	if err := verifyAlert([]byte(testAlertSecret), r.Header, body, alerterTime); err != nil { // testAlerter's clock
		http.Error(w, err.Error(), http.StatusUnauthorized)
		return
	}
	var a Alert
	if json.Unmarshal(body, &a) != nil {
		http.Error(w, "bad", http.StatusBadRequest)
		return
	}
	if strings.HasSuffix(r.URL.Path, "/b") {
		p.once.Do(func() { close(p.bCame) })
	} else {
		select {
		case <-p.bCame:
		case <-r.Context().Done():
			return
		}
	}
	p.mu.Lock()
	p.got = append(p.got, r.URL.Path)
	p.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

// A claim whose first attempt committed but whose reply was lost wins on a
// retry; its round must still end within half the lease of the ledger's
// claim, not of the winning retry, or it is still sending when another
// node takes the alert over after the lease: the alert is delivered twice.
func TestAlertClaimRetryRoundEndsWithinTheLease(t *testing.T) {
	rc := &pairReceiver{bCame: make(chan struct{})}
	srv := httptest.NewServer(rc)
	defer srv.Close()
	l := testLedger(t)
	const lease = 2 * time.Second
	sl := &slowClaimLedger{Ledger: l, hold: lease * 8 / 10}
	a := testAlerter(t, srv.URL+"/a", sl, func(c *Config) { c.AlertLease = lease })
	a.onCharge("acme", decision(8, 10, june2026), nil)
	waitFor(t, 10*time.Second, "A's claim won on its retry", func() bool {
		sl.mu.Lock()
		defer sl.mu.Unlock()
		return sl.calls >= 2
	})
	b := testAlerter(t, srv.URL+"/b", l, func(c *Config) { c.AlertLease = lease })
	// Generous: A's sweep may take the alert over first, each time for a
	// round its receiver holds to the round's end (it waits for B's call),
	// before B's sweep does; on a loaded machine (CI, -race) 10 s ran out.
	waitFor(t, 60*time.Second, "the alert delivered", func() bool {
		rows, err := l.Alerts(context.Background(), flush.AlertQuery{})
		return err == nil && len(rows) == 1 && rows[0].State == flush.AlertDelivered
	})
	// A's held call (if any) ends with its round: then count.
	waitFor(t, 10*time.Second, "A's round over", func() bool {
		return a.stats.Deferred.Load()+a.stats.Sent.Load()+a.stats.AlreadySent.Load() >= 1
	})
	rc.mu.Lock()
	got := append([]string(nil), rc.got...)
	rc.mu.Unlock()
	if len(got) != 1 {
		t.Fatalf("the alert was delivered %d times (%v): node A was still sending after node B took it over (A sent %d, B sent %d)",
			len(got), got, a.stats.Sent.Load(), b.stats.Sent.Load())
	}
}
