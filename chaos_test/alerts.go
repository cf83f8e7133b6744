package chaos

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/cluster"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/shard"
)

// Quota alerts under faults (the ALERT check). Every node POSTs its quota
// alerts to the harness's webhook (alertSink, on the upstream's server)
// with a short lease, so that an alert a killed or paused node claimed is
// taken over by another node within the run. After the heal the harness
// waits until no alert is pending in the ledger, then holds the ledger's
// alerts against what the webhook took.
const (
	alertPath = "/hooks/quota"
	// alertLease is the nodes' --alert-lease: short, so takeovers happen
	// within a run; a node's round of retries ends before half of it.
	alertLease = 4 * time.Second
	// alertFailEvery: the webhook answers every third good delivery 503.
	alertFailEvery = 3
	// alertWait bounds the wait for the last pending alerts after the heal:
	// a lease, a sweep and a delivery, with room for a slow machine.
	alertWait = 60 * time.Second
)

type alertKey struct {
	account, period string
	threshold       int
}

// alertSink is the webhook receiver: it checks each alert's signature and
// timestamp as the README's receiver does and counts deliveries per alert.
// It answers one good delivery in alertFailEvery with a 503, a receiver
// having a bad moment: retries, rounds that end undelivered and takeovers
// happen during the run's faults.
type alertSink struct {
	secret string

	mu     sync.Mutex // protects the fields below
	calls  int
	failed int // good deliveries answered 503 on purpose
	got    map[alertKey]int
	bad    []string // refused deliveries, and why
}

func newAlertSink() *alertSink {
	b := make([]byte, 32)
	rand.Read(b)
	return &alertSink{secret: hex.EncodeToString(b), got: map[alertKey]int{}}
}

func (s *alertSink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<10))
	ts := r.Header.Get(node.AlertTimestampHeader)
	sec, perr := strconv.ParseInt(ts, 10, 64)
	var a node.Alert
	why := ""
	switch {
	case err != nil:
		why = "unreadable body: " + err.Error()
	case perr != nil || time.Since(time.Unix(sec, 0)).Abs() > 5*time.Minute:
		why = fmt.Sprintf("timestamp %q missing or more than 5 minutes off", ts)
	case !hmac.Equal([]byte(r.Header.Get(node.AlertSignatureHeader)), []byte(node.SignAlert([]byte(s.secret), ts, body))):
		why = "bad signature"
	case json.Unmarshal(body, &a) != nil:
		why = "not an alert: " + string(body)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if why != "" {
		s.bad = append(s.bad, why)
		http.Error(w, why, http.StatusUnauthorized)
		return
	}
	if s.calls++; s.calls%alertFailEvery == 0 {
		s.failed++
		http.Error(w, "the billing system is having a bad moment (on purpose)", http.StatusServiceUnavailable)
		return
	}
	k := alertKey{a.Account, a.Period, a.Threshold}
	s.got[k]++
	w.WriteHeader(http.StatusNoContent)
}

// waitAlerts waits until the ledger holds no pending alert and no
// threshold crossed without one (Ledger.MissedAlerts: the nodes' sweeps
// alert those within a sweep of the last settle), or alertWait.
func (h *harness) waitAlerts(run context.Context) {
	ctx, cancel := context.WithTimeout(run, alertWait)
	defer cancel()
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	// The months the run may have billed: this one, and the next one
	// (clock-jump) and the last (clock-skew) beside it.
	now := shard.PeriodOf(time.Now().UnixNano())
	for {
		rows, err := h.ledger.Alerts(ctx, flush.AlertQuery{})
		pending, missed := 0, 0
		for _, r := range rows {
			if r.State == flush.AlertPending {
				pending++
			}
		}
		for p := now - 1; p <= now+1 && err == nil; p++ {
			var m []flush.MissedAlert
			m, err = h.ledger.MissedAlerts(ctx, p, []int{80, 100}, 1000)
			missed += len(m)
		}
		if err == nil && pending == 0 && missed == 0 {
			return
		}
		select {
		case <-ctx.Done():
			if run.Err() == nil { // interrupted: the run says so
				why := ""
				if err != nil {
					why = fmt.Sprintf(" (the last read of the ledger failed: %v)", err)
				}
				h.logf("%d quota alerts still pending and %d thresholds crossed without one after %s%s", pending, missed, alertWait, why)
			}
			return
		case <-tick.C:
		}
	}
}

