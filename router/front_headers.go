package router

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"math/bits"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// Problem types of the HTTP front's refusals (RFC 9457 "type" members). Each
// names one cause, so a client can switch on it.
const (
	problemBase = "https://quotaring.dev/problems/"
	// ProblemQuotaExceeded: the account's quota or credits do not cover the
	// request (FrontOptions.QuotaStatus: 429, 402 or 403).
	ProblemQuotaExceeded = problemBase + "quota-exceeded"
	// ProblemRateLimited: the account's token bucket is empty (429).
	ProblemRateLimited = problemBase + "rate-limited"
	// ProblemUnknownKey: no API key, or one the config does not know (401).
	ProblemUnknownKey = problemBase + "unknown-key"
	// ProblemQuotaUnavailable: the charge could not be decided now (503,
	// Retry-After 1): nothing was charged, or an owner that stopped
	// answering may have charged it (retry with the same Idempotency-Key).
	ProblemQuotaUnavailable = problemBase + "quota-unavailable"
	// ProblemBadRequest: a malformed header, such as Idempotency-Key, or a
	// request body that could not be read to its end (400; the charge was
	// refunded).
	ProblemBadRequest = problemBase + "bad-request"
	// ProblemIdempotencyKeyReused: the Idempotency-Key was already used by
	// the account for another request (422, as the IETF draft
	// on the header asks); nothing was charged.
	ProblemIdempotencyKeyReused = problemBase + "idempotency-key-reused"
	// ProblemIdempotencyReplayLimit: the Idempotency-Key's request was
	// already served again, billed once, as often as an owner serves one
	// key (serve --dedup-max-replays); a new request needs a new key (422;
	// nothing was charged, the upstream was not called).
	ProblemIdempotencyReplayLimit = problemBase + "idempotency-replay-limit"
	// ProblemPayloadTooLarge: the body is over FrontOptions.MaxBodyBytes (413).
	ProblemPayloadTooLarge = problemBase + "payload-too-large"
	// ProblemRequestTimeout: the request body sent nothing for
	// FrontOptions.BodyIdleTimeout, or was not sent in full within
	// FrontOptions.BodyTimeout (408); the charge was refunded.
	ProblemRequestTimeout = problemBase + "request-timeout"
	// ProblemUpstreamUnavailable: the upstream failed or timed out (502 or
	// 504); the charge was refunded, but under BillOnAlways, where it
	// stands (the detail says which).
	ProblemUpstreamUnavailable = problemBase + "upstream-unavailable"
	// ProblemInternal: the quota service failed (500).
	ProblemInternal = problemBase + "internal-error"
)

// Problem is an RFC 9457 problem detail, the body of every refusal
// (Content-Type application/problem+json).
type Problem struct {
	Type     string `json:"type"`
	Title    string `json:"title"`
	Status   int    `json:"status"`
	Detail   string `json:"detail,omitempty"`
	Instance string `json:"instance,omitempty"`

	// retryAfter is the Retry-After header in seconds; negative: none.
	retryAfter int64
}

func newProblem(typ, title string, status int, detail string) *Problem {
	return &Problem{Type: typ, Title: title, Status: status, Detail: detail, retryAfter: -1}
}

// write answers p: problem+json, or for a gRPC request (Content-Type
// application/grpc...) a trailers-only gRPC answer whose grpc-status a gRPC
// client understands (RESOURCE_EXHAUSTED for quota and rate, UNAUTHENTICATED
// for keys...). The headers already set on w (the quota headers) stay; they
// reach a gRPC client as metadata. r may be nil.
func (p *Problem) write(w http.ResponseWriter, r *http.Request) {
	if r != nil && isGRPC(r.Header.Get("Content-Type")) {
		p.writeGRPC(w, r.Header.Get("Content-Type"))
		return
	}
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	h.Del("Content-Length")
	if p.retryAfter >= 0 {
		h.Set("Retry-After", strconv.FormatInt(p.retryAfter, 10))
	}
	if p.Status == http.StatusUnauthorized {
		h.Set("WWW-Authenticate", `Bearer realm="quotaring"`)
	}
	w.WriteHeader(p.Status)
	_, _ = w.Write(encodeJSON(p))
}

