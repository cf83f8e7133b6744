package node

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/shard"
)

// UsageExport is GET /admin/v1/usage: one page of a month's settled usage
// of every account with usage or a monthly grant in it, for billing.
//
// The figures are settled ones: they trail the charges by up to one
// settle interval, and a node that is down keeps its unsettled charges
// until it comes back. Final says whether the month is over and every node
// heard from during it has settled everything it held at least a minute
// after it ended (flush.SettledMonth); UnsettledNodes lists the ones that
// have not, and that may still hold charges of the month (none while the
// month runs).
type UsageExport struct {
	Period string `json:"period"`
	// AsOf is this node's clock when it read the ledger: the figures hold
	// everything settled before then.
	AsOf           time.Time  `json:"as_of"`
	Final          bool       `json:"final"`
	UnsettledNodes []NodeView `json:"unsettled_nodes"`
	// LostNodes are the nodes the request named gone for good (lost_node):
	// left out of Final, as prune --lost-node does.
	LostNodes []string `json:"lost_nodes,omitempty"`
	// RefundsOpenUntil is the end of the month after Period: until then a
	// refund of one of the month's charges (a charge is refundable in its
	// month and the next) still lowers its figures, final or not.
	RefundsOpenUntil time.Time          `json:"refunds_open_until"`
	Usage            []AccountUsageView `json:"usage"`
	// Next is the after of the next page; absent on the last page.
	Next string `json:"next,omitempty"`
}

// AccountUsageView is one account's usage of the month (flush.BillingRow).
type AccountUsageView struct {
	Account string `json:"account"`
	Plan    string `json:"plan"` // the account's plan now
	Hard    bool   `json:"hard"`
	Units   int64  `json:"units"` // settled units of the month's UTC days
	// Quota is the month's quota, null when the account has no monthly
	// grant for the month (it used none of a quota: credits only).
	Quota *int64 `json:"quota"`
	// QuotaUsed is what the monthly grant paid, overage included.
	QuotaUsed int64 `json:"quota_used"`
	// Overage is quota_used - quota when positive (flush.BillingRow.Overage):
	// a soft plan's use past its quota, or use past the quota of a plan
	// changed during the month.
	Overage int64 `json:"overage"`
	// CreditsUsed is what credit grants paid, null when the event log
	// cannot tell (batches settled with --events=false).
	CreditsUsed *int64           `json:"credits_used"`
	ByRoute     map[string]int64 `json:"by_route"`
}

// ParseMonth reads a month as the admin API and quotad admin take it
// ("2026-06"): one the ledger can hold, from flush.MinBillingPeriod to
// flush.MaxBillingPeriod, since its times are Unix nanoseconds, which end
// in April 2262 (a later month wrapped around: 9999-12 read as 1816-02).
func ParseMonth(s string) (shard.Period, error) {
	p, ok := shard.ParsePeriod(s)
	if !ok || p.String() != s || p < flush.MinBillingPeriod || p > flush.MaxBillingPeriod {
		return 0, fmt.Errorf("%q: want a month such as 2026-06, from %s to %s", s, flush.MinBillingPeriod, flush.MaxBillingPeriod)
	}
	return p, nil
}

// parseMonth is ParseMonth for a parameter, a 400 naming it.
func parseMonth(field, s string) (shard.Period, error) {
	p, err := ParseMonth(s)
	if err != nil {
		return 0, badInput(field, "%v", err)
	}
	return p, nil
}

// listUsage answers GET /admin/v1/usage[?period=2026-06][&after=ID]
// [&limit=N][&lost_node=ID,...]: the period's usage of at most limit
// accounts (1,000 by default, up to 10,000) whose ids sort after after,
// and next when more follow. The period defaults to the current month by
// this node's clock. A lost node (gone for good: silent for minutes and
// revoked) holds no month back.
func (n *Node) listUsage(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	v := r.URL.Query()
	now := n.wall()
	q := flush.BillingQuery{Period: shard.PeriodOf(now.UnixNano()), After: v.Get("after"), Limit: flush.BillingDefaultLimit}
	if s := v.Get("period"); s != "" {
		p, err := parseMonth("period", s)
		if err != nil {
			return err
		}
		q.Period = p
	}
	if s := v.Get("limit"); s != "" {
		lim, err := strconv.Atoi(s)
		if err != nil || lim < 1 || lim > flush.BillingMaxLimit {
			return badInput("limit", "%q: want a number of accounts from 1 to %d", s, flush.BillingMaxLimit)
		}
		q.Limit = lim
	}
	// NB: the nodes are read before the usage. A node heard from after
	// the month's end had settled its charges of the month by then, so a
	// usage read that starts later holds them: the other order could call
	// final a month whose last settle landed between the two reads.
	nodes, err := l.Nodes(ctx)
	if err != nil {
		return err
	}
	var lost []string
	for _, s := range v["lost_node"] {
		for _, x := range strings.Split(s, ",") {
			if x = strings.TrimSpace(x); x != "" && !slices.Contains(lost, x) {
				lost = append(lost, x)
			}
		}
	}
	if len(lost) > 0 {
		if err := flush.CheckLostNodes(ctx, l, nodes, lost, now); errors.Is(err, flush.ErrInvalid) {
			return badInput("lost_node", "%s", strings.TrimPrefix(err.Error(), flush.ErrInvalid.Error()+": "))
		} else if err != nil {
			return err
		}
		nodes = slices.DeleteFunc(slices.Clone(nodes), func(x flush.NodeRow) bool { return slices.Contains(lost, x.Node) })
	}
	final, unsettled := flush.SettledMonth(nodes, q.Period, now)
	page, err := l.BillingUsage(ctx, q)
	if err != nil {
		return err
	}
	out := UsageExport{Period: q.Period.String(), AsOf: now, Final: final, UnsettledNodes: nonNil(n.nodeViews(unsettled)), LostNodes: lost,
		RefundsOpenUntil: time.Unix(0, (q.Period + 1).End()).UTC(), Usage: make([]AccountUsageView, 0, len(page.Accounts)), Next: page.Next}
	for _, a := range page.Accounts {
		u := AccountUsageView{Account: a.Account, Plan: a.Plan, Hard: a.Hard, Units: a.Units, QuotaUsed: a.QuotaUsed,
			Overage: a.Overage, ByRoute: a.ByRoute}
		if a.Monthly {
			u.Quota = &a.Quota
		}
		if a.CreditsKnown {
			u.CreditsUsed = &a.Credits
		}
		out.Usage = append(out.Usage, u)
	}
	return writeJSON(w, http.StatusOK, out)
}
