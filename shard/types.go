package shard

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// Now is a reading of the two clocks a decision needs. The caller reads them;
// this package never does.
type Now struct {
	// Wall is Unix nanoseconds (UTC). It names the period and stamps records.
	Wall int64
	// Mono is nanoseconds on a monotonic clock with an arbitrary origin. It
	// drives the token bucket, so a wall-clock jump never refills a bucket.
	Mono int64
}

// Rate is Tokens per Per. The zero Rate means no rate limit.
type Rate struct {
	Tokens int64
	Per    time.Duration
}

// Unlimited reports whether r sets no rate limit.
func (r Rate) Unlimited() bool { return r.Tokens <= 0 }

// String formats r as "10/s", "100/1m0s".
func (r Rate) String() string {
	if r.Unlimited() {
		return "unlimited"
	}
	if r.Per == time.Second {
		return fmt.Sprintf("%d/s", r.Tokens)
	}
	return fmt.Sprintf("%d/%s", r.Tokens, r.Per)
}

// Plan is what an account pays for: a request rate with a burst, and a monthly
// quota of units that is either hard (refuse past it) or soft (record overage).
type Plan struct {
	ID           string
	Rate         Rate
	Burst        int64
	MonthlyQuota int64
	Hard         bool
}

// maxBucketScale bounds Burst*Per so the bucket's integer arithmetic cannot
// overflow (see Bucket).
const maxBucketScale = int64(1) << 62

// Validate says what is wrong with p, if anything.
func (p Plan) Validate() error {
	switch {
	case p.MonthlyQuota < 0:
		return fmt.Errorf("shard: plan %q: monthly quota %d is negative", p.ID, p.MonthlyQuota)
	case p.Rate.Tokens < 0 || p.Burst < 0:
		return fmt.Errorf("shard: plan %q: rate and burst must not be negative", p.ID)
	case p.Rate.Unlimited():
		return nil
	case p.Rate.Per <= 0:
		return fmt.Errorf("shard: plan %q: rate %d per %s: the period must be positive", p.ID, p.Rate.Tokens, p.Rate.Per)
	case p.Burst < 1:
		return fmt.Errorf("shard: plan %q: a rate limit needs a burst of at least 1", p.ID)
	case p.Burst > maxBucketScale/int64(p.Rate.Per):
		return fmt.Errorf("shard: plan %q: burst %d over %s is too large (burst x period must stay under 2^62 ns)", p.ID, p.Burst, p.Rate.Per)
	}
	return nil
}

// GrantConfig is a grant of bought credits: Units to spend between StartsAt
// and ExpiresAt (Unix nanoseconds; ExpiresAt 0 means never).
type GrantConfig struct {
	ID        string
	Units     int64
	StartsAt  int64
	ExpiresAt int64
	// Used is the settled use the ledger knows. It seeds a new Account and is
	// ignored afterwards (the owner's own count is newer).
	Used int64
}

// AccountConfig is everything the config snapshot says about one account.
type AccountConfig struct {
	ID      string
	Plan    Plan
	Credits []GrantConfig
	// MonthlyUsed seeds the current period's monthly grant of a new Account
	// with the ledger's settled use, keyed by grant id (MonthlyGrantID).
	MonthlyUsed map[string]int64
	// RouteUsed is the ledger's settled use by route, keyed by period
	// (Period.String) and route: what the account's usage split by route
	// (Usage.Routes) shows at least, with UseBehind false (and set to,
	// with Reseed), as the grants' use follows MonthlyUsed. Without it the
	// split counts only this owner's charges.
	RouteUsed map[string]map[string]int64
	// UseBehind says the settled use above (and Credits' Used) may lack
	// records of this account that its owner has applied: the ledger was
	// read before they settled. Configure then leaves the grants' use as it
	// is, since raising it to the ledger's figure would count a charge again
	// whose refund has not settled yet. The engine sets it per account.
	UseBehind bool
	// Reseed (with UseBehind false) sets the grants' use to the settled
	// use above, lower or higher: the account came back from another owner,
	// and the use this node kept counts charges that owner refunded since.
	Reseed bool
}

