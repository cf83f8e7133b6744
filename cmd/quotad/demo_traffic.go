package main

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/snapshot"
)

// A demo customer: an account, its plan and key, and how its client
// behaves. Every client sends an Idempotency-Key with every request, as a
// careful SDK does, and retries a request whose outcome it does not know
// (no answer, quota-unavailable) with the same key until it gets a
// definite one: that is what lets the summary hold every client to
// "told OK exactly when billed", even across a kill -9.
type customer struct {
	ID    string
	About string // who they are, one line
	Plan  snapshot.Plan
	// Credits is a prepaid grant on top of the monthly quota (0: none).
	Credits int64
	Key     string // the API key's plaintext (the ledger keeps its hash)

	rate    float64 // logical requests per second
	workers int
	mix     []routeShare
	// resends: how many more times a request answered 2xx is sent again
	// with the same Idempotency-Key (a client whose answers get lost).
	resends int
	// hand: the account for requests typed by hand; not simulated and
	// left out of acknowledged against settled (the demo cannot know what
	// your curl was told).
	hand bool

	seq atomic.Int64
	st  custStats
}

type routeShare struct {
	method, path string
	share        int // relative frequency
}

func (r routeShare) route() string { return r.method + " " + r.path }

// custStats is what a customer's client saw.
type custStats struct {
	mu sync.Mutex // protects everything below
	// acked maps each event id the client was told OK (2xx from the API) to
	// its units: what the customer may be billed for.
	acked      map[string]int64
	ackedUnits int64
	// pending are requests still in doubt when the demo stopped retrying.
	pending map[string]int64
	// counts by outcome (attempts, not logical requests)
	ok, replays, refunded, rateLimited, quotaExceeded, unavailable, noAnswer, other int64
	refundedUnits                                                                   int64
	// first time each kind of refusal was seen (for the event log)
	seen map[string]bool
}

