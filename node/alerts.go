package node

import (
	"bytes"
	"context"
	"crypto/hmac"
	crand "crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
)

// Quota alerts.
//
// The node that answers a charge (the account's owner) sees the account's
// use of the period, Limit - Remaining over Limit, in the decision. When it
// reaches one of Config.AlertThresholds (percent, [80, 100]), the alert
// (account, period, threshold) is due. The charge hook only enqueues it on a
// bounded queue, never blocking the charge; a full queue drops it with a log
// line and quotaring_alerts_dropped_total, and a later charge of the account
// queues it again.
//
// One goroutine (run) owns the queue's other end and every delivery in
// flight. For each alert it first claims it in the ledger
// (Ledger.RecordAlert: only the first claim in the cluster wins, so two
// nodes that both see a crossing, say around an ownership move, send it
// once), then POSTs it to the webhook, retrying with exponential backoff and
// jitter while the receiver fails (5xx, 429, network errors), and records
// the outcome (Ledger.FinishAlert): delivered; given up (a 3xx, which is
// not followed, or a 4xx other than 429 is final); or, after a round of
// alertAttempts failed attempts, still pending.
//
// Delivery is at least once. A claim is a lease (Config.AlertLease, 10
// minutes): a node's round of retries ends before half of it has passed, and
// every node sweeps the ledger (Ledger.TakeOverAlerts) for pending claims
// older than the lease, takes them over under a claim of its own and starts
// a new round. So an alert survives its node's crash or stop and a receiver
// that is down for hours; it is given up only when still undelivered
// Config.AlertGiveUp (72 hours) after its first claim. A webhook can go out
// twice: when its node delivered it but could not record that before the
// lease ran out, or when a node stalled past the lease in mid-round.
// Receivers must be idempotent on (account, period, threshold), which they
// should be anyway: a delivery whose reply was lost is retried.
//
// Each node remembers in memory which alerts of the current period it has
// queued, claimed or found claimed, so that the ledger is asked once per
// account, period and threshold, not on every charge.
//
// # Wire format
//
//	POST <AlertWebhook>
//	Content-Type: application/json
//	X-Quotaring-Timestamp: 1782648000            (Unix seconds, when this attempt was signed)
//	X-Quotaring-Signature: sha256=<hex HMAC-SHA256(AlertSecret, timestamp + "." + body)>
//
//	{"account":"acme","period":"2026-06","threshold":80,"used":48,"limit":60,"at":"2026-06-28T12:00:00Z"}
//
// A receiver recomputes the HMAC over the timestamp header, a dot and the raw
// body, compares it in constant time (hmac.Equal) and rejects timestamps too
// far from its clock (say 5 minutes) against replays. Every attempt is signed
// afresh. README.md ("Quota alerts") has a receiver in Go.

// Alert is the JSON body of a quota alert webhook.
type Alert struct {
	Account   string    `json:"account"`
	Period    string    `json:"period"`    // "2026-06", a calendar month in UTC
	Threshold int       `json:"threshold"` // percent of the period's quota
	Used      int64     `json:"used"`      // units of the month's quota used when the threshold was crossed
	Limit     int64     `json:"limit"`     // units of the month's quota (credits not included)
	At        time.Time `json:"at"`        // when the node saw the crossing, in whole seconds
	// Test marks a test alert (quotad admin alerts test): signed like the
	// others, for no real account; a receiver checks it and drops it.
	Test bool `json:"test,omitempty"`
}

// Alert headers.
const (
	AlertSignatureHeader = "X-Quotaring-Signature"
	AlertTimestampHeader = "X-Quotaring-Timestamp"
)

// SignAlert is the X-Quotaring-Signature value of body signed at timestamp
// (the X-Quotaring-Timestamp value): "sha256=" + hex HMAC-SHA256(secret,
// timestamp + "." + body).
func SignAlert(secret []byte, timestamp string, body []byte) string {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(timestamp))
	m.Write([]byte{'.'})
	m.Write(body)
	return "sha256=" + hex.EncodeToString(m.Sum(nil))
}

const (
	// alertQueueSize bounds the alerts waiting for the sender, and (again)
	// the deliveries it holds in flight.
	alertQueueSize = 1024
	// alertAttempts bounds the claim attempts and the send attempts of one
	// round: with the default AlertRetry of 2s, the waits are at most 2, 4,
	// 8, 16, 32, 60 and 60 s, and at least half of each (jitter): 1.5 to 3
	// minutes in all.
	alertAttempts = 8
	// alertMaxWait caps one backoff wait.
	alertMaxWait = time.Minute
	// alertSweepBatch bounds the alerts one sweep takes over.
	alertSweepBatch = 64
	// alertTimeout bounds one webhook call, and one claim.
	alertTimeout = 10 * time.Second
	// maxThresholds is the width of alertMemo.done.
	maxThresholds = 32
)

