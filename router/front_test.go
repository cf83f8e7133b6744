package router

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"net/url"
	"path"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/iotest"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/quotaring/quotaring/internal/logbuf"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

func TestRateLimitHeaders(t *testing.T) {
	july := time.Date(2026, 7, 1, 0, 0, 0, 0, time.UTC).Unix()
	now := time.Date(2026, 6, 28, 12, 0, 0, 0, time.UTC).Unix() // 2.5 days before July
	for _, tc := range []struct {
		d             shard.Decision
		policy, limit string
	}{
		// No rate limit: the quota alone. June has 30 days (2,592,000 s).
		{shard.Decision{Limit: 60, Remaining: 7, Reset: july},
			`"quota";q=60;w=2592000`, `"quota";r=7;t=216000`},
		{shard.Decision{RateBurst: 10, RateRemaining: 3, RateReset: int64(700 * time.Millisecond), RateWindow: int64(time.Second), Limit: 60, Remaining: 7, Reset: july},
			`"burst";q=10;w=1, "quota";q=60;w=2592000`, `"burst";r=3;t=1, "quota";r=7;t=216000`},
		{shard.Decision{RateBurst: 3, RateRemaining: 0, RateReset: int64(60 * time.Second), RateWindow: int64(60 * time.Second), Limit: 5, Remaining: 0, Reset: july},
			`"burst";q=3;w=60, "quota";q=5;w=2592000`, `"burst";r=0;t=20, "quota";r=0;t=216000`}, // empty: t until the next token (one per 20 s), not until full
		// A rate-limited refusal: t is its Retry-After (was t=2 beside Retry-After: 1).
		{shard.Decision{Reason: shard.RateLimited, RetryAfter: int64(500 * time.Millisecond), RateBurst: 2, RateRemaining: 0, RateReset: int64(1500 * time.Millisecond), RateWindow: int64(2 * time.Second), Limit: 60, Remaining: 7, Reset: july},
			`"burst";q=2;w=2, "quota";q=60;w=2592000`, `"burst";r=0;t=1, "quota";r=7;t=216000`},
		{shard.Decision{RateBurst: 5, RateRemaining: 5, RateReset: 0, RateWindow: int64(1500 * time.Millisecond), Limit: 1, Remaining: 1, Reset: july},
			`"burst";q=5;w=2, "quota";q=1;w=2592000`, `"burst";r=5;t=0, "quota";r=1;t=216000`}, // full bucket: t=0; windows round up
		{shard.Decision{RateBurst: 100, RateRemaining: -1, RateReset: 1, RateWindow: 1, Limit: 10, Remaining: -3, Reset: july},
			`"burst";q=100000000000;w=1, "quota";q=10;w=2592000`, `"burst";r=0;t=1, "quota";r=0;t=216000`}, // never a negative r, never w=0
		// A bucket that refills within a second, described per second:
		// 600/m with a burst of 1 is 10 a second, not "q=1;w=1" (a tenth
		// of the rate); 3 tokens in 700 ms are 4 a second (rounded down).
		{shard.Decision{RateBurst: 1, RateRemaining: 1, RateWindow: int64(100 * time.Millisecond), Limit: 60, Remaining: 7, Reset: july},
			`"burst";q=10;w=1, "quota";q=60;w=2592000`, `"burst";r=1;t=0, "quota";r=7;t=216000`},
		{shard.Decision{RateBurst: 3, RateRemaining: 3, RateWindow: int64(700 * time.Millisecond), Limit: 60, Remaining: 7, Reset: july},
			`"burst";q=4;w=1, "quota";q=60;w=2592000`, `"burst";r=3;t=0, "quota";r=7;t=216000`},
		{shard.Decision{RateBurst: math.MaxInt64 / 2, RateRemaining: 0, RateWindow: 1, Limit: 60, Remaining: 7, Reset: july},
			`"burst";q=9223372036854775807;w=1, "quota";q=60;w=2592000`, `"burst";r=0;t=1, "quota";r=7;t=216000`}, // no overflow
		// February 2027 has 28 days; a period already over (a clock behind) says t=0.
		{shard.Decision{Limit: 9, Remaining: 9, Reset: time.Date(2027, 3, 1, 0, 0, 0, 0, time.UTC).Unix()},
			`"quota";q=9;w=2419200`, `"quota";r=9;t=` + fmt.Sprint(time.Date(2027, 3, 1, 0, 0, 0, 0, time.UTC).Unix()-now)},
		{shard.Decision{Limit: 9, Remaining: 9, Reset: time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC).Unix()},
			`"quota";q=9;w=2678400`, `"quota";r=9;t=0`},
		// Credits that never renew: no period, so no w and no t.
		{shard.Decision{Limit: 500, Remaining: 120}, `"quota";q=500`, `"quota";r=120`},
	} {
		policy, limit := rateLimitHeaders(&tc.d, now, true)
		if policy != tc.policy || limit != tc.limit {
			t.Errorf("%+v:\n got  %q %q\n want %q %q", tc.d, policy, limit, tc.policy, tc.limit)
		}
	}
	// A rate-limited refusal's burst t and Retry-After agree, whatever the
	// bucket: t is when the client may send again.
	for _, d := range []shard.Decision{
		{RetryAfter: int64(500 * time.Millisecond), RateBurst: 2, RateReset: int64(1500 * time.Millisecond), RateWindow: int64(2 * time.Second)},
		{RetryAfter: int64(2100 * time.Millisecond), RateBurst: 10, RateReset: int64(30 * time.Second), RateWindow: int64(30 * time.Second)},
		{RetryAfter: 1, RateBurst: 1, RateReset: 1, RateWindow: int64(time.Hour)},
	} {
		d.Reason, d.Limit, d.Remaining, d.Reset = shard.RateLimited, 10, 10, july
		_, limit := rateLimitHeaders(&d, now, true)
		want := fmt.Sprintf(`"burst";r=0;t=%d,`, refusal(&d, 1, 429).retryAfter)
		if !strings.HasPrefix(limit, want) {
			t.Errorf("%+v: RateLimit %q, want it to start %q (the Retry-After)", d, limit, want)
		}
	}
}

func TestQuotaHeaders(t *testing.T) {
	h := http.Header{}
	setQuotaHeaders(h, &shard.Decision{Limit: 60, Remaining: -2, Reset: time.Date(2026, 7, 1, 0, 0, 0, 0, time.UTC).Unix(),
		RateBurst: 2, RateRemaining: 1, RateReset: int64(time.Second), RateWindow: int64(2 * time.Second)},
		time.Date(2026, 6, 30, 23, 0, 0, 0, time.UTC).Unix(), true)
	want := http.Header{
		"Ratelimit-Policy":  {`"burst";q=2;w=2, "quota";q=60;w=2592000`},
		"Ratelimit":         {`"burst";r=1;t=1, "quota";r=0;t=3600`},
		"X-Quota-Limit":     {"60"},
		"X-Quota-Remaining": {"0"},
		"X-Quota-Reset":     {"2026-07-01T00:00:00Z"},
	}
	if !equalHeaders(h, want) {
		t.Fatalf("got %v\nwant %v", h, want)
	}
}

func equalHeaders(a, b http.Header) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if strings.Join(v, ",") != strings.Join(b[k], ",") {
			return false
		}
	}
	return true
}

func TestCeilSeconds(t *testing.T) {
	for ns, want := range map[int64]int64{-5: 0, 0: 0, 1: 1, int64(time.Second): 1, int64(time.Second) + 1: 2, int64(216000 * time.Second): 216000} {
		if got := ceilSeconds(ns); got != want {
			t.Errorf("ceilSeconds(%d) = %d, want %d", ns, got, want)
		}
	}
}

// The problem bodies, byte for byte.
func TestProblemBodies(t *testing.T) {
	reset := time.Date(2026, 7, 1, 0, 0, 0, 0, time.UTC).Unix()
	for _, tc := range []struct {
		name       string
		p          *Problem
		retryAfter string
		body       string
	}{
		{"rate limited", refusal(&shard.Decision{Reason: shard.RateLimited, RetryAfter: int64(1200 * time.Millisecond), RateBurst: 5}, 1, 429), "2",
			`{"type":"https://quotaring.dev/problems/rate-limited","title":"Rate limited","status":429,"detail":"The account's rate limit (a burst of 5 requests) is used up; retry in 2 s."}`},
		{"quota exceeded", refusal(&shard.Decision{Reason: shard.QuotaExceeded, RetryAfter: int64(216000 * time.Second), Limit: 60, Remaining: 7, Reset: reset}, 25, 402), "216000",
			`{"type":"https://quotaring.dev/problems/quota-exceeded","title":"Quota exceeded","status":402,"detail":"This request costs 25 units and the account has 7 left of 60 this period; the quota renews at 2026-07-01T00:00:00Z."}`},
		{"credits that start before the reset", refusal(&shard.Decision{Reason: shard.QuotaExceeded, RetryAfter: int64(600 * time.Second), CreditsStart: true, Limit: 60, Remaining: 0, Reset: reset}, 25, 429), "600",
			`{"type":"https://quotaring.dev/problems/quota-exceeded","title":"Quota exceeded","status":429,"detail":"This request costs 25 units and the account has 0 left of 60; credits that start in 600 s give it the units: retry then."}`},
		{"credits used up", refusal(&shard.Decision{Reason: shard.QuotaExceeded, RetryAfter: shard.Never, Limit: 10, Remaining: 0, Reset: reset}, 3, 403), "",
			`{"type":"https://quotaring.dev/problems/quota-exceeded","title":"Quota exceeded","status":403,"detail":"This request costs 3 units and the account has 0 left of 10; its credits are used up and waiting does not renew them."}`},
		{"account not loaded", refusal(&shard.Decision{Reason: shard.UnknownAccount}, 1, 429), "1",
			`{"type":"https://quotaring.dev/problems/quota-unavailable","title":"Quota unavailable","status":503,"detail":"The owner of this key's account has not loaded its config yet; retry in a second."}`},
		{"missing key", unknownKey(true), "",
			`{"type":"https://quotaring.dev/problems/unknown-key","title":"Unknown API key","status":401,"detail":"No API key was sent: send it as 'Authorization: Bearer <key>' or 'X-Api-Key: <key>'."}`},
		{"unavailable", unavailable("x"), "1", `{"type":"https://quotaring.dev/problems/quota-unavailable","title":"Quota unavailable","status":503,"detail":"x"}`},
		{"too large", tooLarge(1024), "",
			`{"type":"https://quotaring.dev/problems/payload-too-large","title":"Payload too large","status":413,"detail":"The request body is over the limit of 1024 bytes; nothing was charged."}`},
	} {
		w := httptest.NewRecorder()
		tc.p.write(w, nil)
		if got := strings.TrimSpace(w.Body.String()); got != tc.body {
			t.Errorf("%s: body\n got %s\nwant %s", tc.name, got, tc.body)
		}
		if w.Header().Get("Retry-After") != tc.retryAfter || w.Header().Get("Content-Type") != "application/problem+json" {
			t.Errorf("%s: headers %v, want Retry-After %q", tc.name, w.Header(), tc.retryAfter)
		}
		if (tc.p.Status == 401) != (w.Header().Get("WWW-Authenticate") != "") {
			t.Errorf("%s: WWW-Authenticate %q", tc.name, w.Header().Get("WWW-Authenticate"))
		}
	}
}

func TestIdempotencyKeyHeader(t *testing.T) {
	for _, tc := range []struct {
		vals []string
		want string
		ok   bool
	}{
		{nil, "", true},
		{[]string{"order-42"}, "order-42", true},
		{[]string{`"order-42"`}, "order-42", true},
		{[]string{"with space and ~!"}, "with space and ~!", true},
		{[]string{strings.Repeat("k", 255)}, strings.Repeat("k", 255), true},
		{[]string{strings.Repeat("k", 256)}, "", false},
		{[]string{""}, "", false},
		{[]string{`""`}, "", false},
		{[]string{"tab\there"}, "", false},
		{[]string{"caf\xc3\xa9"}, "", false},
		{[]string{"a", "b"}, "", false},
		// A quoted value is a structured-field string (RFC 9651): its
		// content is the key, with \" and \\ unescaped; a list, an
		// unbalanced quote, another escape or text after the string is
		// refused. Unquoted, a key may not hold " \ or , (it was taken
		// whole: "a", "b" was the key a", "b, and "a\"b" and a"b two keys).
		{[]string{`"a", "b"`}, "", false},
		{[]string{`"abc`}, "", false},
		{[]string{`"`}, "", false},
		{[]string{`"abc"x`}, "", false},
		{[]string{`"abc";p=1`}, "", false},
		{[]string{`"a\xb"`}, "", false},
		{[]string{`"abc\"`}, "", false},
		{[]string{`"a\"b"`}, `a"b`, true},
		{[]string{`"a\\b"`}, `a\b`, true},
		{[]string{`"a,b"`}, "a,b", true},
		{[]string{`a"b`}, "", false},
		{[]string{`a\b`}, "", false},
		{[]string{`a, b`}, "", false},
		{[]string{`abc"`}, "", false},
		// The shape of an event id the proxy makes for a request without
		// a key (passed to the upstream as X-Quota-Event): it could name
		// that request's event in the ledger, which billed nothing.
		{[]string{"74J561BS-6"}, "", false},
		{[]string{`"74J561BS-6"`}, "", false},
		{[]string{"cABCDEFGHIJKLMNOPQRSTUVWXYZ"}, "", false},
		{[]string{"74j561bs-6"}, "74j561bs-6", true},
	} {
		h := http.Header{}
		for _, v := range tc.vals {
			h.Add("Idempotency-Key", v)
		}
		got, p := idempotencyKey(h)
		if got != tc.want || (p == nil) != tc.ok || (p != nil && (p.Status != 400 || p.Type != ProblemBadRequest)) {
			t.Errorf("%q: %q, %+v; want %q ok=%v", tc.vals, got, p, tc.want, tc.ok)
		}
	}
}

// The ids router.Client makes have the shape no client id may have.
func TestMadeEventIDsAreNoClientIDs(t *testing.T) {
	for range 100 {
		if id := madeEventID(); !shard.MadeIDShape(id) || shard.ClientIDProblem(id) == "" {
			t.Fatalf("router.Client's made id %q could be sent as a client id", id)
		}
	}
}

