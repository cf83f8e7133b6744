package router_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

func monthly(id string, units int64) snapshot.Plan {
	return snapshot.Plan{ID: id, MonthlyQuota: units, Hard: true}
}

// Show 1 and 4: a month of 60 units through the proxy of a node that does
// not own the account, then the new period.
func TestProxyMonthlyQuota(t *testing.T) {
	up := newUpstream(t)
	acme := account{id: "acme", key: keyOf("acme"), plan: monthly("m60", 60)}
	c := startCluster(t, []account{acme}, clusterOptions{nodes: 3, clock: engine.NewManualClock(june28), upstream: up.URL})
	via := c.notOwner(t, acme.id)
	proxy := "http://" + via.HTTPAddr()

	steps := []struct {
		what, method, path string
		status             int
		remaining          string
	}{
		{"a read", "GET", "/v1/tasks", 200, "59"},
		{"a write", "POST", "/v1/tasks", 200, "57"},
		{"an export", "POST", "/v1/exports", 200, "32"},
		{"a second export", "POST", "/v1/exports", 200, "7"},
		{"a third export", "POST", "/v1/exports", 429, "7"},
		{"a read after the refusal", "GET", "/v1/tasks", 200, "6"},
	}
	for _, s := range steps {
		a := do(t, proxy, s.method, s.path, acme.key, nil)
		expect(t, s.what, a, s.status, s.remaining)
		if got := a.header.Get("X-Quota-Limit"); got != "60" {
			t.Fatalf("%s: X-Quota-Limit %q, want 60", s.what, got)
		}
		if got := a.header.Get("X-Quota-Reset"); got != "2026-07-01T00:00:00Z" {
			t.Fatalf("%s: X-Quota-Reset %q", s.what, got)
		}
		// No rate limit in this plan: the quota is the one policy. June has
		// 30 days; at 28 June 12:00 the period ends in 2.5 days.
		if p, l := a.header.Get("RateLimit-Policy"), a.header.Get("RateLimit"); p != `"quota";q=60;w=2592000` || l != `"quota";r=`+s.remaining+`;t=216000` {
			t.Fatalf("%s: RateLimit-Policy %q, RateLimit %q", s.what, p, l)
		}
		if s.status != 429 {
			continue
		}
		if a.problem.Type != router.ProblemQuotaExceeded || a.problem.Status != 429 || a.header.Get("Retry-After") != "216000" {
			t.Fatalf("%s: %+v, Retry-After %q; want quota-exceeded, 429, 216000", s.what, a.problem, a.header.Get("Retry-After"))
		}
		if !strings.Contains(a.problem.Detail, "costs 25 units") {
			t.Fatalf("detail %q does not say what the request costs", a.problem.Detail)
		}
	}
	if via.Router().Stats().Forwarded.Load() == 0 {
		t.Fatalf("the proxy's node forwarded nothing: it should not own %q", acme.id)
	}
	if n := up.count("POST /v1/exports"); n != 2 {
		t.Fatalf("the upstream served %d exports, want 2 (the refused one must not reach it)", n)
	}
	if n := up.sawAccount("acme"); n != 5 {
		t.Fatalf("the upstream saw X-Quota-Account acme %d times, want 5", n)
	}

	u := do(t, proxy, "GET", "/v1/usage", acme.key, nil).usage(t)
	want := router.UsageReport{Account: "acme", Period: "2026-06", Used: 54, Limit: 60, Remaining: 6, Reset: "2026-07-01T00:00:00Z",
		Routes: map[string]int64{"POST /v1/exports": 50, "POST /v1/tasks": 2, "GET /v1/tasks": 2}}
	if !reflect.DeepEqual(u, want) {
		t.Fatalf("usage\n got %+v\nwant %+v", u, want)
	}

	// Show 4: the new period, one second in.
	c.clock.Advance(time.Date(2026, 7, 1, 0, 0, 1, 0, time.UTC).Sub(june28))
	expect(t, "a read on 1 July", do(t, proxy, "GET", "/v1/tasks", acme.key, nil), 200, "59")
	if u := do(t, proxy, "GET", "/v1/usage", acme.key, nil).usage(t); u.Period != "2026-07" || u.Used != 1 || u.Reset != "2026-08-01T00:00:00Z" {
		t.Fatalf("July usage %+v", u)
	}
	a := do(t, proxy, "GET", "/v1/tasks", "qr_test_nobody", nil)
	if a.status != 401 || a.problem.Type != router.ProblemUnknownKey || a.header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("unknown key: %d %+v %v", a.status, a.problem, a.header)
	}
}