// alerter is a node's quota alerts: the charge hook (onCharge) and the
// sender (run).
type alerter struct {
	n          *Node
	log        *slog.Logger
	url        string
	shownURL   string // url without its password and query, for logs and errors
	secret     []byte
	thresholds []int // ascending, 1..100
	retry      time.Duration
	lease      time.Duration // a claim older than this is taken over (Config.AlertLease)
	giveUp     time.Duration // a pending alert older than this is given up (Config.AlertGiveUp)
	client     *http.Client
	// queue is written by onCharge (never blocking) and read by run only.
	queue chan queuedAlert

	mu sync.RWMutex // protects memo and latest
	// memo holds, per account, the thresholds of period latest this node has
	// queued, claimed or found claimed (bit i: thresholds[i]).
	memo   map[string]alertMemo
	latest shard.Period

	stats alertStats
}

type alertMemo struct {
	period shard.Period
	done   uint32
	// limit is the month's quota done's crossings were of: a higher one (a
	// quota raised, a bigger plan) clears done, as the ledger re-arms
	// alerts delivered for a lower limit (RecordAlert). Without it a
	// customer who upgraded mid-month ran into the new limit unwarned.
	limit int64
}

type queuedAlert struct {
	Alert
	period shard.Period
	bit    uint32
	claim  string // names this node's claim in the ledger (RecordAlert)
}

// alertStats count what the alerter did (metrics and tests).
type alertStats struct {
	Queued      atomic.Int64 // alerts handed to the sender
	Dropped     atomic.Int64 // alerts dropped because the queue was full
	Sent        atomic.Int64 // webhooks the receiver took (2xx)
	AlreadySent atomic.Int64 // claims another node (or an earlier run) had made
	Failed      atomic.Int64 // alerts given up: never claimed, refused, or past AlertGiveUp
	Deferred    atomic.Int64 // rounds that ended undelivered: left pending for a takeover
	TakenOver   atomic.Int64 // pending alerts this node took over from the ledger
	CaughtUp    atomic.Int64 // crossings the ledger showed that no decision here saw (sweepMissed)
	Attempts    atomic.Int64 // webhook calls made
}

// delivery is one alert the sender works on, through three stages: claim
// it (fresh crossings only; a takeover is claimed already), send it, and
// record the outcome.
type delivery struct {
	a        queuedAlert
	stage    deliveryStage
	attempts int       // of the current stage
	sent     int       // webhook calls of this round
	next     time.Time // when to make the next attempt
	until    time.Time // the round's last send starts before it: half the lease after the claim
	claimed  time.Time // when the first claim attempt started: the ledger's claim may date from it
	body     []byte
	outcome  flush.AlertState // what the report stage records
	lastErr  string           // the round's last failure
}

type deliveryStage uint8

const (
	stageClaim  deliveryStage = iota // Ledger.RecordAlert
	stageSend                        // the webhook
	stageReport                      // Ledger.FinishAlert
)

// alertSecretMin is the shortest --alert-secret accepted, as for the
// admin and RPC tokens.
const alertSecretMin = 16