// encodeJSON encodes v and a newline without HTML escaping, so a detail
// reads "Bearer <key>", not "Bearer \u003ckey\u003e".
func encodeJSON(v any) []byte {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil { // NB: only strings, ints and maps of them: cannot fail
		return []byte(`{"type":"about:blank","status":500}` + "\n")
	}
	return buf.Bytes()
}

// ceilSeconds rounds a duration in ns up to whole seconds, as HTTP's
// delta-seconds need (a client that waits less than RetryAfter is refused
// again).
func ceilSeconds(ns int64) int64 {
	if ns <= 0 {
		return 0
	}
	return (ns + int64(time.Second) - 1) / int64(time.Second)
}

// rateLimitHeaders formats the RateLimit-Policy and RateLimit fields of the
// IETF httpapi draft, in the syntax of draft-ietf-httpapi-ratelimit-headers-08
// (structured field lists with an item per policy; RateLimit-Policy's q and
// w, RateLimit's r and t). "burst" is the token bucket, when the plan has a
// rate limit; "quota" is the period's units (monthly quota and credits, in
// the plan's units: route weights, not requests):
//
//	RateLimit-Policy: "burst";q=<burst>;w=<seconds for a full refill>, "quota";q=<units>;w=<seconds in the period>
//	RateLimit: "burst";r=<tokens left>;t=<seconds until full>, "quota";r=<units left>;t=<seconds until the period ends>
//
// With no token left (r=0), the burst's t is the seconds until the next
// one instead (rounded up, at least 1): when the client may send again,
// which is the Retry-After of a rate-limited refusal. The draft asks the two
// to agree; t until full told a client to wait up to the whole window
// (t=2 beside Retry-After: 1).
//
// quota is false for a soft plan, which records overage and is never
// refused for its quota: its "quota" item is left out, since a limit whose
// r reads 0 for the rest of the month told a client following the draft to
// stop for weeks while it was still served (X-Quota-* carry the figures).
// Both fields are empty when no item is left.
//
// now is Unix seconds. Every decision has a period end (the month, for
// credits too); an item without one (reset 0) would have no w and no t.
func rateLimitHeaders(d *shard.Decision, now int64, quota bool) (policy, limit string) {
	pb, lb := make([]byte, 0, 96), make([]byte, 0, 96)
	if d.RateBurst > 0 {
		pb = appendBurstPolicy(pb, d.RateBurst, d.RateWindow)
		lb = append(lb, `"burst";r=`...)
		lb = strconv.AppendInt(lb, max(0, d.RateRemaining), 10)
		lb = append(lb, ";t="...)
		t := ceilSeconds(d.RateReset)
		if d.RateRemaining <= 0 {
			t = max(1, ceilSeconds(nextToken(d)))
		}
		lb = strconv.AppendInt(lb, t, 10)
	}
	if quota {
		pb, lb = appendQuotaItems(pb, lb, d.Limit, d.Remaining, d.Reset, now)
	}
	return string(pb), string(lb)
}

// appendBurstPolicy appends RateLimit-Policy's "burst" item: a bucket of
// burst tokens that refills in window ns. A bucket that refills within a
// second is described per second, q the tokens a second brings (rounded
// down): w is whole seconds, and "q=1;w=1" for 600/m with a burst of 1
// (a token every 100 ms) told clients pacing by it a tenth of the rate.
func appendBurstPolicy(pb []byte, burst, window int64) []byte {
	q, w := burst, max(1, ceilSeconds(window))
	if window > 0 && window < int64(time.Second) && burst > 0 {
		hi, lo := bits.Mul64(uint64(burst), uint64(time.Second))
		q = math.MaxInt64
		if hi < uint64(window) { // NB: else the quotient passes 64 bits
			if quo, _ := bits.Div64(hi, lo, uint64(window)); quo <= math.MaxInt64 {
				q = int64(quo)
			}
		}
	}
	pb = append(pb, `"burst";q=`...)
	pb = strconv.AppendInt(pb, q, 10)
	pb = append(pb, ";w="...)
	return strconv.AppendInt(pb, w, 10)
}

