package flush

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/quotaring/quotaring/shard"
)

// Event-log retention (quotad prune).
//
// The event log grows by a row per charge, for ever; the grants, the daily
// aggregates and the alerts are what billing reads, and they stay.
// PruneEvents drops the event log of whole months (on Postgres, their
// partitions), oldest first, each month in a transaction of its own that
// also adds what its unrefunded events had allocated to each grant to
// pruned_allocations, per month (so reconcile still proves every grant's
// used units, and BillingUsage still splits a pruned month's use between
// quota and credits), and moves event_retention.pruned_before past it.
//
// A month may go once nothing can change its events any more:
//
//   - no refund: a node refunds a receipt in its charge's month and the
//     next only (shard.Refundable), so the month after the last one pruned
//     (Before) must be over;
//   - nothing unsettled: every pruned month and Before are final
//     (SettledMonth: every node heard from during the month has settled
//     everything it held since it ended, or stopped cleanly: NodeStopped), so no charge or
//     refund of theirs waits in a node's log. A node gone for good otherwise
//     (crashed, its disk lost) is named in PruneOptions.Lost, or it holds
//     the months it was heard from back.
//
//   - no node running an older build: a quotad from before these rules
//     (before schema 8) refunds a receipt of any age. A node heard from in
//     the last oldBuildWindow whose latest registration did not record a
//     build that knows schema 8 (RecordBuild; NodeRow.SchemaKnown) may be
//     such a node, still running since before the ledger was migrated (a
//     restarted old build refuses the newer schema, ErrSchemaTooNew), so
//     the prune waits for the rolling upgrade.
//
// Retries never reach back that far: the nodes deduplicate client ids for
// 24 h, and a charge near a month's edge looks into the neighbouring month,
// which is never pruned while the month after it is not over.

// PruneOptions say what PruneEvents drops.
type PruneOptions struct {
	// Before: the event log of every month before it goes. It must be over
	// and final (see above): at most last month.
	Before shard.Period
	// KeepMonths, instead of Before, keeps this many whole months before
	// the current one by the ledger's clock (at least 1: last month's
	// charges may still be refunded): Before is the current month minus
	// KeepMonths. A job that runs every month needs no date arithmetic.
	KeepMonths int
	// DryRun counts the events of each month and changes nothing (the
	// checks run as for a real prune).
	DryRun bool
	// Lost names nodes gone for good (their disks lost; quotad revoke freed
	// their reservations): their last heartbeat does not hold months back.
	Lost []string
	// Progress, when set, hears of each month as it is done (or counted).
	Progress func(PrunedMonth)
}

// PrunedMonth is one month whose event log was dropped (or would be, with
// DryRun).
type PrunedMonth struct {
	Period shard.Period
	Events int64 // rows, tombstones and refunded ones included
}

// PruneResult says what PruneEvents did.
type PruneResult struct {
	// Months holds the months with events that were (or would be) dropped,
	// oldest first.
	Months []PrunedMonth
	// PrunedBefore is the ledger's mark afterwards: no event log before it.
	PrunedBefore shard.Period
}

// finalAfter is how long after a month's end a node must have settled all
// it held (SettledThrough) for its charges of the month to count as
// settled. A healthy node does so within a settle interval or a heartbeat
// (HeartbeatEvery), so a minute covers a record made just before midnight
// and durable just after, and clocks (the nodes', the ledger's) that differ
// by seconds.
const finalAfter = time.Minute

// settledThroughSchema is the first ledger schema whose quotad writes
// settled_through (NodeRow.SettledThrough).
const settledThroughSchema = 12

// settledThrough is the time up to which x's log is known to have held
// nothing unsettled: SettledThrough, or for an incarnation of a build from
// before settledThroughSchema its heartbeat (as before: a heartbeat goes on
// while settles fail, which is why SettledThrough was added).
func (x NodeRow) settledThrough() time.Time {
	if x.SchemaKnown < settledThroughSchema {
		return x.Heartbeat
	}
	return x.SettledThrough
}

// retentionSchema is the first ledger schema whose quotad refunds a receipt
// in its charge's month and the next only (shard.Refundable).
const retentionSchema = 8

// oldBuildWindow is how recently a node that may run a build from before
// retentionSchema must have been heard from to hold a prune back (see the
// retention notes): a running node is heard from every HeartbeatEvery; an
// hour covers one cut off from the ledger for a while.
const oldBuildWindow = time.Hour