// Show 2: one Idempotency-Key bills once per account, and is scoped by
// account; the same key on another route is refused (422).
func TestProxyIdempotencyKey(t *testing.T) {
	up := newUpstream(t)
	a1 := account{id: "idem-a", key: keyOf("idem-a"), plan: monthly("m100", 100)}
	a2 := account{id: "idem-b", key: keyOf("idem-b"), plan: monthly("m100", 100)}
	c := startCluster(t, []account{a1, a2}, clusterOptions{nodes: 3, clock: engine.NewManualClock(june28), upstream: up.URL})
	proxy := "http://" + c.nodes[0].HTTPAddr()

	for i := 0; i < 2; i++ {
		expect(t, fmt.Sprint("write ", i+1, " of account a"), do(t, proxy, "POST", "/v1/tasks", a1.key, nil, "Idempotency-Key: order-42"), 200, "98")
	}
	expect(t, "the same key from account b", do(t, proxy, "POST", "/v1/tasks", a2.key, nil, "Idempotency-Key: order-42"), 200, "98")
	expect(t, "the key in quotes (the IETF draft's form) is the same key",
		do(t, proxy, "POST", "/v1/tasks", a2.key, nil, `Idempotency-Key: "order-42"`), 200, "98")
	expect(t, "another key", do(t, proxy, "POST", "/v1/tasks", a1.key, nil, "Idempotency-Key: order-43"), 200, "96")
	// One key for another route is a client's mistake, not a retry: an
	// export (25 units) must not pass for a write's 2.
	reused := do(t, proxy, "POST", "/v1/exports", a1.key, nil, "Idempotency-Key: order-42")
	if reused.status != 422 || reused.problem.Type != router.ProblemIdempotencyKeyReused || !strings.Contains(reused.problem.Detail, "another route") {
		t.Fatalf("key order-42 of a write, sent with an export: %d %+v; want 422 idempotency-key-reused", reused.status, reused.problem)
	}
	if got := reused.header.Get("X-Quota-Remaining"); got != "96" || reused.header.Get("RateLimit") == "" {
		t.Errorf("422: X-Quota-Remaining %q, RateLimit %q; want the owner's state (96 left) on the answer it decided", got, reused.header.Get("RateLimit"))
	}
	expect(t, "the write's key on its own route again", do(t, proxy, "POST", "/v1/tasks", a1.key, nil, "Idempotency-Key: order-42"), 200, "96")
	// Nor another request on the same route (another query or path, here
	// under the default route "*", which spans every unpriced path): one
	// key would serve them all for one charge, past a hard quota.
	reusedFor := func(what, method, path, key string) {
		t.Helper()
		got := do(t, proxy, method, path, a1.key, nil, "Idempotency-Key: "+key)
		if got.status != 422 || got.problem.Type != router.ProblemIdempotencyKeyReused || !strings.Contains(got.problem.Detail, "another request") {
			t.Fatalf("key %s for %s: %d %+v; want 422 idempotency-key-reused", key, what, got.status, got.problem)
		}
	}
	reusedFor("another query", "POST", "/v1/tasks?copy=2", "order-42")
	expect(t, "a read of an unpriced path under a new key", do(t, proxy, "GET", "/v1/anything", a1.key, nil, "Idempotency-Key: read-7"), 200, "95")
	expect(t, "its retry", do(t, proxy, "GET", "/v1/anything", a1.key, nil, "Idempotency-Key: read-7"), 200, "95")
	reusedFor("another unpriced path", "GET", "/v1/other", "read-7")
	for _, a := range []account{a1, a2} {
		u := do(t, proxy, "GET", "/v1/usage", a.key, nil).usage(t)
		want := map[string]int64{"POST /v1/tasks": 2}
		if a == a1 {
			want["POST /v1/tasks"], want["*"] = 4, 1
		}
		if !reflect.DeepEqual(u.Routes, want) {
			t.Fatalf("%s: usage %+v, want routes %v", a.id, u, want)
		}
	}
	if n := up.count("POST /v1/tasks"); n != 6 {
		t.Fatalf("the upstream served %d writes, want 6 (a replay is served again, not billed again)", n)
	}
	if n := up.count("POST /v1/exports"); n != 0 {
		t.Fatalf("the upstream served %d exports, want 0 (the reused key was refused before it)", n)
	}
}