// Params are the owner's settings that every account shares.
type Params struct {
	// Reservations makes hard grants spendable only from the allowance the
	// ledger reserved for this node (clusters). Off, the account's own count is
	// the authority (one node with nobody else to share with).
	Reservations bool
	// DedupWindow is how long client-supplied event ids are remembered, in ns.
	DedupWindow int64
	// DedupMax bounds the remembered client ids per account; the oldest go first.
	DedupMax int
	// MaxReplays bounds the retries of one client id answered Replayed and
	// served (billed once) at a time: the next is refused ReplayLimit. A
	// replay taken back (RefundReplay: its upstream failed) frees its place.
	// Replays are served again for no charge, so without a bound one
	// Idempotency-Key would buy any number of runs of its request for one
	// charge for as long as the id is remembered. 0: no bound.
	MaxReplays int32
}

// spentMax bounds the client ids an account keeps past its dedup window
// for the rest of the period (Account.nextGen): four times DedupMax, a
// fraction of the memory (a spent id keeps its generation, not its charge).
func (p *Params) spentMax() int { return 4 * p.DedupMax }

// DefaultMaxReplays is DefaultParams' MaxReplays: ten served retries of one
// request is far beyond what a client's retry loop sends (SDKs retry two or
// three times), and still bounds what one charge buys.
const DefaultMaxReplays = 10

// DefaultParams remembers client ids for 24 hours, at most 100,000 per
// account, and serves at most DefaultMaxReplays retries of each.
func DefaultParams() Params {
	return Params{DedupWindow: int64(24 * time.Hour), DedupMax: 100_000, MaxReplays: DefaultMaxReplays}
}

// Reason is the outcome of an operation.
//
// The zero Reason is Undecided, so a zero Decision (the one returned with
// an error, or one a caller declared and never filled) is never Accepted.
// Reasons travel between nodes as names (String) and protobuf values, never
// as these numbers, and no log record or checkpoint holds one.
type Reason uint8

// Reasons. OK to UnknownAccount, Invalid, IDReused and ReplayLimit are the
// answers a caller sees for a charge; Refunded to Kept, UnknownAccount and
// Invalid for a refund.
//
// A refusal is final when the same request, retried, gets it again however
// long the caller waits (Reason.Final): Invalid, IDReused, ReplayLimit
// (until a replay is taken back or the id is forgotten), and for refunds
// AlreadyRefunded, UnknownEvent and Kept. RateLimited and QuotaExceeded
// pass with time: Decision.RetryIn says when. UnknownAccount is neither: an
// account missing from the config stays unknown, but one created in the
// last seconds is unknown only until its owner's config snapshot catches up
// (the HTTP front answers it 503, retry in 1 s).
const (
	Undecided       Reason = iota // no decision: the operation failed (its error says why); never accepted
	OK                            // charged
	Replayed                      // a retry of a charged event: charged nothing now
	RateLimited                   // the token bucket is empty
	QuotaExceeded                 // not enough units under a hard limit
	UnknownAccount                // no such account in the config
	NeedReservation               // reservations mode: ask the ledger for Shortfall more units, then charge again
	Refunded                      // the refund returned the units
	AlreadyRefunded               // a second refund: nothing changed
	UnknownEvent                  // the account does not remember this event: a generated id refunded without its receipt, a client id older than the dedup window, or a receipt of a charge before last month (Refundable)
	Invalid                       // the request is malformed (units < 0 or > MaxUnits, empty id, a text field storable does not take)
	Kept                          // an attempt's refund refused: a retry was served under the charge
	IDReused                      // a client event id already charged for another route: charged nothing
	ReplayLimit                   // a client event id already replayed Params.MaxReplays times: charged nothing, not served
)

