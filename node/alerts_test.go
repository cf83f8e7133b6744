package node

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

const testAlertSecret = "whsec-test-0123456789"

// verifyAlert is what a receiver does (the README shows the same code): it
// checks the timestamp is recent and the signature is the HMAC-SHA256 of
// timestamp + "." + body. It does not use SignAlert on purpose.
func verifyAlert(secret []byte, h http.Header, body []byte, now time.Time) error {
	ts := h.Get("X-Quotaring-Timestamp")
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return errors.New("missing or malformed X-Quotaring-Timestamp")
	}
	if d := now.Sub(time.Unix(sec, 0)); d > 5*time.Minute || d < -5*time.Minute {
		return errors.New("timestamp too far from now: a replay?")
	}
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte(ts + "."))
	mac.Write(body)
	want := "sha256=" + hex.EncodeToString(mac.Sum(nil))
	if !hmac.Equal([]byte(h.Get("X-Quotaring-Signature")), []byte(want)) {
		return errors.New("bad signature")
	}
	return nil
}

// receiver is a webhook receiver that fails its first failFirst calls.
type receiver struct {
	failFirst int
	status    int // answer after the failures (0: 204)
	hangAfter int // calls after this many hang until the caller gives up (0: none hang)
	// clock, when set, is the receiver's time (the nodes' manual clock,
	// standing for a system clock a node corrected from the ledger's);
	// else time.Now.
	clock *engine.ManualClock

	mu    sync.Mutex // protects the fields below
	calls int
	got   []Alert
	bad   []string
}

func (rc *receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.calls++
	if rc.hangAfter > 0 && rc.calls > rc.hangAfter {
		rc.mu.Unlock()
		<-r.Context().Done()
		rc.mu.Lock()
		return
	}
	if rc.calls <= rc.failFirst {
		http.Error(w, "down for maintenance", http.StatusServiceUnavailable)
		return
	}
	if rc.status != 0 {
		if rc.status/100 == 3 {
			w.Header().Set("Location", "/moved") // where a redirect-following client would GET, bodiless
		}
		w.WriteHeader(rc.status)
		return
	}
	now := time.Now()
	if rc.clock != nil {
		now = time.Unix(0, rc.clock.Now().Wall)
	}
	if err := verifyAlert([]byte(testAlertSecret), r.Header, body, now); err != nil {
		rc.bad = append(rc.bad, err.Error())
		http.Error(w, err.Error(), http.StatusUnauthorized)
		return
	}
	var a Alert
	if err := json.Unmarshal(body, &a); err != nil {
		rc.bad = append(rc.bad, err.Error())
	}
	rc.got = append(rc.got, a)
	w.WriteHeader(http.StatusNoContent)
}

func (rc *receiver) alerts() []Alert {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return slices.Clone(rc.got)
}

func (rc *receiver) callCount() int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return rc.calls
}

func sumStats(nodes []*Node, f func(*alertStats) int64) int64 {
	var n int64
	for _, nd := range nodes {
		n += f(&nd.alerts.stats)
	}
	return n
}

func TestAlertsOncePerThresholdAndPeriod(t *testing.T) {
	// The receiver checks the timestamp by the nodes' clock, months from
	// this machine's: a node signs by the clock it bills by (which a start
	// corrects from the ledger's), not the system clock.
	clock := engine.NewManualClock(time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC))
	rc := &receiver{failFirst: 2, clock: clock}
	srv := httptest.NewServer(rc)
	defer srv.Close()
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acme": 10})
	cfg := func(c *Config) {
		c.Clock, c.AlertWebhook, c.AlertSecret, c.AlertRetry = clock, srv.URL+"/hooks/quota", testAlertSecret, 5*time.Millisecond
	}
	nodes := startNodesWith(t, dsn, cfg, cfg)
	ctx := context.Background()
	charge := func(n int, want shard.Reason) {
		t.Helper()
		for range n {
			res, err := nodes[0].Router().Charge(ctx, router.ChargeRequest{Account: "acme", Route: "GET /x", Units: 1})
			if err != nil || res.Reason != want {
				t.Fatalf("charge: %v %v, want %v", res.Reason, err, want)
			}
		}
	}
	queued := func() int64 { return sumStats(nodes, func(s *alertStats) int64 { return s.Queued.Load() }) }
	waitAlerts := func(n int) {
		t.Helper()
		waitFor(t, 20*time.Second, strconv.Itoa(n)+" alerts at the receiver", func() bool { return len(rc.alerts()) >= n })
	}

	charge(7, shard.OK) // 70 %
	if q := queued(); q != 0 {
		t.Fatalf("%d alerts queued below 80 %%", q)
	}
	charge(1, shard.OK) // 80 %: the receiver fails twice, then takes it
	waitAlerts(1)
	charge(2, shard.OK) // 100 %
	waitAlerts(2)
	charge(3, shard.QuotaExceeded) // past 100 %: nothing more, and no ledger round trip
	if q := queued(); q != 2 {
		t.Fatalf("%d alerts queued after 100 %%, want 2", q)
	}

	// The other node sees the same crossing (as after an ownership move):
	// the ledger says it was sent, so it sends nothing.
	owner, _ := nodes[0].Ring().Owner("acme")
	other := nodes[0]
	if owner.ID == other.ID() {
		other = nodes[1]
	}
	june := shard.PeriodOf(clock.Now().Wall)
	other.alerts.onCharge("acme", decision(10, 10, june), nil)
	waitFor(t, 10*time.Second, "the other node's claims to fail", func() bool { return other.alerts.stats.AlreadySent.Load() == 2 })

	// July: alerts again.
	clock.SetWall(time.Date(2026, 7, 1, 0, 0, 1, 0, time.UTC))
	charge(8, shard.OK)
	waitAlerts(3)
	charge(2, shard.OK)
	waitAlerts(4)
	charge(1, shard.QuotaExceeded)

	got := rc.alerts()
	type k struct {
		period    string
		threshold int
	}
	want := map[k]int64{{"2026-06", 80}: 8, {"2026-06", 100}: 10, {"2026-07", 80}: 8, {"2026-07", 100}: 10}
	for _, a := range got {
		used, ok := want[k{a.Period, a.Threshold}]
		if !ok || a.Account != "acme" || a.Used != used || a.Limit != 10 || a.At.IsZero() {
			t.Errorf("unexpected or repeated alert %+v", a)
		}
		delete(want, k{a.Period, a.Threshold})
	}
	if len(got) != 4 || len(want) != 0 {
		t.Fatalf("alerts %+v; missing %v", got, want)
	}
	if len(rc.bad) > 0 {
		t.Fatalf("the receiver refused signatures: %v", rc.bad)
	}
	// What was sent is in the ledger (quotad admin alerts shows it).
	waitFor(t, 10*time.Second, "the four deliveries recorded in the ledger", func() bool {
		rows, err := nodes[0].Ledger().Alerts(ctx, flush.AlertQuery{Account: "acme"})
		done := 0
		for _, r := range rows {
			if r.State == flush.AlertDelivered {
				done++
			}
		}
		return err == nil && len(rows) == 4 && done == 4
	})
	if c := rc.callCount(); c != 6 {
		t.Fatalf("%d webhook calls, want 6 (2 failures, 4 alerts)", c)
	}
	if s, f, d := sumStats(nodes, func(s *alertStats) int64 { return s.Sent.Load() }),
		sumStats(nodes, func(s *alertStats) int64 { return s.Failed.Load() }),
		sumStats(nodes, func(s *alertStats) int64 { return s.Dropped.Load() }); s != 4 || f != 0 || d != 0 {
		t.Fatalf("sent %d failed %d dropped %d", s, f, d)
	}
}