// The proxy passes an Idempotency-Key on in one spelling: the key read
// back from it is the key billed.
func TestCanonicalKeyReadsBackAsTheKey(t *testing.T) {
	for _, k := range []string{"order-42", "with space and ~!", `a"b`, `a\b`, "a,b", `"starts quoted`, `\`} {
		c := canonicalKey(k)
		got, p := idempotencyKey(http.Header{"Idempotency-Key": {c}})
		if p != nil || got != k {
			t.Errorf("key %q passed on as %q reads back as %q (%v)", k, c, got, p)
		}
	}
	if c := canonicalKey("order-42"); c != "order-42" {
		t.Errorf("a key that can stand bare is passed on as %q", c)
	}
}

func TestAPIKeyHeader(t *testing.T) {
	for _, tc := range []struct {
		headers map[string]string
		want    string
	}{
		{map[string]string{"Authorization": "Bearer k1"}, "k1"},
		{map[string]string{"Authorization": "bearer  k1 "}, "k1"},
		{map[string]string{"X-Api-Key": "k2"}, "k2"},
		{map[string]string{"X-Api-Key": "k2", "Authorization": "Bearer upstream-jwt"}, "k2"},
		{map[string]string{"Authorization": "Basic dXNlcjpwdw=="}, ""},
		{map[string]string{"Authorization": "Bearer "}, ""},
		{map[string]string{}, ""},
	} {
		h := http.Header{}
		for k, v := range tc.headers {
			h.Set(k, v)
		}
		if got, _, ok := apiKey(h); got != tc.want || ok != (tc.want != "") {
			t.Errorf("%v: %q %v, want %q", tc.headers, got, ok, tc.want)
		}
	}
}

func TestFrontOptionsCheck(t *testing.T) {
	for _, o := range []FrontOptions{
		{QuotaStatus: 500}, {BillOn: "never"}, {UsagePath: "v1/usage"}, {UpstreamTimeout: -time.Second},
	} {
		if err := o.Check(); err == nil {
			t.Errorf("%+v: no error", o)
		}
	}
	for _, o := range []FrontOptions{{}, {QuotaStatus: 402, BillOn: BillOn2xx}, {QuotaStatus: 403, BillOn: BillOnAlways, MaxBodyBytes: -1}} {
		if err := o.Check(); err != nil {
			t.Errorf("%+v: %v", o, err)
		}
	}
	if _, err := Middleware(FrontOptions{}); err == nil {
		t.Error("Middleware without a Charger and a Config: no error")
	}
}

// fakeCharger answers every charge with decision (or err) and records
// refunds.
type fakeCharger struct {
	decision shard.Decision
	err      error
	// refundDecision and refundErr answer refunds ({Reason: Refunded}
	// when both are zero); the first refundFails refunds fail with
	// ErrUnavailable before that.
	refundDecision shard.Decision
	refundErr      error
	refundFails    int
	// gate, when set, holds every charge until it is closed; entered, when
	// set, hears each charge that reached the gate.
	gate, entered chan struct{}
	// untilDeadline holds every charge until its ctx ends, then answers err:
	// an owner that answered when the call's deadline passed.
	untilDeadline bool

	mu      sync.Mutex // protects charges and refunds
	charges []ChargeRequest
	refunds []RefundRequest
}

func (f *fakeCharger) Charge(ctx context.Context, req ChargeRequest) (ChargeResult, error) {
	if f.untilDeadline {
		<-ctx.Done()
	}
	if f.gate != nil {
		if f.entered != nil {
			f.entered <- struct{}{}
		}
		<-f.gate
	}
	f.mu.Lock()
	f.charges = append(f.charges, req)
	f.mu.Unlock()
	if f.err != nil {
		return ChargeResult{}, f.err
	}
	res := ChargeResult{Decision: f.decision, EventID: req.EventID, Node: "fake"}
	if res.EventID == "" {
		res.EventID = "gen-1"
	}
	if (f.decision.Reason == shard.OK || f.decision.Reason == shard.Replayed) && req.Units > 0 {
		// As the engine: a Replayed answer carries the receipt of the
		// charge it relied on.
		res.Receipt = &shard.Receipt{EventID: res.EventID, Units: req.Units}
	}
	return res, nil
}

func (f *fakeCharger) Refund(_ context.Context, req RefundRequest) (shard.Decision, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refunds = append(f.refunds, req)
	if len(f.refunds) <= f.refundFails {
		return shard.Decision{}, fmt.Errorf("%w: the owner did not answer (a test's)", ErrUnavailable)
	}
	if f.refundErr != nil || f.refundDecision.Reason != shard.OK {
		return f.refundDecision, f.refundErr
	}
	return shard.Decision{Reason: shard.Refunded}, nil
}

func (f *fakeCharger) Usage(context.Context, string) (UsageResult, error) {
	return UsageResult{Known: true, Usage: shard.Usage{Period: shard.PeriodOf(time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC).UnixNano()),
		Limit: 100, Used: 2, Remaining: 98, Reset: time.Date(2026, 7, 1, 0, 0, 0, 0, time.UTC).Unix(),
		Routes: map[string]int64{"POST /v1/tasks": 2}}}, nil
}

func (f *fakeCharger) counts() (charges, refunds int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.charges), len(f.refunds)
}

type staticConfig struct{ s *snapshot.Snapshot }

func (c staticConfig) Snapshot() *snapshot.Snapshot { return c.s }

func testConfig(t *testing.T) staticConfig {
	t.Helper()
	s, err := snapshot.Decode([]byte(`{"version":1,"plans":[{"id":"p","monthly_quota":100,"hard":true}],
		"accounts":[{"id":"acme","plan":"p"}],"keys":[{"id":"k1","hash":"` + snapshot.HashKey("secret") + `","account":"acme"}],
		"routes":{"version":1,"default":1,"weights":{"POST /v1/tasks":2,"GET /v1/free":0,"POST /v1/files/{name}":7,"POST /v1/jobs/":3}}}`))
	if err != nil {
		t.Fatal(err)
	}
	return staticConfig{s}
}

func okDecision() shard.Decision {
	return shard.Decision{Reason: shard.OK, Limit: 100, Remaining: 98, Reset: time.Date(2026, 7, 1, 0, 0, 0, 0, time.UTC).Unix()}
}

// serve runs one request through Middleware(opts)(h) and returns the
// recorder; a panic in h is recovered (as net/http would) and returned.
func serve(t *testing.T, opts FrontOptions, h http.Handler, req *http.Request) (w *httptest.ResponseRecorder, panicked any) {
	t.Helper()
	mw, err := Middleware(opts)
	if err != nil {
		t.Fatal(err)
	}
	w = httptest.NewRecorder()
	func() {
		defer func() { panicked = recover() }()
		mw(h).ServeHTTP(w, req)
	}()
	return w, panicked
}

func newRequest(method, path string, body io.Reader) *http.Request {
	r := httptest.NewRequest(method, path, body)
	r.Header.Set("Authorization", "Bearer secret")
	return r
}

// Which answers are refunded under each bill-on policy, and that a refund
// happens at most once.
func TestBillOnPolicies(t *testing.T) {
	status := func(code int) http.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(code) }
	}
	grpc := func(trailer string, trailersOnly bool) http.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/grpc+proto")
			if trailersOnly {
				w.Header().Set("Grpc-Status", trailer)
				w.WriteHeader(200)
				return
			}
			w.WriteHeader(200)
			w.Write([]byte{0, 0, 0, 0, 0})
			if trailer != "" {
				w.Header().Set(http.TrailerPrefix+"Grpc-Status", trailer)
			}
		}
	}
	handlers := map[string]http.Handler{
		"200":                   status(200),
		"204":                   status(204),
		"302":                   status(302),
		"404":                   status(404),
		"500":                   status(500),
		"503":                   status(503),
		"nothing written":       http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}),
		"interim 103 then 500":  http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(103); w.WriteHeader(500) }),
		"grpc 0":                grpc("0", false),
		"grpc 13 trailer":       grpc("13", false),
		"grpc 5 trailers-only":  grpc("5", true),
		"grpc without a status": grpc("", false), // ended cleanly: no gRPC server's answer
		"grpc broken by the upstream": http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/grpc+proto")
			w.Write([]byte{0, 0, 0, 0, 0})
			panic(http.ErrAbortHandler) // what ReverseProxy does when the upstream's stream breaks
		}),
		"grpc-web 0": http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/grpc-web+proto")
			w.Write([]byte{0, 0, 0, 0, 0})                                     // a message
			w.Write(append([]byte{0x80, 0, 0, 0, 15}, "grpc-status:0\r\n"...)) // its trailers, in the body
		}),
		"grpc-web 7 trailers-only": http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/grpc-web+proto")
			w.Header().Set("Grpc-Status", "7")
			w.WriteHeader(200)
		}),
		"rest answer typed grpc": grpc("", false), // a REST request: a file served with the type its uploader chose
		"panic":                  http.HandlerFunc(func(http.ResponseWriter, *http.Request) { panic("boom") }),
		"abort after a write": http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Write([]byte("partial"))
			panic(http.ErrAbortHandler)
		}),
	}
	// refunded per policy: success, 2xx, always.
	want := map[string][3]bool{
		"200": {false, false, false}, "204": {false, false, false}, "302": {false, false, false},
		"404": {false, true, false}, "500": {true, true, false}, "503": {true, true, false},
		"nothing written": {false, false, false}, "interim 103 then 500": {true, true, false},
		"grpc 0": {false, false, false}, "grpc 13 trailer": {true, true, false}, "grpc 5 trailers-only": {true, true, false},
		"grpc without a status": {false, false, false}, "grpc broken by the upstream": {true, true, false},
		"panic": {true, true, false}, "abort after a write": {true, true, false},
		"grpc-web 0": {false, false, false}, "grpc-web 7 trailers-only": {true, true, false},
		"rest answer typed grpc": {false, false, false},
	}
	request := func(name string) *http.Request {
		r := newRequest("POST", "/v1/tasks", nil)
		switch {
		case strings.HasPrefix(name, "grpc-web"):
			r.Header.Set("Content-Type", "application/grpc-web+proto")
		case strings.HasPrefix(name, "grpc"):
			r.Proto, r.ProtoMajor, r.ProtoMinor = "HTTP/2.0", 2, 0
			r.Header.Set("Content-Type", "application/grpc")
		}
		return r
	}
	for name, h := range handlers {
		for i, policy := range []string{BillOnSuccess, BillOn2xx, BillOnAlways} {
			ch := &fakeCharger{decision: okDecision()}
			_, p := serve(t, FrontOptions{Charger: ch, Config: testConfig(t), BillOn: policy}, h, request(name))
			if (p != nil) != (name == "panic" || name == "abort after a write" || name == "grpc broken by the upstream") {
				t.Errorf("%s: panic %v", name, p)
			}
			charges, refunds := ch.counts()
			if charges != 1 || refunds != map[bool]int{false: 0, true: 1}[want[name][i]] {
				t.Errorf("%s, bill-on %s: %d charges, %d refunds; want refunded=%v", name, policy, charges, refunds, want[name][i])
			}
			if refunds == 1 && (ch.refunds[0].EventID != "gen-1" || ch.refunds[0].Receipt == nil || ch.refunds[0].Account != "acme") {
				t.Errorf("%s: refund %+v", name, ch.refunds[0])
			}
		}
	}
}

// A failed replay is taken back (Replay), never refunded as the charge it
// replayed, and with the receipt its answer carried: without it, the
// account's next owner (after a move) knew nothing of the replay and
// answered unknown_event, and the event stayed billed though no attempt was
// served. A weight-0 route has nothing to refund.
func TestNoRefundWithoutACharge(t *testing.T) {
	fail := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(500) })
	d := okDecision()
	d.Reason = shard.Replayed
	ch := &fakeCharger{decision: d}
	req := newRequest("POST", "/v1/tasks", nil)
	req.Header.Set("Idempotency-Key", "k")
	serve(t, FrontOptions{Charger: ch, Config: testConfig(t)}, fail, req)
	ch2 := &fakeCharger{decision: okDecision()}
	serve(t, FrontOptions{Charger: ch2, Config: testConfig(t)}, fail, newRequest("GET", "/v1/free", nil))
	if _, r := ch.counts(); r != 1 || !ch.refunds[0].Replay || ch.refunds[0].Attempt || ch.refunds[0].Receipt == nil {
		t.Errorf("a failed replay: refunds %+v, want one Replay take-back with the replayed answer's receipt", ch.refunds)
	}
	if _, r := ch2.counts(); r != 0 {
		t.Errorf("a weight-0 request was refunded")
	}
	if ch.charges[0].EventID != "k" || !ch.charges[0].ClientID || ch2.charges[0].Units != 0 || ch2.charges[0].Route != "GET /v1/free" {
		t.Errorf("charges %+v %+v", ch.charges, ch2.charges)
	}
}

// A failed attempt's charge is refunded as an attempt's (Attempt), with
// its receipt: the owner then keeps the charge when a retry with the same
// Idempotency-Key was answered Replayed and served under it meanwhile
// (shard.Account.RefundAttempt). Refunded as a plain refund, the charge
// went back whatever the retry got, and the served retry was free.
func TestFailedAttemptIsRefundedAsAnAttempt(t *testing.T) {
	fail := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(502) })
	for _, idem := range []string{"", "k"} {
		ch := &fakeCharger{decision: okDecision()}
		req := newRequest("POST", "/v1/tasks", nil)
		if idem != "" {
			req.Header.Set("Idempotency-Key", idem)
		}
		serve(t, FrontOptions{Charger: ch, Config: testConfig(t)}, fail, req)
		if _, r := ch.counts(); r != 1 || !ch.refunds[0].Attempt || ch.refunds[0].Replay || ch.refunds[0].Receipt == nil {
			t.Errorf("Idempotency-Key %q, answer 502: refunds %+v, want one Attempt refund with the charge's receipt", idem, ch.refunds)
		}
	}
}

// A handler that answered 500 failed, whether or not its client stayed to
// read the answer: the charge is refunded. Only a client that left before
// any answer was written (the work done or under way) keeps its charge.
func TestFailedAnswerIsRefundedWhenTheClientLeft(t *testing.T) {
	for _, tc := range []struct {
		name     string
		write    bool
		refunded bool
	}{{"500 written, then the client left", true, true}, {"the client left, nothing written", false, false}} {
		ch := &fakeCharger{decision: okDecision()}
		ctx, cancel := context.WithCancel(context.Background())
		h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			if tc.write {
				w.WriteHeader(500)
			}
			cancel() // the client goes away
		})
		serve(t, FrontOptions{Charger: ch, Config: testConfig(t)}, h, newRequest("POST", "/v1/tasks", nil).WithContext(ctx))
		if _, r := ch.counts(); r != map[bool]int{false: 0, true: 1}[tc.refunded] {
			t.Errorf("%s: %d refunds, want refunded=%v", tc.name, r, tc.refunded)
		}
	}
}

// An upstream that cannot be reached answers 502; the charge is refunded
// unless the policy is bill-on always, which never refunds for the
// upstream (only for what the front itself cut off).
func TestUnreachableUpstreamUnderBillOnAlways(t *testing.T) {
	up := httptest.NewServer(http.NotFoundHandler())
	u, _ := url.Parse(up.URL)
	up.Close() // nothing listens there any more
	for policy, refunds := range map[string]int{BillOnSuccess: 1, BillOn2xx: 1, BillOnAlways: 0} {
		ch := &fakeCharger{decision: okDecision(), refundDecision: shard.Decision{Reason: shard.Refunded}}
		p, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t), BillOn: policy})
		if err != nil {
			t.Fatal(err)
		}
		w := httptest.NewRecorder()
		p.ServeHTTP(w, newRequest("POST", "/v1/tasks", nil))
		if _, r := ch.counts(); w.Code != http.StatusBadGateway || r != refunds {
			t.Errorf("bill-on %s, upstream unreachable: %d with %d refunds, want 502 with %d", policy, w.Code, r, refunds)
		}
		want := "The charge is refunded"
		if refunds == 0 {
			want = "The charge stands"
		}
		if !strings.Contains(w.Body.String(), want) {
			t.Errorf("bill-on %s, upstream unreachable: %s; want it to say %q", policy, w.Body, want)
		}
		// A preflight was charged nothing: the answer said it was refunded.
		pre := httptest.NewRequest("OPTIONS", "/v1/tasks", nil)
		pre.Header.Set("Origin", "https://app.example")
		pre.Header.Set("Access-Control-Request-Method", "POST")
		w = httptest.NewRecorder()
		p.ServeHTTP(w, pre)
		if w.Code != http.StatusBadGateway || !strings.Contains(w.Body.String(), "Nothing was charged") {
			t.Errorf("bill-on %s, a preflight, upstream unreachable: %d %s; want 502 saying nothing was charged", policy, w.Code, w.Body)
		}
	}
}

// Refusals and failures to decide: problem+json, next never runs, nothing
// to refund.
func TestRefusalsNeverCallNext(t *testing.T) {
	next := http.HandlerFunc(func(http.ResponseWriter, *http.Request) { t.Error("next ran") })
	quota := okDecision()
	quota.Reason, quota.RetryAfter, quota.Remaining = shard.QuotaExceeded, int64(time.Hour), 1
	for _, tc := range []struct {
		name    string
		ch      *fakeCharger
		cfg     ConfigSource
		status  int
		typ     string
		headers []string // that must be present
	}{
		{"quota exceeded (402)", &fakeCharger{decision: quota}, testConfig(t), 402, ProblemQuotaExceeded, []string{"Retry-After", "X-Quota-Remaining"}},
		{"ErrUnavailable", &fakeCharger{err: ErrUnavailable}, testConfig(t), 503, ProblemQuotaUnavailable, []string{"Retry-After"}},
		{"ErrInternal", &fakeCharger{err: ErrInternal}, testConfig(t), 500, ProblemInternal, nil},
		// Retryable: an operator fixes the nodes' tokens, not the client.
		{"ErrRejected (the nodes' RPC tokens differ)", &fakeCharger{err: rejectedError("acme", "127.0.0.1:7400", "charge",
			status.Error(codes.Unauthenticated, "router: wrong RPC token: use the cluster's --rpc-token"))}, testConfig(t), 503, ProblemQuotaUnavailable, []string{"Retry-After"}},
		// An owner of an earlier version answered a deadline INTERNAL
		// ("router: internal error at the owner: context deadline
		// exceeded (at n3)"): the deadline is why, and a retry decides it.
		{"the deadline passed at the owner", &fakeCharger{untilDeadline: true, err: fmt.Errorf("%w: context deadline exceeded (at n3)", ErrInternal)},
			testConfig(t), 503, ProblemQuotaUnavailable, []string{"Retry-After"}},
		{"no snapshot yet", &fakeCharger{}, staticConfig{}, 503, ProblemQuotaUnavailable, []string{"Retry-After"}},
		{"account not loaded at the owner", &fakeCharger{decision: shard.Decision{Reason: shard.UnknownAccount}}, testConfig(t), 503,
			ProblemQuotaUnavailable, []string{"Retry-After"}},
	} {
		var seen []int
		opts := FrontOptions{Charger: tc.ch, Config: tc.cfg, QuotaStatus: 402, OnRequest: func(code int, _ time.Duration) { seen = append(seen, code) },
			ChargeTimeout: 200 * time.Millisecond}
		w, _ := serve(t, opts, next, newRequest("POST", "/v1/tasks", nil))
		var p Problem
		if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil || w.Code != tc.status || p.Type != tc.typ || p.Status != tc.status {
			t.Errorf("%s: %d %s", tc.name, w.Code, w.Body)
		}
		for _, h := range tc.headers {
			if w.Header().Get(h) == "" {
				t.Errorf("%s: no %s", tc.name, h)
			}
		}
		if quota := w.Header().Get("X-Quota-Limit") != ""; quota != (tc.typ == ProblemQuotaExceeded) {
			t.Errorf("%s: X-Quota-Limit %q: quota headers only with the owner's decision", tc.name, w.Header().Get("X-Quota-Limit"))
		}
		if _, r := tc.ch.counts(); r != 0 || len(seen) != 1 || seen[0] != tc.status {
			t.Errorf("%s: %d refunds, OnRequest heard %v", tc.name, r, seen)
		}
	}
}

// A client that hangs up while its charge is in flight: the charge
// completes (its outcome is known), next never runs, and it is refunded.
func TestClientGoneDuringCharge(t *testing.T) {
	ch := &fakeCharger{decision: okDecision(), gate: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	req := newRequest("POST", "/v1/tasks", nil).WithContext(ctx)
	var code int
	done := make(chan struct{})
	go func() {
		defer close(done)
		serve(t, FrontOptions{Charger: ch, Config: testConfig(t), OnRequest: func(c int, _ time.Duration) { code = c }},
			http.HandlerFunc(func(http.ResponseWriter, *http.Request) { t.Error("next ran for a client that left") }), req)
	}()
	cancel()
	close(ch.gate)
	<-done
	if c, r := ch.counts(); c != 1 || r != 1 || code != 499 {
		t.Fatalf("%d charges, %d refunds, code %d; want 1, 1, 499", c, r, code)
	}
}

// A chunked body over the limit that the handler cannot read: 413 and a
// refund; a Content-Length over it: 413 before any charge.
func TestMaxBodyBytes(t *testing.T) {
	reader := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.ReadAll(r.Body); err == nil {
			t.Error("read the whole body past the limit")
		}
	})
	ch := &fakeCharger{decision: okDecision()}
	req := newRequest("POST", "/v1/tasks", io.MultiReader(strings.NewReader(strings.Repeat("x", 100))))
	req.ContentLength = -1
	w, _ := serve(t, FrontOptions{Charger: ch, Config: testConfig(t), MaxBodyBytes: 10, BillOn: BillOnAlways}, reader, req)
	if c, r := ch.counts(); w.Code != 413 || c != 1 || r != 1 {
		t.Fatalf("chunked: %d, %d charges, %d refunds (even under bill-on always)", w.Code, c, r)
	}
	ch = &fakeCharger{decision: okDecision()}
	w, _ = serve(t, FrontOptions{Charger: ch, Config: testConfig(t), MaxBodyBytes: 10}, reader, newRequest("POST", "/v1/tasks", strings.NewReader(strings.Repeat("x", 11))))
	if c, _ := ch.counts(); w.Code != 413 || c != 0 {
		t.Fatalf("Content-Length: %d, %d charges", w.Code, c)
	}
}

// An upstream's interim answers (103 Early Hints, 100 Continue) do not take
// the quota headers off the final answer: ReverseProxy clears the header
// map after relaying each.
func TestQuotaHeadersAfterInterimAnswers(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.Header().Set("X-Quota-Remaining", "999999") // on the 103: never reaches the client either
		w.Header().Set("RateLimit", `"evil";r=999`)
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link")
		w.Header().Del("RateLimit")
		w.Header().Set("X-Quota-Remaining", "1000000") // an upstream's own value never reaches the client
		io.WriteString(w, "ok")
	}))
	defer up.Close()
	u, _ := url.Parse(up.URL)
	ch := &fakeCharger{decision: okDecision()}
	proxy, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t)})
	if err != nil {
		t.Fatal(err)
	}
	front := httptest.NewServer(proxy)
	defer front.Close()
	req, _ := http.NewRequest("POST", front.URL+"/v1/tasks", nil)
	req.Header.Set("X-Api-Key", "secret")
	var interim []int
	var interimHeaders []textproto.MIMEHeader
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
		Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
			interim, interimHeaders = append(interim, code), append(interimHeaders, h)
			return nil
		},
	}))
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if len(interim) != 1 || interim[0] != 103 {
		t.Fatalf("interim answers %v, want [103]: the test's upstream did not send one", interim)
	}
	// The 103 carries the upstream's Link, and none of the quota headers:
	// the upstream's values of them reached the client there, beside the
	// front's, which belong on the final answer.
	if h := interimHeaders[0]; h.Get("Link") == "" || len(h.Values("X-Quota-Remaining")) != 0 || len(h.Values("Ratelimit")) != 0 {
		t.Errorf("the 103's headers %v: want its Link and no quota headers", h)
	}
	for k, want := range map[string]string{"X-Quota-Limit": "100", "X-Quota-Remaining": "98", "X-Quota-Reset": "2026-07-01T00:00:00Z"} {
		if got := res.Header.Get(k); got != want {
			t.Errorf("%s: %q after a 103, want %q", k, got, want)
		}
	}
}

func TestUsageEndpoint(t *testing.T) {
	ch := &fakeCharger{}
	w, _ := serve(t, FrontOptions{Charger: ch, Config: testConfig(t), UsagePath: "/usage"}, http.NotFoundHandler(), newRequest("GET", "/usage", nil))
	want := `{"account":"acme","period":"2026-06","used":2,"limit":100,"remaining":98,"reset":"2026-07-01T00:00:00Z","routes":{"POST /v1/tasks":2}}`
	if got := strings.TrimSpace(w.Body.String()); w.Code != 200 || got != want || w.Header().Get("X-Quota-Remaining") != "98" {
		t.Fatalf("usage: %d %s %v\nwant %s", w.Code, got, w.Header(), want)
	}
	if c, _ := ch.counts(); c != 0 {
		t.Fatal("the usage endpoint charged")
	}
	r := httptest.NewRequest("GET", "/usage", nil)
	w, _ = serve(t, FrontOptions{Charger: ch, Config: testConfig(t), UsagePath: "/usage"}, http.NotFoundHandler(), r)
	if w.Code != 401 {
		t.Fatalf("usage without a key: %d", w.Code)
	}
}

func TestCallerInContext(t *testing.T) {
	ch := &fakeCharger{decision: okDecision()}
	var got *Caller
	h := http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { got, _ = CallerFrom(r.Context()) })
	serve(t, FrontOptions{Charger: ch, Config: testConfig(t)}, h, newRequest("POST", "/v1/tasks/", nil))
	if got == nil || got.Account != "acme" || got.KeyID != "k1" || got.Route != "*" || got.Units != 1 || got.EventID != "gen-1" {
		t.Fatalf("caller %+v", got)
	}
}

// A gRPC caller gets refusals as trailers-only gRPC answers.
func TestProblemAsGRPC(t *testing.T) {
	req := httptest.NewRequest("POST", "/pkg.Svc/Method", nil)
	req.Header.Set("Content-Type", "application/grpc+proto")
	for _, tc := range []struct {
		p    *Problem
		code string
	}{
		{refusal(&shard.Decision{Reason: shard.RateLimited, RetryAfter: 1, RateBurst: 1}, 1, 429), "8"},
		{unknownKey(true), "16"},
		{unavailable("down"), "14"},
		{newProblem(ProblemUpstreamUnavailable, "Upstream timed out", 504, "late"), "4"},
		{internalError(), "13"},
	} {
		w := httptest.NewRecorder()
		tc.p.write(w, req)
		h := w.Header()
		if w.Code != 200 || h.Get("Grpc-Status") != tc.code || h.Get("Content-Type") != "application/grpc" || w.Body.Len() != 0 ||
			h.Get("X-Quota-Problem") != tc.p.Type {
			t.Errorf("%s: %d %v %q", tc.p.Type, w.Code, h, w.Body)
		}
	}
	// A gRPC-Web caller gets its own content type back, which its clients
	// check before they read grpc-status.
	for _, ct := range []string{"application/grpc-web+proto", "application/grpc-web-text"} {
		web := httptest.NewRequest("POST", "/pkg.Svc/Method", nil)
		web.Header.Set("Content-Type", ct)
		w := httptest.NewRecorder()
		unknownKey(true).write(w, web)
		if w.Header().Get("Content-Type") != ct || w.Header().Get("Grpc-Status") != "16" {
			t.Errorf("gRPC-Web %s: %v", ct, w.Header())
		}
	}
	if got := grpcMessage("50% off: café\n"); got != "50%25 off: caf%C3%A9%0A" {
		t.Errorf("grpcMessage: %q", got)
	}
}

// earlyCharger answers before durability; its wait is under the test's
// control.
type earlyCharger struct {
	fakeCharger
	waitErr error
	order   []string   // "wait", "write": what happened first
	mu      sync.Mutex // protects order
}

func (e *earlyCharger) ChargeEarly(ctx context.Context, req ChargeRequest) (ChargeResult, func(context.Context) error, error) {
	res, err := e.Charge(ctx, req)
	return res, func(context.Context) error {
		e.mu.Lock()
		e.order = append(e.order, "wait")
		e.mu.Unlock()
		return e.waitErr
	}, err
}

// With an EarlyCharger the upstream runs before the charge is durable, and
// nothing reaches the client until it is: a failed wait withholds the
// upstream's answer (500) and refunds.
func TestEarlyChargeHoldsTheAnswerUntilDurable(t *testing.T) {
	for _, fail := range []bool{false, true} {
		ch := &earlyCharger{fakeCharger: fakeCharger{decision: okDecision()}}
		if fail {
			ch.waitErr = errors.New("log failed")
		}
		h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			ch.mu.Lock()
			ch.order = append(ch.order, "upstream")
			ch.mu.Unlock()
			w.Header().Set("Set-Cookie", "session=1")
			w.WriteHeader(201)
			io.WriteString(w, "created")
		})
		w, _ := serve(t, FrontOptions{Charger: ch, Config: testConfig(t)}, h, newRequest("POST", "/v1/tasks", nil))
		ch.mu.Lock()
		order := fmt.Sprint(ch.order)
		ch.mu.Unlock()
		_, refunds := ch.counts()
		switch {
		case order != "[upstream wait]":
			t.Errorf("fail=%v: order %s, want the upstream before the wait", fail, order)
		case !fail && (w.Code != 201 || w.Body.String() != "created" || refunds != 0):
			t.Errorf("durable: %d %q, %d refunds", w.Code, w.Body.String(), refunds)
		case fail && (w.Code != 500 || strings.Contains(w.Body.String(), "created") || refunds != 1 ||
			w.Header().Get("Set-Cookie") != "" || w.Header().Get("Content-Type") != "application/problem+json"):
			t.Errorf("not durable: %d %q %v, %d refunds; want 500 problem+json, nothing of the upstream (body or headers), a refund", w.Code, w.Body.String(), w.Header(), refunds)
		}
	}
}

// Through the proxy on a real server, a charge whose wait fails after the
// upstream answered is a whole 500 problem+json, not a cut connection:
// ReverseProxy aborts the handler (http.ErrAbortHandler) when its copy of
// the upstream's body fails, and the front's gate fails that copy; the
// front had answered in full, so it does not pass the abort on. Over
// HTTP/1.1 and HTTP/2, with a body the upstream streams too.
func TestEarlyChargeNotDurableThroughTheProxy(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Set-Cookie", "session=1")
		w.WriteHeader(201)
		io.WriteString(w, "created")
		if r.URL.Query().Has("stream") {
			w.(http.Flusher).Flush()
			io.WriteString(w, " and more")
		}
	}))
	defer up.Close()
	u, _ := url.Parse(up.URL)
	for _, h2 := range []bool{false, true} {
		for _, path := range []string{"/v1/tasks", "/v1/tasks?stream=1"} {
			ch := &earlyCharger{fakeCharger: fakeCharger{decision: okDecision()}, waitErr: errors.New("log failed")}
			proxy, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t)})
			if err != nil {
				t.Fatal(err)
			}
			front := httptest.NewUnstartedServer(proxy)
			front.EnableHTTP2 = h2
			front.StartTLS()
			req, _ := http.NewRequest("POST", front.URL+path, nil)
			req.Header.Set("X-Api-Key", "secret")
			res, err := front.Client().Do(req)
			var body []byte
			if err == nil {
				body, err = io.ReadAll(res.Body)
				res.Body.Close()
			}
			front.Close()
			_, refunds := ch.counts()
			switch {
			case err != nil:
				t.Errorf("http2=%v %s: %v; want a 500 problem+json", h2, path, err)
			case res.StatusCode != 500 || res.Header.Get("Content-Type") != "application/problem+json" || strings.Contains(string(body), "created") ||
				res.Header.Get("Set-Cookie") != "" || refunds != 1:
				t.Errorf("http2=%v %s: %d %v %q, %d refunds; want 500 problem+json, nothing of the upstream, a refund", h2, path, res.StatusCode, res.Header, body, refunds)
			case h2 != (res.ProtoMajor == 2):
				t.Errorf("http2=%v: the answer came over %s", h2, res.Proto)
			}
		}
	}
}

// A CORS preflight needs no key and is never charged: the API answers it.
// A plain OPTIONS is a request like any other.
func TestPreflightPassesUncharged(t *testing.T) {
	var served int
	h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		served++
		w.Header().Set("Access-Control-Allow-Origin", "https://app.example")
		w.WriteHeader(http.StatusNoContent)
	})
	ch := &fakeCharger{decision: okDecision()}
	req := httptest.NewRequest("OPTIONS", "/v1/tasks", nil)
	req.Header.Set("Origin", "https://app.example")
	req.Header.Set("Access-Control-Request-Method", "POST")
	w, _ := serve(t, FrontOptions{Charger: ch, Config: testConfig(t)}, h, req)
	if c, _ := ch.counts(); w.Code != 204 || served != 1 || c != 0 || w.Header().Get("Access-Control-Allow-Origin") == "" {
		t.Fatalf("preflight: %d, served %d, %d charges, headers %v", w.Code, served, c, w.Header())
	}
	w, _ = serve(t, FrontOptions{Charger: ch, Config: testConfig(t)}, h, httptest.NewRequest("OPTIONS", "/v1/tasks", nil))
	if c, _ := ch.counts(); w.Code != 401 || served != 1 || c != 0 {
		t.Fatalf("OPTIONS without preflight headers or key: %d, served %d, %d charges", w.Code, served, c)
	}
	// A preflight with a body (browsers send none) passed uncharged and
	// past MaxBodyBytes; one for the usage path reached the API.
	preflight := func(path string, body io.Reader) *http.Request {
		req := httptest.NewRequest("OPTIONS", path, body)
		req.Header.Set("Origin", "https://app.example")
		req.Header.Set("Access-Control-Request-Method", "POST")
		return req
	}
	w, _ = serve(t, FrontOptions{Charger: ch, Config: testConfig(t), MaxBodyBytes: 10}, h, preflight("/v1/exports", strings.NewReader(strings.Repeat("x", 100))))
	if c, _ := ch.counts(); w.Code != 400 || served != 1 || c != 0 || !strings.Contains(w.Body.String(), "carries no body") {
		t.Fatalf("a preflight with a body: %d %s, served %d, %d charges; want 400, not served", w.Code, w.Body, served, c)
	}
	w, _ = serve(t, FrontOptions{Charger: ch, Config: testConfig(t), UsagePath: "/usage"}, h, preflight("/usage", nil))
	if w.Code != 405 || served != 1 {
		t.Fatalf("a preflight for the usage path: %d, served %d; want the usage endpoint's 405, not the API", w.Code, served)
	}
}

// The handler behind the middleware sees the front's X-Quota-Account and
// X-Quota-Event, never a client's forged ones (the proxy's upstream
// already did); a preflight sees neither. With ChargePreflights a preflight
// is a request like any other: no key, 401.
func TestMiddlewareQuotaHeadersAreTheFronts(t *testing.T) {
	var seen []string
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen = append(seen, r.Header.Get(HeaderAccount)+"|"+r.Header.Get(HeaderEvent))
	})
	forge := func(req *http.Request) *http.Request {
		req.Header.Set(HeaderAccount, "victim")
		req.Header.Set(HeaderEvent, "forged")
		return req
	}
	ch := &fakeCharger{decision: okDecision()}
	req := forge(newRequest("GET", "/v1/tasks", nil))
	req.Header.Set("Idempotency-Key", "k-1")
	if w, _ := serve(t, FrontOptions{Charger: ch, Config: testConfig(t)}, h, req); w.Code != 200 {
		t.Fatalf("charged request: %d", w.Code)
	}
	pre := forge(httptest.NewRequest("OPTIONS", "/v1/tasks", nil))
	pre.Header.Set("Origin", "https://app.example")
	pre.Header.Set("Access-Control-Request-Method", "POST")
	serve(t, FrontOptions{Charger: ch, Config: testConfig(t)}, h, pre)
	if len(seen) != 2 || seen[0] != "acme|k-1" || seen[1] != "|" {
		t.Fatalf("the handler saw %q, want the front's account and event, then nothing for the preflight", seen)
	}
	if pre.Header.Get(HeaderAccount) != "victim" {
		t.Error("the middleware changed the caller's own request")
	}
	pre = httptest.NewRequest("OPTIONS", "/v1/tasks", nil)
	pre.Header.Set("Origin", "https://app.example")
	pre.Header.Set("Access-Control-Request-Method", "POST")
	if w, _ := serve(t, FrontOptions{Charger: ch, Config: testConfig(t), ChargePreflights: true}, h, pre); w.Code != 401 || len(seen) != 2 {
		t.Fatalf("preflight with ChargePreflights: %d, handler ran %d times; want 401 and not run", w.Code, len(seen)-2)
	}
}

// A gRPC call (HTTP/2, a gRPC Content-Type) is a stream: MaxBodyBytes does
// not cut it off. The same Content-Type over HTTP/1.1, which gRPC does not
// use, is a client's claim: it exempted any body from the limit.
func TestGRPCStreamsAreNotBodyBounded(t *testing.T) {
	var read int
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			t.Errorf("reading the stream: %v", err)
		}
		read = len(b)
		w.Header().Set("Content-Type", "application/grpc")
		w.Header().Set("Grpc-Status", "0")
		w.WriteHeader(200)
	})
	ch := &fakeCharger{decision: okDecision()}
	req := newRequest("POST", "/v1/tasks", io.MultiReader(strings.NewReader(strings.Repeat("x", 100))))
	req.ContentLength = -1
	req.Header.Set("Content-Type", "application/grpc")
	req.Proto, req.ProtoMajor, req.ProtoMinor = "HTTP/2.0", 2, 0
	w, _ := serve(t, FrontOptions{Charger: ch, Config: testConfig(t), MaxBodyBytes: 10}, h, req)
	if c, r := ch.counts(); w.Code != 200 || read != 100 || c != 1 || r != 0 {
		t.Fatalf("gRPC stream of 100 bytes, limit 10: %d, read %d, %d charges, %d refunds", w.Code, read, c, r)
	}

	req = newRequest("POST", "/v1/tasks", strings.NewReader(strings.Repeat("x", 100)))
	req.Header.Set("Content-Type", "application/grpc+json")
	w, _ = serve(t, FrontOptions{Charger: ch, Config: testConfig(t), MaxBodyBytes: 10}, http.NotFoundHandler(), req)
	if w.Header().Get("Grpc-Status") != "8" || w.Header().Get("X-Quota-Problem") != ProblemPayloadTooLarge { // NB: refusals to a gRPC-typed request are gRPC statuses
		t.Fatalf("an HTTP/1.1 body of 100 bytes typed application/grpc+json, limit 10: %d %v, want payload-too-large", w.Code, w.Header())
	}
}

// X-Forwarded-* from the client are replaced unless the operator trusts
// them (a load balancer in front sets them).
func TestTrustForwarded(t *testing.T) {
	var got http.Header
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { got = r.Header.Clone() }))
	defer up.Close()
	u, _ := url.Parse(up.URL)
	for _, trust := range []bool{false, true} {
		proxy, err := NewProxy(u, FrontOptions{Charger: &fakeCharger{decision: okDecision()}, Config: testConfig(t), TrustForwarded: trust})
		if err != nil {
			t.Fatal(err)
		}
		front := httptest.NewServer(proxy)
		req, _ := http.NewRequest("GET", front.URL+"/v1/tasks", nil)
		req.Header.Set("X-Api-Key", "secret")
		req.Header.Set("X-Forwarded-For", "203.0.113.7")
		req.Header.Set("X-Forwarded-Proto", "https")
		req.Header.Set("X-Real-IP", "203.0.113.9")
		req.Header.Set("True-Client-IP", "203.0.113.10") // chi's RealIP reads it first
		req.Header.Set("CF-Connecting-IP", "203.0.113.11")
		req.Header.Set("Forwarded", "for=203.0.113.7;proto=https")
		req.Header.Set("Via", "1.1 lb")
		// Lookalikes of the headers the proxy owns, which an upstream that
		// reads "_" as "-" (CGI, WSGI, Rack) would take for them; a header
		// of the API's own with an underscore passes.
		for _, name := range []string{"X_Quota_Account", "x_quota_event", "X_Forwarded_For", "X_REAL_IP", "Forwarded_", "X_HTTP_Method_Override", "Idempotency_Key"} {
			req.Header[name] = []string{"forged"}
		}
		req.Header["X_Api_Trace"] = []string{"kept"}
		res, err := http.DefaultClient.Do(req)
		front.Close()
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		// The proxy's own Forwarded element: its peer, the Host it got.
		hop := `for=127.0.0.1;host="` + strings.TrimPrefix(front.URL, "http://") + `";proto=http`
		wantFor, wantProto, wantReal, wantFwd := "127.0.0.1", "http", "127.0.0.1", hop
		if trust {
			wantFor, wantProto, wantReal, wantFwd = "203.0.113.7, 127.0.0.1", "https", "203.0.113.9", "for=203.0.113.7;proto=https, "+hop
		}
		if f, p := got.Get("X-Forwarded-For"), got.Get("X-Forwarded-Proto"); f != wantFor || p != wantProto {
			t.Errorf("trust %v: upstream saw X-Forwarded-For %q, -Proto %q; want %q, %q", trust, f, p, wantFor, wantProto)
		}
		// X-Real-IP (trusted first by chi's RealIP, gin, nginx) passed as the
		// client forged it; Forwarded was dropped even when trusted.
		if r, f := got.Get("X-Real-IP"), strings.Join(got.Values("Forwarded"), ", "); r != wantReal || f != wantFwd {
			t.Errorf("trust %v: upstream saw X-Real-IP %q, Forwarded %q; want %q, %q", trust, r, f, wantReal, wantFwd)
		}
		// The other client-address headers frameworks trust: the client's
		// own are dropped; a trusted balancer's pass.
		wantTrue, wantCF := "", ""
		if trust {
			wantTrue, wantCF = "203.0.113.10", "203.0.113.11"
		}
		if tc, cf := got.Get("True-Client-IP"), got.Get("CF-Connecting-IP"); tc != wantTrue || cf != wantCF {
			t.Errorf("trust %v: upstream saw True-Client-IP %q, CF-Connecting-IP %q; want %q, %q", trust, tc, cf, wantTrue, wantCF)
		}
		for name, vs := range got {
			if strings.Contains(name, "_") && name != "X_api_trace" && name != "Forwarded_" {
				t.Errorf("trust %v: the upstream got the lookalike %s: %q", trust, name, vs)
			}
		}
		if got.Get("X_api_trace") != "kept" {
			t.Errorf("trust %v: the API's own X_Api_Trace did not reach the upstream: %v", trust, got)
		}
		// RFC 9110 section 7.6.3: a gateway sends Via, after the client's.
		if v := strings.Join(got.Values("Via"), ", "); v != "1.1 lb, 1.1 quotad" {
			t.Errorf("trust %v: upstream saw Via %q, want %q", trust, v, "1.1 lb, 1.1 quotad")
		}
	}
}