// demoCustomers are the simulated customers, their quotas scaled to the
// run's length so that the free account reaches its hard quota about half
// way through and the soft one passes its quota into overage.
func demoCustomers(d time.Duration) []*customer {
	secs := d.Seconds()
	round := func(v float64, to int64) int64 { return max(to, int64(math.Round(v/float64(to)))*to) }
	cs := []*customer{
		{ID: "free-co", About: "runs out of its hard quota mid-run",
			Plan: snapshot.Plan{ID: "free", Rate: "10/s", Burst: 20, MonthlyQuota: round(3*secs, 10), Hard: true},
			rate: 4, workers: 2, mix: []routeShare{{"GET", "/v1/tasks", 1}, {"POST", "/v1/tasks", 1}}},
		{ID: "acme", About: "pays: quota, then credits; reports fail 1 in 8",
			Plan:    snapshot.Plan{ID: "pro", Rate: "50/s", Burst: 50, MonthlyQuota: round(8*secs, 50), Hard: true},
			Credits: round(30*secs, 100),
			rate:    8, workers: 3, mix: []routeShare{{"GET", "/v1/tasks", 8}, {"POST", "/v1/tasks", 6}, {"POST", "/v1/exports", 3}, {"GET", "/v1/reports", 3}}},
		{ID: "globex", About: "soft quota: past it, billed as overage",
			Plan: snapshot.Plan{ID: "scale", Rate: "20/s", Burst: 40, MonthlyQuota: round(3.6*secs, 10)},
			rate: 4, workers: 2, mix: []routeShare{{"GET", "/v1/tasks", 1}, {"POST", "/v1/tasks", 1}}},
		{ID: "retry-co", About: "sends every request 3 times, one key",
			Plan: snapshot.Plan{ID: "team", Rate: "20/s", Burst: 40, MonthlyQuota: 100_000},
			rate: 1.5, workers: 2, resends: 2, mix: []routeShare{{"POST", "/v1/tasks", 1}}},
		{ID: "spam-co", About: "hammers at ~30 requests/s, limit 5/s",
			Plan: snapshot.Plan{ID: "starter", Rate: "5/s", Burst: 10, MonthlyQuota: 100_000, Hard: true},
			rate: 30, workers: 4, mix: []routeShare{{"GET", "/v1/tasks", 1}}},
		{ID: "you", About: "your curl requests (not in the totals)",
			Plan: snapshot.Plan{ID: "trial", Rate: "10/s", Burst: 20, MonthlyQuota: 1_000, Hard: true}, hand: true},
	}
	for _, c := range cs {
		c.Key = "demo_" + strings.ReplaceAll(c.ID, "-", "") + "_" + randomHex(6) // short enough for the view's curl lines
		c.st.acked = map[string]int64{}
		c.st.pending = map[string]int64{}
		c.st.seen = map[string]bool{}
	}
	return cs
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// limit is what the plan and credits allow this month.
func (c *customer) limit() int64 { return c.Plan.MonthlyQuota + c.Credits }

func (c *customer) planText() string {
	kind := "soft"
	if c.Plan.Hard {
		kind = "hard"
	}
	return c.Plan.ID + " " + kind
}

// outcome is how a client reads one answer.
type outcome int

const (
	outAck           outcome = iota // 2xx from the API: told OK
	outUpstreamFail                 // the API answered 5xx: the front refunded the charge
	outRateLimited                  // 429 rate-limited: not charged
	outQuotaExceeded                // 429 quota-exceeded: not charged
	outUnavailable                  // 503 quota-unavailable: not decided; retry with the same key
	outNoAnswer                     // the connection broke after the request went out: unknown; retry
	outRefused                      // the proxy's port refused the connection: never sent; try another node
	outOther                        // anything else (a bug): counted and shown
)

type answer struct {
	out        outcome
	retryAfter time.Duration
	detail     string
}

// traffic drives the customers' clients through the nodes' proxies.
type traffic struct {
	proxies []string // node i's proxy address
	down    []atomic.Int64
	hc      *http.Client
	events  *eventLog
	// retrying stops at this time (the drain deadline) once traffic stops.
	mu        sync.Mutex // protects giveUpAt
	giveUpAt  time.Time
	start     time.Time
	requested atomic.Int64
}

func newTraffic(proxies []string, events *eventLog) *traffic {
	tr := &http.Transport{
		Proxy:                 nil, // loopback: never through an environment proxy
		DialContext:           (&net.Dialer{Timeout: time.Second}).DialContext,
		MaxIdleConns:          256,
		MaxIdleConnsPerHost:   32,
		IdleConnTimeout:       30 * time.Second,
		ResponseHeaderTimeout: 10 * time.Second,
	}
	return &traffic{proxies: proxies, down: make([]atomic.Int64, len(proxies)), events: events,
		hc: &http.Client{Transport: tr, Timeout: 15 * time.Second}}
}

// pick returns a proxy, round robin over those not seen down in the last
// second (as a load balancer's health check would).
func (t *traffic) pick(rr *int) int {
	now := time.Now().UnixNano()
	for range len(t.proxies) {
		*rr = (*rr + 1) % len(t.proxies)
		if t.down[*rr].Load() < now {
			return *rr
		}
	}
	*rr = (*rr + 1) % len(t.proxies)
	return *rr
}

// run starts c's workers; they stop taking new requests when stop closes
// and return once their requests are decided (or the drain deadline
// passes).
func (t *traffic) run(c *customer, stop <-chan struct{}, wg *sync.WaitGroup) {
	if c.hand || c.rate <= 0 {
		return
	}
	ticks := make(chan struct{})
	wg.Add(1)
	go func() { // the customer's arrival rate, shared by its workers
		defer wg.Done()
		defer close(ticks)
		tk := time.NewTicker(time.Duration(float64(time.Second) / c.rate))
		defer tk.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tk.C:
				select {
				case ticks <- struct{}{}:
				default: // every worker is busy (retrying): this arrival is dropped
				}
			}
		}
	}()
	for w := range c.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rr := w
			for range ticks {
				t.logical(c, c.pickRoute(), &rr)
			}
		}()
	}
}