// A retry under one Idempotency-Key is served again and billed once, so
// an owner serves one key's request at most shard.DefaultMaxReplays times
// over: the next is refused 422 idempotency-replay-limit with the owner's
// quota headers, charges nothing and does not reach the upstream, also
// through a node that forwards to the owner (the refusal crosses the
// internal RPC), and the middleware on an embedded client answers the
// same. Another key is served as before.
func TestProxyIdempotencyReplayLimit(t *testing.T) {
	up := newUpstream(t)
	acme := account{id: "loop-co", key: keyOf("loop-co"), plan: monthly("m100", 100)}
	embedded := account{id: "loop-embedded", key: keyOf("loop-embedded"), plan: monthly("m100", 100)}
	c := startCluster(t, []account{acme, embedded}, clusterOptions{nodes: 3, clock: engine.NewManualClock(june28), upstream: up.URL})
	seed := c.notOwner(t, acme.id, embedded.id)
	proxy := "http://" + seed.HTTPAddr()
	client, local := embeddedFront(t, c, seed)
	for i := 0; i <= shard.DefaultMaxReplays+1; i++ {
		p := do(t, proxy, "POST", "/v1/exports", acme.key, nil, "Idempotency-Key: exp-1")
		m := do(t, local.URL, "POST", "/v1/exports", embedded.key, nil, "Idempotency-Key: exp-1")
		if p.status != m.status || p.problem != m.problem || p.header.Get("X-Quota-Remaining") != m.header.Get("X-Quota-Remaining") {
			t.Fatalf("export %d: proxy %d %+v, middleware %d %+v", i+1, p.status, p.problem, m.status, m.problem)
		}
		wantStatus, wantType := 200, ""
		if i > shard.DefaultMaxReplays { // the charge, then DefaultMaxReplays retries served
			wantStatus, wantType = 422, router.ProblemIdempotencyReplayLimit
		}
		if m.status != wantStatus || m.problem.Type != wantType || m.header.Get("X-Quota-Remaining") != "75" {
			t.Fatalf("export %d: %d %+v, %s left; want %d %q, 75 left", i+1, m.status, m.problem, m.header.Get("X-Quota-Remaining"), wantStatus, wantType)
		}
	}
	if n := up.count("POST /v1/exports"); n != 1+shard.DefaultMaxReplays {
		t.Fatalf("the upstream served key exp-1 %d times, want %d", n, 1+shard.DefaultMaxReplays)
	}
	res, err := client.Charge(context.Background(), router.ChargeRequest{Account: embedded.id, EventID: "exp-1", ClientID: true,
		Route: "POST /v1/exports", Units: 25, Target: router.RequestTarget(httptest.NewRequest("POST", "/v1/exports", nil))})
	if err != nil || res.Reason != shard.ReplayLimit || !res.Reason.Final() {
		t.Fatalf("the client's own retry of exp-1: %+v, %v; want replay_limit, final", res, err)
	}

	expect(t, "the first write", do(t, proxy, "POST", "/v1/tasks", acme.key, nil, "Idempotency-Key: job-1"), 200, "73")
	for i := range shard.DefaultMaxReplays {
		expect(t, fmt.Sprint("retry ", i+1), do(t, proxy, "POST", "/v1/tasks", acme.key, nil, "Idempotency-Key: job-1"), 200, "73")
	}
	for i := 0; i < 2; i++ {
		got := do(t, proxy, "POST", "/v1/tasks", acme.key, nil, "Idempotency-Key: job-1")
		if got.status != 422 || got.problem.Type != router.ProblemIdempotencyReplayLimit || !strings.Contains(got.problem.Detail, "new key") {
			t.Fatalf("retry %d of key job-1: %d %+v; want 422 idempotency-replay-limit", shard.DefaultMaxReplays+1+i, got.status, got.problem)
		}
		if r := got.header.Get("X-Quota-Remaining"); r != "73" {
			t.Errorf("422: X-Quota-Remaining %q, want the owner's 73", r)
		}
	}
	if n := up.count("POST /v1/tasks"); n != 1+shard.DefaultMaxReplays {
		t.Fatalf("the upstream served key job-1 %d times, want %d (the refused retries must not reach it)", n, 1+shard.DefaultMaxReplays)
	}
	expect(t, "a write under a new key", do(t, proxy, "POST", "/v1/tasks", acme.key, nil, "Idempotency-Key: job-2"), 200, "71")
	if u := do(t, proxy, "GET", "/v1/usage", acme.key, nil).usage(t); u.Used != 29 {
		t.Fatalf("used %d, want 29: an export and two writes, each billed once", u.Used)
	}
}

