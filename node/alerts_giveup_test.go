package node

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
)

// A give-up age the node accepts leaves an alert whose first round failed
// at least one takeover: --alert-give-up equal to --alert-lease ("at least
// --alert-lease") gave such an alert up at the very sweep that would have
// taken it over, untried, though the receiver was back.
func TestAlertGiveUpAgeLeavesATakeover(t *testing.T) {
	rc := &receiver{status: http.StatusServiceUnavailable}
	srv := httptest.NewServer(rc)
	defer srv.Close()
	l := testLedger(t)
	const lease = 300 * time.Millisecond
	cfg := Config{AlertWebhook: srv.URL, AlertSecret: testAlertSecret, AlertRetry: time.Millisecond, AlertLease: lease, AlertGiveUp: lease}
	n := &Node{cfg: cfg, log: slog.New(slog.DiscardHandler), reg: prometheus.NewRegistry(),
		clock: engine.NewManualClock(time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC))}
	n.ctx, n.cancel = context.WithCancel(context.Background())
	n.ledger.Store(&ledgerBox{l: l})
	if err := n.startAlerts(); err != nil {
		if !strings.Contains(err.Error(), "give-up") {
			t.Fatalf("refused for another reason: %v", err)
		}
		return // refused at the start: no alert is given up untried
	}
	t.Cleanup(stopAlerts(n))
	a := n.alerts
	a.onCharge("acme", decision(9, 10, june2026), nil)
	waitFor(t, 10*time.Second, "the first round to end undelivered", func() bool { return a.stats.Deferred.Load() == 1 })
	rc.mu.Lock()
	rc.status = 0 // the receiver is back
	rc.mu.Unlock()
	got := ledgerAlert(t, l, "the alert finished", func(r flush.AlertRecord) bool { return r.State != flush.AlertPending })
	if got.State != flush.AlertDelivered {
		t.Fatalf("with --alert-give-up equal to --alert-lease (accepted), the alert was %s after one round, never taken over (taken over %d)",
			got.State, a.stats.TakenOver.Load())
	}
}