// startAlerts validates the alert config and, with a webhook, hooks the
// alerter to every answered charge and starts its sender.
func (n *Node) startAlerts() error {
	c := &n.cfg
	if c.AlertWebhook == "" {
		if c.AlertSecret != "" {
			n.log.Warn("--alert-secret is set without --alert-webhook: no alerts are sent")
		}
		return nil
	}
	u, err := CheckAlertWebhook(c.AlertWebhook)
	if err != nil {
		return err
	}
	if c.AlertSecret == "" {
		return fmt.Errorf("node: --alert-webhook needs --alert-secret (QUOTAD_ALERT_SECRET): alerts are signed so the receiver can tell them from forgeries")
	}
	if len(c.AlertSecret) < alertSecretMin {
		return fmt.Errorf("node: --alert-secret is %d characters; use at least %d random ones (openssl rand -hex 32), and give the receiver the same: a short secret can be guessed, and then alerts forged", len(c.AlertSecret), alertSecretMin)
	}
	if NotASecretAlone(c.AlertSecret) {
		// The receiver is given the secret without them: every signature
		// would fail its check, found only when alerts go missing.
		return fmt.Errorf("node: --alert-secret has spaces or a line break around it, or control characters: give the secret alone, as the receiver has it")
	}
	thresholds, err := alertThresholds(c.AlertThresholds)
	if err != nil {
		return err
	}
	if c.AlertRetry < 0 {
		return fmt.Errorf("node: alert retry %s must not be negative", c.AlertRetry)
	}
	if c.AlertLease < 0 || c.AlertGiveUp < 0 {
		return fmt.Errorf("node: alert lease %s and give-up age %s must not be negative", c.AlertLease, c.AlertGiveUp)
	}
	setDefault(&c.AlertRetry, 2*time.Second)
	setDefault(&c.AlertLease, 10*time.Minute)
	setDefault(&c.AlertGiveUp, 72*time.Hour)
	if c.AlertGiveUp < c.AlertLease {
		return fmt.Errorf("node: alert give-up age %s is shorter than the alert lease %s: an alert whose first round failed would be given up before any node took it over", c.AlertGiveUp, c.AlertLease)
	}
	if c.AlertGiveUp < 2*c.AlertLease {
		// The sweep that finds a claim past its lease gives the alert up
		// first when it is past the give-up age too: with a give-up age
		// within a sweep of the lease, never taken over.
		return fmt.Errorf("node: alert give-up age %s is less than twice the alert lease %s: an alert whose first round failed would be given up by the sweep that was to take it over", c.AlertGiveUp, c.AlertLease)
	}
	a := &alerter{n: n, log: n.log.With("component", "alerts"), url: c.AlertWebhook, shownURL: redactURL(u), secret: []byte(c.AlertSecret),
		thresholds: thresholds, retry: c.AlertRetry, lease: c.AlertLease, giveUp: c.AlertGiveUp, client: &http.Client{Timeout: alertTimeout,
			// A redirect would turn the POST into a bodiless GET whose 2xx
			// counts as delivered: a 3xx is an answer, and not a 2xx.
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }},
		queue: make(chan queuedAlert, alertQueueSize), memo: make(map[string]alertMemo)}
	counter := func(name, help string, v *atomic.Int64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return float64(v.Load()) })
	}
	if err := registerAll(n.reg,
		counter("quotaring_alerts_sent_total", "Quota alert webhooks the receiver accepted (2xx).", &a.stats.Sent),
		counter("quotaring_alerts_dropped_total", "Quota alerts dropped because the alert queue was full (queued again by a later charge).", &a.stats.Dropped),
		counter("quotaring_alerts_failed_total", "Quota alerts given up: refused by the webhook (4xx), undelivered for the give-up age, or never claimed in the ledger.", &a.stats.Failed),
		counter("quotaring_alerts_deferred_total", "Rounds of webhook retries that ended undelivered; the alert stays pending in the ledger and is taken over after the lease.", &a.stats.Deferred),
		counter("quotaring_alerts_taken_over_total", "Pending quota alerts this node took over from the ledger (their claim's lease had run out).", &a.stats.TakenOver),
		counter("quotaring_alerts_caught_up_total", "Quota alerts queued by the sweep for thresholds the ledger's settled use crossed with no alert recorded: crossings no owner saw in a decision (the charges were another owner's).", &a.stats.CaughtUp),
		counter("quotaring_alerts_already_sent_total", "Quota alerts this node saw but another node (or an earlier start) had already claimed.", &a.stats.AlreadySent),
		counter("quotaring_alert_attempts_total", "Webhook calls made for quota alerts, retries included.", &a.stats.Attempts),
	); err != nil {
		return fmt.Errorf("node: alert metrics: %w", err)
	}
	n.alerts = a
	n.chargeHooks = append(n.chargeHooks, a.onCharge)
	n.goLoop(a.run)
	n.log.Info("quota alerts on", "webhook", a.shownURL, "thresholds", thresholds, "lease", c.AlertLease, "give_up", c.AlertGiveUp)
	return nil
}

func registerAll(reg *prometheus.Registry, cs ...prometheus.Collector) error {
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// redactURL hides a password, the query and the path past its first
// segment, where tokens live (Slack's /services/T…/B…/SECRET, a Zapier or
// Teams hook's id): logs, errors and the ledger's last_error show only
// scheme://host:port/first-segment/….
func redactURL(u *url.URL) string {
	r := url.URL{Scheme: u.Scheme, Host: u.Host}
	if u.User != nil {
		r.User = url.User(u.User.Username())
	}
	s := r.String()
	if p := strings.TrimPrefix(u.EscapedPath(), "/"); p != "" {
		first, rest, more := strings.Cut(p, "/")
		s += "/" + first
		if more && rest != "" {
			s += "/…"
		}
	}
	if u.RawQuery != "" {
		s += "?…"
	}
	return s
}

// CheckAlertWebhook parses Config.AlertWebhook, refusing what can never
// be delivered to: not an absolute http:// or https:// URL, no host name,
// a port that is not a number from 1 to 65535, or a #fragment (never
// sent). Errors show the URL without its query and password.
func CheckAlertWebhook(raw string) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("node: --alert-webhook: want an absolute http:// or https:// URL, such as https://billing.example.com/hooks/quota")
	}
	if err := router.CheckURLHost(u, "node: --alert-webhook "+redactURL(u), "http(s)://HOST[:PORT]/path"); err != nil {
		return nil, err
	}
	return u, nil
}

// MinAlertLease is the shortest --alert-lease quotad serve takes (outside
// chaos tests): a node's round of tries gets half the lease, and one
// webhook call may take up to 10 s; under it a slow but working receiver
// has its calls cut short every round, and the alert is never delivered.
const MinAlertLease = 3 * alertTimeout

