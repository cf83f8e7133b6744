package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/snapshot"
)

// demoTotals compares, per customer, what its client was told with what
// the ledger holds once every node has settled.
type demoTotals struct {
	rows []demoRow
	// Units, over the simulated customers.
	acked, settled, overshoot, lost, unacked int64
	ackedReqs, replays, refunded, pending    int64
	handSettled                              int64
	reconcileRows, reconcileDiffs            int
	diffs                                    []string
	alerts                                   []flush.AlertRecord // the ledger's quota alerts
}

type demoRow struct {
	id                                      string
	hard                                    bool
	limit                                   int64
	ackedReqs, acked, settled               int64
	overshoot, lost, unacked, pending       int64
	refunded, replays, rateLimited, refused int64
}

// finish stops the traffic's world in order: every node settles, every
// node stops with SIGTERM, then the ledger is read and reconciled.
func (d *demoRun) finish(ctx context.Context) error {
	d.title("Settle, stop, and hold what clients were told against the ledger")
	t0 := time.Now()
	left, err := d.waitSettled(ctx, 30*time.Second)
	if err != nil {
		return err
	}
	if len(left) > 0 {
		d.say("%s", d.st.yellow("not settled after 30s: "+strings.Join(left, ", ")+" (the SIGTERM below settles the rest)"))
	} else {
		d.say("every node's log is settled (quotaring_unsettled_records 0 on %s) %.1fs after the traffic ended", nodeIDs(d.c.Nodes), time.Since(t0).Seconds())
	}
	var settles, dups float64
	for i := range d.c.Nodes {
		s := d.mon.node(i)
		settles += s.settles.total()
		dups += s.duplicates.total()
	}
	if err := d.stopNodes(ctx); err != nil {
		return err
	}
	t, err := demoSummary(ctx, d.dsn, d.cs)
	if err != nil {
		return err
	}
	bad := d.printSummary(t, settles, dups)
	if t.overshoot != 0 {
		bad = append(bad, fmt.Sprintf("%d units acknowledged beyond a hard limit", t.overshoot))
	}
	if t.lost != 0 {
		bad = append(bad, fmt.Sprintf("%d acknowledged units missing from the ledger", t.lost))
	}
	if t.unacked != 0 {
		bad = append(bad, fmt.Sprintf("%d units billed that no client was told OK", t.unacked))
	}
	if t.reconcileDiffs != 0 {
		bad = append(bad, fmt.Sprintf("reconcile found %d differences", t.reconcileDiffs))
	}
	if len(bad) > 0 {
		return &exitError{code: 1, err: errors.New("demo: " + strings.Join(bad, "; "))}
	}
	return nil
}