// alerterTime is the time of testAlerter's manual clock, and of a receiver
// of its alerts (alerterReceiver): the alerter signs by it.
var alerterTime = time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC)

// alerterReceiver is a receiver on testAlerter's time.
func alerterReceiver(rc *receiver) *receiver {
	rc.clock = engine.NewManualClock(alerterTime)
	return rc
}

// testAlerter starts an alerter on a bare node: ledger l (nil: not reached),
// a manual clock at alerterTime, small retry waits, then what opts change.
func testAlerter(t *testing.T, url string, l flush.Ledger, opts ...func(*Config)) *alerter {
	t.Helper()
	cfg := Config{AlertWebhook: url, AlertSecret: testAlertSecret, AlertRetry: time.Millisecond}
	for _, o := range opts {
		o(&cfg)
	}
	n := &Node{cfg: cfg, log: slog.New(slog.DiscardHandler), reg: prometheus.NewRegistry(),
		clock: engine.NewManualClock(alerterTime)}
	n.ctx, n.cancel = context.WithCancel(context.Background())
	if l != nil {
		n.ledger.Store(&ledgerBox{l: l})
	}
	if err := n.startAlerts(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stopAlerts(n)) // the sender's stop path
	return n.alerts
}

// stopAlerts stops a bare node's alerter: the sender returns.
func stopAlerts(n *Node) func() { return func() { n.cancel(); n.wg.Wait() } }

// ledgerAlert waits until the ledger's only alert satisfies ok and returns it.
func ledgerAlert(t *testing.T, l flush.Ledger, what string, ok func(flush.AlertRecord) bool) flush.AlertRecord {
	t.Helper()
	var last []flush.AlertRecord
	waitFor(t, 10*time.Second, what, func() bool {
		var err error
		last, err = l.Alerts(context.Background(), flush.AlertQuery{})
		return err == nil && len(last) == 1 && ok(last[0])
	})
	return last[0]
}

func testLedger(t *testing.T) flush.Ledger {
	t.Helper()
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, nil)
	l, err := flush.Open(context.Background(), dsn, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

var june2026 = shard.PeriodOf(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC).UnixNano())

func decision(used, limit int64, p shard.Period) *shard.Decision {
	return &shard.Decision{Reason: shard.OK, Limit: limit, Remaining: limit - used, MonthUnits: limit, MonthUsed: used, Reset: p.End() / 1e9}
}