// SettledMonth says how final p's settled usage is at now (the ledger's
// clock), from the ledger's nodes (each node id by its latest incarnation,
// the one that heartbeat last). Until p is over it is not final and names
// no node. After, the nodes heard from during p (a heartbeat at or after
// its start) that have not settled everything they held since finalAfter
// past its end (NodeRow.SettledThrough; the heartbeat for an older build's
// incarnation) may hold unsettled charges of p: p is final when there are
// none. A node last heard from
// before p began holds no charge of p, nor does one that stopped cleanly
// (NodeStopped) after it was last heard from, nor one that first
// registered finalAfter past its end (a node that never settled, such as
// one whose start was refused, held every month it had been heard from
// back for good, those before it existed too).
func SettledMonth(rows []NodeRow, p shard.Period, now time.Time) (final bool, unsettled []NodeRow) {
	end := time.Unix(0, p.End())
	if now.Before(end) {
		return false, nil
	}
	latest := LatestIncarnations(rows)
	start, settledBy := time.Unix(0, p.Start()), end.Add(finalAfter)
	for _, x := range latest {
		if !x.Heartbeat.Before(start) && x.settledThrough().Before(settledBy) && x.Stopped.IsZero() && !x.Created.After(settledBy) {
			unsettled = append(unsettled, x)
		}
	}
	slices.SortFunc(unsettled, func(a, b NodeRow) int { return strings.Compare(a.Node, b.Node) })
	return len(unsettled) == 0, unsettled
}

// LostNodeQuiet is how long a node must have been silent (no heartbeat in
// the ledger, written every HeartbeatEvery) before it may be named gone:
// quotad revoke frees its reservations and PruneOptions.Lost stops it
// holding months back only then (revoke has --force).
const LostNodeQuiet = 2 * time.Minute

// checkLost refuses a node named lost (--lost-node) that the ledger does
// not know or heard from within LostNodeQuiet of now: it may be running.
// risk says what naming it lost would risk, then what to do after.
func checkLost(lost []string, nodes []NodeRow, now time.Time, risk, then string) error {
	running := LatestRunning(nodes)
	for _, x := range lost {
		if !slices.ContainsFunc(nodes, func(n NodeRow) bool { return n.Node == x }) {
			return fmt.Errorf("%w: --lost-node %q: the ledger knows no such node", ErrInvalid, x)
		}
		if last := running[x].Heartbeat; now.Sub(last) < LostNodeQuiet {
			return fmt.Errorf("%w: --lost-node %s: it was heard from %s ago (its last heartbeat, at %s): it may be running, and %s. "+
				"Stop it (or run quotad revoke --node %s once it is gone), wait until it has been silent for %s, then %s",
				ErrInvalid, x, now.Sub(last).Round(time.Second), last.UTC().Format(time.RFC3339), risk, x, LostNodeQuiet, then)
		}
	}
	return nil
}

// checkRevoked refuses a node named lost that the ledger still reserves
// units for: it was not revoked, so it may come back.
func checkRevoked(ctx context.Context, l Ledger, lost []string, risk string) error {
	for _, x := range lost {
		rs, err := l.ReservationsOf(ctx, x)
		if err != nil {
			return err
		}
		var units int64
		for _, r := range rs {
			units += r.Units
		}
		if units > 0 {
			return fmt.Errorf("%w: --lost-node %s: the ledger still reserves %d units for it, so it was not revoked: a node gone for good is revoked first "+
				"(quotad revoke --node %s frees them; its unsettled charges are the documented loss); one that may come back settles its months then, and %s",
				ErrInvalid, x, units, x, risk)
		}
	}
	return nil
}

// CheckLostNodes refuses, for a month's billing (quotad admin usage
// --lost-node), nodes named lost that the ledger does not know, heard from
// lately, or still reserves units for (not revoked); now is the clock the
// heartbeats are compared with.
func CheckLostNodes(ctx context.Context, l Ledger, nodes []NodeRow, lost []string, now time.Time) error {
	const risk = "what its log holds of the month would be billed after the month was called final"
	if err := checkLost(lost, nodes, now, risk, "export"); err != nil {
		return err
	}
	return checkRevoked(ctx, l, lost, risk)
}