// CheckAlertThresholds reports what is wrong with Config.AlertThresholds
// (each a percentage from 1 to 100, at most 32 of them), naming the flag
// --alert-thresholds. Start checks them only with a webhook; a command line
// checks them always.
func CheckAlertThresholds(thresholds []int) error {
	_, err := alertThresholds(thresholds)
	return err
}

// alertThresholds checks and sorts thresholds; nil means 80 and 100.
func alertThresholds(in []int) ([]int, error) {
	if len(in) == 0 {
		return []int{80, 100}, nil
	}
	out := slices.Clone(in)
	slices.Sort(out)
	out = slices.Compact(out)
	if len(out) > maxThresholds {
		return nil, fmt.Errorf("node: --alert-thresholds: at most %d thresholds", maxThresholds)
	}
	for _, t := range out {
		if t < 1 || t > 100 {
			return nil, fmt.Errorf("node: --alert-thresholds: %d is not a percentage from 1 to 100 (such as 80,100)", t)
		}
	}
	return out, nil
}

// reached reports whether used units reach pct percent of limit (limit > 0),
// in integers without overflow: used >= ceil(limit * pct / 100).
func reached(used, limit int64, pct int) bool {
	q, r := limit/100, limit%100
	p := int64(pct)
	return used >= q*p+(r*p+99)/100
}

// onCharge is the charge hook: it runs on the charge path, after the answer
// is durable, for every charge this node answered as the owner. It never
// blocks: most calls return after a few comparisons, without a lock.
func (a *alerter) onCharge(account string, d *shard.Decision, err error) {
	if err != nil || d == nil || d.MonthUnits <= 0 || d.Reset <= 0 {
		return // NB: a plan without a monthly quota (credits only) has no alerts
	}
	// The month's quota, not the credits beside it: credits count their use
	// since they were granted, which would raise alerts in a month that has
	// barely begun, and a large credit would hide the quota running out.
	// NB: a refusal for want of units is not 100 %: the request may cost
	// more than is left of a month barely used (one large export).
	used, limit := d.MonthUsed, d.MonthUnits
	var crossed uint32
	for i, t := range a.thresholds {
		if !reached(used, limit, t) {
			break // ascending
		}
		crossed |= 1 << i
	}
	if crossed == 0 {
		return
	}
	// Reset is the end of the decision's period (Unix seconds), so the
	// period is the decision's own, not a second reading of the clock.
	period := shard.PeriodOf(d.Reset*int64(time.Second) - 1)
	fresh := a.mark(account, period, limit, crossed)
	if fresh == 0 {
		return
	}
	// Whole seconds: the body is the same bytes whichever node sends it (a
	// takeover reads it back from the ledger, which keeps microseconds).
	at := time.Unix(0, a.n.clock.Now().Wall).UTC().Truncate(time.Second)
	for i, t := range a.thresholds {
		bit := uint32(1) << i
		if fresh&bit == 0 {
			continue
		}
		qa := queuedAlert{Alert: Alert{Account: account, Period: period.String(), Threshold: t, Used: used, Limit: limit, At: at},
			period: period, bit: bit, claim: crand.Text()}
		select {
		case a.queue <- qa:
			a.stats.Queued.Add(1)
		default:
			a.stats.Dropped.Add(1)
			a.unmark(account, period, bit) // a later charge queues it again
			a.log.Warn("alert queue full: alert dropped for now (the account's next charge queues it again)",
				"account", account, "period", period.String(), "threshold", t)
		}
	}
}

// mark records the crossed thresholds of account in period, of the month's
// quota limit, and returns the ones not recorded before (all of them again
// when limit is higher than the one recorded).
func (a *alerter) mark(account string, period shard.Period, limit int64, crossed uint32) uint32 {
	// Every charge of an account past a threshold lands here: a shared lock
	// answers the common "already known" case without serializing them.
	a.mu.RLock()
	m, ok := a.memo[account]
	known := ok && (m.period > period || m.period == period && crossed&^m.done == 0 && limit <= m.limit)
	a.mu.RUnlock()
	if known {
		return 0
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if period > a.latest {
		// A new month: forget the old one, so the memo holds at most the
		// accounts that crossed a threshold this month.
		for acct, m := range a.memo {
			if m.period < period {
				delete(a.memo, acct)
			}
		}
		a.latest = period
	}
	m = a.memo[account]
	switch {
	case m.period > period:
		return 0 // a late answer from a month already over
	case m.period < period:
		m = alertMemo{period: period}
	}
	if limit > m.limit {
		m.done, m.limit = 0, limit // raised: the crossings of the new limit are new alerts
	}
	fresh := crossed &^ m.done
	m.done |= crossed
	a.memo[account] = m
	return fresh
}

// unmark forgets a threshold, so that a later charge queues it again.
func (a *alerter) unmark(account string, period shard.Period, bit uint32) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if m, ok := a.memo[account]; ok && m.period == period {
		m.done &^= bit
		a.memo[account] = m
	}
}