func (c *customer) pickRoute() routeShare {
	total := 0
	for _, r := range c.mix {
		total += r.share
	}
	k := mrand.IntN(total)
	for _, r := range c.mix {
		if k < r.share {
			return r
		}
		k -= r.share
	}
	return c.mix[0]
}

func (t *traffic) givingUp() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return !t.giveUpAt.IsZero() && time.Now().After(t.giveUpAt)
}

// stopRetrying sets the drain deadline.
func (t *traffic) stopRetrying(at time.Time) {
	t.mu.Lock()
	t.giveUpAt = at
	t.mu.Unlock()
}

// logical sends one request until its outcome is known: told OK, refused,
// or failed upstream (refunded).
func (t *traffic) logical(c *customer, r routeShare, rr *int) {
	key := fmt.Sprintf("%s-%06d", c.ID, c.seq.Add(1))
	units := demoRoutes[r.route()]
	t.requested.Add(1)
	doubt := false // an attempt may have been charged without an answer
	for {
		a := t.attempt(c, r, key, rr)
		switch a.out {
		case outAck:
			first := c.ack(key, units)
			if first && c.resends > 0 {
				for range c.resends { // the same request again, as if the answer had been lost
					time.Sleep(time.Duration(50+mrand.IntN(100)) * time.Millisecond)
					if b := t.attempt(c, r, key, rr); b.out == outAck {
						c.replayed()
					}
				}
			}
			return
		case outUpstreamFail:
			c.count(func(s *custStats) { s.refunded++; s.refundedUnits += units })
			return
		case outQuotaExceeded:
			t.note(c, "quota-exceeded", a)
			return
		case outRateLimited:
			t.note(c, "rate-limited", a)
			if !doubt {
				return
			}
			// NB: after an attempt whose fate is unknown, a refusal of a
			// later attempt does not say the first was not charged: keep
			// asking with the same key until it is answered OK.
			sleepFor(a.retryAfter, time.Second)
		case outUnavailable:
			doubt = true
			t.note(c, "quota-unavailable", a)
			sleepFor(a.retryAfter, time.Second)
		case outNoAnswer:
			doubt = true
			c.count(func(s *custStats) { s.noAnswer++ })
			time.Sleep(200 * time.Millisecond)
		case outRefused:
			time.Sleep(20 * time.Millisecond)
		case outOther:
			doubt = true
			c.count(func(s *custStats) { s.other++ })
			t.events.add("%s: unexpected answer %s", c.ID, a.detail)
			time.Sleep(500 * time.Millisecond)
		}
		if t.givingUp() {
			if doubt {
				c.count(func(s *custStats) { s.pending[key] = units })
			}
			return
		}
	}
}

func sleepFor(d, def time.Duration) {
	if d <= 0 {
		d = def
	}
	time.Sleep(min(d, 2*time.Second))
}

// counts are a customer's counters at one moment.
type counts struct {
	ok, replays, refunded, rateLimited, quotaExceeded, unavailable int64
	acked                                                          int64 // units
}

func (c *customer) counts() counts {
	c.st.mu.Lock()
	defer c.st.mu.Unlock()
	s := &c.st
	return counts{ok: s.ok, replays: s.replays, refunded: s.refunded, rateLimited: s.rateLimited, quotaExceeded: s.quotaExceeded,
		unavailable: s.unavailable, acked: s.ackedUnits}
}

func (c *customer) count(f func(*custStats)) {
	c.st.mu.Lock()
	f(&c.st)
	c.st.mu.Unlock()
}