// checkPrunable refuses a prune that could lose a change to the events it
// drops (see the package's retention notes): months holds the months with
// events before o.Before.
func checkPrunable(o PruneOptions, months []shard.Period, nodes []NodeRow, now time.Time) error {
	cur := shard.PeriodOf(now.UnixNano())
	if o.Before < MinBillingPeriod || o.Before > MaxBillingPeriod {
		return fmt.Errorf("%w: prune before %v: want a month from %v to %v", ErrInvalid, o.Before, MinBillingPeriod, MaxBillingPeriod)
	}
	if o.Before >= cur {
		return fmt.Errorf("%w: prune before %v: a month's events stay while its charges may still be refunded, in the month and the next; "+
			"it is %v by the ledger's clock, so the latest you can give is %v (which drops the events of %v and before)",
			ErrInvalid, o.Before, cur, cur-1, cur-2)
	}
	if err := checkLost(o.Lost, nodes, now, "what its log holds of the months this drops would settle unchecked", "prune"); err != nil {
		return err
	}
	live := slices.DeleteFunc(slices.Clone(nodes), func(n NodeRow) bool { return slices.Contains(o.Lost, n.Node) })
	if old := olderBuilds(live, now); len(old) > 0 {
		var names []string
		for _, n := range old {
			build := n.Build
			if build == "" {
				build = "a build from before builds were recorded"
			}
			names = append(names, fmt.Sprintf("%s (incarnation %s, %s, last heard from %s)", n.Node, n.Incarnation, build, n.Heartbeat.UTC().Format(time.RFC3339)))
		}
		return fmt.Errorf("%w: prune before %v: %s may run a quotad older than the event log's retention rules, which refunds charges "+
			"of any age: a refund of a dropped month's charge would go unbilled. Upgrade every node first (a rolling restart with "+
			"this build; quotad admin nodes shows each one's build), then prune; a node stopped for good holds the prune back for "+
			"%v after it was last heard from, or name it with --lost-node",
			ErrInvalid, o.Before, strings.Join(names, ", "), oldBuildWindow)
	}
	// Every month from the first one dropped to Before, not only those
	// with events: a dropped month's charges may be refunded in the next
	// month, whose only records may be such refunds (they land on the
	// dropped month's rows and leave none of their own).
	check := []shard.Period{o.Before}
	if len(months) > 0 {
		check = check[:0]
		for p := slices.Min(months); p <= o.Before; p++ {
			check = append(check, p)
		}
	}
	for _, p := range check {
		if final, unsettled := SettledMonth(live, p, now); !final {
			var names []string
			for _, n := range unsettled {
				names = append(names, fmt.Sprintf("%s (last heard from %s, settled everything it held through %s)", n.Node,
					n.Heartbeat.UTC().Format(time.RFC3339), timeOrNever(n.settledThrough())))
			}
			return fmt.Errorf("%w: prune before %v: %v is not final: %s has not settled everything it held since the month ended, "+
				"and may hold charges or refunds of it: a running node does within seconds unless its settles fail (its log and "+
				"quotaring_settle_errors_total say why); start a stopped one and let it settle; for a node gone for good whose "+
				"reservations quotad revoke freed, name it with --lost-node", ErrInvalid, o.Before, p, strings.Join(names, ", "))
		}
	}
	return nil
}

// LatestIncarnations is each node id's latest incarnation in rows: the one
// that heartbeat last.
func LatestIncarnations(rows []NodeRow) map[string]NodeRow {
	latest := map[string]NodeRow{}
	for _, x := range rows {
		if l, ok := latest[x.Node]; !ok || x.Heartbeat.After(l.Heartbeat) {
			latest[x.Node] = x
		}
	}
	return latest
}

// LatestRunning is LatestIncarnations of the incarnations that may still
// run (NodeRow.Running): for each node id, the one heard from last that has
// not stopped cleanly since. A node id whose every incarnation stopped
// cleanly is not in it. The node-id check at start, a node's wait for the
// peers it is alone without, and quotad revoke's refusal all read it.
func LatestRunning(rows []NodeRow) map[string]NodeRow {
	return LatestIncarnations(slices.DeleteFunc(slices.Clone(rows), func(r NodeRow) bool { return !r.Running() }))
}

// olderBuilds returns, of each node id's latest incarnation in rows, those
// heard from within oldBuildWindow of now, not stopped cleanly since, whose
// recorded build does not know retentionSchema (see the retention notes).
func olderBuilds(rows []NodeRow, now time.Time) []NodeRow {
	var old []NodeRow
	for _, x := range LatestIncarnations(rows) {
		if x.SchemaKnown < retentionSchema && x.Stopped.IsZero() && x.Heartbeat.After(now.Add(-oldBuildWindow)) {
			old = append(old, x)
		}
	}
	slices.SortFunc(old, func(a, b NodeRow) int { return strings.Compare(a.Node, b.Node) })
	return old
}

// monthPruner is what pruneEvents needs of a dialect besides what Ledger
// has: the months its event log holds before a month, and per month a
// count, and the drop itself (count, allocations into pruned_allocations,
// delete, mark past it, in one transaction), and the mark alone. Their
// errors are the database's; pruneEvents names the step.
type monthPruner interface {
	Ledger
	eventMonths(ctx context.Context, before shard.Period) ([]shard.Period, error)
	countMonth(ctx context.Context, per shard.Period) (int64, error)
	dropMonth(ctx context.Context, per shard.Period) (int64, error)
	markPrunedBefore(ctx context.Context, before shard.Period) error
	fail(op string, err error) error
}