// nextToken is the ns until the bucket of d, empty, has a token again: a
// rate-limited refusal's RetryAfter (what its Retry-After says), else the
// time until full less the refill time of the other burst-1 tokens.
func nextToken(d *shard.Decision) int64 {
	if d.Reason == shard.RateLimited && d.RetryAfter > 0 {
		return d.RetryAfter
	}
	if d.RateBurst <= 0 || d.RateWindow <= 0 || d.RateReset <= 0 {
		return d.RateReset
	}
	hi, lo := bits.Mul64(uint64(d.RateBurst-1), uint64(d.RateWindow))
	others, _ := bits.Div64(hi, lo, uint64(d.RateBurst)) // NB: < RateWindow, so hi < RateBurst: no panic
	return d.RateReset - int64(others)
}

// appendQuotaItems appends the "quota" items of RateLimit-Policy (to pb)
// and RateLimit (to lb), after a ", " when there is an item already.
func appendQuotaItems(pb, lb []byte, limitUnits, remaining, reset, now int64) ([]byte, []byte) {
	if len(pb) > 0 {
		pb, lb = append(pb, ", "...), append(lb, ", "...)
	}
	pb = append(pb, `"quota";q=`...)
	pb = strconv.AppendInt(pb, max(0, limitUnits), 10)
	lb = append(lb, `"quota";r=`...)
	lb = strconv.AppendInt(lb, max(0, remaining), 10)
	if reset > 0 {
		end := time.Unix(reset, 0).UTC()
		start := time.Unix(reset-1, 0).UTC()
		start = time.Date(start.Year(), start.Month(), 1, 0, 0, 0, 0, time.UTC) // the period is a UTC month
		pb = append(pb, ";w="...)
		pb = strconv.AppendInt(pb, int64(end.Sub(start)/time.Second), 10)
		lb = append(lb, ";t="...)
		lb = strconv.AppendInt(lb, max(0, reset-now), 10)
	}
	return pb, lb
}

// formatReset formats Unix seconds as RFC 3339 in UTC.
func formatReset(unix int64) string { return time.Unix(unix, 0).UTC().Format(time.RFC3339) }

// setQuotaHeaders puts the rate-limit and quota fields of d on h; now is
// Unix seconds; quota is false for a soft plan (rateLimitHeaders).
func setQuotaHeaders(h http.Header, d *shard.Decision, now int64, quota bool) {
	policy, limit := rateLimitHeaders(d, now, quota)
	setField(h, "RateLimit-Policy", policy)
	setField(h, "RateLimit", limit)
	setQuotaFields(h, d.Limit, d.Remaining, d.Reset)
}

// setField sets h's field k to v, or drops it when v is empty.
func setField(h http.Header, k, v string) {
	if v == "" {
		h.Del(k)
		return
	}
	h.Set(k, v)
}

// hardQuota reports whether the account's plan refuses past its quota (a
// hard plan), as the snapshot has it; true when the snapshot does not know
// the account (the owner's answer then decides).
func hardQuota(snap *snapshot.Snapshot, account string) bool {
	cfg, ok := snap.AccountConfig(account)
	return !ok || cfg.Plan.Hard
}