// run is the sender: the only reader of the queue and the only owner of the
// deliveries in flight. It returns when ctx is canceled (Shutdown); what is
// still pending then stays pending in the ledger, for a takeover.
func (a *alerter) run(ctx context.Context) {
	var pending []*delivery
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	sweep := time.NewTicker(min(max(a.lease/10, 10*time.Millisecond), time.Minute))
	defer sweep.Stop()
	for {
		in := a.queue
		if len(pending) >= alertQueueSize {
			in = nil // back-pressure: the queue fills and the hook drops
		}
		var due <-chan time.Time
		if len(pending) > 0 {
			next := pending[0].next
			for _, d := range pending[1:] {
				if d.next.Before(next) {
					next = d.next
				}
			}
			timer.Reset(time.Until(next))
			due = timer.C
		}
		select {
		case <-ctx.Done():
			n := len(a.queue) // not delivered: queued, claimed, in a round (recorded at stop or not)
			for _, d := range pending {
				if d.stage != stageReport || d.outcome != flush.AlertDelivered {
					n++
				}
			}
			a.recordAtStop(ctx, pending)
			if n > 0 {
				a.log.Warn("stopping with quota alerts not delivered: the claimed ones stay pending in the ledger, and a node takes them over once their lease runs out",
					"alerts", n, "lease", a.lease)
			}
			return
		case qa := <-in:
			pending = append(pending, &delivery{a: qa, next: time.Now()})
		case <-sweep.C:
			// Alerts the charges queued first: a sweep that ran before them
			// (the sender was busy with a slow receiver, and select picked
			// the tick) took their crossings for missed ones, and sent
			// them as caught up, with the sweep's time as when the node saw
			// the crossing.
			pending = drainQueued(pending, in)
			pending = a.sweep(ctx, pending)
		case <-due:
		}
		now := time.Now()
		pending = slices.DeleteFunc(pending, func(d *delivery) bool {
			if d.next.After(now) || ctx.Err() != nil {
				return false
			}
			return a.step(ctx, d)
		})
	}
}

// alertStopWait bounds recordAtStop. Short: the stop waits for it before
// the final settle, whose budget (--settle-timeout) it shares; a record
// lost here costs a second delivery of the alert, not a unit.
const alertStopWait = 2 * time.Second

// recordAtStop makes a last attempt, at the stop, to record the outcomes
// of the rounds that ended and wait to be recorded (a failed FinishAlert,
// retried later): a delivery made and left pending in the ledger is sent
// again by the next node to take it over.
func (a *alerter) recordAtStop(ctx context.Context, pending []*delivery) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), alertStopWait)
	defer cancel()
	for _, d := range pending {
		switch {
		case ctx.Err() != nil:
			return
		case d.stage == stageSend && d.sent > 0:
			// A round the stop cut short: recorded as one that ended
			// undelivered, or its calls and its last failure were lost (0
			// attempts and no error, until a takeover's own).
			d.stage, d.outcome = stageReport, flush.AlertPending
		case d.stage != stageReport:
			continue
		}
		d.attempts = alertAttempts // the last one
		a.reportStep(ctx, d, a.log.With("account", d.a.Account, "period", d.a.Period, "threshold", d.a.Threshold))
	}
}

// sweep takes over the pending alerts whose claim's lease ran out (their
// node stopped, or its round of retries ended undelivered) and appends
// them to pending; the ledger gives up the ones pending for too long.
func (a *alerter) sweep(ctx context.Context, pending []*delivery) []*delivery {
	room := min(alertQueueSize-len(pending), alertSweepBatch)
	l := a.n.Ledger()
	if room <= 0 || l == nil {
		return pending
	}
	ctx, cancel := context.WithTimeout(ctx, alertTimeout)
	defer cancel()
	claim := crand.Text()
	start := time.Now()
	taken, givenUp, err := l.TakeOverAlerts(ctx, claim, a.lease, a.giveUp, room)
	if err != nil {
		a.log.Warn("could not look for pending alerts to take over; trying again at the next sweep", "err", err)
		return pending
	}
	for _, g := range givenUp {
		a.stats.Failed.Add(1)
		a.log.Error("alert given up: not delivered within the give-up age (check the webhook receiver)", "account", g.Account,
			"period", g.Period.String(), "threshold", g.Threshold, "give_up", a.giveUp, "attempts", g.Attempts, "last_error", g.LastError)
	}
	for _, r := range taken {
		a.stats.TakenOver.Add(1)
		al := Alert{Account: r.Account, Period: r.Period.String(), Threshold: r.Threshold, Used: r.Used, Limit: r.Limit, At: r.CrossedAt.UTC()}
		a.log.Info("taking over a pending alert (its claim's node stopped, or its round of retries ended undelivered)",
			"account", al.Account, "period", al.Period, "threshold", al.Threshold, "attempts_before", r.Attempts, "last_error", r.LastError)
		pending = append(pending, &delivery{a: queuedAlert{Alert: al, period: r.Period, claim: claim},
			stage: stageSend, next: start, until: start.Add(a.lease / 2), body: alertBody(al)})
	}
	return a.sweepMissed(ctx, l, pending)
}