// switchingUpstream is an upstream that switches to whatever protocol a
// request offers in Upgrade (101, then nothing), as an h2c or WebSocket
// server does, and serves a request without one; seen hears each request.
func switchingUpstream(t *testing.T, seen func(*http.Request)) *httptest.Server {
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen(r)
		if p := r.Header.Get("Upgrade"); p != "" {
			conn, brw, err := http.NewResponseController(w).Hijack()
			if err != nil {
				t.Error(err)
				return
			}
			defer conn.Close()
			brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: " + p + "\r\n\r\n")
			brw.Flush()
			return
		}
		io.WriteString(w, "served without switching")
	}))
}

// An offer to upgrade to h2c does not reach the upstream: once switched,
// the connection would carry HTTP/2 requests to the upstream that the
// proxy relays as bytes, unbilled. The request is served as HTTP/1.1 and
// billed once; a WebSocket upgrade still passes.
func TestProxyDropsH2CUpgrade(t *testing.T) {
	var mu sync.Mutex
	var sawUpgrade []string
	up := switchingUpstream(t, func(r *http.Request) {
		mu.Lock()
		sawUpgrade = append(sawUpgrade, r.Header.Get("Upgrade")+"|"+r.Header.Get("HTTP2-Settings"))
		mu.Unlock()
	})
	defer up.Close()
	u, _ := url.Parse(up.URL)
	ch := &fakeCharger{decision: okDecision()}
	proxy, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t)})
	if err != nil {
		t.Fatal(err)
	}
	front := httptest.NewServer(proxy)
	defer front.Close()
	send := func(connection, upgrade string) string {
		conn, err := net.Dial("tcp", strings.TrimPrefix(front.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(conn, "GET /v1/tasks HTTP/1.1\r\nHost: api.example.com\r\nX-Api-Key: secret\r\nConnection: %s\r\nUpgrade: %s\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n", connection, upgrade)
		line, err := bufio.NewReader(conn).ReadString('\n')
		if err != nil {
			t.Fatalf("Upgrade: %s: %v", upgrade, err)
		}
		return strings.TrimSpace(line)
	}
	for _, offer := range []struct{ connection, upgrade string }{
		{"Upgrade, HTTP2-Settings", "h2c"},
		{"Upgrade", "H2C"},
		{"Upgrade, HTTP2-Settings", "foo/2, h2c"},
	} {
		if got := send(offer.connection, offer.upgrade); got != "HTTP/1.1 200 OK" {
			t.Errorf("Upgrade: %s: the client got %q, want the request served as HTTP/1.1 (200)", offer.upgrade, got)
		}
	}
	if got := send("Upgrade", "websocket"); got != "HTTP/1.1 101 Switching Protocols" {
		t.Errorf("Upgrade: websocket: the client got %q, want the upgrade to pass", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if want := []string{"|", "|", "|", "websocket|AAMAAABkAARAAAAAAAIAAAAA"}; !slices.Equal(sawUpgrade, want) {
		t.Errorf("the upstream saw Upgrade|HTTP2-Settings %q, want %q", sawUpgrade, want)
	}
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if len(ch.charges) != 4 {
		t.Errorf("%d charges for 4 requests", len(ch.charges))
	}
}

// Only the protocols FrontOptions.Upgrades allows (a WebSocket by default)
// are offered to the upstream: after a 101 the proxy relays bytes, and
// whatever the client sent over the switched connection (Docker's "tcp"
// attach, or any protocol an upstream happens to speak) would reach it
// unbilled. An offer with nothing allowed left is served without switching.
func TestProxyUpgradesOnlyTheAllowedProtocols(t *testing.T) {
	for _, c := range []struct {
		name  string
		opts  FrontOptions
		offer string
		want  string // the status line the client gets
		saw   string // the Upgrade the upstream saw
	}{
		{"default: websocket", FrontOptions{}, "websocket", "HTTP/1.1 101 Switching Protocols", "websocket"},
		{"default: WebSocket among others", FrontOptions{}, "tcp, WebSocket/13", "HTTP/1.1 101 Switching Protocols", "WebSocket/13"},
		{"default: tcp", FrontOptions{}, "tcp", "HTTP/1.1 200 OK", ""},
		{"default: anything", FrontOptions{}, "IRC/6.9", "HTTP/1.1 200 OK", ""},
		{"tcp allowed", FrontOptions{Upgrades: []string{"TCP"}}, "tcp", "HTTP/1.1 101 Switching Protocols", "tcp"},
		{"tcp allowed: websocket", FrontOptions{Upgrades: []string{"tcp"}}, "websocket", "HTTP/1.1 200 OK", ""},
		{"none", FrontOptions{NoUpgrades: true}, "websocket", "HTTP/1.1 200 OK", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			saw := make(chan string, 1)
			up := switchingUpstream(t, func(r *http.Request) { saw <- r.Header.Get("Upgrade") })
			defer up.Close()
			u, _ := url.Parse(up.URL)
			opts := c.opts
			opts.Charger, opts.Config = &fakeCharger{decision: okDecision()}, testConfig(t)
			proxy, err := NewProxy(u, opts)
			if err != nil {
				t.Fatal(err)
			}
			front := httptest.NewServer(proxy)
			defer front.Close()
			conn, err := net.Dial("tcp", strings.TrimPrefix(front.URL, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(10 * time.Second))
			fmt.Fprintf(conn, "GET /v1/tasks HTTP/1.1\r\nHost: api.example.com\r\nX-Api-Key: secret\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n", c.offer)
			line, err := bufio.NewReader(conn).ReadString('\n')
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.TrimSpace(line); got != c.want {
				t.Errorf("Upgrade: %s: the client got %q, want %q", c.offer, got, c.want)
			}
			if got := <-saw; got != c.saw {
				t.Errorf("Upgrade: %s: the upstream saw Upgrade %q, want %q", c.offer, got, c.saw)
			}
		})
	}
}

// Upgrades names protocols, and never h2c.
func TestProxyUpgradesAreChecked(t *testing.T) {
	for _, c := range []struct {
		opts FrontOptions
		want string
	}{
		{FrontOptions{Upgrades: []string{"h2c"}}, "upgrade h2c cannot be allowed"},
		{FrontOptions{Upgrades: []string{"H2C"}}, "upgrade h2c cannot be allowed"},
		{FrontOptions{Upgrades: []string{"websocket/13"}}, `upgrade "websocket/13": want a protocol name`},
		{FrontOptions{Upgrades: []string{"web socket"}}, `upgrade "web socket": want a protocol name`},
		{FrontOptions{Upgrades: []string{""}}, `upgrade "": want a protocol name`},
		{FrontOptions{Upgrades: []string{"tcp"}, NoUpgrades: true}, "NoUpgrades with Upgrades"},
	} {
		if err := c.opts.Check(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error with %q", c.opts.Upgrades, err, c.want)
		}
	}
	if err := (FrontOptions{Upgrades: []string{"websocket", "tcp"}}).Check(); err != nil {
		t.Errorf("websocket, tcp: %v", err)
	}
}

// A POST that asks for another method in a method-override header (which
// Rack, Symfony, Laravel and Express's method-override honour) is priced as
// the dearer of the two; other methods, and headers that name no method,
// are priced as sent.
func TestMethodOverrideIsPricedAsTheDearerMethod(t *testing.T) {
	s, err := snapshot.Decode([]byte(`{"version":1,"plans":[{"id":"p","monthly_quota":100,"hard":true}],
		"accounts":[{"id":"acme","plan":"p"}],"keys":[{"id":"k1","hash":"` + snapshot.HashKey("secret") + `","account":"acme"}],
		"routes":{"version":1,"default":1,"weights":{"POST /v1/things":2,"PUT /v1/things":5,"DELETE /v1/things":10}}}`))
	if err != nil {
		t.Fatal(err)
	}
	ch := &fakeCharger{decision: okDecision()}
	ok := http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})
	for _, tc := range []struct {
		method  string
		headers map[string][]string
		route   string
		units   int64
	}{
		{"POST", nil, "POST /v1/things", 2},
		{"POST", map[string][]string{"X-Http-Method-Override": {"DELETE"}}, "DELETE /v1/things", 10},
		{"POST", map[string][]string{"X-Http-Method": {"put"}}, "PUT /v1/things", 5},
		{"POST", map[string][]string{"X-Method-Override": {"PUT"}, "X-Http-Method-Override": {"DELETE"}}, "DELETE /v1/things", 10},
		{"POST", map[string][]string{"X-Http-Method-Override": {"GET"}}, "POST /v1/things", 2}, // cheaper: as a POST
		{"POST", map[string][]string{"X-Http-Method-Override": {"DE LETE"}}, "POST /v1/things", 2},
		{"GET", map[string][]string{"X-Http-Method-Override": {"DELETE"}}, "*", 1},                         // frameworks override POSTs only
		{"POST", map[string][]string{"X-Http-Method-Override": {"DELETE, POST"}}, "DELETE /v1/things", 10}, // Express takes the first item
		{"POST", map[string][]string{"X-Http-Method-Override": {"POST, put"}}, "PUT /v1/things", 5},
	} {
		req := newRequest(tc.method, "/v1/things", nil)
		for k, v := range tc.headers {
			req.Header[k] = v
		}
		serve(t, FrontOptions{Charger: ch, Config: staticConfig{s}}, ok, req)
		ch.mu.Lock()
		got := ch.charges[len(ch.charges)-1]
		ch.mu.Unlock()
		if got.Route != tc.route || got.Units != tc.units {
			t.Errorf("%s /v1/things with %v: charged %d units as %q, want %d as %q", tc.method, tc.headers, got.Units, got.Route, tc.units, tc.route)
		}
	}
	// Symfony and Laravel read _method from the query string too, and
	// decode its name as any other: an escaped one was priced as POST.
	for _, q := range []string{"_method=DELETE", "%5Fmethod=DELETE", "%5fmethod=DELETE", "_%6Dethod=DELETE", "a=1&_method=DELETE"} {
		serve(t, FrontOptions{Charger: ch, Config: staticConfig{s}}, ok, newRequest("POST", "/v1/things?"+q, nil))
		if got := ch.charges[len(ch.charges)-1]; got.Route != "DELETE /v1/things" || got.Units != 10 {
			t.Errorf("POST /v1/things?%s: charged %d units as %q, want 10 as DELETE", q, got.Units, got.Route)
		}
	}
	// One Idempotency-Key, then the same request with an override: another
	// request (refused 422 at the owner), not a free replay of the first.
	plain, overridden := newRequest("POST", "/v1/things", nil), newRequest("POST", "/v1/things", nil)
	overridden.Header.Set("X-HTTP-Method-Override", "GET")
	if RequestTarget(plain) == RequestTarget(overridden) {
		t.Error("a POST and the same POST with a method override have one RequestTarget")
	}
	if RequestTarget(plain) != RequestTarget(newRequest("POST", "/v1/things", nil)) {
		t.Error("RequestTarget differs for the same request")
	}
}

// A route pattern with a host part bills requests to that host: the front
// matches with the request's Host, not a placeholder.
func TestRouteWithHostIsBilled(t *testing.T) {
	s, err := snapshot.Decode([]byte(`{"version":1,"plans":[{"id":"p","monthly_quota":100,"hard":true}],
		"accounts":[{"id":"acme","plan":"p"}],"keys":[{"id":"k1","hash":"` + snapshot.HashKey("secret") + `","account":"acme"}],
		"routes":{"version":1,"default":1,"weights":{"POST api.example.com/v1/exports":25}}}`))
	if err != nil {
		t.Fatal(err)
	}
	ch := &fakeCharger{decision: okDecision()}
	ok := http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})
	for host, want := range map[string]int64{"api.example.com:8080": 25, "other.example.com": 1} {
		req := newRequest("POST", "/v1/exports", nil)
		req.Host = host
		serve(t, FrontOptions{Charger: ch, Config: staticConfig{s}}, ok, req)
		ch.mu.Lock()
		got := ch.charges[len(ch.charges)-1]
		ch.mu.Unlock()
		if got.Units != want {
			t.Errorf("POST %s/v1/exports: charged %d units (route %q), want %d", host, got.Units, got.Route, want)
		}
	}
}

