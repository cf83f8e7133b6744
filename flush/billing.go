package flush

import (
	"fmt"

	"github.com/quotaring/quotaring/shard"
)

// BillingQuery selects one page of Ledger.BillingUsage.
type BillingQuery struct {
	Period shard.Period
	// After: the page starts with the first account whose id sorts after
	// it ("" for the first page; BillingPage.Next for the next one).
	After string
	// Limit: at most this many accounts. 0 means BillingDefaultLimit; a
	// negative one or one above BillingMaxLimit is ErrInvalid.
	Limit int
}

// Page sizes of Ledger.BillingUsage: one page is one answer of the admin
// API, so that a ledger of 100,000 accounts is read in bounded pieces.
const (
	BillingDefaultLimit = 1000
	BillingMaxLimit     = 10_000
)

// BillingPage is one page of Ledger.BillingUsage.
type BillingPage struct {
	Accounts []BillingRow // by account id
	// Next is the After of the next page: this page's last account when
	// more accounts follow, "" when this page is the last.
	Next string
}

// BillingRow is one account's usage of a period, as the ledger holds it:
// settled figures only (they trail the charges by up to one settle
// interval, and a node that is down may hold unsettled ones).
type BillingRow struct {
	Account string
	// Plan and Hard are the account's plan as it is now: the ledger keeps
	// no history of plans.
	Plan string
	Hard bool
	// Units is the settled usage of the period's UTC days, as Usage reads
	// it, and ByRoute its split by route (routes whose units add up to 0,
	// their charges refunded, are left out).
	Units   int64
	ByRoute map[string]int64
	// Monthly reports whether the account has the period's monthly grant
	// (made from the plan at the month's first reservation or charge
	// against it). Quota is its units (the plan's quota for that month: a
	// change of plan during the month applies to all of it) and QuotaUsed
	// its used units, overage included. Without it both are 0: nothing of
	// a monthly quota was used.
	Monthly   bool
	Quota     int64
	QuotaUsed int64
	// Overage is QuotaUsed - Quota when positive: what the month used past
	// its quota as the grant holds it now. A soft plan gets there by going
	// on past the quota; any plan when it changed during the month to a
	// smaller quota, or from soft to hard, after use past the new quota
	// (the ledger keeps no history of plans: the figure says what was let
	// through, whatever the plan is now). A hard plan that never changed
	// has none: it refuses instead.
	Overage int64
	// Credits is the units of the period's charges that credit grants (not
	// the monthly one) paid, from the event log's allocations. The event
	// log is the only place that splits a credit grant's use by month.
	// CreditsKnown is false, and Credits 0, when the event log does not
	// account for the period's usage: batches settled with the event log
	// off, or a charge billed in another month than its day's (a node's
	// clock ran ahead; see Reserve).
	Credits      int64
	CreditsKnown bool
}

// limit checks q and returns its page size.
func (q BillingQuery) limit() (int, error) {
	switch {
	case q.Limit < 0 || q.Limit > BillingMaxLimit:
		return 0, fmt.Errorf("%w: billing usage: limit %d: want 1 to %d accounts a page (0 for %d)",
			ErrInvalid, q.Limit, BillingMaxLimit, BillingDefaultLimit)
	case q.Period < MinBillingPeriod || q.Period > MaxBillingPeriod:
		return 0, fmt.Errorf("%w: billing usage: period %s: want a month from %s to %s",
			ErrInvalid, q.Period, MinBillingPeriod, MaxBillingPeriod)
	case q.Limit == 0:
		return BillingDefaultLimit, nil
	}
	return q.Limit, nil
}

// MinBillingPeriod and MaxBillingPeriod bound the periods BillingUsage
// reads: the ledger's times are Unix nanoseconds, which end in April 2262.
const (
	MinBillingPeriod = shard.Period(1970 * 12)
	MaxBillingPeriod = shard.Period(2261*12 + 11)
)

// finish fills what follows from the figures read: the overage, and the
// credits when the event log's unrefunded units of the period (evUnits)
// are its settled usage.
func (r *BillingRow) finish(evUnits, evCredits int64) {
	if r.QuotaUsed > r.Quota {
		r.Overage = r.QuotaUsed - r.Quota
	}
	if evUnits == r.Units {
		r.Credits, r.CreditsKnown = evCredits, true
	}
	if r.ByRoute == nil {
		r.ByRoute = map[string]int64{}
	}
}

// billingPage cuts rows, read with a limit one above the page's, to the
// page, and names the next one.
func billingPage(rows []BillingRow, limit int) BillingPage {
	if len(rows) <= limit {
		return BillingPage{Accounts: rows}
	}
	rows = rows[:limit]
	return BillingPage{Accounts: rows, Next: rows[limit-1].Account}
}