// missedPastGrace is how long after a month ends its crossings are still
// swept (sweepMissed): long enough for charges settled late (a node down
// for hours) to alert, short enough that turning a webhook on does not
// alert for months long over.
const missedPastGrace = 24 * time.Hour

// sweepMissed queues the crossings of this month, the last (for a day
// after it ended: missedPastGrace) and the next that the ledger's settled
// use shows and no alert records (Ledger.MissedAlerts). The next month has use only where a node whose
// clock ran ahead billed an account there; once that clock is put right, no
// node's clock names that month until the calendar reaches it.
// The charge hook sees a crossing only in a decision, and an owner's
// decisions count another owner's charges only once they settle: an
// account charged by a second owner while its first was down or cut off,
// then handed back, could use its month up with no decision ever showing
// 100 %, and with no charge after it, none ever would. Every node sweeps;
// the claim in the ledger sends each alert once.
func (a *alerter) sweepMissed(ctx context.Context, l flush.Ledger, pending []*delivery) []*delivery {
	now := a.n.clock.Now().Wall
	cur := shard.PeriodOf(now)
	at := time.Unix(0, now).UTC().Truncate(time.Second)
	start := time.Now()
	for _, period := range []shard.Period{cur - 1, cur, cur + 1} {
		if period < cur && now-period.End() > int64(missedPastGrace) {
			continue // over for a while: nothing to act on (and a webhook just turned on must not alert for it)
		}
		room := min(alertQueueSize-len(pending), alertSweepBatch)
		if room <= 0 {
			break
		}
		missed, err := l.MissedAlerts(ctx, period, a.thresholds, room)
		if err != nil {
			a.log.Warn("could not look for quota thresholds crossed without an alert; trying again at the next sweep", "err", err)
			return pending
		}
		for _, m := range missed {
			i := slices.Index(a.thresholds, m.Threshold)
			if i < 0 || slices.ContainsFunc(pending, func(d *delivery) bool {
				return d.a.Account == m.Account && d.a.period == period && d.a.Threshold == m.Threshold
			}) {
				continue // claimed by an earlier sweep's delivery, not recorded yet
			}
			bit := uint32(1) << i
			a.mark(m.Account, period, m.Limit, bit) // the charge hook need not queue it too
			a.stats.CaughtUp.Add(1)
			a.log.Info("quota threshold crossed with no alert recorded: the ledger's settled use shows it (charges another owner decided, or use from before alerts were on); alerting",
				"account", m.Account, "period", period.String(), "threshold", m.Threshold, "used", m.Used, "limit", m.Limit)
			al := Alert{Account: m.Account, Period: period.String(), Threshold: m.Threshold, Used: m.Used, Limit: m.Limit, At: at}
			pending = append(pending, &delivery{a: queuedAlert{Alert: al, period: period, bit: bit, claim: crand.Text()}, next: start})
		}
	}
	return pending
}

// drainQueued moves what is queued in in to pending, without waiting.
func drainQueued(pending []*delivery, in <-chan queuedAlert) []*delivery {
	for {
		select {
		case qa := <-in:
			pending = append(pending, &delivery{a: qa, next: time.Now()})
		default:
			return pending
		}
	}
}

func alertBody(al Alert) []byte {
	body, err := json.Marshal(al)
	if err != nil {
		panic(err) // plain fields: cannot fail
	}
	return body
}

// step makes one attempt at d's current stage and reports whether d is
// finished (recorded, found claimed, or given up).
func (a *alerter) step(ctx context.Context, d *delivery) (done bool) {
	al := &d.a
	logger := a.log.With("account", al.Account, "period", al.Period, "threshold", al.Threshold)
	d.attempts++
	switch d.stage {
	case stageClaim:
		if d.claimed.IsZero() {
			// An attempt whose reply was lost may have made the claim: the
			// ledger dates the lease from it, and a retry that wins finds
			// that claim, not a new one.
			d.claimed = time.Now()
		}
		won, err := a.claim(ctx, al)
		switch {
		case err != nil && d.attempts >= alertAttempts:
			a.stats.Failed.Add(1)
			a.unmark(al.Account, al.period, al.bit) // never claimed: a later charge may try again
			logger.Error("alert not claimed in the ledger after retries: not sent", "attempts", d.attempts, "err", err)
			return true
		case err != nil:
			d.next = time.Now().Add(a.backoff(d.attempts))
			logger.Warn("alert claim failed; retrying", "attempt", d.attempts, "err", err)
			return false
		case !won:
			a.stats.AlreadySent.Add(1)
			logger.Debug("alert already claimed by another node or an earlier start: not sent again")
			return true
		}
		d.stage, d.attempts, d.until, d.body = stageSend, 1, d.claimed.Add(a.lease/2), alertBody(al.Alert)
		return a.sendStep(ctx, d, logger)
	case stageSend:
		return a.sendStep(ctx, d, logger)
	}
	return a.reportStep(ctx, d, logger)
}