// alertResult is the ALERT check: every alert the ledger records was
// delivered and taken by the webhook, signed; the webhook took nothing the
// ledger does not record; each alert's figures reach its threshold; and a
// hard account whose month's quota the ledger shows used up has both its
// 80 % and 100 % alerts for that month.
func (h *harness) alertResult(ctx context.Context) cluster.Result {
	r := cluster.Result{ID: "ALERT", Name: "quota alerts: delivered at least once, signed, as recorded", Verdict: cluster.Held}
	add := func(account, format string, args ...any) {
		r.Count++
		if len(r.Violations) < 10 {
			r.Violations = append(r.Violations, cluster.Violation{Account: account, Detail: fmt.Sprintf(format, args...)})
		}
	}
	rows, err := h.ledger.Alerts(ctx, flush.AlertQuery{})
	if err != nil {
		add("", "could not read the ledger's alerts: %v", err)
		r.Verdict = cluster.Violated
		return r
	}
	s := h.alerts
	s.mu.Lock()
	defer s.mu.Unlock()
	recorded := map[alertKey]flush.AlertRecord{}
	var twice, takenOver int
	for _, a := range rows {
		k := alertKey{a.Account, a.Period.String(), a.Threshold}
		recorded[k] = a
		n := s.got[k]
		switch {
		case a.State != flush.AlertDelivered:
			add(a.Account, "%s %d%% alert %s after the run (%d attempts; last error %q)", k.period, k.threshold, a.State, a.Attempts, a.LastError)
		case n == 0:
			add(a.Account, "%s %d%% alert recorded delivered, never taken by the webhook", k.period, k.threshold)
		}
		if n > 1 {
			twice++
		}
		if !a.CreatedAt.Equal(a.ClaimedAt) {
			takenOver++
		}
		if a.Limit <= 0 || a.Used*100 < a.Limit*int64(a.Threshold) {
			add(a.Account, "%s %d%% alert claimed at %d of %d units", k.period, k.threshold, a.Used, a.Limit)
		}
	}
	for k, n := range s.got {
		if _, ok := recorded[k]; !ok {
			add(k.account, "the webhook took a %s %d%% alert %d times that the ledger does not record", k.period, k.threshold, n)
		}
	}
	for _, why := range s.bad {
		add("", "the webhook refused a delivery: %s", why)
	}
	exhausted := 0
	for _, id := range h.acct.hard {
		grants, err := h.ledger.Grants(ctx, id)
		if err != nil {
			add(id, "could not read its grants: %v", err)
			continue
		}
		for _, g := range grants {
			if !g.Monthly || g.Units <= 0 || g.Used < g.Units {
				continue
			}
			exhausted++
			for _, t := range []int{80, 100} {
				if _, ok := recorded[alertKey{id, g.Period, t}]; !ok {
					add(id, "used its %s quota up (%d of %d units) without a %d%% alert", g.Period, g.Used, g.Units, t)
				}
			}
		}
	}
	if r.Count > 0 {
		r.Verdict = cluster.Violated
	}
	at80 := 0
	for k := range recorded {
		if k.threshold == 80 {
			at80++
		}
	}
	r.Summary = fmt.Sprintf("%d alerts recorded (%d at 80 %%, %d at 100 %%), %d taken over after their lease, %d received twice, "+
		"%d deliveries answered 503 on purpose; %d hard accounts used a month's quota up",
		len(rows), at80, len(rows)-at80, takenOver, twice, s.failed, exhausted)
	return r
}