// ack records a 2xx; it reports whether it was the first for this key.
func (c *customer) ack(key string, units int64) bool {
	c.st.mu.Lock()
	defer c.st.mu.Unlock()
	if _, ok := c.st.acked[key]; ok {
		c.st.replays++
		return false
	}
	c.st.acked[key] = units
	c.st.ackedUnits += units
	c.st.ok++
	return true
}

func (c *customer) replayed() { c.count(func(s *custStats) { s.replays++ }) }

// note counts a refusal and logs the first of each kind per customer.
func (t *traffic) note(c *customer, kind string, a answer) {
	c.st.mu.Lock()
	switch kind {
	case "quota-exceeded":
		c.st.quotaExceeded++
	case "rate-limited":
		c.st.rateLimited++
	case "quota-unavailable":
		c.st.unavailable++
	}
	first := !c.st.seen[kind]
	c.st.seen[kind] = true
	acked := c.st.ackedUnits
	c.st.mu.Unlock()
	if !first {
		return
	}
	switch kind {
	case "quota-exceeded":
		t.events.add("%s: 429 quota-exceeded: %d of its %d units told OK; a hard limit is never passed", c.ID, acked, c.limit())
	case "quota-unavailable":
		t.events.add("%s: 503 quota-unavailable: nothing charged; the client retries with the same key", c.ID)
	default:
		t.events.add("%s: %s", c.ID, truncate(a.detail, 110))
	}
}

// resetSeen lets the next refusal of a kind be logged again (after the
// kill, so the log shows the refusals the failover causes).
func (c *customer) resetSeen(kinds ...string) {
	c.st.mu.Lock()
	for _, k := range kinds {
		delete(c.st.seen, k)
	}
	c.st.mu.Unlock()
}

// attempt sends one HTTP request and reads its answer.
func (t *traffic) attempt(c *customer, r routeShare, key string, rr *int) answer {
	i := t.pick(rr)
	var body io.Reader
	if r.method == http.MethodPost {
		body = strings.NewReader(`{"title":"from the demo"}`)
	}
	req, _ := http.NewRequest(r.method, "http://"+t.proxies[i]+r.path, body)
	req.Header.Set("X-Api-Key", c.Key)
	req.Header.Set("Idempotency-Key", key)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := t.hc.Do(req)
	if err != nil {
		if isDialError(err) {
			t.down[i].Store(time.Now().Add(time.Second).UnixNano())
			return answer{out: outRefused}
		}
		return answer{out: outNoAnswer, detail: err.Error()}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	fromAPI := resp.Header.Get(demoServedBy) != ""
	switch {
	case fromAPI && resp.StatusCode < 300:
		return answer{out: outAck}
	case fromAPI && resp.StatusCode >= 500:
		return answer{out: outUpstreamFail}
	case fromAPI:
		return answer{out: outOther, detail: fmt.Sprintf("%s from the API: %s", resp.Status, strings.TrimSpace(string(b)))}
	}
	var p router.Problem
	if err := json.Unmarshal(b, &p); err != nil || p.Type == "" {
		return answer{out: outOther, detail: fmt.Sprintf("%s: %q", resp.Status, truncate(string(b), 120))}
	}
	ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	a := answer{retryAfter: time.Duration(ra) * time.Second, detail: fmt.Sprintf("%d %s", resp.StatusCode, p.Detail)}
	switch p.Type {
	case router.ProblemRateLimited:
		a.out = outRateLimited
	case router.ProblemQuotaExceeded:
		a.out = outQuotaExceeded
	case router.ProblemQuotaUnavailable:
		a.out = outUnavailable
	case router.ProblemUpstreamUnavailable:
		a.out = outUpstreamFail // no answer from the API: the front refunded
	case router.ProblemInternal:
		a.out = outNoAnswer // the quota service failed mid-way: unknown, retry
	default:
		a.out, a.detail = outOther, fmt.Sprintf("%d %s: %s", resp.StatusCode, p.Type, p.Detail)
	}
	return a
}

// isDialError: the connection was never made, so the request was never
// sent and may go to another node without doubt.
func isDialError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