func TestAlertRetriesAreBounded(t *testing.T) {
	for _, tc := range []struct {
		name         string
		status       int
		wantAttempts int
		wantState    flush.AlertState
		wantErr      string
	}{
		{"5xx retried for a round, then left pending", http.StatusBadGateway, alertAttempts, flush.AlertPending, "the webhook answered 502"},
		{"429 retried", http.StatusTooManyRequests, alertAttempts, flush.AlertPending, "the webhook answered 429"},
		{"4xx final", http.StatusUnauthorized, 1, flush.AlertGivenUp, "the webhook answered 401"},
		{"3xx final, not followed", http.StatusFound, 1, flush.AlertGivenUp, "the webhook answered 302"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rc := &receiver{status: tc.status}
			srv := httptest.NewServer(rc)
			defer srv.Close()
			l := testLedger(t)
			a := testAlerter(t, srv.URL, l)
			a.onCharge("acme", decision(9, 10, june2026), nil)
			got := ledgerAlert(t, l, "the round's outcome in the ledger", func(r flush.AlertRecord) bool { return r.Attempts > 0 })
			if got.State != tc.wantState || got.Attempts != tc.wantAttempts || got.LastError != tc.wantErr || got.Used != 9 || got.Limit != 10 {
				t.Fatalf("ledger: %+v; want %s after %d attempts (%q)", got, tc.wantState, tc.wantAttempts, tc.wantErr)
			}
			if n := a.stats.Attempts.Load(); n != int64(tc.wantAttempts) || rc.callCount() != tc.wantAttempts {
				t.Fatalf("%d attempts, %d calls; want %d", n, rc.callCount(), tc.wantAttempts)
			}
			final, deferred := a.stats.Failed.Load(), a.stats.Deferred.Load()
			if tc.wantState == flush.AlertGivenUp && (final != 1 || deferred != 0) || tc.wantState == flush.AlertPending && (final != 0 || deferred != 1) {
				t.Fatalf("failed %d, deferred %d", final, deferred)
			}
		})
	}
}

// A round of retries that ends undelivered leaves the alert pending; once
// the claim's lease runs out a node takes it over and delivers it.
func TestAlertTakenOverAfterAFailedRound(t *testing.T) {
	rc := alerterReceiver(&receiver{status: http.StatusServiceUnavailable})
	srv := httptest.NewServer(rc)
	defer srv.Close()
	l := testLedger(t)
	a := testAlerter(t, srv.URL, l, func(c *Config) { c.AlertLease = 300 * time.Millisecond })
	a.onCharge("acme", decision(9, 10, june2026), nil)
	waitFor(t, 10*time.Second, "the first round to end undelivered", func() bool { return a.stats.Deferred.Load() == 1 })
	failed := rc.callCount()
	rc.mu.Lock()
	rc.status = 0 // the receiver is back
	rc.mu.Unlock()
	waitFor(t, 10*time.Second, "the alert taken over and sent", func() bool { return a.stats.Sent.Load() == 1 })
	got := ledgerAlert(t, l, "the delivery recorded", func(r flush.AlertRecord) bool { return r.State == flush.AlertDelivered })
	if got.Attempts != failed+1 || a.stats.TakenOver.Load() != 1 || len(rc.alerts()) != 1 {
		t.Fatalf("ledger %+v; %d failed calls, taken over %d, received %d", got, failed, a.stats.TakenOver.Load(), len(rc.alerts()))
	}
	if r := rc.alerts()[0]; r.Account != "acme" || r.Period != "2026-06" || r.Threshold != 80 || r.Used != 9 || r.Limit != 10 ||
		!r.At.Equal(time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC)) {
		t.Fatalf("taken-over alert %+v: not the crossing's figures", r)
	}
}

// An alert claimed by a node that stops before delivering it is sent by
// another node (or the same one started again) after the lease.
func TestAlertSurvivesItsNodeStopping(t *testing.T) {
	rc := alerterReceiver(&receiver{status: http.StatusServiceUnavailable})
	srv := httptest.NewServer(rc)
	defer srv.Close()
	l := testLedger(t)
	lease := func(c *Config) { c.AlertLease, c.AlertRetry = 300*time.Millisecond, time.Hour }
	first := testAlerter(t, srv.URL, l, lease)
	first.onCharge("acme", decision(10, 10, june2026), nil) // 80 % and 100 %
	// Answered, not only started: an attempt counted but still on its way
	// reached the receiver after it was back, and was delivered twice.
	waitFor(t, 10*time.Second, "the first attempts answered", func() bool {
		return first.stats.Attempts.Load() == 2 && rc.callCount() == 2
	})
	stopAlerts(first.n)() // waiting an hour to retry: both alerts still pending
	rc.mu.Lock()
	rc.status = 0 // the receiver is back
	rc.mu.Unlock()

	second := testAlerter(t, srv.URL, l, lease)
	waitFor(t, 10*time.Second, "both alerts taken over and sent", func() bool { return second.stats.Sent.Load() == 2 })
	got := rc.alerts()
	if len(got) != 2 || second.stats.TakenOver.Load() != 2 || rc.callCount() != 4 {
		t.Fatalf("received %+v in %d calls; taken over %d", got, rc.callCount(), second.stats.TakenOver.Load())
	}
	all, err := l.Alerts(context.Background(), flush.AlertQuery{Account: "acme"})
	if err != nil || len(all) != 2 {
		t.Fatalf("ledger %+v, %v", all, err)
	}
	waitFor(t, 10*time.Second, "both deliveries recorded", func() bool {
		all, _ = l.Alerts(context.Background(), flush.AlertQuery{Account: "acme"})
		return len(all) == 2 && all[0].State == flush.AlertDelivered && all[1].State == flush.AlertDelivered
	})
}