// planPolicy is RateLimit-Policy for an account's plan, as the snapshot has
// it: the policy every charged answer of the account carries (the "burst"
// item as the owner's bucket fills it, shard.Bucket, and the "quota" item
// for a hard plan), for the usage endpoint, which has no bucket state and
// so only the "quota" item in RateLimit (limit).
func planPolicy(snap *snapshot.Snapshot, account string, limitUnits, remaining, reset, now int64) (policy, limit []byte) {
	cfg, ok := snap.AccountConfig(account)
	if p := cfg.Plan; ok && !p.Rate.Unlimited() && p.Burst > 0 {
		policy = appendBurstPolicy(policy, p.Burst, p.Burst*int64(p.Rate.Per)/p.Rate.Tokens)
	}
	if !ok || cfg.Plan.Hard {
		qp, ql := appendQuotaItems(nil, nil, limitUnits, remaining, reset, now)
		if len(policy) > 0 {
			policy = append(policy, ", "...)
		}
		policy, limit = append(policy, qp...), ql
	}
	return policy, limit
}

// setQuotaFields sets X-Quota-Limit, X-Quota-Remaining and X-Quota-Reset
// (the end of the period, RFC 3339 UTC).
func setQuotaFields(h http.Header, limit, remaining, reset int64) {
	h.Set("X-Quota-Limit", strconv.FormatInt(limit, 10))
	h.Set("X-Quota-Remaining", strconv.FormatInt(max(0, remaining), 10))
	if reset > 0 {
		h.Set("X-Quota-Reset", formatReset(reset))
	}
}

// frontHeaders are the response fields the front owns; an upstream's own
// values for them are dropped so a client never sees two.
var frontHeaders = []string{"RateLimit-Policy", "RateLimit", "X-Quota-Limit", "X-Quota-Remaining", "X-Quota-Reset"}

// delFrontHeaders deletes the front's own headers (frontHeaders) from h,
// which may be nil.
func delFrontHeaders(h http.Header) {
	for _, k := range frontHeaders {
		h.Del(k)
	}
}

// refusal turns a refused decision into its problem. units is what the
// request would have cost.
func refusal(d *shard.Decision, units int64, quotaStatus int) *Problem {
	switch d.Reason {
	case shard.RateLimited:
		wait := max(1, ceilSeconds(d.RetryAfter))
		p := newProblem(ProblemRateLimited, "Rate limited", http.StatusTooManyRequests,
			fmt.Sprintf("The account's rate limit (a burst of %d requests) is used up; retry in %d s.", d.RateBurst, wait))
		p.retryAfter = wait
		return p
	case shard.QuotaExceeded:
		p := newProblem(ProblemQuotaExceeded, "Quota exceeded", quotaStatus, "")
		if d.RetryAfter == shard.Never {
			p.Detail = fmt.Sprintf("This request costs %s and the account has %d left of %d; its credits are used up and waiting does not renew them.",
				unitsText(units), max(0, d.Remaining), d.Limit)
			if d.MonthUnits > 0 {
				p.Detail = fmt.Sprintf("This request costs %s and the account has %d left of %d: more than its monthly quota of %d and the credits it will still have "+
					"give, so waiting for the next month does not help; it needs more credits or a larger plan.",
					unitsText(units), max(0, d.Remaining), d.Limit, d.MonthUnits)
			}
			return p
		}
		p.retryAfter = max(1, ceilSeconds(d.RetryAfter))
		if d.CreditsStart {
			// NB: the owner says so; not read from the times: the front's
			// clock and the owner's (or an account ahead in the next month,
			// G9) differ, and a plain month-end refusal read as credits.
			p.Detail = fmt.Sprintf("This request costs %s and the account has %d left of %d; credits that start in %d s give it the units: retry then.",
				unitsText(units), max(0, d.Remaining), d.Limit, p.retryAfter)
			return p
		}
		p.Detail = fmt.Sprintf("This request costs %s and the account has %d left of %d this period; the quota renews at %s.",
			unitsText(units), max(0, d.Remaining), d.Limit, formatReset(d.Reset))
		return p
	case shard.IDReused:
		return newProblem(ProblemIdempotencyKeyReused, "Idempotency-Key reused", http.StatusUnprocessableEntity,
			"This Idempotency-Key was used by this account in the last 24 hours for another request (another route, method, path or query); a retry must repeat the same request, and a new request needs a new key. Nothing was charged.")
	case shard.ReplayLimit:
		return newProblem(ProblemIdempotencyReplayLimit, "Idempotency-Key replayed too often", http.StatusUnprocessableEntity,
			"This request was already served again under this Idempotency-Key, and billed once, as often as a key is served (a client's retries need far fewer); each retry runs the request again, so a new request needs a new key. Nothing was charged and the request was not served.")
	case shard.UnknownAccount:
		p := newProblem(ProblemQuotaUnavailable, "Quota unavailable", http.StatusServiceUnavailable,
			"The owner of this key's account has not loaded its config yet; retry in a second.")
		p.retryAfter = 1
		return p
	}
	return newProblem(ProblemInternal, "Internal error", http.StatusInternalServerError,
		fmt.Sprintf("The quota service answered %q; this is a bug, please report it.", d.Reason))
}