// sendStep makes one webhook call of d's round.
func (a *alerter) sendStep(ctx context.Context, d *delivery, logger *slog.Logger) (done bool) {
	left := time.Until(d.until)
	if left <= 0 {
		why := "" // the round's last webhook error says more
		if d.lastErr == "" {
			why = "the round ran out of its half of the lease before a send"
		}
		a.stats.Deferred.Add(1)
		return a.endRound(ctx, d, logger, flush.AlertPending, why)
	}
	timeout := min(left, alertTimeout)
	status, err := a.send(ctx, d.body, timeout)
	d.sent++
	if err != nil && timeout < alertTimeout && errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
		// The round's own end cut the call short, not the webhook: the
		// ledger keeps what the webhook last answered.
		why := ""
		if d.lastErr == "" {
			why = "the webhook had not answered when the round ran out of its half of the lease"
		}
		a.stats.Deferred.Add(1)
		logger.Warn("alert round ran out during a webhook call: it stays pending in the ledger, and a node tries again once its claim's lease runs out",
			"attempts", d.attempts, "lease", a.lease)
		return a.endRound(ctx, d, logger, flush.AlertPending, why)
	}
	switch {
	case err == nil && status < 300:
		a.stats.Sent.Add(1)
		logger.Info("alert sent", "attempts", d.attempts)
		return a.endRound(ctx, d, logger, flush.AlertDelivered, "")
	case err == nil && status < 500 && status != http.StatusTooManyRequests:
		a.stats.Failed.Add(1)
		logger.Error("alert refused by the webhook: not retried (a 4xx answer is final: check the receiver's signature check and secret; a 3xx is not followed: point --alert-webhook at the final URL)", "status", status)
		return a.endRound(ctx, d, logger, flush.AlertGivenUp, fmt.Sprintf("the webhook answered %d", status))
	}
	lastErr := fmt.Sprintf("the webhook answered %d", status)
	if err != nil {
		lastErr = err.Error()
	}
	next := time.Now().Add(a.backoff(d.attempts))
	if d.attempts >= alertAttempts || !next.Before(d.until) {
		a.stats.Deferred.Add(1)
		logger.Warn("alert not delivered in this round of retries: it stays pending in the ledger, and a node tries again once its claim's lease runs out",
			"attempts", d.attempts, "last_error", lastErr, "lease", a.lease)
		return a.endRound(ctx, d, logger, flush.AlertPending, lastErr)
	}
	d.next, d.lastErr = next, lastErr
	logger.Warn("alert webhook failed; retrying", "attempt", d.attempts, "status", status, "err", err, "retry_in", time.Until(d.next).Round(time.Millisecond))
	return false
}

// endRound moves d to the report stage with the round's outcome and makes
// the first attempt at recording it.
func (a *alerter) endRound(ctx context.Context, d *delivery, logger *slog.Logger, outcome flush.AlertState, lastErr string) bool {
	d.stage, d.attempts, d.outcome = stageReport, 1, outcome
	if lastErr != "" {
		d.lastErr = lastErr
	}
	return a.reportStep(ctx, d, logger)
}

// reportStep records the round's outcome in the ledger.
func (a *alerter) reportStep(ctx context.Context, d *delivery, logger *slog.Logger) (done bool) {
	l := a.n.Ledger()
	err := fmt.Errorf("the ledger has not been reached yet")
	var recorded bool
	if l != nil {
		ctx, cancel := context.WithTimeout(ctx, alertTimeout)
		rec := flush.AlertRecord{Account: d.a.Account, Period: d.a.period, Threshold: d.a.Threshold, Claim: d.a.claim}
		recorded, err = l.FinishAlert(ctx, rec, d.outcome, d.sent, d.lastErr)
		cancel()
	}
	switch {
	case err == nil:
		if !recorded {
			logger.Info("alert's outcome not recorded: another node took it over or finished it meanwhile", "outcome", d.outcome)
		}
		return true
	case d.attempts >= alertAttempts:
		logger.Error("could not record the alert's outcome in the ledger: once its lease runs out a node may send it again",
			"outcome", d.outcome, "attempts", d.attempts, "err", err)
		return true
	}
	d.next = time.Now().Add(a.backoff(d.attempts))
	logger.Warn("recording the alert's outcome failed; retrying", "outcome", d.outcome, "attempt", d.attempts, "err", err)
	return false
}