// A round of retries the node's stop cuts short is recorded as a round
// that ended undelivered: its calls count and its last failure stays (they
// were lost, the row showing 0 attempts and no error until a takeover).
func TestAlertRoundCutByAStopIsRecorded(t *testing.T) {
	rc := &receiver{status: http.StatusInternalServerError}
	srv := httptest.NewServer(rc)
	defer srv.Close()
	l := testLedger(t)
	a := testAlerter(t, srv.URL, l, func(c *Config) { c.AlertLease, c.AlertRetry = time.Hour, time.Hour })
	a.onCharge("acme", decision(10, 10, june2026), nil) // 80 % and 100 %
	waitFor(t, 10*time.Second, "the first attempts answered", func() bool {
		return a.stats.Attempts.Load() == 2 && rc.callCount() == 2
	})
	stopAlerts(a.n)() // mid-round: the next attempts wait an hour
	all, err := l.Alerts(context.Background(), flush.AlertQuery{Account: "acme"})
	if err != nil || len(all) != 2 {
		t.Fatalf("ledger %+v, %v", all, err)
	}
	for _, al := range all {
		if al.State != flush.AlertPending || al.Attempts != 1 || !strings.Contains(al.LastError, "500") {
			t.Errorf("%d%% alert after a stop mid-round: %s, %d attempts, last error %q; want pending, 1 attempt and the 500", al.Threshold, al.State, al.Attempts, al.LastError)
		}
	}
}

// An alert undelivered for AlertGiveUp is given up, and says why.
func TestAlertGivenUpAfterItsAge(t *testing.T) {
	rc := &receiver{status: http.StatusBadGateway}
	srv := httptest.NewServer(rc)
	defer srv.Close()
	l := testLedger(t)
	a := testAlerter(t, srv.URL, l, func(c *Config) { c.AlertLease, c.AlertGiveUp = 300*time.Millisecond, 600*time.Millisecond })
	a.onCharge("acme", decision(8, 10, june2026), nil)
	got := ledgerAlert(t, l, "the alert given up", func(r flush.AlertRecord) bool { return r.State == flush.AlertGivenUp })
	// NB: the sweep counts the failure once the ledger has given it up.
	waitFor(t, 10*time.Second, "the give-up counted", func() bool { return a.stats.Failed.Load() >= 1 })
	if got.LastError != "the webhook answered 502" || got.Attempts == 0 || int64(got.Attempts) > a.stats.Attempts.Load() || a.stats.Failed.Load() != 1 {
		t.Fatalf("given up: %+v; %d attempts made, failed %d", got, a.stats.Attempts.Load(), a.stats.Failed.Load())
	}
	if rc.alerts() != nil || a.stats.Sent.Load() != 0 {
		t.Fatal("sent")
	}
}

// A send the round's own end cuts short is not the webhook's failure: the
// ledger keeps the answer the webhook did give.
func TestAlertRoundCutShortKeepsTheWebhooksAnswer(t *testing.T) {
	rc := &receiver{status: http.StatusBadGateway, hangAfter: 1}
	srv := httptest.NewServer(rc)
	defer srv.Close()
	l := testLedger(t)
	a := testAlerter(t, srv.URL, l, func(c *Config) { c.AlertLease = 400 * time.Millisecond })
	a.onCharge("acme", decision(8, 10, june2026), nil)
	got := ledgerAlert(t, l, "the round's outcome", func(r flush.AlertRecord) bool { return r.State == flush.AlertPending && r.Attempts > 0 })
	if got.LastError != "the webhook answered 502" || got.Attempts != 2 {
		t.Fatalf("after a 502 and a send cut short by the round's end: %+v", got)
	}
}

func TestAlertClaimRetriedThenForgotten(t *testing.T) {
	rc := &receiver{}
	srv := httptest.NewServer(rc)
	defer srv.Close()
	a := testAlerter(t, srv.URL, nil) // the ledger is never reached
	a.onCharge("acme", decision(8, 10, june2026), nil)
	waitFor(t, 10*time.Second, "the claim given up", func() bool { return a.stats.Failed.Load() == 1 })
	if rc.callCount() != 0 {
		t.Fatal("an unclaimed alert was sent")
	}
	// Never claimed, so forgotten: the next charge queues it again.
	a.onCharge("acme", decision(8, 10, june2026), nil)
	if q := a.stats.Queued.Load(); q != 2 {
		t.Fatalf("queued %d, want 2", q)
	}
}

func TestAlertQueueFullDrops(t *testing.T) {
	a := &alerter{n: &Node{clock: engine.NewManualClock(time.Unix(0, 0))}, log: slog.New(slog.DiscardHandler),
		thresholds: []int{80, 100}, queue: make(chan queuedAlert, 1), memo: map[string]alertMemo{}}
	a.onCharge("acme", decision(10, 10, june2026), nil) // both thresholds at once; room for one
	if q, d := a.stats.Queued.Load(), a.stats.Dropped.Load(); q != 1 || d != 1 {
		t.Fatalf("queued %d dropped %d", q, d)
	}
	if qa := <-a.queue; qa.Threshold != 80 {
		t.Fatalf("queued %+v", qa)
	}
	a.onCharge("acme", decision(10, 10, june2026), nil) // the dropped one again
	if qa := <-a.queue; qa.Threshold != 100 || a.stats.Queued.Load() != 2 {
		t.Fatalf("queued %+v", qa)
	}
	a.onCharge("acme", decision(10, 10, june2026), nil)   // nothing new
	a.onCharge("acme", decision(10, 10, june2026-1), nil) // a late answer from May
	if len(a.queue) != 0 {
		t.Fatal("queued again")
	}
	// A new month forgets the old one's memo.
	a.onCharge("other", decision(9, 10, june2026+1), nil)
	if _, ok := a.memo["acme"]; ok || len(a.queue) != 1 {
		t.Fatalf("memo %v, queue %d", a.memo, len(a.queue))
	}
}