// The front's own answers for refunded requests (413 for a body that grew
// over the limit, 502 for a failed upstream) carry the quota after the
// refund, or no quota headers when the refund failed: never the charged
// state, which their detail contradicts.
func TestRefundedAnswerHeaders(t *testing.T) {
	after := okDecision()
	after.Reason, after.Remaining = shard.Refunded, 100
	ch := &fakeCharger{decision: okDecision(), refundDecision: after}
	drain := http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { io.Copy(io.Discard, r.Body) })
	req := newRequest("POST", "/v1/tasks", io.MultiReader(strings.NewReader(strings.Repeat("x", 100))))
	req.ContentLength = -1
	w, _ := serve(t, FrontOptions{Charger: ch, Config: testConfig(t), MaxBodyBytes: 10}, drain, req)
	if w.Code != 413 || w.Header().Get("X-Quota-Remaining") != "100" || !strings.HasPrefix(w.Header().Get("RateLimit"), `"quota";r=100;`) {
		t.Errorf("413: %d, X-Quota-Remaining %q, RateLimit %q; want 100 (after the refund), not 98", w.Code, w.Header().Get("X-Quota-Remaining"), w.Header().Get("RateLimit"))
	}
	if !strings.Contains(w.Body.String(), "the charge is refunded") {
		t.Errorf("413 refunded: %s; want a detail saying the charge is refunded", w.Body)
	}
	req = newRequest("POST", "/v1/tasks", io.MultiReader(strings.NewReader(strings.Repeat("x", 100))))
	req.ContentLength = -1
	w, _ = serve(t, FrontOptions{Charger: &fakeCharger{decision: okDecision(), refundErr: ErrUnavailable}, Config: testConfig(t), MaxBodyBytes: 10,
		RefundTimeout: 200 * time.Millisecond}, drain, req)
	if w.Code != 413 || w.Header().Get("X-Quota-Remaining") != "" || !strings.Contains(w.Body.String(), "could not be refunded now and stands") {
		t.Errorf("413 with the refund failing: %d, X-Quota-Remaining %q, %s; want no quota headers and a detail saying the charge stands",
			w.Code, w.Header().Get("X-Quota-Remaining"), w.Body)
	}

	drop := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if c, _, err := http.NewResponseController(w).Hijack(); err == nil {
			c.Close()
		}
	}))
	defer drop.Close()
	u, _ := url.Parse(drop.URL)
	for _, tc := range []struct {
		what      string
		charger   *fakeCharger
		remaining string
		tries     int // refunds sent; 0: more than one (retried until RefundTimeout)
	}{
		{"refunded", &fakeCharger{decision: okDecision(), refundDecision: after}, "100", 1},
		// An owner that just crashed answers again within seconds: the
		// refund is tried again until it does (a single try left the
		// charge standing).
		{"refunded at the third try", &fakeCharger{decision: okDecision(), refundDecision: after, refundFails: 2}, "100", 3},
		{"refund failed", &fakeCharger{decision: okDecision(), refundErr: ErrUnavailable}, "", 0},
	} {
		proxy, err := NewProxy(u, FrontOptions{Charger: tc.charger, Config: testConfig(t), RefundTimeout: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		front := httptest.NewServer(proxy)
		req, _ := http.NewRequest("POST", front.URL+"/v1/tasks", nil)
		req.Header.Set("X-Api-Key", "secret")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		front.Close()
		// The detail says what became of the charge: "refunded" when the
		// refund failed sent a client that trusted it to retry without its
		// Idempotency-Key, and pay twice.
		if want := map[bool]string{true: "The charge is refunded", false: "could not be refunded now and stands"}[tc.remaining != ""]; !strings.Contains(string(body), want) {
			t.Errorf("%s: %s; want a detail saying %q", tc.what, body, want)
		}
		if res.StatusCode != 502 || res.Header.Get("X-Quota-Remaining") != tc.remaining || (tc.remaining == "") != (res.Header.Get("RateLimit") == "") {
			t.Errorf("%s: %d, X-Quota-Remaining %q, RateLimit %q; want 502 with %q", tc.what, res.StatusCode,
				res.Header.Get("X-Quota-Remaining"), res.Header.Get("RateLimit"), tc.remaining)
		}
		if _, r := tc.charger.counts(); (tc.tries > 0 && r != tc.tries) || (tc.tries == 0 && r < 2) {
			t.Errorf("%s: %d refunds sent, want %d (0: retried)", tc.what, r, tc.tries)
		}
	}
}

// A body without a Content-Length streams to the upstream as it comes, so
// one that grows over MaxBodyBytes has reached the upstream in part when it
// is cut off. The upstream must then see an aborted request (its read of
// the body fails), never a complete one; the client gets 413 and the
// charge is refunded. Over HTTP/1.1 (a chunked body without its last
// chunk, then a closed connection) and h2c (a reset stream).
// protoServer serves h over HTTP/1.1 ("http") or HTTP/2 without TLS
// ("h2c") until the test ends.
func protoServer(t *testing.T, proto string, h http.Handler) *httptest.Server {
	srv := httptest.NewUnstartedServer(h)
	if proto == "h2c" {
		srv.Config.Protocols = new(http.Protocols)
		srv.Config.Protocols.SetUnencryptedHTTP2(true)
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv
}

// protoProxy serves NewProxy(opts) in front of up (an upstream from
// protoServer), speaking proto ("http" or "h2c") both ways, and returns it
// with a client that speaks proto to it, bounded by 10 s.
func protoProxy(t *testing.T, proto string, up *httptest.Server, opts FrontOptions) (front *httptest.Server, client *http.Client) {
	t.Helper()
	u, _ := url.Parse(up.URL)
	u.Scheme = proto
	proxy, err := NewProxy(u, opts)
	if err != nil {
		t.Fatal(err)
	}
	front = protoServer(t, proto, proxy)
	return front, &http.Client{Transport: &http.Transport{Protocols: front.Config.Protocols}, Timeout: 10 * time.Second}
}

func TestChunkedBodyOverLimitAbortsTheUpstream(t *testing.T) {
	for _, proto := range []string{"http", "h2c"} {
		t.Run(proto, func(t *testing.T) {
			type read struct {
				n   int64
				err error
			}
			reads := make(chan read, 1)
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n, err := io.Copy(io.Discard, r.Body)
				reads <- read{n, err}
				if err != nil {
					return
				}
				io.WriteString(w, "served") // a complete request is served and billed
			})
			up := protoServer(t, proto, h)
			u, _ := url.Parse(up.URL)
			u.Scheme = proto
			ch := &fakeCharger{decision: okDecision()}
			proxy, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t), MaxBodyBytes: 64 << 10})
			if err != nil {
				t.Fatal(err)
			}
			front := httptest.NewServer(proxy)
			defer front.Close()
			// 256 KiB in 4 KiB writes, no Content-Length: sent chunked.
			pr, pw := io.Pipe()
			go func() {
				buf := make([]byte, 4<<10)
				for i := 0; i < 64; i++ {
					if _, err := pw.Write(buf); err != nil {
						return
					}
				}
				pw.Close()
			}()
			req, _ := http.NewRequest("POST", front.URL+"/v1/tasks", pr)
			req.Header.Set("X-Api-Key", "secret")
			res, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(res.Body)
			res.Body.Close()
			pr.CloseWithError(io.ErrClosedPipe)
			if res.StatusCode != http.StatusRequestEntityTooLarge {
				t.Fatalf("answer %d %s, want 413", res.StatusCode, body)
			}
			select {
			case got := <-reads:
				if got.err == nil {
					t.Fatalf("the upstream read a complete body of %d bytes; it must see the request aborted", got.n)
				}
				if got.n > 64<<10 {
					t.Fatalf("the upstream read %d bytes, more than the limit of %d", got.n, 64<<10)
				}
				t.Logf("the upstream read %d bytes, then: %v", got.n, got.err)
			case <-time.After(10 * time.Second): // NB: a deadline, not a wait: the read has failed before the 413 in practice
				t.Fatal("the upstream's read of the body did not end within 10 s")
			}
			if c, r := ch.counts(); c != 1 || r != 1 {
				t.Fatalf("%d charges, %d refunds; want the charge refunded", c, r)
			}
		})
	}
}

