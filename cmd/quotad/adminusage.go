package main

import (
	"context"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/shard"
)

// --- usage (billing) ----------------------------------------------------------

func newAdminUsageCmd(c *adminClient) *cobra.Command {
	var period string
	var csvOut, byRoute bool
	var pageSize int
	var lost []string
	cmd := &cobra.Command{
		Use:   "usage [--period 2026-06] [--csv] [--by-route]",
		Short: "A month's settled usage of every account, for billing: a table, CSV or JSON",
		Long: `Print a month's settled usage of every account that has usage or a monthly
grant in it (the current month by the node's clock unless --period), reading
every page of GET /admin/v1/usage. Accounts with neither are left out.

Per account: its plan (as it is now) and limit (hard or soft), the units
settled on the month's UTC days, the month's quota (empty when the account
has no monthly grant that month: it ran on credits), what the monthly grant
paid (quota_used, overage included), the overage (what a soft plan used past
its quota; 0 on a hard one) and what credit grants paid (credits_used; empty
when the ledger's event log cannot tell, with --events=false).

The figures are settled ones. They trail the charges by up to one settle
interval, and a node that is down holds its unsettled charges until it comes
back. A month is final once it is over and every node heard from during it has
settled everything it held a minute or more after it ended; until then the
output says which nodes may still hold charges of it (on stderr with --csv).
A node gone for good (its disk lost, revoked with quotad revoke, silent for 2
minutes) holds its months back until named with --lost-node, as for prune. A
charge refunded in the next month lowers its own month, so a final month's
figures can still go down by such refunds until the next month is over.

--csv prints one row per account with a header:
  period,account,plan,limit,units,quota,quota_used,overage,credits_used
--csv --by-route prints one row per account and route instead:
  period,account,route,units
--json prints the API's answer with every page's accounts in one "usage" list.`,
		Example: `  quotad admin usage
  quotad admin usage --period 2026-06 --csv > usage-2026-06.csv
  quotad admin usage --period 2026-06 --csv --by-route > usage-2026-06-routes.csv
  quotad admin usage --period 2026-06 --json | jq '.usage[] | select(.overage > 0)'
  quotad admin usage --period 2026-06 --lost-node q3 --csv   # q3's disk was lost and revoked`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if period != "" {
				if _, err := node.ParseMonth(period); err != nil {
					return fmt.Errorf("--period %v", err)
				}
			}
			if pageSize < 1 || pageSize > flush.BillingMaxLimit {
				return fmt.Errorf("--page-size %d: want a number of accounts from 1 to %d", pageSize, flush.BillingMaxLimit)
			}
			if csvOut && c.json {
				// A billing job's CSV must never be JSON because of a
				// variable it inherited.
				return fmt.Errorf("--csv and --json are two formats: give one (is QUOTAD_ADMIN_JSON set in the environment? it stands for --json)")
			}
			if byRoute && c.json {
				return fmt.Errorf("--by-route is a form of the table and the CSV; --json always carries by_route")
			}
			exp, err := c.usageExport(cmd.Context(), period, pageSize, lost)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			switch {
			case c.json:
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				return enc.Encode(exp)
			case csvOut:
				if !exp.Final {
					fmt.Fprintf(cmd.ErrOrStderr(), "quotad: warning: %s\n", finality(exp))
				}
				return writeUsageCSV(out, exp, byRoute)
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			printUsage(tw, exp, byRoute)
			return tw.Flush()
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&period, "period", "", "the month, such as 2026-06 (default: the current one by the node's clock)")
	fl.BoolVar(&csvOut, "csv", false, "print CSV with a header row, for a billing system to import")
	fl.BoolVar(&byRoute, "by-route", false, "one row per account and route (period, account, route, units)")
	fl.IntVar(&pageSize, "page-size", flush.BillingDefaultLimit, fmt.Sprintf("accounts per API call (1 to %d); every page is read", flush.BillingMaxLimit))
	fl.StringSliceVar(&lost, "lost-node", nil, "a node gone for good (revoked) whose last heartbeat would otherwise hold the month back; repeat or comma-separate")
	markNoEnv(cmd, "lost-node", safetyOverride)
	return cmd
}

// usageExport reads every page of a month's usage and returns them as one
// answer: the first page's period (so that a run across midnight at the
// month's end stays in one month) and as_of, final only when every page
// said so, and the nodes any page named.
func (c *adminClient) usageExport(ctx context.Context, period string, pageSize int, lost []string) (*node.UsageExport, error) {
	var all *node.UsageExport
	seen := map[string]bool{"": true}
	for after := ""; ; {
		v := url.Values{}
		if period != "" {
			v.Set("period", period)
		}
		if after != "" {
			v.Set("after", after)
		}
		v.Set("limit", strconv.Itoa(pageSize))
		for _, x := range lost {
			v.Add("lost_node", x)
		}
		var p node.UsageExport
		if _, err := c.do(ctx, "GET", "/admin/v1/usage?"+v.Encode(), nil, &p); err != nil {
			return nil, err
		}
		if all == nil {
			all = &p
			all.Usage = slices.Clip(all.Usage)
			period = p.Period
		} else {
			all.Final = all.Final && p.Final
			for _, n := range p.UnsettledNodes {
				if !slices.ContainsFunc(all.UnsettledNodes, func(m node.NodeView) bool { return m.Node == n.Node }) {
					all.UnsettledNodes = append(all.UnsettledNodes, n)
				}
			}
			all.Usage = append(all.Usage, p.Usage...)
		}
		if p.Next == "" {
			break
		}
		// NB: pages follow the ledger's order of account ids, which on
		// Postgres is the database's collation ("B" may come after "a"),
		// so the guard against a node that loops is that no page repeats,
		// not that ids grow in Go's byte order.
		if seen[p.Next] {
			return nil, fmt.Errorf("the node answered the page after %q a second time (after the page after %q): is --addr a quotad of this version?", p.Next, after)
		}
		seen[p.Next] = true
		after = p.Next
	}
	all.Next = ""
	return all, nil
}

// finality says in a sentence how final the export's figures are.
func finality(exp *node.UsageExport) string {
	asOf := exp.AsOf.UTC().Format(time.RFC3339)
	p, _ := shard.ParsePeriod(exp.Period)
	switch {
	case exp.AsOf.Before(time.Unix(0, p.Start())):
		return fmt.Sprintf("%s has not begun (as of %s): no usage yet (a mistyped --period?)", exp.Period, asOf)
	case exp.AsOf.Before(time.Unix(0, p.End())):
		return fmt.Sprintf("%s is not over (as of %s): settled usage so far, trailing the charges by up to one settle interval", exp.Period, asOf)
	case exp.Final && exp.AsOf.Before(exp.RefundsOpenUntil):
		return fmt.Sprintf("%s is final (as of %s): every node heard from during the month has settled since it ended; "+
			"refunds of its charges can still lower it until %s", exp.Period, asOf, exp.RefundsOpenUntil.UTC().Format(time.RFC3339))
	case exp.Final:
		return fmt.Sprintf("%s is final (as of %s): every node heard from during the month has settled since it ended", exp.Period, asOf)
	}
	s := fmt.Sprintf("%s is not final yet (as of %s): %s heard from during the month and has not settled everything it held since it ended, "+
		"so it may hold unsettled charges of it (a running node does within seconds unless its settles fail: its log and "+
		"quotaring_settle_errors_total say why; start a stopped one so it settles; one stopped cleanly, or whose disk is lost, has nothing left to settle):",
		exp.Period, asOf, plural(int64(len(exp.UnsettledNodes)), "node was", "nodes were"))
	for _, n := range exp.UnsettledNodes {
		through := "never"
		if n.SettledThrough != nil {
			through = n.SettledThrough.UTC().Format(time.RFC3339)
		}
		s += fmt.Sprintf(" %s (incarnation %s, last heard from %s, settled through %s, ring state %s);", n.Node, n.Incarnation,
			n.HeartbeatAt.UTC().Format(time.RFC3339), through, orDash(n.State))
	}
	return s[:len(s)-1]
}

// writeUsageCSV prints the export as CSV with a header row: one row per
// account, or per account and route (by route name) with byRoute. An
// unknown figure (a quota without a monthly grant, credits the event log
// cannot tell) is an empty cell, not 0.
func writeUsageCSV(w io.Writer, exp *node.UsageExport, byRoute bool) error {
	cw := csv.NewWriter(w)
	if byRoute {
		cw.Write([]string{"period", "account", "route", "units"})
		for _, u := range exp.Usage {
			for _, r := range sortedRoutes(u.ByRoute) {
				cw.Write([]string{exp.Period, csvText(u.Account), csvText(r), strconv.FormatInt(u.ByRoute[r], 10)})
			}
		}
	} else {
		cw.Write([]string{"period", "account", "plan", "limit", "units", "quota", "quota_used", "overage", "credits_used"})
		for _, u := range exp.Usage {
			cw.Write([]string{exp.Period, csvText(u.Account), csvText(u.Plan), hardText(u.Hard), strconv.FormatInt(u.Units, 10), optInt(u.Quota),
				strconv.FormatInt(u.QuotaUsed, 10), strconv.FormatInt(u.Overage, 10), optInt(u.CreditsUsed)})
		}
	}
	cw.Flush()
	return cw.Error()
}

// csvText keeps a text cell (an account, plan or route id) from being read
// as a formula by a spreadsheet: one that starts with =, +, -, @, a tab or
// a carriage return gets a leading ' (OWASP's advice against CSV
// injection), which spreadsheets show as text and do not evaluate. Ids
// come from the admin API, and account ids may come from customers.
func csvText(s string) string {
	if s != "" && strings.ContainsRune("=+-@\t\r", rune(s[0])) {
		return "'" + s
	}
	return s
}

func printUsage(w io.Writer, exp *node.UsageExport, byRoute bool) {
	fmt.Fprintf(w, "%s\n%s with usage or a monthly grant in %s\n\n", finality(exp), plural(int64(len(exp.Usage)), "account", "accounts"), exp.Period)
	if byRoute {
		fmt.Fprintln(w, "ACCOUNT\tROUTE\tUNITS")
		for _, u := range exp.Usage {
			for _, r := range sortedRoutes(u.ByRoute) {
				fmt.Fprintf(w, "%s\t%s\t%d\n", u.Account, r, u.ByRoute[r])
			}
		}
		return
	}
	fmt.Fprintln(w, "ACCOUNT\tPLAN\tLIMIT\tUNITS\tQUOTA\tQUOTA USED\tOVERAGE\tCREDITS USED")
	var units, overage int64
	for _, u := range exp.Usage {
		fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%s\t%d\t%d\t%s\n", u.Account, u.Plan, hardText(u.Hard), u.Units, orDash(optInt(u.Quota)),
			u.QuotaUsed, u.Overage, orDash(optInt(u.CreditsUsed)))
		units += u.Units
		overage += u.Overage
	}
	// NB: with a space, which no account id has: "total" alone was an
	// account's row as well as the sum's.
	fmt.Fprintf(w, "= total\t\t\t%d\t\t\t%d\n", units, overage)
}

func sortedRoutes(m map[string]int64) []string {
	routes := make([]string, 0, len(m))
	for r := range m {
		routes = append(routes, r)
	}
	slices.Sort(routes)
	return routes
}

func optInt(v *int64) string {
	if v == nil {
		return ""
	}
	return strconv.FormatInt(*v, 10)
}