func TestReached(t *testing.T) {
	for _, tc := range []struct {
		used, limit int64
		pct         int
		want        bool
	}{
		{79, 100, 80, false}, {80, 100, 80, true}, {100, 100, 100, true}, {99, 100, 100, false},
		{7, 9, 80, false}, {8, 9, 80, true}, // 7.2 units is 80 %: 8 reaches it
		{0, 1, 1, false}, {1, 1, 1, true},
		{math.MaxInt64 / 10 * 8, math.MaxInt64 / 10 * 10, 80, true},
		{math.MaxInt64 - 1, math.MaxInt64, 100, false}, {math.MaxInt64, math.MaxInt64, 100, true},
	} {
		if got := reached(tc.used, tc.limit, tc.pct); got != tc.want {
			t.Errorf("reached(%d, %d, %d) = %v", tc.used, tc.limit, tc.pct, got)
		}
	}
}

func TestAlertConfig(t *testing.T) {
	if got, _ := alertThresholds(nil); !slices.Equal(got, []int{80, 100}) {
		t.Fatalf("default %v", got)
	}
	if got, _ := alertThresholds([]int{100, 50, 100}); !slices.Equal(got, []int{50, 100}) {
		t.Fatalf("sorted %v", got)
	}
	for _, bad := range [][]int{{0}, {101}, {-5, 80}} {
		if _, err := alertThresholds(bad); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
	for _, c := range []Config{
		{AlertWebhook: "http://example.com/hook"},                                  // no secret
		{AlertWebhook: "example.com/hook", AlertSecret: "s"},                       // not absolute
		{AlertWebhook: "ftp://example.com/", AlertSecret: "s"},                     // not http
		{AlertWebhook: "http://x/", AlertSecret: "s", AlertThresholds: []int{120}}, // not a percentage
	} {
		n := &Node{cfg: c, log: slog.New(slog.DiscardHandler), reg: prometheus.NewRegistry()}
		if err := n.startAlerts(); err == nil {
			t.Errorf("config %+v accepted", c)
		}
	}
	n := &Node{cfg: Config{AlertWebhook: "http://example.com/hook", AlertSecret: "whsec-short"}, log: slog.New(slog.DiscardHandler), reg: prometheus.NewRegistry()}
	if err := n.startAlerts(); err == nil || !strings.Contains(err.Error(), "--alert-secret is 11 characters; use at least 16") {
		t.Errorf("an 11-character secret: %v, want it refused, naming the length to use", err)
	}
	// The receiver is given the secret alone: with a line break or spaces
	// around it every signature would fail there.
	for _, secret := range []string{testAlertSecret + "\n", " " + testAlertSecret, testAlertSecret + "\x00"} {
		n := &Node{cfg: Config{AlertWebhook: "http://example.com/hook", AlertSecret: secret}, log: slog.New(slog.DiscardHandler), reg: prometheus.NewRegistry()}
		if err := n.startAlerts(); err == nil || !strings.Contains(err.Error(), "--alert-secret has spaces or a line break around it") {
			t.Errorf("secret %q: %v, want it refused", secret, err)
		}
	}
	n = &Node{cfg: Config{AlertWebhook: "http://example.com:99999/hook", AlertSecret: testAlertSecret}, log: slog.New(slog.DiscardHandler), reg: prometheus.NewRegistry()}
	if err := n.startAlerts(); err == nil || !strings.Contains(err.Error(), `port "99999" is not a number from 1 to 65535`) {
		t.Errorf("webhook port 99999: %v, want it refused", err)
	}
}

func TestSignAlert(t *testing.T) {
	body := []byte(`{"account":"acme"}`)
	h := http.Header{}
	ts := strconv.FormatInt(time.Now().Unix(), 10)
	h.Set(AlertTimestampHeader, ts)
	h.Set(AlertSignatureHeader, SignAlert([]byte(testAlertSecret), ts, body))
	if err := verifyAlert([]byte(testAlertSecret), h, body, time.Now()); err != nil {
		t.Fatal(err)
	}
	if verifyAlert([]byte("another secret"), h, body, time.Now()) == nil || verifyAlert([]byte(testAlertSecret), h, []byte(`{}`), time.Now()) == nil ||
		verifyAlert([]byte(testAlertSecret), h, body, time.Now().Add(time.Hour)) == nil {
		t.Fatal("a wrong secret, body or time verified")
	}
	// A fixed vector, so a change of the scheme shows up here. The same from
	// a shell: printf '%s' '1782648000.{}' | openssl dgst -sha256 -hmac secret
	if got := SignAlert([]byte("secret"), "1782648000", []byte(`{}`)); got != "sha256=be889f8acb309578e1f217b21414ba89c31573e08b7b5f993feba197d36de7ba" {
		t.Fatalf("vector: %s", got)
	}
}

// Alerts measure the month's quota, not the credits beside it: credits
// spent in an earlier month do not raise an alert at a new month's first
// charge, and a large credit does not hide the quota running out. A
// refusal for want of units is not 100 %: the request may cost more than
// is left of a month barely used.
func TestAlertsMeasureTheMonthsQuota(t *testing.T) {
	newAlerter := func() *alerter {
		return &alerter{n: &Node{clock: engine.NewManualClock(time.Unix(0, 0))}, log: slog.New(slog.DiscardHandler),
			thresholds: []int{80, 100}, queue: make(chan queuedAlert, 8), memo: map[string]alertMemo{}}
	}
	reset := june2026.End() / 1e9
	// June's first charge: 1,000 of quota unused, 9,000 of 10,000 credits
	// spent in May (Limit and Remaining count them).
	a := newAlerter()
	a.onCharge("acme", &shard.Decision{Reason: shard.OK, Limit: 11000, Remaining: 2000, MonthUnits: 1000, MonthUsed: 1, Reset: reset}, nil)
	if len(a.queue) != 0 {
		t.Fatalf("%d alerts at 0.1 %% of the month's quota (credits spent in May)", len(a.queue))
	}
	// The quota 85 % used beside a credit of 100,000 barely touched.
	a.onCharge("acme", &shard.Decision{Reason: shard.OK, Limit: 101000, Remaining: 99150, MonthUnits: 1000, MonthUsed: 850, Reset: reset}, nil)
	if qa := <-a.queue; qa.Threshold != 80 || qa.Used != 850 || qa.Limit != 1000 {
		t.Fatalf("queued %+v, want the 80 %% alert of the month's 1,000", qa.Alert)
	}
	// An export of 2,000 units refused at 10 % of a 1,000-unit month.
	a = newAlerter()
	a.onCharge("acme", &shard.Decision{Reason: shard.QuotaExceeded, Limit: 1000, Remaining: 900, MonthUnits: 1000, MonthUsed: 100, Reset: reset, RetryAfter: 1}, nil)
	if len(a.queue) != 0 {
		t.Fatalf("%d alerts for a request larger than what is left of a month 10 %% used", len(a.queue))
	}
	// A plan without a monthly quota (credits only) has no alerts.
	a = newAlerter()
	a.onCharge("acme", &shard.Decision{Reason: shard.QuotaExceeded, Limit: 500, Remaining: 0, Reset: reset, RetryAfter: shard.Never}, nil)
	if len(a.queue) != 0 {
		t.Fatal("an alert for an account without a monthly quota")
	}
}

// A given-up alert resent (quotad admin alerts resend) is taken over by the
// next sweep and delivered.
func TestAlertResentAfterTheReceiverIsFixed(t *testing.T) {
	rc := alerterReceiver(&receiver{status: http.StatusUnauthorized}) // a receiver with the wrong secret
	srv := httptest.NewServer(rc)
	defer srv.Close()
	l := testLedger(t)
	a := testAlerter(t, srv.URL, l, func(c *Config) { c.AlertLease = time.Second })
	a.onCharge("acme", decision(8, 10, june2026), nil)
	ledgerAlert(t, l, "the alert given up", func(r flush.AlertRecord) bool { return r.State == flush.AlertGivenUp })
	rc.mu.Lock()
	rc.status = 0 // fixed
	rc.mu.Unlock()
	if _, err := l.ResendAlert(context.Background(), "acme", june2026, 80); err != nil {
		t.Fatal(err)
	}
	got := ledgerAlert(t, l, "the resent alert delivered", func(r flush.AlertRecord) bool { return r.State == flush.AlertDelivered })
	if len(rc.alerts()) != 1 || got.Attempts != 2 || a.stats.TakenOver.Load() != 1 {
		t.Fatalf("received %d, ledger %+v, taken over %d", len(rc.alerts()), got, a.stats.TakenOver.Load())
	}
}

// A test alert (quotad admin alerts test) reaches the receiver signed like
// a real one and marked as a test, is not recorded, and the answer says
// what the receiver did and what that means for real alerts.
func TestAlertTestEndpoint(t *testing.T) {
	rc := &receiver{}
	srv := httptest.NewServer(rc)
	defer srv.Close()
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	withWebhook := func(c *Config) {
		c.AdminToken, c.AlertWebhook, c.AlertSecret = testAdminToken, srv.URL+"/hooks/quota?token=hide-me", testAlertSecret
	}
	withoutWebhook := func(c *Config) { c.AdminToken = testAdminToken }
	nodes := startNodesWith(t, dsn, withWebhook, withoutWebhook)

	var res AlertTest
	if code, raw := adminCall(t, nodes[0], testAdminToken, "POST", "/admin/v1/alerts/test", nil, &res); code != http.StatusOK {
		t.Fatalf("test alert: %d %s", code, raw)
	}
	got := rc.alerts()
	if !res.OK || res.Status != http.StatusNoContent || len(got) != 1 || !got[0].Test || got[0].Account != TestAlertAccount ||
		got[0].Threshold != 80 || got[0].Used != 80 || got[0].Limit != 100 {
		t.Fatalf("test alert: answer %+v, received %+v (bad signatures: %v)", res, got, rc.bad)
	}
	if strings.Contains(res.Webhook, "hide-me") || !strings.Contains(res.Hint, "the receiver took it") {
		t.Fatalf("test alert answer: webhook %q, hint %q", res.Webhook, res.Hint)
	}
	if rows, err := nodes[0].Ledger().Alerts(context.Background(), flush.AlertQuery{}); err != nil || len(rows) != 0 {
		t.Fatalf("a test alert is in the ledger: %+v %v", rows, err)
	}

	rc.mu.Lock()
	rc.status = http.StatusUnauthorized // a receiver with another secret
	rc.mu.Unlock()
	res = AlertTest{}
	adminCall(t, nodes[0], testAdminToken, "POST", "/admin/v1/alerts/test", nil, &res)
	if res.OK || res.Status != http.StatusUnauthorized || !strings.Contains(res.Hint, "--alert-secret") {
		t.Fatalf("test alert refused: %+v", res)
	}
	srv.Close()
	res = AlertTest{}
	adminCall(t, nodes[0], testAdminToken, "POST", "/admin/v1/alerts/test", nil, &res)
	if res.OK || res.Status != 0 || res.Error == "" || strings.Contains(res.Error, "hide-me") || !strings.Contains(res.Hint, "did not answer") {
		t.Fatalf("test alert to a receiver that is gone: %+v", res)
	}
	if p := wantProblem(t, nodes[1], "POST", "/admin/v1/alerts/test", nil, http.StatusConflict, ""); !strings.Contains(p.Detail, "--alert-webhook") {
		t.Fatalf("test alert from a node without a webhook: %q", p.Detail)
	}
}

// A webhook URL's query often carries a token: a failed call's error, which
// goes to the logs and the ledger's last_error, does not show it.
func TestAlertErrorsHideTheWebhooksSecrets(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	addr := dead.Listener.Addr().String()
	dead.Close()
	a := testAlerter(t, "http://user:pw-secret@"+addr+"/hooks?token=q-secret", nil)
	_, err := a.send(context.Background(), []byte("{}"), time.Second)
	if err == nil || strings.Contains(err.Error(), "secret") || !strings.Contains(err.Error(), addr+"/hooks") {
		t.Fatalf("send to a closed port: %v, want an error naming %s/hooks without the password or query", err, addr)
	}
}

// A crossing no decision here saw: another owner's charges used the month up
// and settled (the account was charged elsewhere while this owner was down),
// and no charge followed. The sweep finds it in the ledger and sends the 80 %
// and 100 % alerts, once each, with the ledger's figures: in this node's
// month, and in the next one, where only a node whose clock ran ahead bills
// (once that clock is put right, no node's clock names the month).
func TestAlertForACrossingNoDecisionSaw(t *testing.T) {
	for _, p := range []shard.Period{june2026, june2026 + 1} {
		t.Run(p.String(), func(t *testing.T) { testAlertForACrossingNoDecisionSaw(t, p) })
	}
}

func testAlertForACrossingNoDecisionSaw(t *testing.T, period shard.Period) {
	rc := alerterReceiver(&receiver{})
	srv := httptest.NewServer(rc)
	defer srv.Close()
	l := testLedger(t)
	ctx := context.Background()
	settleOthersMonth(t, l, period)

	a := testAlerter(t, srv.URL, l, func(c *Config) { c.AlertLease = 300 * time.Millisecond }) // sweeps every 30 ms
	waitFor(t, 10*time.Second, "both alerts delivered", func() bool { return len(rc.alerts()) == 2 })
	got := rc.alerts()
	slices.SortFunc(got, func(x, y Alert) int { return x.Threshold - y.Threshold })
	for i, th := range []int{80, 100} {
		if r := got[i]; r.Account != "acme" || r.Period != period.String() || r.Threshold != th || r.Used != 10 || r.Limit != 10 {
			t.Fatalf("alert %d: %+v; want acme %s %d%% at 10 of 10", i, r, period, th)
		}
	}
	if n := a.stats.CaughtUp.Load(); n != 2 {
		t.Fatalf("caught up %d alerts, want 2", n)
	}
	// Once recorded, a sweep finds nothing more; and a charge's decision that
	// now shows 100 % queues nothing (the sweep marked it as this node's).
	ledgerDelivered := func() bool {
		rs, err := l.Alerts(ctx, flush.AlertQuery{})
		return err == nil && len(rs) == 2 && rs[0].State == flush.AlertDelivered && rs[1].State == flush.AlertDelivered
	}
	waitFor(t, 10*time.Second, "both deliveries recorded", ledgerDelivered)
	if more := a.sweepMissed(ctx, l, nil); len(more) != 0 {
		t.Fatalf("a sweep after delivery queued %d alerts again", len(more))
	}
	a.onCharge("acme", decision(10, 10, period), nil)
	if n := a.stats.Queued.Load(); n != 0 {
		t.Fatalf("a charge at 100 %% queued %d alerts the sweep had sent", n)
	}
}

// Last month's crossings are swept for a day after it ended (charges
// settled late), not later: a webhook turned on in June does not alert
// for May.
func TestMissedAlertsOfLastMonthOnlyForADay(t *testing.T) {
	l := testLedger(t)
	ctx := context.Background()
	may := june2026 - 1
	settleOthersMonth(t, l, may)
	a := testAlerter(t, "http://127.0.0.1:1/hooks", l, func(c *Config) { c.AlertLease = time.Hour }) // the loop sweeps every 6 minutes
	clock := a.n.clock.(*engine.ManualClock)
	clock.SetWall(time.Unix(0, june2026.Start()).Add(missedPastGrace + time.Minute))
	if got := a.sweepMissed(ctx, l, nil); len(got) != 0 {
		t.Fatalf("a day and a minute into June: %d of May's alerts queued, want none", len(got))
	}
	clock.SetWall(time.Unix(0, june2026.Start()).Add(30 * time.Minute))
	got := a.sweepMissed(ctx, l, nil)
	if len(got) != 2 || got[0].a.Period != may.String() {
		t.Fatalf("half an hour into June: %d alerts queued, want May's 80 %% and 100 %%", len(got))
	}
}

// settleOthersMonth settles, as another node's, a charge that uses up the
// 10-unit hard quota of account acme in period.
func settleOthersMonth(t *testing.T, l flush.Ledger, period shard.Period) {
	t.Helper()
	ctx := context.Background()
	if err := l.UpsertPlan(ctx, snapshot.Plan{ID: "ten", MonthlyQuota: 10, Hard: true}); err != nil {
		t.Fatal(err)
	}
	if err := l.UpsertAccount(ctx, "acme", "ten"); err != nil {
		t.Fatal(err)
	}
	mark, err := l.RegisterNode(ctx, "other", "other-inc")
	if err != nil {
		t.Fatal(err)
	}
	b := &flush.Batch{Node: "other", Incarnation: "other-inc", Prev: mark, Next: mark + 1, Events: true,
		Charges: []flush.Charge{{Seq: mark + 1, Account: "acme", EventID: "e1", ClientID: true, Key: "k", Route: "GET /x", Units: 10,
			Wall: period.Start() + int64(time.Hour), Period: period, Allocs: []shard.Alloc{{Grant: shard.MonthlyGrantID(period), Units: 10}}}}}
	if res, err := l.Settle(ctx, b); err != nil || !res.Applied {
		t.Fatalf("settle the other owner's charge: %+v, %v", res, err)
	}
}

// A sweep takes what the charges queued first: it ran before them when the
// sender had been busy with a slow receiver, took their crossings for
// missed ones and sent them as caught up, at the sweep's time.
func TestSweepTakesTheQueuedAlertsFirst(t *testing.T) {
	in := make(chan queuedAlert, 3)
	in <- queuedAlert{Alert: Alert{Account: "gamma", Threshold: 100}}
	in <- queuedAlert{Alert: Alert{Account: "delta", Threshold: 80}}
	pending := drainQueued([]*delivery{{a: queuedAlert{Alert: Alert{Account: "beta", Threshold: 80}}}}, in)
	var got []string
	for _, d := range pending {
		got = append(got, d.a.Account)
	}
	if !slices.Equal(got, []string{"beta", "gamma", "delta"}) || len(in) != 0 {
		t.Fatalf("pending %v with %d left queued; want beta, gamma, delta and none", got, len(in))
	}
	if p := drainQueued(pending, in); len(p) != 3 {
		t.Fatalf("an empty queue added %d", len(p)-3)
	}
}

// A quota raised mid-month (the plan's, or a bigger plan) makes its
// thresholds new crossings: the customer who upgraded from 10 to 20 units
// is warned at 16 and 20, not left to run into the new limit unwarned
// (a review: alerts went silent for the rest of the month).
func TestAlertsAgainAfterTheQuotaIsRaised(t *testing.T) {
	rc := &receiver{}
	srv := httptest.NewServer(rc)
	defer srv.Close()
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acme": 10})
	// NB: the ledger's clock, not a test month: UpsertPlan raises the monthly
	// grant of the ledger's current month.
	clock := engine.NewManualClock(time.Now())
	cfg := func(c *Config) {
		c.Clock, c.AlertWebhook, c.AlertSecret, c.AlertRetry = clock, srv.URL+"/hooks/quota", testAlertSecret, 5*time.Millisecond
		c.SnapshotInterval = 20 * time.Millisecond
	}
	nodes := startNodesWith(t, dsn, cfg, cfg)
	ctx := context.Background()
	charge := func(n int) {
		t.Helper()
		for range n {
			if res, err := nodes[0].Router().Charge(ctx, router.ChargeRequest{Account: "acme", Route: "GET /x", Units: 1}); err != nil || res.Reason != shard.OK {
				t.Fatalf("charge: %v %v", res.Reason, err)
			}
		}
	}
	waitAlerts := func(n int) {
		t.Helper()
		waitFor(t, 20*time.Second, strconv.Itoa(n)+" alerts at the receiver", func() bool { return len(rc.alerts()) >= n })
	}
	charge(10)
	waitAlerts(2)
	l, err := flush.Open(ctx, dsn, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = l.UpsertPlan(ctx, snapshot.Plan{ID: "plan-acme", MonthlyQuota: 20, Hard: true})
	l.Close()
	if err != nil {
		t.Fatal(err)
	}
	// A refused charge leaves no trace: try until the owner has the new
	// quota and the units it frees reserved.
	waitFor(t, 20*time.Second, "a charge past the old quota", func() bool {
		res, err := nodes[0].Router().Charge(ctx, router.ChargeRequest{Account: "acme", Route: "GET /x", Units: 1})
		return err == nil && res.Reason == shard.OK
	})
	charge(5) // 16 of 20: 80 %
	waitAlerts(3)
	charge(4) // 20 of 20
	waitAlerts(4)
	got := rc.alerts()
	if len(got) != 4 {
		t.Fatalf("alerts %+v, want 4", got)
	}
	for i, w := range []struct {
		threshold   int
		used, limit int64
	}{{80, 8, 10}, {100, 10, 10}, {80, 16, 20}, {100, 20, 20}} {
		if a := got[i]; a.Threshold != w.threshold || a.Used != w.used || a.Limit != w.limit {
			t.Errorf("alert %d: %+v, want %d %% at %d of %d", i, a, w.threshold, w.used, w.limit)
		}
	}
}