// A handler that takes the connection over (an upgrade: ReverseProxy
// relays a WebSocket this way) gets it only once the charge is durable; a
// charge that is not durable refuses the hijack: the client gets 500 and
// the charge is refunded.
func TestHijackWaitsUntilDurable(t *testing.T) {
	for _, fail := range []bool{false, true} {
		ch := &earlyCharger{fakeCharger: fakeCharger{decision: okDecision()}}
		if fail {
			ch.waitErr = errors.New("log failed")
		}
		hijackErr := make(chan error, 1)
		h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			if _, ok := w.(http.Hijacker); !ok {
				t.Error("the front's ResponseWriter is no http.Hijacker")
			}
			conn, brw, err := http.NewResponseController(w).Hijack()
			hijackErr <- err
			if err != nil {
				return
			}
			defer conn.Close()
			ch.mu.Lock()
			ch.order = append(ch.order, "hijacked")
			ch.mu.Unlock()
			brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: test\r\n\r\n")
			brw.Flush()
		})
		codes := make(chan int, 1)
		mw, err := Middleware(FrontOptions{Charger: ch, Config: testConfig(t), OnRequest: func(c int, _ time.Duration) { codes <- c }})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(mw(h))
		req, _ := http.NewRequest("GET", srv.URL+"/v1/stream", nil)
		req.Header.Set("Authorization", "Bearer secret")
		req.Header.Set("Connection", "Upgrade")
		req.Header.Set("Upgrade", "test")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		var herr error
		var code int
		select {
		case herr = <-hijackErr:
		case <-time.After(10 * time.Second):
			t.Fatal("the handler never got to hijack")
		}
		select {
		case code = <-codes:
		case <-time.After(10 * time.Second):
			t.Fatal("OnRequest never heard the request: did the front panic after the hijack?")
		}
		srv.Close()
		ch.mu.Lock()
		order := fmt.Sprint(ch.order)
		ch.mu.Unlock()
		_, refunds := ch.counts()
		switch {
		case !fail && (res.StatusCode != 101 || herr != nil || order != "[wait hijacked]" || refunds != 0 || code != 101):
			t.Errorf("durable: %d, hijack %v, order %s, %d refunds, OnRequest %d; want 101 after the wait, no refund", res.StatusCode, herr, order, refunds, code)
		case fail && (res.StatusCode != 500 || herr == nil || !strings.Contains(herr.Error(), "not durable") || order != "[wait]" || refunds != 1 || code != 500):
			t.Errorf("not durable: %d, hijack %v, order %s, %d refunds, OnRequest %d; want 500, the hijack refused, a refund", res.StatusCode, herr, order, refunds, code)
		}
	}
}

