package node

import (
	"context"
	"errors"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
)

// flakyFinishLedger fails the first FinishAlert (a moment's ledger error).
type flakyFinishLedger struct {
	flush.Ledger
	mu     sync.Mutex
	failed bool
}

func (l *flakyFinishLedger) FinishAlert(ctx context.Context, a flush.AlertRecord, s flush.AlertState, attempts int, lastErr string) (bool, error) {
	l.mu.Lock()
	first := !l.failed
	l.failed = true
	l.mu.Unlock()
	if first {
		return false, errors.New("ledger: connection reset")
	}
	return l.Ledger.FinishAlert(ctx, a, s, attempts, lastErr)
}

func (l *flakyFinishLedger) tried() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.failed
}

// A node that stops while it waits to retry recording a delivery it made
// records it on its way out: the ledger answers, and leaving the alert
// pending has the next node send it again after the lease.
func TestAlertStopRecordsADeliveryMade(t *testing.T) {
	rc := alerterReceiver(&receiver{})
	srv := httptest.NewServer(rc)
	defer srv.Close()
	l := testLedger(t)
	fl := &flakyFinishLedger{Ledger: l}
	lease := func(c *Config) { c.AlertLease, c.AlertRetry = 300*time.Millisecond, time.Hour }
	first := testAlerter(t, srv.URL, fl, lease)
	first.onCharge("acme", decision(8, 10, june2026), nil)
	waitFor(t, 10*time.Second, "the alert delivered and its recording failed once", func() bool {
		return first.stats.Sent.Load() == 1 && fl.tried()
	})
	stopAlerts(first.n)() // its report retry waited an hour
	rows, err := l.Alerts(context.Background(), flush.AlertQuery{})
	if err != nil || len(rows) != 1 {
		t.Fatalf("alerts %+v, %v", rows, err)
	}
	if rows[0].State != flush.AlertDelivered {
		// Left pending: the next node takes it over after the lease and
		// sends it again.
		second := testAlerter(t, srv.URL, l, lease)
		waitFor(t, 10*time.Second, "another node to take it over", func() bool { return second.stats.Sent.Load() == 1 })
		t.Fatalf("a delivery made before the stop was left %s in the ledger; the receiver got it %d times", rows[0].State, len(rc.alerts()))
	}
}