// Show 3: an upstream 500 and a gRPC error in the trailers are refunded,
// once each; a gRPC OK is billed.
func TestProxyRefundsFailures(t *testing.T) {
	up := newUpstream(t)
	acct := account{id: "refunds", key: keyOf("refunds"), plan: monthly("m100", 100)}
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 3, clock: engine.NewManualClock(june28), upstream: up.URL})
	proxy := "http://" + c.notOwner(t, acct.id).HTTPAddr()

	before := c.refunds()
	a := do(t, proxy, "POST", "/v1/fail", acct.key, nil)
	expect(t, "an upstream 500", a, 500, "95") // the headers show the charge; the refund follows the answer
	waitFor(t, 5*time.Second, "the refund of the 500", func() bool { return c.refunds() == before+1 })

	h2c := h2cClient() // a gRPC call is HTTP/2 with a gRPC Content-Type
	a = doWith(t, h2c, proxy, "POST", "/v1/grpc", acct.key, nil, "Content-Type: application/grpc")
	if a.status != 200 || a.trailer.Get("Grpc-Status") != "13" || a.header.Get("Content-Type") != "application/grpc" {
		t.Fatalf("gRPC answer %d, trailer %v, header %v", a.status, a.trailer, a.header)
	}
	waitFor(t, 5*time.Second, "the refund of grpc-status 13", func() bool { return c.refunds() == before+2 })

	a = doWith(t, h2c, proxy, "POST", "/v1/grpc-ok", acct.key, nil, "Content-Type: application/grpc")
	if a.status != 200 || a.trailer.Get("Grpc-Status") != "0" {
		t.Fatalf("gRPC OK answer %d, trailer %v", a.status, a.trailer)
	}
	u := do(t, proxy, "GET", "/v1/usage", acct.key, nil).usage(t)
	if u.Used != 3 || !reflect.DeepEqual(u.Routes, map[string]int64{"POST /v1/grpc-ok": 3}) {
		t.Fatalf("usage %+v: want only the gRPC OK billed", u)
	}
	if got := c.refunds(); got != before+2 {
		t.Fatalf("%d refunds, want exactly 2", got-before)
	}
}