func unknownKey(missing bool) *Problem {
	if missing {
		return newProblem(ProblemUnknownKey, "Unknown API key", http.StatusUnauthorized,
			"No API key was sent: send it as 'Authorization: Bearer <key>' or 'X-Api-Key: <key>'.")
	}
	return newProblem(ProblemUnknownKey, "Unknown API key", http.StatusUnauthorized,
		"The API key is not known (revoked, mistyped, or created less than a few seconds ago).")
}

func unavailable(detail string) *Problem {
	p := newProblem(ProblemQuotaUnavailable, "Quota unavailable", http.StatusServiceUnavailable, detail)
	p.retryAfter = 1
	return p
}

func internalError() *Problem {
	return newProblem(ProblemInternal, "Internal error", http.StatusInternalServerError,
		"The quota service failed to decide this request; nothing was charged. Retry later.")
}

// notDurable answers a charge whose record the node's log could not make
// durable: the upstream's answer is withheld, and the charge may or may not
// stand (the log failed mid-write).
func notDurable() *Problem {
	return newProblem(ProblemInternal, "Internal error", http.StatusInternalServerError,
		"The quota service could not record this request's charge durably, so its answer is withheld; the charge may or may not stand. Retry with the same Idempotency-Key: it is billed at most once.")
}

// tooLarge refuses a Content-Length over the limit, before any charge.
func tooLarge(limit int64) *Problem {
	return newProblem(ProblemPayloadTooLarge, "Payload too large", http.StatusRequestEntityTooLarge,
		fmt.Sprintf("The request body is over the limit of %d bytes; nothing was charged.", limit))
}

// cutTooLarge answers a body without a Content-Length (chunked, or HTTP/2)
// that grew over the limit: it was charged and streamed, then cut off and
// refunded. It said "nothing was charged", which the account's usage (a
// charge and its refund) contradicted.
func cutTooLarge(limit int64, refunded bool) *Problem {
	return newProblem(ProblemPayloadTooLarge, "Payload too large", http.StatusRequestEntityTooLarge,
		fmt.Sprintf("The request body grew over the limit of %d bytes and was cut off; %s. Send at most %d bytes (with a Content-Length, a larger body is refused before it is charged).",
			limit, refundText(refunded), limit))
}

func bodyStalled(idle time.Duration, refunded bool) *Problem {
	return newProblem(ProblemRequestTimeout, "Request body timed out", http.StatusRequestTimeout,
		fmt.Sprintf("The request body sent nothing for %s; the request was cut off, and %s. Send the body without pauses that long, or retry.", idle, refundText(refunded)))
}

func bodyTooSlow(total time.Duration, refunded bool) *Problem {
	return newProblem(ProblemRequestTimeout, "Request body timed out", http.StatusRequestTimeout,
		fmt.Sprintf("The request body was not sent in full within %s of the request; the request was cut off, and %s. Send it faster, or a smaller one.", total, refundText(refunded)))
}

// bodyBroken answers a request whose body could not be read to its end:
// the client went away mid-body (nobody reads this), or sent a malformed
// body (a broken chunked encoding, an HTTP/2 stream reset).
func bodyBroken(refunded bool) *Problem {
	return badRequest("The request body could not be read to its end (the connection closed or the stream was reset mid-body, or its chunked encoding is malformed); the request was cut off, and " +
		refundText(refunded) + ". Send the whole body, or retry.")
}