// waitSettled waits until every running node's log is settled; it returns
// the nodes still behind at the deadline.
func (d *demoRun) waitSettled(ctx context.Context, limit time.Duration) ([]string, error) {
	deadline := time.Now().Add(limit)
	for {
		var left []string
		for _, n := range d.c.Nodes {
			if !n.Running() {
				continue
			}
			m := scrapeMetrics(ctx, n)
			if m == nil || m["quotaring_unsettled_records"] != 0 {
				left = append(left, n.ID)
			}
		}
		if len(left) == 0 || time.Now().After(deadline) {
			return left, nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// stopNodes sends SIGTERM to the nodes one after the other, the last
// started first: each drains, hands its reservations back, settles what is
// left and leaves the ring. NB: one at a time, because a node leaving
// waits for the others to hear its leave broadcast; stopped all at once,
// they wait for each other's timeouts.
func (d *demoRun) stopNodes(ctx context.Context) error {
	t0 := time.Now()
	var codes, failed []string
	for i := len(d.c.Nodes) - 1; i >= 0; i-- {
		n := d.c.Nodes[i]
		if !n.Running() {
			codes = append(codes, n.ID+" was not running")
			continue
		}
		tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 45*time.Second)
		code, err := n.Terminate(tctx)
		cancel()
		if errors.Is(err, context.DeadlineExceeded) {
			n.Kill()
		}
		codes = append(codes, fmt.Sprintf("%s exit %d", n.ID, code))
		if code != 0 {
			failed = append(failed, fmt.Sprintf("%s exited %d (its log %s ends:\n%s)", n.ID, code, n.LogPath, n.LogTail(10)))
		}
	}
	d.c = nil
	d.say("SIGTERM to each node: %s in %.1fs", strings.Join(codes, ", "), time.Since(t0).Seconds())
	d.say("(each drained, handed its reservations back, settled what was left and left the ring)")
	if len(failed) > 0 {
		return fmt.Errorf("demo: %s", strings.Join(failed, "; "))
	}
	return nil
}

// demoSummary reads the ledger after every node stopped.
func demoSummary(ctx context.Context, dsn string, cs []*customer) (*demoTotals, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	l, err := flush.Open(ctx, dsn, nil)
	if err != nil {
		return nil, err
	}
	defer l.Close()
	t := &demoTotals{}
	for _, c := range cs {
		events, err := l.Events(ctx, c.ID)
		if err != nil {
			return nil, err
		}
		grants, err := l.Grants(ctx, c.ID)
		if err != nil {
			return nil, err
		}
		// billed maps the client's event id to its billed units. NB: a
		// refunded id charged again is its next generation, which the
		// ledger names id + U+001F + generation (shard.LedgerEventID).
		billed := map[string]int64{}
		var settled int64
		for _, e := range events {
			if e.Refunded || e.Tombstone {
				continue
			}
			id, _, _ := strings.Cut(e.EventID, "\x1f")
			billed[id] += e.Units
			settled += e.Units
		}
		if c.hand {
			t.handSettled += settled
			continue
		}
		c.st.mu.Lock()
		r := demoRow{id: c.ID, hard: c.Plan.Hard, ackedReqs: c.st.ok, acked: c.st.ackedUnits, settled: settled,
			refunded: c.st.refunded, replays: c.st.replays, rateLimited: c.st.rateLimited, refused: c.st.quotaExceeded + c.st.unavailable}
		for id, units := range c.st.acked {
			if got, ok := billed[id]; !ok {
				r.lost += units
				t.diffs = append(t.diffs, fmt.Sprintf("%s: event %s was acknowledged (%d units) and is not billed in the ledger", c.ID, id, units))
			} else if got != units {
				r.lost += max(0, units-got)
				r.unacked += max(0, got-units)
				t.diffs = append(t.diffs, fmt.Sprintf("%s: event %s was acknowledged for %d units and billed %d", c.ID, id, units, got))
			}
		}
		for id, units := range billed {
			if _, ok := c.st.acked[id]; !ok {
				r.unacked += units
				why := "no client was told OK"
				if _, ok := c.st.pending[id]; ok {
					why = "its client gave up retrying it (still in doubt when the demo stopped)"
				}
				t.diffs = append(t.diffs, fmt.Sprintf("%s: event %s is billed %d units and %s", c.ID, id, units, why))
			}
		}
		r.pending = int64(len(c.st.pending))
		c.st.mu.Unlock()
		for _, g := range grants {
			r.limit += g.Units
			if c.Plan.Hard && g.Used > g.Units {
				r.overshoot += g.Used - g.Units
				t.diffs = append(t.diffs, fmt.Sprintf("%s: grant %s used %d of %d units", c.ID, g.Grant, g.Used, g.Units))
			}
		}
		if c.Plan.Hard && r.acked > r.limit {
			r.overshoot = max(r.overshoot, r.acked-r.limit)
		}
		t.rows = append(t.rows, r)
		t.acked += r.acked
		t.settled += r.settled
		t.overshoot += r.overshoot
		t.lost += r.lost
		t.unacked += r.unacked
		t.ackedReqs += r.ackedReqs
		t.replays += r.replays
		t.refunded += r.refunded
		t.pending += r.pending
	}
	rows, err := flush.ReconcileRows(ctx, l)
	if err != nil {
		return nil, fmt.Errorf("demo: reconcile: %w", err)
	}
	t.reconcileRows = len(rows)
	if t.alerts, err = l.Alerts(ctx, flush.AlertQuery{}); err != nil {
		return nil, err
	}
	for _, r := range rows {
		if r.Diff {
			t.reconcileDiffs++
			t.diffs = append(t.diffs, fmt.Sprintf("reconcile: %s %s %s: counter %d, event log %d", r.Account, r.Kind, r.Scope, r.Counter, r.Events))
		}
	}
	sort.Strings(t.diffs)
	return t, nil
}

func (d *demoRun) printSummary(t *demoTotals, settles, dups float64) (problems []string) {
	st := d.st
	d.say("")
	d.say("%s", st.bold(fmt.Sprintf("%-9s %-5s %9s %12s %9s %9s %9s %6s %9s %8s", "customer", "kind", "limit", "acknowledged", "settled", "overshoot", "lost", "", "refunded", "replayed")))
	for _, r := range t.rows {
		kind := "soft"
		if r.hard {
			kind = "hard"
		}
		mark := st.green("ok")
		if r.overshoot != 0 || r.lost != 0 || r.unacked != 0 {
			mark = st.red("DIFF")
		}
		d.say("%-9s %-5s %9s %12s %9s %9d %9d %s %9d %8d", r.id, kind, node.Thousands(r.limit), node.Thousands(r.acked), node.Thousands(r.settled),
			r.overshoot, r.lost, padLeft(mark, 6), r.refunded, r.replays)
	}
	d.say("%s", st.dim(fmt.Sprintf("acknowledged: units of requests answered 2xx, once per Idempotency-Key (%s requests)", node.Thousands(t.ackedReqs))))
	d.say("%s", st.dim("settled: the ledger's event log, unrefunded, once every node settled"))
	d.say("%s", st.dim("refunded: requests the API failed, their charges returned; replayed: resends billed once"))
	for i, s := range t.diffs {
		if i == 20 {
			d.say("... and %d more", len(t.diffs)-20)
			break
		}
		d.say("%s", st.red(s))
	}
	if t.pending > 0 {
		d.say("%s", st.yellow(fmt.Sprintf("%d requests were still in doubt when the clients stopped retrying", t.pending)))
	}
	// NB: the rate limit's and the alerts' failures fail the demo too: they
	// were only shown in red, and the demo said OK and exited 0.
	if p := d.rateLimitLine(); p != "" {
		problems = append(problems, p)
	}
	problems = append(problems, d.alertLines(t.alerts)...)
	if t.handSettled > 0 {
		d.say("your requests by hand: %d units settled to the account \"you\" (not counted below)", t.handSettled)
	}
	d.say("")
	d.say("the ledger took %.0f settle transactions for %s charges: at most one per node per second,", settles, node.Thousands(t.ackedReqs+t.refunded))
	d.say("not one per charge as counting in a database does")
	if dups > 0 {
		d.say("%s caught at settle and billed once", plural(int64(dups), "retry that reached a new owner after the kill was", "retries that reached a new owner after the kill were"))
	}
	recon := "clean"
	if t.reconcileDiffs > 0 {
		recon = fmt.Sprintf("%d differences", t.reconcileDiffs)
	}
	fmt.Fprintln(d.out)
	// The lines below are the summary's stable, parseable form.
	fmt.Fprintf(d.out, "acknowledged: %d\n", t.acked)
	fmt.Fprintf(d.out, "settled: %d\n", t.settled)
	fmt.Fprintf(d.out, "overshoot: %d\n", t.overshoot)
	fmt.Fprintf(d.out, "lost: %d\n", t.lost)
	fmt.Fprintf(d.out, "unacknowledged: %d\n", t.unacked)
	fmt.Fprintf(d.out, "reconcile: %s (%d rows: every grant's used units and every month's usage against the event log)\n", recon, t.reconcileRows)
	fmt.Fprintln(d.out)
	if t.overshoot == 0 && t.lost == 0 && t.unacked == 0 && t.reconcileDiffs == 0 && len(problems) == 0 {
		end := "."
		if d.killed && d.restarted {
			end = ","
		}
		fmt.Fprintln(d.out, st.green(st.bold("OK"))+": every acknowledged charge is in the ledger exactly once, nothing else is, and no hard limit was passed"+end)
		if d.killed && d.restarted {
			fmt.Fprintln(d.out, "    through a kill -9, a restart and ownership moving twice.")
		}
	} else {
		fmt.Fprintln(d.out, st.red(st.bold("FAILED"))+": see the differences above.")
	}
	return problems
}

// alertLines holds the quota alerts the ledger records against the ones
// the sample API's webhook took, and returns what differs (an alert still
// pending is not: its lease runs on after the demo).
func (d *demoRun) alertLines(recorded []flush.AlertRecord) (problems []string) {
	type key struct {
		account, period string
		threshold       int
	}
	received := map[key]int{}
	for _, a := range d.api.receivedAlerts() {
		received[key{a.Account, a.Period, a.Threshold}]++
	}
	var names []string
	var delivered, pending, givenUp, twice, missing int
	for _, r := range recorded {
		names = append(names, fmt.Sprintf("%s %d%%", r.Account, r.Threshold))
		n := received[key{r.Account, r.Period.String(), r.Threshold}]
		switch {
		case r.State == flush.AlertDelivered && n == 0:
			missing++
		case r.State == flush.AlertDelivered:
			delivered++
		case r.State == flush.AlertPending:
			pending++
		case r.State == flush.AlertGivenUp:
			givenUp++
		}
		if n > 1 {
			twice++
		}
	}
	if len(recorded) == 0 {
		d.say("quota alerts: none (no account reached 80 %% of its month's quota)")
		return nil
	}
	d.say("quota alerts (signed webhooks at 80 %% and 100 %% of the month's quota): %s", strings.Join(names, ", "))
	line := fmt.Sprintf("   %d in the ledger, %d delivered to the sample API's webhook, signatures checked", len(recorded), delivered)
	if bad := d.api.badAlerts.Load(); bad > 0 {
		line += d.st.red(fmt.Sprintf("; %d refused for a bad signature", bad))
		problems = append(problems, fmt.Sprintf("%d alerts refused by the webhook for a bad signature", bad))
	}
	if missing > 0 {
		line += d.st.red(fmt.Sprintf("; %d marked delivered that the webhook never took", missing))
		problems = append(problems, fmt.Sprintf("%d alerts marked delivered that the webhook never took", missing))
	}
	if givenUp > 0 {
		line += d.st.red(fmt.Sprintf("; %d given up (see the node logs, component=alerts)", givenUp))
		problems = append(problems, fmt.Sprintf("%d alerts given up", givenUp))
	}
	if pending > 0 {
		line += d.st.yellow(fmt.Sprintf("; %d still pending (a node takes it over once its 10-minute lease runs out)", pending))
	}
	if twice > 0 {
		line += fmt.Sprintf("; %d received twice (delivery is at least once)", twice)
	}
	d.say("%s", line)
	return problems
}

// plural formats "1 retry was" or "3 retries were".
func plural(n int64, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}

// rateLimitLine holds the rate-limited customer to G7: through the whole
// cluster, at most burst + rate*t requests in t, plus one burst per move of
// its account (a new owner starts with a full bucket). It returns the
// problem when the customer got more through, "" otherwise.
func (d *demoRun) rateLimitLine() string {
	for _, c := range d.cs {
		if c.ID != "spam-co" {
			continue
		}
		r, err := snapshot.ParseRate(c.Plan.Rate)
		if err != nil || r.Unlimited() {
			return ""
		}
		moves := int64(0)
		if d.killed && slices.Contains(d.victimOwned, c.ID) {
			moves = 2 // to a survivor and back
		}
		secs := d.trafficTook.Seconds()
		bound := c.Plan.Burst*(1+moves) + int64(float64(r.Tokens)*secs/r.Per.Seconds())
		got := c.counts().ok
		line := fmt.Sprintf("rate limit (G7): %s got %d requests through in %.1fs, at most %d allowed (burst %d + %s x %.1fs",
			c.ID, got, secs, bound, c.Plan.Burst, c.Plan.Rate, secs)
		if moves > 0 {
			line += ", + a burst per ownership move"
		}
		line += ")"
		if got > bound {
			d.say("%s", d.st.red(line+": over"))
			return fmt.Sprintf("the rate limit let %s through %d requests, more than %d", c.ID, got, bound)
		}
		d.say("%s", line)
	}
	return ""
}