// Show 7: bad input gets a clear problem, and nothing is charged that was
// not served.
func TestProxyBadInput(t *testing.T) {
	up := newUpstream(t)
	acct := account{id: "careless", key: keyOf("careless"), plan: monthly("m100", 100)}
	c := startCluster(t, []account{acct}, clusterOptions{nodes: 3, clock: engine.NewManualClock(june28), upstream: up.URL,
		front: func(o *router.FrontOptions) { o.MaxBodyBytes, o.UpstreamTimeout = 1024, time.Second }})
	proxy := "http://" + c.notOwner(t, acct.id).HTTPAddr()

	cases := []struct {
		what    string
		key     string
		path    string
		body    func() io.Reader
		headers []string
		status  int
		typ     string
		detail  string
		// refunded: charged, then refunded before the answer
		refunded bool
	}{
		{what: "no key", path: "/v1/tasks", status: 401, typ: router.ProblemUnknownKey, detail: "Authorization: Bearer"},
		{what: "an Idempotency-Key of 256 characters", key: acct.key, path: "/v1/tasks",
			headers: []string{"Idempotency-Key: " + strings.Repeat("k", 256)}, status: 400, typ: router.ProblemBadRequest, detail: "1 to 255"},
		{what: "an Idempotency-Key with a non-ASCII byte", key: acct.key, path: "/v1/tasks",
			headers: []string{"Idempotency-Key: caf\xe9"}, status: 400, typ: router.ProblemBadRequest, detail: "printable ASCII"},
		{what: "two Idempotency-Keys", key: acct.key, path: "/v1/tasks",
			headers: []string{"Idempotency-Key: a", "Idempotency-Key: b"}, status: 400, typ: router.ProblemBadRequest, detail: "at most one"},
		{what: "a body over the limit with a Content-Length", key: acct.key, path: "/v1/upload",
			body: func() io.Reader { return bytes.NewReader(make([]byte, 2048)) }, status: 413, typ: router.ProblemPayloadTooLarge, detail: "1024 bytes; nothing was charged"},
		{what: "a chunked body that grows over the limit", key: acct.key, path: "/v1/upload",
			body: func() io.Reader { return io.MultiReader(bytes.NewReader(make([]byte, 2048))) }, status: 413, typ: router.ProblemPayloadTooLarge,
			detail: "cut off; the charge is refunded", refunded: true}, // it said "nothing was charged"
		{what: "an upstream that hangs", key: acct.key, path: "/v1/hang", status: 504, typ: router.ProblemUpstreamUnavailable, detail: "in time", refunded: true},
		{what: "an upstream that drops the connection", key: acct.key, path: "/v1/drop", status: 502, typ: router.ProblemUpstreamUnavailable, detail: "refunded", refunded: true},
	}
	for _, tc := range cases {
		var body io.Reader
		if tc.body != nil {
			body = tc.body()
		}
		a := do(t, proxy, "POST", tc.path, tc.key, body, tc.headers...)
		if a.status != tc.status || a.problem.Type != tc.typ || a.problem.Status != tc.status || !strings.Contains(a.problem.Detail, tc.detail) {
			t.Fatalf("%s: %d %+v; want %d %s with %q in the detail", tc.what, a.status, a.problem, tc.status, tc.typ, tc.detail)
		}
		if ct := a.header.Get("Content-Type"); ct != "application/problem+json" {
			t.Fatalf("%s: Content-Type %q", tc.what, ct)
		}
		if tc.status == 401 && a.header.Get("WWW-Authenticate") == "" {
			t.Fatalf("%s: no WWW-Authenticate", tc.what)
		}
		// A refunded answer shows the quota after its refund, as its
		// detail says: nothing is used (the charged state would read 99).
		if tc.refunded {
			if got, rl := a.header.Get("X-Quota-Remaining"), a.header.Get("RateLimit"); got != "100" || !strings.HasPrefix(rl, `"quota";r=100;`) {
				t.Fatalf("%s: X-Quota-Remaining %q, RateLimit %q; want the state after the refund, 100", tc.what, got, rl)
			}
		}
	}
	if up.count("POST /v1/upload") > 1 {
		t.Fatalf("the upstream saw %d uploads: the one with a Content-Length over the limit must not reach it", up.count("POST /v1/upload"))
	}
	if up.hanging.Load() != 1 {
		t.Fatalf("the hanging upstream was called %d times", up.hanging.Load())
	}
	// The chunked body, the hang and the drop were charged, then refunded.
	waitFor(t, 5*time.Second, "three refunds", func() bool { return c.refunds() == 3 })
	u := do(t, proxy, "GET", "/v1/usage", acct.key, nil).usage(t)
	if u.Used != 0 || u.Remaining != 100 {
		t.Fatalf("usage %+v: nothing was served, nothing may be charged", u)
	}
	if a := do(t, proxy, "DELETE", "/v1/usage", acct.key, nil); a.status != http.StatusMethodNotAllowed || a.header.Get("Allow") == "" {
		t.Fatalf("DELETE usage: %d %v", a.status, a.header)
	}
}