// The Caller a handler gets is its own: changing it cannot send the refund
// to another account or event.
func TestCallerIsTheHandlersCopy(t *testing.T) {
	ch := &fakeCharger{decision: okDecision()}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, _ := CallerFrom(r.Context())
		c.Account, c.EventID = "someone-else", "other-event"
		w.WriteHeader(500)
	})
	serve(t, FrontOptions{Charger: ch, Config: testConfig(t)}, h, newRequest("POST", "/v1/tasks", nil))
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if len(ch.refunds) != 1 || ch.refunds[0].Account != "acme" || ch.refunds[0].EventID != "gen-1" {
		t.Fatalf("refunds %+v, want one of acme's event gen-1", ch.refunds)
	}
}

// OnRequest hears 500 for a handler that panicked before answering (the
// client got no answer), not net/http's default 200.
func TestPanicIsHeardAs500(t *testing.T) {
	ch := &fakeCharger{decision: okDecision()}
	var code int
	_, p := serve(t, FrontOptions{Charger: ch, Config: testConfig(t), OnRequest: func(c int, _ time.Duration) { code = c }},
		http.HandlerFunc(func(http.ResponseWriter, *http.Request) { panic("boom") }), newRequest("POST", "/v1/tasks", nil))
	if _, refunds := ch.counts(); p == nil || code != 500 || refunds != 1 {
		t.Fatalf("panic %v, OnRequest %d, %d refunds; want the panic passed on, 500, one refund", p, code, refunds)
	}
}

// usageGone answers Usage as router.Client does for a context that ended.
type usageGone struct{ fakeCharger }

func (u *usageGone) Usage(ctx context.Context, account string) (UsageResult, error) {
	<-ctx.Done()
	return UsageResult{}, fmt.Errorf("router: usage for account %q not sent: %w", account, ctx.Err())
}

// A client that hangs up on the usage endpoint is heard as 499 and gets
// nothing written, not a 500 logged as an internal error.
func TestUsageClientGone(t *testing.T) {
	var code int
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	w, _ := serve(t, FrontOptions{Charger: &usageGone{}, Config: testConfig(t), OnRequest: func(c int, _ time.Duration) { code = c }},
		http.NotFoundHandler(), newRequest("GET", "/v1/usage", nil).WithContext(ctx))
	if code != 499 || w.Body.Len() != 0 {
		t.Fatalf("OnRequest %d, body %q; want 499 and nothing written", code, w.Body.String())
	}
}

// A client that hangs up after the upstream got its request is not the
// upstream failing: the charge stands (bill-on success), as for a client
// that leaves a plain handler. It was refunded: a client that dropped a
// streamed answer part way, or sent a slow POST and left, paid nothing
// for the upstream's work. A client that leaves before the upstream got
// the request is still refunded.
func TestClientLeavingKeepsTheCharge(t *testing.T) {
	for _, tc := range []struct {
		name     string
		stream   bool // the upstream answers its head and a first event, then waits
		early    bool // the client leaves while its charge is decided, before the upstream is called
		cut      bool // the server cuts the request off (ErrCutOff), the client stays
		refunded bool
	}{
		{name: "mid-stream", stream: true},
		{name: "before the answer, after the upstream got it"},
		{name: "before the upstream got it", early: true, refunded: true},
		{name: "cut off by the server", cut: true, refunded: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := make(chan struct{}, 1)
			var upstreamCalls atomic.Int64
			up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				upstreamCalls.Add(1)
				if tc.stream {
					w.Header().Set("Content-Type", "text/event-stream")
					io.WriteString(w, "data: 1\n\n")
					w.(http.Flusher).Flush()
				}
				got <- struct{}{}
				<-r.Context().Done() // the proxy cancels it when the client leaves
			}))
			defer up.Close()
			u, _ := url.Parse(up.URL)
			ch := &fakeCharger{decision: okDecision()}
			if tc.early {
				ch.gate, ch.entered = make(chan struct{}), make(chan struct{}, 1)
			}
			done := make(chan int, 1)
			proxy, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t), OnRequest: func(code int, _ time.Duration) { done <- code }})
			if err != nil {
				t.Fatal(err)
			}
			reqCtx := make(chan context.Context, 1)
			front := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				reqCtx <- r.Context()
				proxy.ServeHTTP(w, r)
			}))
			base, cut := context.WithCancelCause(context.Background())
			defer cut(nil)
			front.Config.BaseContext = func(net.Listener) context.Context { return base }
			front.Start()
			defer front.Close()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if tc.cut {
				cancel = func() { cut(ErrCutOff) }
			}
			req, _ := http.NewRequestWithContext(ctx, "POST", front.URL+"/v1/tasks", nil)
			req.Header.Set("X-Api-Key", "secret")
			errc := make(chan error, 1)
			go func() {
				res, err := http.DefaultClient.Do(req)
				if err == nil {
					buf := make([]byte, 9)
					_, err = io.ReadFull(res.Body, buf) // the first event
					res.Body.Close()
				}
				errc <- err
			}()
			if tc.early {
				<-ch.entered // the charge is being decided
				cancel()
				<-errc
				<-(<-reqCtx).Done() // the server saw the client leave
				close(ch.gate)
			} else {
				<-got
				if tc.stream {
					if err := <-errc; err != nil {
						t.Fatalf("the first event: %v", err)
					}
				}
				cancel()
			}
			select {
			case code := <-done:
				t.Logf("the front heard %d", code)
			case <-time.After(10 * time.Second):
				t.Fatal("the front never finished the request")
			}
			charges, refunds := ch.counts()
			if charges != 1 || (refunds == 1) != tc.refunded || refunds > 1 {
				t.Fatalf("%d charges, %d refunds; want 1 charge, refunded=%v", charges, refunds, tc.refunded)
			}
			if tc.early && upstreamCalls.Load() != 0 {
				t.Fatalf("the upstream got a request whose client had left before it was sent")
			}
		})
	}
}

// The route is matched on the path as sent (escaped), as an upstream's
// ServeMux matches it: /v1/files/a%2Fb is POST /v1/files/{name} there, and
// billed the default route when the decoded path (/v1/files/a/b) was matched.
func TestRouteMatchesTheEscapedPath(t *testing.T) {
	ch := &fakeCharger{decision: okDecision()}
	serve(t, FrontOptions{Charger: ch, Config: testConfig(t)}, http.NotFoundHandler(), newRequest("POST", "/v1/files/a%2Fb", nil))
	if len(ch.charges) != 1 || ch.charges[0].Route != "POST /v1/files/{name}" || ch.charges[0].Units != 7 {
		t.Fatalf("charges %+v, want one of 7 units on POST /v1/files/{name}", ch.charges)
	}
}

// StripAPIKeyHeader drops the header the key came from: with the key as a
// Bearer token, Authorization carried it to the upstream whatever the flag
// said. An Authorization sent beside an X-Api-Key is the upstream's own.
func TestStripAPIKeyHeader(t *testing.T) {
	var got http.Header
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { got = r.Header.Clone() }))
	defer up.Close()
	u, _ := url.Parse(up.URL)
	proxy, err := NewProxy(u, FrontOptions{Charger: &fakeCharger{decision: okDecision()}, Config: testConfig(t), StripAPIKeyHeader: true})
	if err != nil {
		t.Fatal(err)
	}
	front := httptest.NewServer(proxy)
	defer front.Close()
	for _, tc := range []struct {
		name                 string
		headers              map[string]string
		wantAuth, wantAPIKey string
	}{
		{"bearer", map[string]string{"Authorization": "Bearer secret"}, "", ""},
		{"x-api-key", map[string]string{"X-Api-Key": "secret"}, "", ""},
		{"x-api-key beside the upstream's own authorization", map[string]string{"X-Api-Key": "secret", "Authorization": "Bearer user-token"}, "Bearer user-token", ""},
	} {
		req, _ := http.NewRequest("GET", front.URL+"/v1/tasks", nil)
		for k, v := range tc.headers {
			req.Header.Set(k, v)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		if res.StatusCode != 200 || got.Get("Authorization") != tc.wantAuth || got.Get("X-Api-Key") != tc.wantAPIKey {
			t.Errorf("%s: %d; upstream saw Authorization %q, X-Api-Key %q; want %q, %q", tc.name, res.StatusCode,
				got.Get("Authorization"), got.Get("X-Api-Key"), tc.wantAuth, tc.wantAPIKey)
		}
	}
}

// bodyCutRig is a proxy (opts, with a charger that allows everything) over
// proto in front of an upstream that reads each body to its end, sends
// the result of that read on reads, and answers "served" when it
// succeeded; post sends a body through it and returns the status and
// answer. Its client gives up after 10 s: without a cut-off, a stalled or
// trickling body would wait that long.
func bodyCutRig(t *testing.T, proto string, opts FrontOptions) (ch *fakeCharger, reads chan error, post func(io.Reader) (int, string)) {
	t.Helper()
	reads = make(chan error, 4)
	up := protoServer(t, proto, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, err := io.Copy(io.Discard, r.Body)
		reads <- err
		if err == nil {
			io.WriteString(w, "served")
		}
	}))
	ch = &fakeCharger{decision: okDecision()}
	opts.Charger, opts.Config = ch, testConfig(t)
	front, client := protoProxy(t, proto, up, opts) // NB: the client's timeout is a bound, see above
	post = func(body io.Reader) (int, string) {
		t.Helper()
		req, _ := http.NewRequest("POST", front.URL+"/v1/tasks", body)
		req.Header.Set("X-Api-Key", "secret")
		res, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	return ch, reads, post
}

// A request body that sends nothing for BodyIdleTimeout is cut off: the
// client gets 408 request-timeout, the upstream sees the request aborted,
// and the charge is refunded. A slow but steady body goes through, billed.
// (Before, a client that sent its headers and stalled held a connection, a
// goroutine and an upstream request for as long as it liked.)
func TestStalledBodyIsCutOff(t *testing.T) {
	for _, proto := range []string{"http", "h2c"} {
		t.Run(proto, func(t *testing.T) {
			const idle = 300 * time.Millisecond
			ch, reads, post := bodyCutRig(t, proto, FrontOptions{BodyIdleTimeout: idle})

			// 4 KiB, then nothing.
			pr, pw := io.Pipe()
			defer pw.Close()
			go pw.Write(make([]byte, 4<<10))
			code, body := post(pr)
			if code != http.StatusRequestTimeout || !strings.Contains(body, ProblemRequestTimeout) {
				t.Fatalf("a stalled body: %d %s, want 408 %s", code, body, ProblemRequestTimeout)
			}
			select {
			case err := <-reads:
				if err == nil {
					t.Fatal("the upstream read a complete body; it must see the request aborted")
				}
			case <-time.After(10 * time.Second): // NB: a deadline, not a wait
				t.Fatal("the upstream's read of the stalled body did not end within 10 s")
			}
			if c, r := ch.counts(); c != 1 || r != 1 {
				t.Fatalf("%d charges, %d refunds after the stalled body; want it refunded", c, r)
			}

			// Six writes, each after a pause shorter than idle: slower in
			// all than idle, never idle that long.
			pr, pw = io.Pipe()
			go func() {
				tick := time.NewTicker(idle / 3)
				defer tick.Stop()
				for range 6 {
					<-tick.C
					if _, err := pw.Write([]byte("chunk")); err != nil {
						return
					}
				}
				pw.Close()
			}()
			if code, body := post(pr); code != http.StatusOK || body != "served" {
				t.Fatalf("a slow but steady body: %d %s, want 200 served", code, body)
			}
			if c, r := ch.counts(); c != 2 || r != 1 {
				t.Fatalf("%d charges, %d refunds after the steady body; want it billed", c, r)
			}
		})
	}
}

// The idle bound is on the client, not on the upstream: a body sent at once
// whose upstream pauses reading it for longer than BodyIdleTimeout is no
// stalled body. Over HTTP/2 the read deadline's timer fired while no read
// waited and closed the body: a 408 and a refund for a steady upload.
func TestUpstreamPauseIsNoStalledBody(t *testing.T) {
	for _, proto := range []string{"http", "h2c"} {
		t.Run(proto, func(t *testing.T) {
			// Real time (a network bound): wide enough that a client starved
			// of CPU (-race beside the chaos runs on two cores) does not leave
			// its flow-controlled upload idle that long between window
			// updates, as 200 ms once did.
			const idle = 500 * time.Millisecond
			up := protoServer(t, proto, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if _, err := io.CopyN(io.Discard, r.Body, 64<<10); err != nil {
					http.Error(w, err.Error(), 400)
					return
				}
				time.Sleep(3 * idle) // NB: the upstream's own pause (writing to slow storage, say), not a wait in the test
				if _, err := io.Copy(io.Discard, r.Body); err != nil {
					http.Error(w, err.Error(), 400)
					return
				}
				io.WriteString(w, "served")
			}))
			ch := &fakeCharger{decision: okDecision()}
			front, client := protoProxy(t, proto, up, FrontOptions{Charger: ch, Config: testConfig(t), BodyIdleTimeout: idle, MaxBodyBytes: -1})
			req, _ := http.NewRequest("POST", front.URL+"/v1/tasks", bytes.NewReader(make([]byte, 8<<20)))
			req.Header.Set("X-Api-Key", "secret")
			res, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if res.StatusCode != 200 || string(b) != "served" {
				t.Fatalf("an 8 MiB body sent at once, the upstream pausing %s: %d %s; want 200 served", 3*idle, res.StatusCode, b)
			}
			if c, r := ch.counts(); c != 1 || r != 0 {
				t.Fatalf("%d charges, %d refunds; want it billed", c, r)
			}
		})
	}
}

// A body that trickles steadily, never idle for BodyIdleTimeout, is cut
// off once BodyTimeout has passed since the request came: 408
// request-timeout with its own detail, the upstream sees the request
// aborted, and the charge is refunded. A body sent in full within it goes
// through, billed. (Before, a client that sent a byte now and then held
// its request, a goroutine and an upstream request for as long as it
// liked.)
func TestTricklingBodyIsCutOffAtTheBodyTimeout(t *testing.T) {
	for _, proto := range []string{"http", "h2c"} {
		t.Run(proto, func(t *testing.T) {
			const total = time.Second
			ch, reads, post := bodyCutRig(t, proto, FrontOptions{BodyIdleTimeout: time.Minute, BodyTimeout: total})
			trickle := func(w *io.PipeWriter, every time.Duration, n int) {
				tick := time.NewTicker(every)
				defer tick.Stop()
				for range n {
					<-tick.C
					if _, err := w.Write([]byte("x")); err != nil {
						return // NB: the test closed the pipe
					}
				}
				w.Close()
			}

			// A byte every 100 ms for 10 s: never idle, far slower than total.
			pr, pw := io.Pipe()
			defer pw.Close()
			go trickle(pw, 100*time.Millisecond, 100)
			code, body := post(pr)
			if code != http.StatusRequestTimeout || !strings.Contains(body, ProblemRequestTimeout) || !strings.Contains(body, "not sent in full within 1s") {
				t.Fatalf("a trickling body: %d %s, want 408 %s, not sent in full within 1s", code, body, ProblemRequestTimeout)
			}
			select {
			case err := <-reads:
				if err == nil {
					t.Fatal("the upstream read a complete body; it must see the request aborted")
				}
			case <-time.After(10 * time.Second): // NB: a deadline, not a wait
				t.Fatal("the upstream's read of the trickling body did not end within 10 s")
			}
			if c, r := ch.counts(); c != 1 || r != 1 {
				t.Fatalf("%d charges, %d refunds after the trickling body; want it refunded", c, r)
			}

			// Three bytes 20 ms apart: in full well within total.
			pr, pw = io.Pipe()
			defer pw.Close()
			go trickle(pw, 20*time.Millisecond, 3)
			if code, body := post(pr); code != http.StatusOK || body != "served" {
				t.Fatalf("a body sent within the bound: %d %s, want 200 served", code, body)
			}
			if c, r := ch.counts(); c != 2 || r != 1 {
				t.Fatalf("%d charges, %d refunds after the body within the bound; want it billed", c, r)
			}
		})
	}
}

