package node

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"
)

// The reservation audit: units the ledger reserves for this node on an
// account it has let go are spendable by nobody (the new owner is answered
// quota-unavailable, held elsewhere, for them) until this node stops or
// starts, which in production can be weeks. Every bug of that kind the
// chaos tests found (a hand-back dropped, one that overtook a refund, a
// duplicate refund's take-back) left such units behind silently, seen only
// when the node drained. The audit looks for them while the node runs and
// says so: the gauge quotaring_reservations_stranded_units (alert
// QuotaringReservationsStranded) and a log line naming the accounts.
//
// It only judges accounts where no in-flight work can explain a
// difference: the ledger reserves units of the account for this node, in
// two audits in a row, while this node neither owns it (so nothing here
// charges or reserves for it) nor holds any allowance of it nor has a
// reservation of it on its way (one asked while it owned it) nor a
// hand-back of it queued, and every record this node logged before the
// first of the two was settled before the second read the ledger (so the
// ledger's reservation it read is final). A reservation or hand-back that
// arrives between the ledger's read and the look at this node's state is
// gone by the second audit. The units this node counts in doubt (quotaring_reservations_uncertain_units:
// reserves whose answer it never got, which the ledger may hold anywhere)
// are subtracted from the sum. Units stranded on an account the node owns
// (reserved beyond its allowance) are not judged: its charges in flight,
// unsettled, differ from the ledger the same way.

// auditEvery is how often the audit reads this node's reservations in the
// ledger (Config.ReservationAudit's default): one query a minute per node.
const auditEvery = time.Minute

// auditLogEvery bounds how often a finding is logged again while it stands.
const auditLogEvery = 10 * time.Minute

// strandFinding is the reservation audit's last finding, for the status
// page: units stranded and the accounts ("account grant units").
type strandFinding struct {
	units    int64
	accounts []string
}

// grantKey is an account's grant.
type grantKey struct{ account, grant string }

// audit is the state of the reservation audit between rounds.
type audit struct {
	prev     map[grantKey]int64 // the last round's candidates (see auditLoop), nil: none to compare
	prevMark uint64             // the log's last seq before the last round's ledger read
	logged   time.Time          // when a finding was last logged
}

// auditLoop runs the reservation audit every Config.ReservationAudit until
// ctx ends.
func (n *Node) auditLoop(ctx context.Context) {
	t := time.NewTicker(n.cfg.ReservationAudit)
	defer t.Stop()
	var a audit
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		stranded, accounts := n.auditOnce(ctx, &a)
		n.metrics.reservationsStranded.Set(float64(stranded))
		n.stranded.Store(&strandFinding{units: stranded, accounts: accounts})
		n.audits.Add(1)
		if stranded > 0 && time.Since(a.logged) >= auditLogEvery {
			a.logged = time.Now()
			n.log.Warn(fmt.Sprintf("the ledger reserves %d units for this node on accounts it neither owns nor holds anything of: spendable by nobody (their owners answer quota-unavailable for them) "+
				"until this node stops or starts; quotad admin reservations --addr %s lists them. A bug: please report it with this log", stranded, n.AdminAddr()),
				"units", stranded, "accounts", accounts)
		}
	}
}

// auditOnce is one round: it returns the units judged stranded and the
// accounts they are on ("account grant units", at most 10), and keeps this
// round's candidates in a for the next.
func (n *Node) auditOnce(ctx context.Context, a *audit) (int64, []string) {
	l := n.Ledger()
	if l == nil || n.eng == nil || n.leaving.Load() {
		a.prev = nil // nothing to compare the next round with
		return 0, nil
	}
	// NB: the settled mark is read before the ledger, like the log's last
	// seq: read after it, a settle that committed while the ledger was read
	// counted as settled for rows read before it, and the units its charges
	// spent of a reservation (gone from the ledger a moment later) were
	// judged stranded (quotad chaos --seed 12 --faults
	// isolate,split,bridge,ledger-slow, RES during the slow ledger).
	mark, settledSeq := n.wal.LastSeq(), n.wal.SettledSeq()
	rctx, cancel := context.WithTimeout(ctx, min(max(n.cfg.ReservationAudit/2, 5*time.Second), 30*time.Second))
	rows, err := l.ReservationsOf(rctx, n.cfg.ID)
	cancel()
	if err != nil {
		a.prev = nil
		n.log.Debug("reservation audit: the ledger's reservations could not be read", "err", err)
		return 0, nil
	}
	// Read after the ledger: what this node holds or hands back now.
	held := map[string]bool{}
	for _, h := range n.eng.Held() {
		held[h.Account] = true
	}
	for _, acct := range n.eng.HandingBack() {
		held[acct] = true
	}
	for _, acct := range n.eng.Reserving() {
		held[acct] = true
	}
	cur := map[grantKey]int64{}
	for _, r := range rows {
		if r.Node == n.cfg.ID && r.Units > 0 && !held[r.Account] && !n.owns(r.Account) {
			cur[grantKey{r.Account, r.Grant}] += r.Units
		}
	}
	prev, settled := a.prev, a.prev != nil && settledSeq >= a.prevMark
	a.prev, a.prevMark = cur, mark
	if !settled {
		return 0, nil
	}
	var sum int64
	var found []grantKey
	for k, units := range cur {
		if both := min(units, prev[k]); both > 0 {
			sum += both
			found = append(found, k)
		}
	}
	stranded := max(0, sum-n.eng.Stats().UncertainUnits.Load())
	if stranded == 0 {
		return 0, nil
	}
	slices.SortFunc(found, func(x, y grantKey) int { return strings.Compare(x.account+" "+x.grant, y.account+" "+y.grant) })
	var names []string
	for _, k := range found[:min(len(found), 10)] {
		names = append(names, fmt.Sprintf("%s %s %d", k.account, k.grant, min(cur[k], prev[k])))
	}
	return stranded, names
}