// refundText says what became of the charge of a request the front cut
// off or the upstream failed: refunded, or (the owner did not answer the
// refund in time) standing, in which case a retry under the same
// Idempotency-Key is a replay, not a second charge. The text said
// "refunded" either way, and a client that believed it and retried
// without the key paid twice.
func refundText(refunded bool) string {
	if refunded {
		return "the charge is refunded"
	}
	return "the charge could not be refunded now and stands: a retry with the same Idempotency-Key is not charged again"
}

func badRequest(detail string) *Problem {
	return newProblem(ProblemBadRequest, "Bad request", http.StatusBadRequest, detail)
}

func isGRPC(contentType string) bool { return strings.HasPrefix(contentType, "application/grpc") }

// gRPC status codes (google.golang.org/grpc/codes), by problem type.
var grpcCodes = map[string]int{
	ProblemQuotaExceeded:          8,  // RESOURCE_EXHAUSTED
	ProblemRateLimited:            8,  // RESOURCE_EXHAUSTED
	ProblemPayloadTooLarge:        8,  // RESOURCE_EXHAUSTED, as gRPC answers a message over its limit
	ProblemRequestTimeout:         4,  // DEADLINE_EXCEEDED
	ProblemUnknownKey:             16, // UNAUTHENTICATED
	ProblemQuotaUnavailable:       14, // UNAVAILABLE
	ProblemUpstreamUnavailable:    14, // UNAVAILABLE (DEADLINE_EXCEEDED for 504)
	ProblemBadRequest:             3,  // INVALID_ARGUMENT
	ProblemIdempotencyKeyReused:   9,  // FAILED_PRECONDITION
	ProblemIdempotencyReplayLimit: 9,  // FAILED_PRECONDITION
	ProblemInternal:               13, // INTERNAL
}

// writeGRPC answers p as a trailers-only gRPC response: HTTP 200 with
// grpc-status and grpc-message (the problem's title and detail) in the
// headers, as gRPC servers answer a call that fails before any message;
// X-Quota-Problem carries the problem type. A gRPC-Web caller (asked with
// contentType application/grpc-web...) gets its own type back: its clients
// check the answer's type before they read grpc-status.
func (p *Problem) writeGRPC(w http.ResponseWriter, contentType string) {
	code, ok := grpcCodes[p.Type]
	switch {
	case p.Type == ProblemUpstreamUnavailable && p.Status == http.StatusGatewayTimeout:
		code = 4 // DEADLINE_EXCEEDED
	case !ok:
		code = 2 // UNKNOWN
	}
	h := w.Header()
	h.Del("Content-Length")
	if ct, _, _ := strings.Cut(contentType, ";"); strings.HasPrefix(ct, "application/grpc-web") {
		h.Set("Content-Type", strings.TrimSpace(ct))
	} else {
		h.Set("Content-Type", "application/grpc")
	}
	h.Set("Grpc-Status", strconv.Itoa(code))
	h.Set("Grpc-Message", grpcMessage(p.Title+": "+p.Detail))
	h.Set("X-Quota-Problem", p.Type)
	if p.retryAfter >= 0 {
		h.Set("Retry-After", strconv.FormatInt(p.retryAfter, 10))
	}
	w.WriteHeader(http.StatusOK)
}

// grpcMessage percent-encodes s as the gRPC wire spec requires of
// grpc-message: bytes outside printable ASCII, and '%'.
func grpcMessage(s string) string {
	const hex = "0123456789ABCDEF"
	b := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c > 0x7e || c == '%' {
			b = append(b, '%', hex[c>>4], hex[c&15])
			continue
		}
		b = append(b, c)
	}
	return string(b)
}

// unitsText is "1 unit" or "n units".
func unitsText(n int64) string {
	if n == 1 {
		return "1 unit"
	}
	return strconv.FormatInt(n, 10) + " units"
}