// Ways a client got work done uncharged, each closed: hanging up once the
// upstream had the request (bill-on 2xx refunded the 499), cancelling a
// gRPC stream (its missing or CANCELLED status was refunded under every
// policy), and a protocol upgrade that took place (101 refunded under
// bill-on 2xx). And a request the upstream only redirects to its canonical
// path is refunded, while the same path served is billed.
func TestBillingBypasses(t *testing.T) {
	leaves := func(grpcStatus string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if grpcStatus != "-" {
				w.Header().Set("Content-Type", "application/grpc+proto")
				w.WriteHeader(200)
				w.Write([]byte{0, 0, 0, 0, 0})
			}
			r.Context().Value(cancelKey{}).(context.CancelFunc)() // the client hangs up
			if grpcStatus != "" && grpcStatus != "-" {
				w.Header().Set(http.TrailerPrefix+"Grpc-Status", grpcStatus)
			}
		}
	}
	for _, tc := range []struct {
		name string
		h    http.Handler
		grpc bool
	}{
		{"a client that hangs up before the answer", leaves("-"), false},
		{"a gRPC stream the client cancels", leaves(""), true},
		{"a gRPC stream the client cancels, CANCELLED", leaves("1"), true},
	} {
		for _, policy := range []string{BillOnSuccess, BillOn2xx} {
			ch := &fakeCharger{decision: okDecision()}
			ctx, cancel := context.WithCancel(context.Background())
			req := newRequest("POST", "/v1/tasks", nil).WithContext(context.WithValue(ctx, cancelKey{}, cancel))
			if tc.grpc {
				req.Proto, req.ProtoMajor, req.ProtoMinor = "HTTP/2.0", 2, 0
				req.Header.Set("Content-Type", "application/grpc")
			}
			serve(t, FrontOptions{Charger: ch, Config: testConfig(t), BillOn: policy}, tc.h, req)
			if charges, refunds := ch.counts(); charges != 1 || refunds != 0 {
				t.Errorf("%s, bill-on %s: %d charges, %d refunds; want it billed", tc.name, policy, charges, refunds)
			}
		}
	}

	for _, tc := range []struct {
		path     string
		status   int
		location string
		refunded bool
	}{
		{"/v1//tasks", http.StatusTemporaryRedirect, "/v1/tasks", true},
		{"/v1/x/../tasks", http.StatusMovedPermanently, "/v1/tasks", true},
		{"/v1//tasks?page=2", http.StatusPermanentRedirect, "/v1/tasks?page=2", true},
		{"/v1//tasks", http.StatusMovedPermanently, "http://api.example.com/v1/tasks", true}, // an absolute Location names the upstream's host
		{"/v1//jobs", http.StatusMovedPermanently, "/v1/jobs/", true},                        // cleaned, then the subtree's slash
		{"/v1//tasks", http.StatusOK, "", false},                                             // an upstream that cleans paths itself served it
		{"/v1/tasks", http.StatusFound, "/v1/tasks", false},
		// A handler's own redirect on a path the upstream cleans itself
		// did the work (Post/Redirect/Get): billed. It was refunded.
		{"/v1//tasks", http.StatusSeeOther, "/v1/tasks/7", false},
		{"/v1//tasks", http.StatusSeeOther, "", false},
		{"/v1//tasks?page=2", http.StatusMovedPermanently, "/v1/tasks", false}, // not the query the request had
		{"/v1//jobs", http.StatusMovedPermanently, "/v1/jobs", false},          // a ServeMux sends /v1//jobs to /v1/jobs/
	} {
		ch := &fakeCharger{decision: okDecision()}
		h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			if tc.location != "" {
				w.Header().Set("Location", tc.location)
			}
			w.WriteHeader(tc.status)
		})
		req := newRequest("POST", "/", nil)
		req.URL.Path, req.RequestURI = tc.path, tc.path
		if p, q, ok := strings.Cut(tc.path, "?"); ok {
			req.URL.Path, req.URL.RawQuery = p, q
		}
		serve(t, FrontOptions{Charger: ch, Config: testConfig(t)}, h, req)
		charges, refunds := ch.counts()
		wantRoute := "POST /v1/tasks"
		if strings.Contains(tc.path, "jobs") {
			wantRoute = "POST /v1/jobs/"
		}
		if charges != 1 || ch.charges[0].Route != wantRoute || (refunds == 1) != tc.refunded {
			t.Errorf("POST %s answered %d to %q: charges %+v, %d refunds; want %s charged, refunded %v", tc.path, tc.status, tc.location, ch.charges, refunds, wantRoute, tc.refunded)
		}
	}

	// An upgrade that took place is billed under bill-on 2xx.
	ch := &fakeCharger{decision: okDecision()}
	mw, err := Middleware(FrontOptions{Charger: ch, Config: testConfig(t), BillOn: BillOn2xx})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: test\r\n\r\n")
		brw.Flush()
	})))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/v1/tasks", nil)
	req.Header.Set("Authorization", "Bearer secret")
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "test")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: %d", resp.StatusCode)
	}
	srv.Close() // the handler has returned: its refund, if any, is made
	if charges, refunds := ch.counts(); charges != 1 || refunds != 0 {
		t.Errorf("an upgrade that took place, bill-on 2xx: %d charges, %d refunds; want it billed", charges, refunds)
	}
}

type cancelKey struct{}

// The proxy prices a request by the host the upstream serves it as: with
// TrustForwarded, the X-Forwarded-Host it passes on (a cheap Host beside a
// dear X-Forwarded-Host was served dear and billed cheap). And the
// Idempotency-Key a request was billed under reaches the upstream even when
// the client names it in Connection, which made ReverseProxy drop it.
func TestProxyPricesAndPassesWhatTheUpstreamSees(t *testing.T) {
	s, err := snapshot.Decode([]byte(`{"version":1,"plans":[{"id":"p","monthly_quota":100,"hard":true}],
		"accounts":[{"id":"acme","plan":"p"}],"keys":[{"id":"k1","hash":"` + snapshot.HashKey("secret") + `","account":"acme"}],
		"routes":{"version":1,"default":1,"weights":{"POST api.example.com/v1/premium":30}}}`))
	if err != nil {
		t.Fatal(err)
	}
	var got http.Header
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { got = r.Header.Clone() }))
	defer up.Close()
	u, _ := url.Parse(up.URL)
	for _, trust := range []bool{false, true} {
		ch := &fakeCharger{decision: okDecision()}
		proxy, err := NewProxy(u, FrontOptions{Charger: ch, Config: staticConfig{s}, TrustForwarded: trust})
		if err != nil {
			t.Fatal(err)
		}
		front := httptest.NewServer(proxy)
		req, _ := http.NewRequest("POST", front.URL+"/v1/premium", nil)
		req.Host = "free.example.com"
		req.Header.Set("X-Api-Key", "secret")
		req.Header.Set("X-Forwarded-Host", "api.example.com")
		req.Header.Set("Idempotency-Key", `"order-1"`) // billed as order-1, passed on so
		req.Header.Set("Connection", "Idempotency-Key")
		res, err := http.DefaultClient.Do(req)
		front.Close()
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		wantHost, wantRoute := "free.example.com", "*"
		if trust {
			wantHost, wantRoute = "api.example.com", "POST api.example.com/v1/premium"
		}
		if h := got.Get("X-Forwarded-Host"); h != wantHost || ch.charges[0].Route != wantRoute {
			t.Errorf("trust %v: the upstream saw X-Forwarded-Host %q and the front charged %q; want %q, charged %q", trust, h, ch.charges[0].Route, wantHost, wantRoute)
		}
		if k := got.Get("Idempotency-Key"); k != "order-1" || got.Get(HeaderEvent) != "order-1" {
			t.Errorf("trust %v: the upstream saw Idempotency-Key %q (event %q); want order-1", trust, k, got.Get(HeaderEvent))
		}
	}
}

// Through the proxy, to an upstream under a base path: a Go ServeMux's
// redirect of a non-canonical path to its canonical one is refunded; a
// path-cleaning upstream's Post/Redirect/Get 303 on the same path is the
// handler's work, and billed (it was refunded every time), also when it
// sends the client back to the very path it cleaned (a 303 to the list:
// only a mux's 301, 307 or 308 runs no handler).
func TestProxyRefundsOnlyTheCanonicalRedirect(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /base/v1/tasks", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/base/v1/tasks/7", http.StatusSeeOther)
	})
	cleaning := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			r.URL.Path = path.Clean(r.URL.Path) // as nginx's merge_slashes or Express
			h.ServeHTTP(w, r)
		})
	}
	backToList := http.NewServeMux()
	backToList.HandleFunc("POST /base/v1/tasks", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/base/v1/tasks", http.StatusSeeOther)
	})
	for _, tc := range []struct {
		name     string
		up       http.Handler
		refunded bool
	}{
		{"a ServeMux's redirect to the canonical path", mux, true},
		{"a path-cleaning upstream's 303", cleaning(mux), false},
		{"a path-cleaning upstream's 303 to the same path", cleaning(backToList), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := httptest.NewServer(tc.up)
			defer up.Close()
			u, _ := url.Parse(up.URL + "/base")
			ch := &fakeCharger{decision: okDecision()}
			proxy, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t)})
			if err != nil {
				t.Fatal(err)
			}
			front := httptest.NewServer(proxy)
			defer front.Close()
			req, _ := http.NewRequest("POST", front.URL+"/v1/tasks", nil)
			req.URL.Opaque = "//" + req.URL.Host + "//v1/tasks" // sent as is
			req.Header.Set("X-Api-Key", "secret")
			client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
			res, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			res.Body.Close()
			front.Close() // the handler has returned: its refund, if any, is made
			charges, refunds := ch.counts()
			if res.StatusCode/100 != 3 || charges != 1 || (refunds == 1) != tc.refunded {
				t.Fatalf("POST //v1/tasks: %d to %q, %d charges, %d refunds; want a 3xx, refunded %v", res.StatusCode, res.Header.Get("Location"), charges, refunds, tc.refunded)
			}
		})
	}
}

// A client that breaks its request body off (the connection closes
// mid-body, with a Content-Length or chunked) or sends a malformed one is
// refunded whatever the bill-on policy, as a body cut off for 413 or 408:
// the upstream's read of the body failed, it did not serve the request.
// The charge stood, since the upstream had the request's head.
func TestBrokenBodyIsRefunded(t *testing.T) {
	for _, tc := range []struct {
		name string
		head string // after the request line and the key
		body string // sent after the upstream has the head
		// hangUp: the client closes the connection after body; otherwise
		// it reads the answer.
		hangUp bool
	}{
		{"a Content-Length body cut short", "Content-Length: 1000\r\n", "0123456789", true},
		{"a chunked body cut short", "Transfer-Encoding: chunked\r\n", "a\r\n0123456789\r\n", true},
		{"a malformed chunked body", "Transfer-Encoding: chunked\r\n", "a\r\n0123456789\r\nzz\r\n", false},
	} {
		for _, policy := range []string{BillOnSuccess, BillOnAlways} {
			t.Run(tc.name+", bill-on "+policy, func(t *testing.T) {
				got, reads := make(chan struct{}, 1), make(chan error, 1)
				up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					got <- struct{}{}
					_, err := io.Copy(io.Discard, r.Body)
					reads <- err
					if err == nil {
						io.WriteString(w, "served")
					}
				}))
				defer up.Close()
				u, _ := url.Parse(up.URL)
				ch := &fakeCharger{decision: okDecision()}
				done := make(chan int, 1)
				proxy, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t), BillOn: policy,
					OnRequest: func(code int, _ time.Duration) { done <- code }})
				if err != nil {
					t.Fatal(err)
				}
				front := httptest.NewServer(proxy)
				defer front.Close()
				conn, err := net.Dial("tcp", front.Listener.Addr().String())
				if err != nil {
					t.Fatal(err)
				}
				defer conn.Close()
				conn.SetDeadline(time.Now().Add(10 * time.Second)) // NB: a bound, not a wait
				fmt.Fprintf(conn, "POST /v1/tasks HTTP/1.1\r\nHost: x\r\nX-Api-Key: secret\r\n%s\r\n", tc.head)
				select {
				case <-got: // the upstream has the request's head: a client leaving now used to stay billed
				case <-time.After(10 * time.Second):
					t.Fatal("the upstream never got the request")
				}
				io.WriteString(conn, tc.body)
				if tc.hangUp {
					conn.Close()
				} else {
					res, err := http.ReadResponse(bufio.NewReader(conn), nil)
					if err != nil {
						t.Fatal(err)
					}
					b, _ := io.ReadAll(res.Body)
					res.Body.Close()
					if res.StatusCode != 400 || !strings.Contains(string(b), ProblemBadRequest) || !strings.Contains(string(b), "refunded") ||
						res.Header.Get("Content-Type") != "application/problem+json" {
						t.Fatalf("answer %d %s; want 400 bad-request, refunded", res.StatusCode, b)
					}
				}
				waitBodyBrokenOff(t, reads, done)
				if c, r := ch.counts(); c != 1 || r != 1 {
					t.Fatalf("%d charges, %d refunds; want the charge refunded", c, r)
				}
			})
		}
	}

	// Middleware: a handler whose read of the body fails is refunded too;
	// one that reads it whole is billed, and so is one that answered
	// before its read failed (a full-duplex handler: the client had its
	// answer).
	broken := func() io.Reader {
		return io.MultiReader(strings.NewReader("0123456789"), iotest.ErrReader(io.ErrUnexpectedEOF))
	}
	for _, tc := range []struct {
		body        io.Reader
		answerFirst bool
		refunded    bool
		maxBody     int64 // 0: no limit
	}{
		{broken(), false, true, 0},
		{strings.NewReader("0123456789"), false, false, 0},
		{broken(), true, false, 0},
		// Over the limit: refunded before the answer, billed after it (a
		// client padding its body past the limit got the answer free).
		{io.MultiReader(strings.NewReader("0123456789")), false, true, 5},
		{io.MultiReader(strings.NewReader("0123456789")), true, false, 5},
	} {
		ch := &fakeCharger{decision: okDecision()}
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if tc.answerFirst {
				io.WriteString(w, "answered")
				w.(http.Flusher).Flush()
			}
			if _, err := io.Copy(io.Discard, r.Body); err != nil && !tc.answerFirst {
				http.Error(w, err.Error(), 400)
			}
		})
		maxBody := cmp.Or(tc.maxBody, -1)
		w, _ := serve(t, FrontOptions{Charger: ch, Config: testConfig(t), MaxBodyBytes: maxBody, BillOn: BillOnAlways}, h, newRequest("POST", "/v1/tasks", tc.body))
		if _, r := ch.counts(); (r == 1) != tc.refunded {
			t.Errorf("Middleware, refund wanted %v, answered first %v, limit %d: answer %d, %d refunds", tc.refunded, tc.answerFirst, maxBody, w.Code, r)
		}
	}
}