// claim records the alert in the ledger; only the first claim in the
// cluster wins.
func (a *alerter) claim(ctx context.Context, al *queuedAlert) (bool, error) {
	l := a.n.Ledger()
	if l == nil {
		return false, fmt.Errorf("the ledger has not been reached yet")
	}
	ctx, cancel := context.WithTimeout(ctx, alertTimeout)
	defer cancel()
	return l.RecordAlert(ctx, flush.AlertRecord{Account: al.Account, Period: al.period, Threshold: al.Threshold,
		Used: al.Used, Limit: al.Limit, CrossedAt: al.At, Claim: al.claim})
}

// send makes one webhook call, signed now, that may take up to timeout.
func (a *alerter) send(ctx context.Context, body []byte, timeout time.Duration) (status int, err error) {
	a.stats.Attempts.Add(1)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, a.url, bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	// NB: the node's clock, which a start off from the ledger's corrects:
	// by the system clock, minutes off, every receiver checking the
	// timestamp's age refused each alert for good (401 is final).
	ts := strconv.FormatInt(time.Unix(0, a.n.clock.Now().Wall).Unix(), 10)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "quotaring-alerts/1")
	req.Header.Set(AlertTimestampHeader, ts)
	req.Header.Set(AlertSignatureHeader, SignAlert(a.secret, ts, body))
	resp, err := a.client.Do(req)
	if err != nil {
		// The error quotes the URL, which goes to logs and the ledger's
		// last_error: without its password and query (a token, often).
		var ue *url.Error
		if errors.As(err, &ue) {
			ue.URL = a.shownURL
		}
		return 0, err
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // let the connection be reused
	resp.Body.Close()
	return resp.StatusCode, nil
}

// backoff is the wait after the given failed attempt: AlertRetry doubled
// per attempt, capped at alertMaxWait, with "equal jitter" (half fixed,
// half random) so that nodes retrying a receiver that came back do not all
// call it at once.
func (a *alerter) backoff(attempt int) time.Duration {
	d := a.retry << min(attempt-1, 20)
	if d <= 0 || d > alertMaxWait {
		d = alertMaxWait
	}
	half := d / 2
	return half + rand.N(half+1)
}

// TestAlertAccount is the account of a test alert.
const TestAlertAccount = "quotaring-test"

// AlertTest is the outcome of one test alert (POST /admin/v1/alerts/test).
type AlertTest struct {
	Webhook string  `json:"webhook"`          // where it went (password and query hidden)
	OK      bool    `json:"ok"`               // the receiver answered 2xx
	Status  int     `json:"status,omitempty"` // the receiver's HTTP status, 0 when there was none
	Error   string  `json:"error,omitempty"`  // why there was no answer
	TookMS  float64 `json:"took_ms"`
	Hint    string  `json:"hint"` // what the outcome means for real alerts
	Alert   Alert   `json:"alert"`
}

// sendTest sends one test alert, signed as real ones are, once: not
// retried, not recorded in the ledger, not counted in the alert metrics
// (but for quotaring_alert_attempts_total).
func (a *alerter) sendTest(ctx context.Context) AlertTest {
	now := time.Unix(0, a.n.clock.Now().Wall).UTC().Truncate(time.Second)
	t := a.thresholds[0]
	al := Alert{Account: TestAlertAccount, Period: shard.PeriodOf(now.UnixNano()).String(), Threshold: t,
		Used: int64(t), Limit: 100, At: now, Test: true}
	start := time.Now()
	status, err := a.send(ctx, alertBody(al), alertTimeout)
	out := AlertTest{Webhook: a.shownURL, OK: err == nil && status >= 200 && status < 300, Status: status,
		TookMS: float64(time.Since(start).Microseconds()) / 1000, Alert: al}
	switch {
	case err != nil:
		out.Error = err.Error()
		out.Hint = "the receiver did not answer from this node: check the URL, that it listens, and the network or firewall between them; real alerts would be retried"
	case out.OK:
		out.Hint = "the receiver took it, so real alerts will reach it (have it ignore alerts marked \"test\": true)"
	case status == http.StatusUnauthorized || status == http.StatusForbidden:
		out.Hint = "the receiver refused it: check that it verifies with the node's --alert-secret (QUOTAD_ALERT_SECRET); real alerts would be given up"
	case status >= 300 && status < 400:
		out.Hint = "a redirect, which quotaring does not follow: point --alert-webhook at the final URL; real alerts would be given up"
	case status == http.StatusNotFound || status == http.StatusMethodNotAllowed:
		out.Hint = "the receiver has no POST handler at this URL: check --alert-webhook's path; real alerts would be given up"
	case status == http.StatusTooManyRequests || status >= 500:
		out.Hint = "the receiver failed: real alerts would be retried, and taken over after the lease"
	default:
		out.Hint = "the receiver refused it: real alerts would be given up (a 3xx or a 4xx other than 429 is final)"
	}
	return out
}