var reasonNames = [...]string{"undecided", "ok", "replayed", "rate_limited", "quota_exceeded", "unknown_account", "need_reservation", "refunded", "already_refunded", "unknown_event", "invalid", "kept", "id_reused", "replay_limit"}

func (r Reason) String() string {
	if int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return fmt.Sprintf("reason(%d)", r)
}

// ParseReason is the inverse of Reason.String.
func ParseReason(s string) (Reason, bool) {
	for i, n := range reasonNames {
		if n == s {
			return Reason(i), true
		}
	}
	return 0, false
}

// Accepted reports whether the charge may go on (OK or Replayed).
func (r Reason) Accepted() bool { return r == OK || r == Replayed }

// Final reports whether r is a refusal that the same request, retried,
// gets again however long the caller waits: a malformed request (Invalid),
// an event id used for another route (IDReused: a new request needs a new
// id) or retried too often (ReplayLimit), and the refund answers
// AlreadyRefunded, UnknownEvent and Kept.
// Undecided is not final: the operation failed and its error says whether
// to retry. Neither is UnknownAccount (see the Reasons).
func (r Reason) Final() bool {
	switch r {
	case Invalid, IDReused, ReplayLimit, AlreadyRefunded, UnknownEvent, Kept:
		return true
	}
	return false
}

// MaxTextLen bounds a charge's EventID, Key and Route, in bytes (storable).
const MaxTextLen = 1024

// storable reports whether s can be stored as a charge's text field: the
// log takes any bytes, but the ledger's event log (Postgres text) refuses
// a NUL byte and bytes that are not UTF-8, and a settle holding one would
// fail for ever. It is at most MaxTextLen bytes, since every charge carries
// its route and key into the log and the ledger.
func storable(s string) bool {
	return len(s) <= MaxTextLen && strings.IndexByte(s, 0) < 0 && utf8.ValidString(s)
}

// MadeIDShape reports whether id has the shape of an event id quotaring
// makes for a charge sent without a client id: the engine's (8 base32hex
// letters, a dash, base-36 digits: "74J561BS-6", which the HTTP front
// passes to the upstream as X-Quota-Event) or router.Client's ("c" and 26
// base32 letters). The ledger keys an account's events by id alone, so a
// client id of that shape could name another request's event, and the
// ledger took the client's charge for a retry of it and billed nothing (a
// review served 100 units for 27 billed). Charges with such a client id are
// Invalid (ClientIDProblem).
func MadeIDShape(id string) bool {
	if head, tail, ok := strings.Cut(id, "-"); ok && len(head) == 8 && tail != "" && len(tail) <= 13 {
		for i := range len(head) {
			if c := head[i]; !('0' <= c && c <= '9' || 'A' <= c && c <= 'V') {
				return false
			}
		}
		for i := range len(tail) {
			if c := tail[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'z') {
				return false
			}
		}
		return true
	}
	if len(id) == 27 && id[0] == 'c' {
		for i := 1; i < len(id); i++ {
			if c := id[i]; !('A' <= c && c <= 'Z' || '2' <= c && c <= '7') {
				return false
			}
		}
		return true
	}
	return false
}

// ClientIDProblem says why id cannot be a client's idempotency key, ""
// when it can: the shape of an id quotaring makes (MadeIDShape), or one of
// the separators the ledger builds event names with (U+001F: LedgerEventID;
// U+001E: the SQLite ledger's archived names), with which "k\x1f1" named
// the second generation of "k".
func ClientIDProblem(id string) string {
	switch {
	case MadeIDShape(id):
		return "it has the shape of the event ids quotaring makes for requests sent without one (8 letters or digits, a dash and a number, such as 74J561BS-6, or c and 26 capitals): it could name another request's charge; use another key"
	case strings.ContainsAny(id, "\x1e\x1f"):
		return "it holds U+001E or U+001F, which the ledger uses to build event names; use another key"
	}
	return ""
}