// CONNECT is refused 501 problem+json, with or without a key, before
// anything is charged: it was proxied as "CONNECT /", charged, and
// answered 200 with a body (RFC 9110 section 9.3.6 forbids one).
func TestProxyRefusesConnect(t *testing.T) {
	var calls atomic.Int64
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { calls.Add(1) }))
	defer up.Close()
	u, _ := url.Parse(up.URL)
	ch := &fakeCharger{decision: okDecision()}
	proxy, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t)})
	if err != nil {
		t.Fatal(err)
	}
	front := httptest.NewServer(proxy)
	defer front.Close()
	for _, key := range []string{"X-Api-Key: secret\r\n", ""} {
		conn, err := net.Dial("tcp", front.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(10 * time.Second)) // NB: a bound, not a wait
		fmt.Fprintf(conn, "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n%s\r\n", key)
		res, err := http.ReadResponse(bufio.NewReader(conn), &http.Request{Method: "CONNECT"})
		if err != nil {
			t.Fatal(err)
		}
		var p Problem
		err = json.NewDecoder(res.Body).Decode(&p)
		conn.Close()
		if err != nil || res.StatusCode != http.StatusNotImplemented || p.Status != 501 || res.Header.Get("Content-Type") != "application/problem+json" {
			t.Fatalf("CONNECT with key %q: %d %v %+v (%v); want 501 problem+json", key, res.StatusCode, res.Header, p, err)
		}
	}
	if c, _ := ch.counts(); c != 0 || calls.Load() != 0 {
		t.Fatalf("%d charges, %d upstream calls; want none", c, calls.Load())
	}
}

// A soft plan records overage and is never refused for its quota: its
// answers carry no "quota" item in RateLimit and RateLimit-Policy (r=0
// there told a client following the draft to stop for the rest of the
// month while it was still served), and X-Quota-* as before. A hard
// plan's do.
func TestSoftPlanAdvertisesNoQuotaLimit(t *testing.T) {
	s, err := snapshot.Decode([]byte(`{"version":1,"plans":[{"id":"soft","monthly_quota":100,"hard":false},
		{"id":"soft-rl","rate":"1/s","burst":5,"monthly_quota":100,"hard":false},{"id":"hard","monthly_quota":100,"hard":true}],
		"accounts":[{"id":"s","plan":"soft"},{"id":"srl","plan":"soft-rl"},{"id":"h","plan":"hard"}],
		"keys":[{"id":"k1","hash":"` + snapshot.HashKey("soft") + `","account":"s"},{"id":"k2","hash":"` + snapshot.HashKey("soft-rl") + `","account":"srl"},
		{"id":"k3","hash":"` + snapshot.HashKey("hard") + `","account":"h"}],
		"routes":{"version":1,"default":1}}`))
	if err != nil {
		t.Fatal(err)
	}
	over := shard.Decision{Reason: shard.OK, Limit: 100, Remaining: 0, Reset: time.Date(2026, 7, 1, 0, 0, 0, 0, time.UTC).Unix()}
	limited := over
	limited.RateBurst, limited.RateRemaining, limited.RateReset, limited.RateWindow = 5, 4, int64(time.Second), int64(5*time.Second)
	now := func() time.Time { return time.Date(2026, 6, 28, 12, 0, 0, 0, time.UTC) }
	for _, tc := range []struct {
		key           string
		d             shard.Decision
		policy, limit string
	}{
		{"soft", over, "", ""},
		{"soft-rl", limited, `"burst";q=5;w=5`, `"burst";r=4;t=1`},
		{"hard", over, `"quota";q=100;w=2592000`, `"quota";r=0;t=216000`},
	} {
		req := newRequest("POST", "/v1/tasks", nil)
		req.Header.Set("Authorization", "Bearer "+tc.key)
		w, _ := serve(t, FrontOptions{Charger: &fakeCharger{decision: tc.d}, Config: staticConfig{s}, Now: now},
			http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}), req)
		h := w.Result().Header
		_, hasPolicy := h["Ratelimit-Policy"]
		_, hasLimit := h["Ratelimit"]
		if h.Get("RateLimit-Policy") != tc.policy || h.Get("RateLimit") != tc.limit || hasPolicy != (tc.policy != "") || hasLimit != (tc.limit != "") {
			t.Errorf("%s plan: RateLimit-Policy %q, RateLimit %q; want %q, %q", tc.key, h.Get("RateLimit-Policy"), h.Get("RateLimit"), tc.policy, tc.limit)
		}
		if h.Get("X-Quota-Remaining") != "0" || h.Get("X-Quota-Limit") != "100" {
			t.Errorf("%s plan: X-Quota-Limit %q, X-Quota-Remaining %q; want 100, 0", tc.key, h.Get("X-Quota-Limit"), h.Get("X-Quota-Remaining"))
		}
	}
	// The usage endpoint too.
	for key, want := range map[string]string{"soft": "", "hard": `"quota";r=98;t=216000`} {
		req := newRequest("GET", "/v1/usage", nil)
		req.Header.Set("Authorization", "Bearer "+key)
		w, _ := serve(t, FrontOptions{Charger: &fakeCharger{}, Config: staticConfig{s}, Now: now}, http.NotFoundHandler(), req)
		if got := w.Result().Header.Get("RateLimit"); w.Code != 200 || got != want || w.Result().Header.Get("X-Quota-Remaining") != "98" {
			t.Errorf("usage, %s plan: %d, RateLimit %q, want %q", key, w.Code, got, want)
		}
	}
}

// The usage endpoint's RateLimit-Policy is the policy every other answer of
// the account carries: it left the "burst" item out.
func TestUsagePolicyIsTheAnswersPolicy(t *testing.T) {
	s, err := snapshot.Decode([]byte(`{"version":1,"plans":[{"id":"hard-rl","rate":"2/s","burst":10,"monthly_quota":100,"hard":true},
		{"id":"soft-rl","rate":"2/s","burst":10,"monthly_quota":100,"hard":false}],
		"accounts":[{"id":"h","plan":"hard-rl"},{"id":"s","plan":"soft-rl"}],
		"keys":[{"id":"k1","hash":"` + snapshot.HashKey("hard") + `","account":"h"},{"id":"k2","hash":"` + snapshot.HashKey("soft") + `","account":"s"}],
		"routes":{"version":1,"default":1}}`))
	if err != nil {
		t.Fatal(err)
	}
	now := func() time.Time { return time.Date(2026, 6, 28, 12, 0, 0, 0, time.UTC) }
	// As the owner's bucket fills a decision for 2/s, burst 10 (shard.Bucket).
	d := okDecision()
	d.RateBurst, d.RateRemaining, d.RateReset, d.RateWindow = 10, 9, int64(500*time.Millisecond), int64(5*time.Second)
	for key, want := range map[string]string{"hard": `"burst";q=10;w=5, "quota";q=100;w=2592000`, "soft": `"burst";q=10;w=5`} {
		policy := func(path string) string {
			req := newRequest("GET", path, nil)
			req.Header.Set("Authorization", "Bearer "+key)
			w, _ := serve(t, FrontOptions{Charger: &fakeCharger{decision: d}, Config: staticConfig{s}, Now: now},
				http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}), req)
			if w.Code != 200 {
				t.Fatalf("%s plan: GET %s: %d", key, path, w.Code)
			}
			return w.Result().Header.Get("RateLimit-Policy")
		}
		if answer, usage := policy("/v1/tasks"), policy("/v1/usage"); answer != want || usage != want {
			t.Errorf("%s plan: RateLimit-Policy %q on an answer, %q on the usage endpoint; want %q on both", key, answer, usage, want)
		}
	}
}

// Failed charges are logged one line a second, with the count held back,
// whatever their kind: an owner whose log fails, or nodes whose RPC tokens
// differ, failed every request with a line of its own (one unsampled ERROR
// per request). A rejection between nodes names the flag to fix.
func TestChargeFailureLinesAreSampled(t *testing.T) {
	next := http.HandlerFunc(func(http.ResponseWriter, *http.Request) { t.Error("next ran") })
	rejected := rejectedError("acme", "127.0.0.1:7400", "charge", status.Error(codes.Unauthenticated, "router: wrong RPC token"))
	for _, tc := range []struct {
		err        error
		line, want string
	}{
		{fmt.Errorf("%w: the log failed", ErrInternal), `msg="charge failed"`, "the log failed"},
		{rejected, `msg="charge undecided: a node refused this node's call`, "--rpc-token (QUOTAD_RPC_TOKEN)"},
		{fmt.Errorf("%w: the owner did not answer", ErrUnavailable), `msg="charge undecided"`, "did not answer"},
	} {
		var logs logbuf.Buffer
		opts := FrontOptions{Charger: &fakeCharger{err: tc.err}, Config: testConfig(t), Logger: slog.New(slog.NewTextHandler(&logs, nil))}
		h, err := Middleware(opts)
		if err != nil {
			t.Fatal(err)
		}
		front := h(next)
		for range 20 { // well within a second
			front.ServeHTTP(httptest.NewRecorder(), newRequest("POST", "/v1/tasks", nil))
		}
		out := logs.String()
		if n := strings.Count(out, "\n"); n != 1 || !strings.Contains(out, tc.line) || !strings.Contains(out, tc.want) {
			t.Errorf("20 charges failing with %v logged %d lines, want one %s naming %q:\n%s", tc.err, n, tc.line, tc.want, out)
		}
	}
}

// Request trailers pass through with their values (README: trailers pass
// through): ReverseProxy copied the Trailer map before the body was read,
// and the upstream got the names without values. Not those the proxy sets
// for the upstream to trust (X-Quota-Account, X-Quota-Event), nor the key
// it strips: a client's trailer named them and reached the upstream, which
// may read trailers as headers.
func TestRequestTrailersPassThrough(t *testing.T) {
	for _, proto := range []string{"http", "h2c"} {
		t.Run(proto, func(t *testing.T) {
			got := make(chan http.Header, 1)
			up := protoServer(t, proto, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				got <- r.Trailer.Clone()
			}))
			front, client := protoProxy(t, proto, up, FrontOptions{Charger: &fakeCharger{decision: okDecision()}, Config: testConfig(t), StripAPIKeyHeader: true})
			req, _ := http.NewRequest("POST", front.URL+"/v1/tasks", io.MultiReader(strings.NewReader("payload")))
			req.Header.Set("X-Api-Key", "secret")
			// And the names that say who the client is, or price a POST
			// (a review's raw request carried all of them to the upstream).
			forged := []string{HeaderAccount, HeaderEvent, "X-Api-Key", "X-Forwarded-For", "X-Real-Ip", "Forwarded", "X-Forwarded-Host", "True-Client-Ip", "X-Http-Method-Override"}
			req.Trailer = http.Header{"X-Checksum": {"abc"}}
			for _, k := range forged {
				req.Trailer[k] = []string{"forged"}
			}
			res, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			res.Body.Close()
			select {
			case tr := <-got:
				if tr.Get("X-Checksum") != "abc" || slices.ContainsFunc(forged, func(k string) bool { return tr.Get(k) != "" }) {
					t.Fatalf("the upstream got trailers %v; want X-Checksum: abc and none the proxy sets, strips or owns", tr)
				}
			case <-time.After(10 * time.Second): // NB: a deadline, not a wait
				t.Fatal("the upstream never got the request")
			}
		})
	}
}

// An upstream's trailers named as the front's own headers (RateLimit,
// X-Quota-*) do not reach the client, announced or not: a client that
// merges trailers into headers read the upstream's figures after the
// front's. Its other trailers pass through with their values.
func TestResponseTrailersDropTheFrontsNames(t *testing.T) {
	for _, proto := range []string{"http", "h2c"} {
		t.Run(proto, func(t *testing.T) {
			up := protoServer(t, proto, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Trailer", "X-Checksum, X-Quota-Remaining, RateLimit")
				io.WriteString(w, "ok")
				w.Header().Set("X-Checksum", "abc")
				w.Header().Set("X-Quota-Remaining", "1000000")
				w.Header().Set("RateLimit", `"upstream";r=1000000`)
				w.Header().Set(http.TrailerPrefix+"X-Quota-Limit", "1000000") // not announced
				w.Header().Set(http.TrailerPrefix+"X-Late", "yes")
			}))
			front, client := protoProxy(t, proto, up, FrontOptions{Charger: &fakeCharger{decision: okDecision()}, Config: testConfig(t)})
			req, _ := http.NewRequest("POST", front.URL+"/v1/tasks", nil)
			req.Header.Set("X-Api-Key", "secret")
			res, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(res.Body)
			res.Body.Close()
			if err != nil || string(body) != "ok" || res.StatusCode != 200 {
				t.Fatalf("answer %d %q (%v), want 200 ok", res.StatusCode, body, err)
			}
			if res.Trailer.Get("X-Checksum") != "abc" || res.Trailer.Get("X-Late") != "yes" {
				t.Errorf("trailers %v: want X-Checksum: abc and X-Late: yes through", res.Trailer)
			}
			for _, k := range frontHeaders {
				if _, ok := res.Trailer[http.CanonicalHeaderKey(k)]; ok {
					t.Errorf("trailers %v: the upstream's %s reached the client", res.Trailer, k)
				}
			}
			if res.Header.Get("X-Quota-Remaining") == "1000000" || res.Header.Get("X-Quota-Remaining") == "" {
				t.Errorf("X-Quota-Remaining %q, want the front's", res.Header.Get("X-Quota-Remaining"))
			}
		})
	}
}

// A middleware handler that set headers for an answer it never wrote (its
// read of a body over MaxBodyBytes failed) does not lend them to the
// front's 413: a Content-Encoding: gzip made the problem's JSON unreadable.
// Headers set before the front (an outer middleware's) stay.
func TestCutOffAnswerDropsTheHandlersHeaders(t *testing.T) {
	after := okDecision()
	after.Reason, after.Remaining = shard.Refunded, 100
	mw, err := Middleware(FrontOptions{Charger: &fakeCharger{decision: okDecision(), refundDecision: after}, Config: testConfig(t), MaxBodyBytes: 10})
	if err != nil {
		t.Fatal(err)
	}
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Set("Set-Cookie", "session=1")
		w.Header().Set("Access-Control-Allow-Origin", "https://handler.example") // over the outer one's
		if _, err := io.Copy(io.Discard, r.Body); err == nil {
			t.Error("the handler read a body over the bound to its end")
		}
	}))
	req := newRequest("POST", "/v1/tasks", io.MultiReader(strings.NewReader(strings.Repeat("x", 100))))
	req.ContentLength = -1
	w := httptest.NewRecorder()
	w.Header().Set("Access-Control-Allow-Origin", "https://app.example") // an outer middleware's
	h.ServeHTTP(w, req)
	var p Problem
	if err := json.Unmarshal(w.Body.Bytes(), &p); w.Code != 413 || err != nil {
		t.Fatalf("answer %d %q (%v), want a 413 problem", w.Code, w.Body.String(), err)
	}
	if got := w.Header(); got.Get("Content-Encoding") != "" || got.Get("Set-Cookie") != "" ||
		got.Get("Access-Control-Allow-Origin") != "https://app.example" || got.Get("Content-Type") != "application/problem+json" || got.Get("X-Quota-Remaining") != "100" {
		t.Errorf("413 headers %v: want the outer middleware's and the front's, none of the handler's", got)
	}
}

// waitBodyBrokenOff waits (10 s at most for each) for the upstream's read
// of a request body to fail, as it must for a body broken off, and then
// for the front to finish the request (its OnRequest's code on done).
func waitBodyBrokenOff(t *testing.T, reads <-chan error, done <-chan int) {
	t.Helper()
	select {
	case err := <-reads:
		if err == nil {
			t.Fatal("the upstream read a complete body")
		}
	case <-time.After(10 * time.Second): // NB: a deadline, not a wait
		t.Fatal("the upstream's read of the body did not end within 10 s")
	}
	select {
	case code := <-done:
		t.Logf("the front heard %d", code)
	case <-time.After(10 * time.Second):
		t.Fatal("the front never finished the request")
	}
}