// pruneEvents is PruneEvents for both ledgers (see the notes above).
func pruneEvents(ctx context.Context, l monthPruner, o PruneOptions) (PruneResult, error) {
	var res PruneResult
	now, err := l.Clock(ctx)
	if err != nil {
		return res, err
	}
	if o.Before, err = pruneBefore(o, now); err != nil {
		return res, err
	}
	months, err := l.eventMonths(ctx, o.Before)
	if err != nil {
		return res, l.fail("prune events: list the months", err)
	}
	months = periodsBefore(months, o.Before)
	nodes, err := l.Nodes(ctx)
	if err != nil {
		return res, err
	}
	if err := checkPrunable(o, months, nodes, now); err != nil {
		return res, err
	}
	if err := checkRevoked(ctx, l, o.Lost, "what its log holds of the months this drops would settle unchecked"); err != nil {
		return res, err
	}
	for _, per := range months {
		m := PrunedMonth{Period: per}
		if o.DryRun {
			m.Events, err = l.countMonth(ctx, per)
		} else {
			m.Events, err = l.dropMonth(ctx, per)
		}
		if err != nil {
			return res, l.fail(fmt.Sprintf("prune the events of %v", per), err)
		}
		res.Months = append(res.Months, m)
		if o.Progress != nil {
			o.Progress(m)
		}
	}
	// NB: not when nothing was dropped: each month's drop moved the mark
	// past it already (a prune cut short leaves it right), and moved over
	// months without events it said that the event log had been pruned.
	if !o.DryRun && len(months) > 0 {
		if err := l.markPrunedBefore(ctx, o.Before); err != nil {
			return res, l.fail("prune events: record the mark", err)
		}
	}
	res.PrunedBefore, err = l.EventsPrunedBefore(ctx)
	return res, err
}

// pruneBefore is the month o drops the event log before: o.Before, or the
// month KeepMonths before now's (no earlier than MinBillingPeriod, before
// which no event can be).
func pruneBefore(o PruneOptions, now time.Time) (shard.Period, error) {
	switch {
	case o.KeepMonths != 0 && o.Before != 0:
		return 0, fmt.Errorf("%w: prune: give the month to prune before or the months to keep, not both", ErrInvalid)
	case o.KeepMonths < 0 || o.Before == 0 && o.KeepMonths == 0:
		return 0, fmt.Errorf("%w: prune: keep at least 1 whole month before the current one: a charge may be refunded in its month and the next", ErrInvalid)
	case o.Before != 0:
		return o.Before, nil
	}
	cur := shard.PeriodOf(now.UnixNano())
	if int64(cur)-int64(MinBillingPeriod) < int64(o.KeepMonths) {
		return MinBillingPeriod, nil
	}
	return cur - shard.Period(o.KeepMonths), nil
}

// periodsBefore keeps the periods before p, sorted.
func periodsBefore(ps []shard.Period, p shard.Period) []shard.Period {
	ps = slices.DeleteFunc(ps, func(x shard.Period) bool { return x >= p })
	slices.Sort(ps)
	return slices.Compact(ps)
}

// waitingTakeBacks counts the replay take-backs waiting in the ledger for
// their replays (tests: a pruned month leaves none).
func (p *Postgres) waitingTakeBacks(ctx context.Context) (n int64, err error) {
	err = p.pool.QueryRow(ctx, `SELECT coalesce(sum(count), 0) FROM replay_takebacks WHERE count > 0`).Scan(&n)
	return n, err
}

// waitingTakeBacks: as Postgres's.
func (s *SQLite) waitingTakeBacks(ctx context.Context) (n int64, err error) {
	err = s.db.QueryRowContext(ctx, `SELECT coalesce(sum(count), 0) FROM replay_takebacks WHERE count > 0`).Scan(&n)
	return n, err
}

// takeBackNames counts the names of replays taken back the ledger keeps
// (tests: a pruned month leaves none).
func (p *Postgres) takeBackNames(ctx context.Context) (n int64, err error) {
	err = p.pool.QueryRow(ctx, `SELECT count(*) FROM takeback_names`).Scan(&n)
	return n, err
}

// takeBackNames: as Postgres's.
func (s *SQLite) takeBackNames(ctx context.Context) (n int64, err error) {
	err = s.db.QueryRowContext(ctx, `SELECT count(*) FROM takeback_names`).Scan(&n)
	return n, err
}

// timeOrNever formats t, or "never" for the zero time.
func timeOrNever(t time.Time) string {
	if t.IsZero() {
		return "never"
	}
	return t.UTC().Format(time.RFC3339)
}