// MaxUnits bounds the Units of one charge: a charge of more is Invalid.
// Units are summed into usage, allowances and the ledger's int64 columns,
// and the log refuses counts above 2^62 as corrupt, so a soft plan's
// overage of a few charges near the int64 limit would otherwise wrap
// around or leave a record the node cannot replay. 10^15 is far beyond any
// real charge, and the admin API bounds quotas and grants by the same.
const MaxUnits = 1_000_000_000_000_000

// MaxMonthUse bounds what a soft plan's month may take, overage included
// (a hard plan's is its quota and credits, each bounded by the admin API):
// 1,000 charges of MaxUnits. Past it a charge is QuotaExceeded until the
// next month. Unbounded, the month's use wrapped past int64 after ~9,224
// of them, and the ledger refused the settle (a bigint out of range) or,
// on SQLite, stored a float that every later snapshot read failed on.
const MaxMonthUse = 1000 * MaxUnits

// Charge asks for Units on behalf of an account.
type Charge struct {
	EventID string
	// ClientID marks EventID as supplied by the client (Idempotency-Key):
	// only those are deduplicated. Generated ids are unique by construction.
	ClientID bool
	Key      string // the API key's id (never the plaintext), for usage by key
	Route    string // the route pattern, for usage by route
	Units    int64
	// Target is a digest of the request a client id names (the HTTP front
	// hashes its method and request target); 0: the caller has
	// none. A client id reused with another target is refused IDReused,
	// as one reused on another route is: without it one Idempotency-Key
	// would serve every path under one route pattern for one charge. The
	// owner logs it with the charge and keeps it with the id, across its
	// restarts; the account's next owner knows nothing of the id, so it
	// charges it again (the ledger bills the event once).
	Target uint64
}

// Decision is the answer to a charge or a refund.
type Decision struct {
	Reason Reason
	Units  int64 // charged, replayed or refunded units
	// Seq is the log sequence the answer depends on: the caller must wait until
	// it is durable before answering. Zero means nothing to wait for.
	Seq       uint64
	Limit     int64 // units of the active grants
	Remaining int64 // units left in the active grants (never negative)
	Reset     int64 // end of the current period, Unix seconds
	// RetryAfter is set for RateLimited and QuotaExceeded only: nanoseconds
	// (an int64, not a time.Duration) until the same charge, retried, can
	// succeed, or Never when waiting does not help (credits used up). It is
	// 0 for every other Reason, where it means nothing: Reason.Final says
	// whether to retry. RetryIn reads it as a time.Duration.
	RetryAfter int64
	Shortfall  int64 // NeedReservation: units missing

	RateBurst     int64 // 0 when unlimited
	RateRemaining int64 // whole tokens left after this request
	RateReset     int64 // ns until the bucket is full again
	RateWindow    int64 // ns for Burst tokens to refill (RateLimit-Policy's w)

	// MonthUnits and MonthUsed are the active monthly grant's units and use
	// (both 0 for a plan without a monthly quota): what quota alerts
	// measure. Credits are not in them (they are in Limit and Remaining).
	MonthUnits, MonthUsed int64
	// CreditsStart, on QuotaExceeded, says RetryAfter is until credits that
	// start before the period ends give the units (not until its end).
	CreditsStart bool
}

// Never is RetryAfter for a refusal that waiting does not fix.
const Never = -1

// RetryIn says when the refused charge d answers, retried, may be accepted:
// after wait (ok true) for RateLimited, and for QuotaExceeded until the
// period renews. ok is false when waiting does not help (credits used up,
// Never), for an accepted or undecided d, and for every other refusal.
func (d Decision) RetryIn() (wait time.Duration, ok bool) {
	if (d.Reason != RateLimited && d.Reason != QuotaExceeded) || d.RetryAfter < 0 {
		return 0, false
	}
	return time.Duration(d.RetryAfter), true
}

// Errors.
var (
	// ErrCorruptRecord is returned when a record or checkpoint does not decode.
	ErrCorruptRecord = errors.New("shard: corrupt record")
)
