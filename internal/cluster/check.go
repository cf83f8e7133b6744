package cluster

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/shard"
)

// The checkers below read a History of what clients saw and the ledger as it
// stands after the cluster healed and settled, and say, per guarantee of
// DESIGN.md, whether it held. They are pure functions of CheckInput, so a
// test can feed them a made-up history and ledger and see each one fail.
//
// They are sound rather than complete where a client cannot know what
// happened: an operation with an unknown outcome (a timeout, a transport
// error) may or may not have taken effect, and every checker takes the
// reading that is least likely to report a violation that did not happen.

// Limits is what the checkers need to know of an account's plan.
type Limits struct {
	Hard  bool    // quota is a hard limit (G1 applies)
	Quota int64   // units per monthly period
	Rate  float64 // requests per second; 0: no rate limit (G7 skipped)
	Burst int64
}

// LostCharge is a record that a destroyed data dir held unsettled: the
// documented loss of a lost disk (DESIGN.md: at most its unsettled log).
// Mostly charges (in the customer's favour); a lost refund (Refund set) is
// one the customer was told about and is billed for anyway.
type LostCharge struct {
	Node, Incarnation string
	Seq               uint64
	Account, EventID  string
	Units             int64
	Reset             int64 // end of the charge's period, Unix seconds
	Refund            bool
}

// Window is an interval of history time (ns since the history began).
type Window struct {
	Kind  string `json:"kind"`
	Node  string `json:"node,omitempty"`
	Start int64  `json:"start"`
	End   int64  `json:"end"`
}

// LogState is a node's data dir as found after the final drain.
type LogState struct {
	Node, Incarnation string
	Settled, Durable  uint64
}

// LedgerState is what the checkers read from the ledger.
type LedgerState struct {
	Events       map[string][]flush.EventRow // by account
	Grants       map[string][]flush.GrantRow // by account
	Reconcile    []flush.ReconcileRow
	Nodes        []flush.NodeRow
	Reservations []flush.Reservation
}

// CheckInput is everything the checkers read.
type CheckInput struct {
	Ops      []Op
	Accounts map[string]Limits
	Ledger   *LedgerState
	// Logs are the nodes' data dirs after the final drain; nil skips that
	// part of the sequence check.
	Logs []LogState
	// Lost are the unsettled charges of destroyed data dirs.
	Lost []LostCharge
	// LedgerDown are the windows the ledger was stopped (G8).
	LedgerDown []Window
	// Faults are the windows of every fault, LedgerDown's included (AVAIL).
	Faults []Window
	// Starts are the times a node process started after the cluster first
	// converged (restarts, new nodes): each may start a full token bucket
	// for the accounts it then owns (G7).
	Starts []int64
	// Holds are each running node's reservations before the final drain
	// (RES); nil when they were not read.
	Holds []NodeHold
	// Strands are what the nodes' reservation audits found during the run
	// (RES): units stranded while a node ran, which a later restart of it
	// may have freed before Holds were read.
	Strands []Strand
}

// Strand is one finding of a node's reservation audit (quotad serve
// --reservation-audit), from its log: units the ledger kept reserved for
// the node, in two audits in a row, on accounts it had let go.
type Strand struct {
	Node string `json:"node"`
	// At is the log line's time (RFC 3339).
	At    string `json:"at"`
	Units int64  `json:"units"`
	// Accounts are "account grant units", at most 10.
	Accounts []string `json:"accounts"`
}

// NodeHold is what one node holds reserved and what the ledger reserves
// for it, read once every log is settled and before the final drain, when
// the two must agree: a drain frees everything a node holds in the ledger,
// so after it a node's stranded units no longer show.
type NodeHold struct {
	Node string `json:"node"`
	// Held is the node's quotaring_reservations_held_units: the units its
	// allowances hold.
	Held int64 `json:"held"`
	// Uncertain is its quotaring_reservations_uncertain_units: the most the
	// ledger may hold for it beyond Held (reserves whose commit was cut
	// off, refused hand-backs, refunds taken back whose credit is not
	// known).
	Uncertain int64 `json:"uncertain"`
	// Ledger is the sum of the ledger's reservation rows of the node.
	Ledger int64 `json:"ledger"`
}

// Agrees reports whether the ledger reserves for the node what it holds,
// give or take the units in doubt.
func (h NodeHold) Agrees() bool { return h.Ledger >= h.Held && h.Ledger <= h.Held+h.Uncertain }

// Verdicts.
const (
	Held         = "held"
	Violated     = "violated"
	NotExercised = "not exercised"
)

// Result is one checker's verdict.
type Result struct {
	ID      string `json:"id"`
	Name    string `json:"name"`
	Verdict string `json:"verdict"`
	// Summary says what was checked, with the numbers that matter.
	Summary string `json:"summary"`
	// Count is the number of violations; Violations holds the first ones.
	Count      int         `json:"count"`
	Violations []Violation `json:"violations,omitempty"`
}

// Violation is one offence, with the operations that show it.
type Violation struct {
	Account string `json:"account,omitempty"`
	Event   string `json:"event,omitempty"`
	Detail  string `json:"detail"`
	Ops     []int  `json:"ops,omitempty"`
}

// maxViolations bounds the violations a Result keeps.
const maxViolations = 10

type collector struct{ r Result }

func (c *collector) add(v Violation) {
	c.r.Count++
	if len(c.r.Violations) < maxViolations {
		c.r.Violations = append(c.r.Violations, v)
	}
}

func (c *collector) done(summary string) Result {
	c.r.Summary = summary
	c.r.Verdict = Held
	if c.r.Count > 0 {
		c.r.Verdict = Violated
	}
	return c.r
}

// Checker is one of the checks.
type Checker struct {
	ID, Name string
	Check    func(*CheckInput) Result
}

// Checkers lists every check in report order.
var Checkers = []Checker{
	{"G1", "no overshoot of a hard limit", CheckG1},
	{"G2", "every acknowledged charge in the ledger exactly once", CheckG2},
	{"G3", "no event billed twice; a refused charge leaves no trace", CheckG3},
	{"G4", "a refund returns units once", CheckG4},
	{"G6", "counters equal the event log (reconcile)", CheckG6},
	{"G7", "rate limits within burst + rate*t (+ one burst per move)", CheckG7},
	{"G8", "charges acknowledged while the ledger was down", CheckG8},
	{"G9", "no period goes backwards", CheckG9},
	{"AVAIL", "every account is decided again within 15 s of the faults that held it", CheckAvail},
	{"SEQ", "settled sequences contiguous per incarnation", CheckSeq},
	{"RES", "reservations agree with the nodes before the final drain; none left after it", CheckReservations},
}

// Check runs the checkers named by ids (all when none) in report order.
func Check(in *CheckInput, ids ...string) []Result {
	var out []Result
	for _, c := range Checkers {
		if len(ids) > 0 && !slices.Contains(ids, c.ID) {
			continue
		}
		r := c.Check(in)
		r.ID, r.Name = c.ID, c.Name
		out = append(out, r)
	}
	return out
}

// Failed lists the results that were violated.
func Failed(rs []Result) []Result {
	var out []Result
	for _, r := range rs {
		if r.Verdict == Violated {
			out = append(out, r)
		}
	}
	return out
}

// SplitLoss splits in.Lost by the ledger's settled marks: the records past
// their incarnation's mark (really lost with the disk) and those the mark
// covers. A node killed between a settle's commit in the ledger and writing
// its own settled mark leaves settled records behind as unsettled in its
// log; a restart with the same data dir catches its mark up from the ledger,
// but a destroyed disk cannot, and whoever measured the loss from the dir
// alone counted them. They were not lost: the checkers count only the
// first, and CheckSeq verifies the ledger holds each of the second.
func (in *CheckInput) SplitLoss() (lost, settled []LostCharge) {
	if in.Ledger == nil {
		return in.Lost, nil
	}
	marks := settledMarks(in.Ledger)
	for _, l := range in.Lost {
		if mark, ok := marks[inc{l.Node, l.Incarnation}]; ok && l.Seq <= mark {
			settled = append(settled, l)
		} else {
			lost = append(lost, l)
		}
	}
	return lost, settled
}

// inc names one incarnation of a node.
type inc struct{ node, inc string }

// settledMarks is the ledger's settled mark of each incarnation.
func settledMarks(l *LedgerState) map[inc]uint64 {
	marks := map[inc]uint64{}
	for _, n := range l.Nodes {
		marks[inc{n.Node, n.Incarnation}] = n.Settled
	}
	return marks
}

// eventKey names an event: ids are scoped by account.
type eventKey struct{ account, event string }

// index groups a history by event.
type index struct {
	ops []Op
	// charges and refunds by event, op indexes in history order.
	charges, refunds map[eventKey][]int
	// acked: the acknowledged charge of each acknowledged event with the
	// earliest End.
	acked map[eventKey]int
	// unknownGenerated counts charges per account whose outcome and event id
	// are unknown.
	unknownGenerated map[string]int
	// lost and lostRefunds: the charges and refunds of destroyed disks.
	lost, lostRefunds map[eventKey]LostCharge
}

func newIndex(in *CheckInput) *index {
	x := &index{ops: in.Ops, charges: map[eventKey][]int{}, refunds: map[eventKey][]int{}, acked: map[eventKey]int{},
		unknownGenerated: map[string]int{}, lost: map[eventKey]LostCharge{}, lostRefunds: map[eventKey]LostCharge{}}
	for i := range in.Ops {
		o := &in.Ops[i]
		if o.Kind == OpRefund {
			k := eventKey{o.Account, o.EventID}
			x.refunds[k] = append(x.refunds[k], i)
			continue
		}
		if o.EventID == "" {
			if o.Status == StatusUnknown {
				x.unknownGenerated[o.Account]++
			}
			continue
		}
		k := eventKey{o.Account, o.EventID}
		x.charges[k] = append(x.charges[k], i)
		if o.Acked() {
			if j, ok := x.acked[k]; !ok || o.End < in.Ops[j].End {
				x.acked[k] = i
			}
		}
	}
	lost, _ := in.SplitLoss()
	for _, l := range lost {
		if l.Refund {
			x.lostRefunds[eventKey{l.Account, l.EventID}] = l
		} else {
			x.lost[eventKey{l.Account, l.EventID}] = l
		}
	}
	return x
}

func (x *index) opIDs(idx []int) []int {
	out := make([]int, 0, len(idx))
	for _, i := range idx {
		out = append(out, x.ops[i].ID)
	}
	return out
}

// ledgerRows groups the ledger's rows by the event id clients used: every
// generation of an id (a refunded id charged again, see
// shard.LedgerEventID) under the id itself.
func ledgerRows(l *LedgerState) map[eventKey][]flush.EventRow {
	rows := map[eventKey][]flush.EventRow{}
	for acct, evs := range l.Events {
		for _, e := range evs {
			k := eventKey{acct, BaseEventID(e.EventID)}
			rows[k] = append(rows[k], e)
		}
	}
	return rows
}

// BaseEventID is the event id a client used for a ledger event id: a
// refunded id charged again is kept as id + U+001F + its generation
// (shard.LedgerEventID), each generation billed once.
func BaseEventID(ledgerID string) string {
	if i := strings.IndexByte(ledgerID, 0x1f); i >= 0 {
		return ledgerID[:i]
	}
	return ledgerID
}

func sortedKeys[K cmp.Ordered, V any](m map[K]V) []K {
	ks := make([]K, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

func sortedEventKeys[V any](m map[eventKey]V) []eventKey {
	ks := make([]eventKey, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	slices.SortFunc(ks, func(a, b eventKey) int {
		return cmp.Or(cmp.Compare(a.account, b.account), cmp.Compare(a.event, b.event))
	})
	return ks
}

// periodName names the period that ends at reset (Unix seconds).
func periodName(reset int64) string {
	if reset == 0 {
		return "unknown period"
	}
	return shard.PeriodOf((reset - 1) * int64(time.Second)).String()
}

// CheckG1: for every hard account and period, the units acknowledged minus
// the units refunds may have returned never exceed the quota (plus what a
// destroyed disk lost for that account: its frozen reservation was freed, so
// those units could be spent again, in the customer's favour). The sweep is
// over time: a charge counts from the moment it was acknowledged, a refund
// from the moment it was asked for (ok or unknown), which is the reading
// least likely to accuse. The ledger side: no hard grant's used plus
// reserved units exceed its units (plus the loss).
func CheckG1(in *CheckInput) Result {
	var c collector
	x := newIndex(in)
	type step struct {
		at    int64
		units int64 // + charge, - refund
		op    int
	}
	type group struct {
		account string
		reset   int64
	}
	steps := map[group][]step{}
	hard := 0
	for k, i := range x.acked {
		lim, ok := in.Accounts[k.account]
		if !ok || !lim.Hard {
			continue
		}
		o := &in.Ops[i]
		g := group{k.account, o.Reset}
		steps[g] = append(steps[g], step{o.End, o.Units, i})
		// The earliest refund that may have returned the units: a refund
		// answered refunded or unknown, or the front's refund of a charge
		// whose upstream failed.
		var at int64 = math.MaxInt64
		for _, j := range x.charges[k] {
			if in.Ops[j].RefundPending {
				at = min(at, in.Ops[j].Start)
			}
		}
		for _, j := range x.refunds[k] {
			if r := &in.Ops[j]; r.Refunded() || r.Status == StatusUnknown {
				at = min(at, r.Start)
			}
		}
		if at != math.MaxInt64 {
			steps[g] = append(steps[g], step{at, -o.Units, -1})
		}
	}
	lost := map[group]int64{}
	for _, l := range x.lost {
		lost[group{l.Account, l.Reset}] += l.Units
	}
	groups := make([]group, 0, len(steps))
	for g := range steps {
		groups = append(groups, g)
	}
	slices.SortFunc(groups, func(a, b group) int { return cmp.Or(cmp.Compare(a.account, b.account), cmp.Compare(a.reset, b.reset)) })
	for _, g := range groups {
		ss := steps[g]
		hard++
		// Refunds before charges at the same instant.
		slices.SortFunc(ss, func(a, b step) int { return cmp.Or(cmp.Compare(a.at, b.at), cmp.Compare(a.units, b.units)) })
		limit := in.Accounts[g.account].Quota + lost[g]
		var net, peak int64
		var over []int
		for _, s := range ss {
			net += s.units
			peak = max(peak, net)
			if s.units > 0 && net > limit && len(over) < 5 {
				over = append(over, in.Ops[s.op].ID)
			}
		}
		if peak > limit {
			c.add(Violation{Account: g.account, Ops: over, Detail: fmt.Sprintf(
				"%d units acknowledged at once in %s against a hard quota of %d (lost with destroyed disks: %d)",
				peak, periodName(g.reset), in.Accounts[g.account].Quota, lost[g])})
		}
	}
	grants := 0
	if in.Ledger != nil {
		lostByAccount := map[string]int64{}
		for _, l := range x.lost {
			lostByAccount[l.Account] += l.Units
		}
		for _, acct := range sortedKeys(in.Ledger.Grants) {
			if lim, ok := in.Accounts[acct]; !ok || !lim.Hard {
				continue
			}
			for _, gr := range in.Ledger.Grants[acct] {
				grants++
				if gr.Used+gr.Reserved > gr.Units+lostByAccount[acct] {
					c.add(Violation{Account: acct, Detail: fmt.Sprintf("ledger grant %s: used %d + reserved %d > units %d",
						gr.Grant, gr.Used, gr.Reserved, gr.Units)})
				}
			}
		}
	}
	return c.done(fmt.Sprintf("%d hard account-periods swept over time, %d hard grants in the ledger", hard, grants))
}

// CheckG2: every acknowledged charge is in the ledger's event log (exactly
// once: CheckG3 reports the ones billed more than once), except the charges
// a destroyed disk held unsettled (the documented loss, reported as a
// number).
func CheckG2(in *CheckInput) Result {
	var c collector
	if in.Ledger == nil {
		return Result{Verdict: NotExercised, Summary: "no ledger state"}
	}
	x := newIndex(in)
	rows := ledgerRows(in.Ledger)
	var lostN, lostUnits int64
	for _, k := range sortedEventKeys(x.acked) {
		if len(rows[k]) > 0 {
			continue // more than once is G3's to report
		}
		if l, ok := x.lost[k]; ok {
			lostN++
			lostUnits += l.Units
			continue
		}
		c.add(Violation{Account: k.account, Event: k.event, Ops: x.opIDs(x.charges[k]),
			Detail: "acknowledged, but not in the ledger (and not on a destroyed disk)"})
	}
	return c.done(fmt.Sprintf("%d acknowledged events; documented loss (destroyed disks): %d charges, %d units",
		len(x.acked), lostN, lostUnits))
}

// LossTotals sums the documented loss: charges and refunds that destroyed
// disks held unsettled.
func LossTotals(lost []LostCharge) (charges, chargeUnits, refunds, refundUnits int64) {
	for _, l := range lost {
		if l.Refund {
			refunds++
			refundUnits += l.Units
		} else {
			charges++
			chargeUnits += l.Units
		}
	}
	return
}

// CheckG3: no event id is billed twice (each generation of an id once: a
// refunded id charged again is billed again); an event the client only ever saw
// refused is not in the ledger; the ledger holds no event nobody asked for
// (beyond charges with generated ids whose outcome is unknown).
func CheckG3(in *CheckInput) Result {
	var c collector
	if in.Ledger == nil {
		return Result{Verdict: NotExercised, Summary: "no ledger state"}
	}
	x := newIndex(in)
	rows := ledgerRows(in.Ledger)
	unexplained := map[string][]string{}
	for _, k := range sortedEventKeys(rows) {
		rs := rows[k]
		// Billed rows only: one event can have a row in each of two months
		// (Postgres's unique key is per month), and a refunded row, or a
		// tombstone, bills nothing (a node billing in the wrong month had
		// its charge of an abandoned attempt refunded there, while the
		// served retry stayed billed in the right one: billed once).
		byGen := map[string][]flush.EventRow{}
		var billed []flush.EventRow
		for _, r := range rs {
			if !r.Refunded && !r.Tombstone {
				byGen[r.EventID] = append(byGen[r.EventID], r)
				billed = append(billed, r)
			}
		}
		twice := false
		for _, id := range sortedKeys(byGen) {
			if g := byGen[id]; len(g) > 1 {
				twice = true
				c.add(Violation{Account: k.account, Event: k.event, Ops: x.opIDs(x.charges[k]),
					Detail: fmt.Sprintf("billed %d times (by %s)", len(g), rowOrigins(g))})
			}
		}
		// NB: across generations too: a generation is made when the one
		// before was refunded (shard.LedgerEventID), so two billed at once
		// are one client id billed twice (a refund the owner made in its
		// memory that never reached the ledger). The workload never uses
		// an id again after its own refund but through a retry, which
		// takes the next generation only once the last is refunded.
		if !twice && len(billed) > 1 {
			c.add(Violation{Account: k.account, Event: k.event, Ops: x.opIDs(x.charges[k]),
				Detail: fmt.Sprintf("billed under %d of its generations at once (by %s), each but one should be refunded", len(billed), rowOrigins(billed))})
		}
		idx, asked := x.charges[k]
		if !asked {
			if _, lost := x.lost[k]; !lost && !rs[0].Tombstone {
				unexplained[k.account] = append(unexplained[k.account], k.event)
			}
			continue
		}
		refusedOnly := true
		for _, i := range idx {
			if in.Ops[i].Status != StatusRefused {
				refusedOnly = false
			}
		}
		if refusedOnly {
			c.add(Violation{Account: k.account, Event: k.event, Ops: x.opIDs(idx),
				Detail: "billed, but every attempt was answered refused"})
		}
	}
	for _, acct := range sortedKeys(unexplained) {
		if n := len(unexplained[acct]); n > x.unknownGenerated[acct] {
			evs := unexplained[acct]
			c.add(Violation{Account: acct, Event: evs[0], Detail: fmt.Sprintf(
				"%d events in the ledger that no client asked for (only %d charges with generated ids had unknown outcomes): %s",
				n, x.unknownGenerated[acct], strings.Join(evs[:min(len(evs), 5)], ", "))})
		}
	}
	return c.done(fmt.Sprintf("%d events in the ledger, %d asked for by the workload", len(rows), len(x.charges)))
}

func rowOrigins(rs []flush.EventRow) string {
	var s []string
	for _, r := range rs {
		s = append(s, fmt.Sprintf("%s/%s seq %d", r.Node, short(r.Incarnation), r.Seq))
	}
	return strings.Join(s, ", ")
}

func short(s string) string {
	if len(s) > 8 {
		return s[:8]
	}
	return s
}

// CheckG4: a refund returns an event's units once. In the ledger: a refund
// answered refunded is there (the event marked refunded); nothing is marked
// refunded that nobody asked to refund; and an event the client was served
// and told ok stays billed unless the client asked for its refund (the HTTP
// front refunds only attempts that were not served). Units returned twice
// would also show as a difference in G6. In the history: one owner never answers
// refunded twice for one event. Two owners may each answer refunded while an
// account changes hands (DESIGN: the ledger then takes the second for a
// duplicate refund that changes nothing); those are counted in the summary,
// not reported, when the ledger refunded the event once.
func CheckG4(in *CheckInput) Result {
	var c collector
	x := newIndex(in)
	var rows map[eventKey][]flush.EventRow
	if in.Ledger != nil {
		rows = ledgerRows(in.Ledger)
	}
	refunded, twoOwners := 0, 0
	for _, k := range sortedEventKeys(x.refunds) {
		var ok []int
		for _, i := range x.refunds[k] {
			if in.Ops[i].Refunded() {
				ok = append(ok, i)
			}
		}
		if len(ok) > 0 {
			refunded++
		}
		if len(ok) > 1 {
			if same := sameDecider(in.Ops, ok); same != "" {
				c.add(Violation{Account: k.account, Event: k.event, Ops: x.opIDs(ok),
					Detail: fmt.Sprintf("%d refunds of one event answered refunded by %s", len(ok), same)})
			} else {
				twoOwners++
			}
		}
		if len(ok) > 0 && rows != nil {
			rs := rows[k]
			if _, lost := x.lostRefunds[k]; lost {
				continue // documented loss: the refund was on a destroyed disk
			}
			if _, lost := x.lost[k]; len(rs) == 0 && lost {
				continue
			}
			if !slices.ContainsFunc(rs, func(r flush.EventRow) bool { return r.Refunded }) {
				c.add(Violation{Account: k.account, Event: k.event, Ops: x.opIDs(ok),
					Detail: "answered refunded, but the ledger does not mark the event refunded"})
			}
		}
	}
	// Charges under ids the client library or the owner made, whose outcome
	// was unknown: the history cannot name their ledger rows, and the owner
	// may have taken each back (engine.Charge); so many unasked refunds of
	// rows no operation names are theirs.
	takenBack := map[string]int{}
	for i := range in.Ops {
		if o := &in.Ops[i]; o.Kind == OpCharge && o.Generated && o.Status == StatusUnknown {
			takenBack[o.Account]++
		}
	}
	for _, k := range sortedEventKeys(rows) {
		refund := func(r flush.EventRow) bool { return r.Refunded }
		if !slices.ContainsFunc(rows[k], refund) {
			continue
		}
		// Who may have asked: the client (a refund), the HTTP front for an
		// attempt whose upstream failed or whose client went away, or the
		// owner for an attempt whose caller gave up while its record waited
		// for the disk (engine.Charge takes it back; the caller heard an
		// unknown outcome).
		asked, frontOnly, served, undecided := len(x.refunds[k]) > 0, false, false, false
		for _, i := range x.charges[k] {
			o := &in.Ops[i]
			frontOnly = frontOnly || o.RefundPending
			served = served || (o.Acked() && !o.RefundPending)
			undecided = undecided || o.Status == StatusUnknown
		}
		switch {
		case !asked && !frontOnly && !undecided && len(x.charges[k]) == 0 && takenBack[k.account] > 0:
			takenBack[k.account]-- // one of the account's unknown charges under a generated id
		case !asked && !frontOnly && !undecided:
			c.add(Violation{Account: k.account, Event: k.event, Ops: x.opIDs(x.charges[k]),
				Detail: "the ledger marks the event refunded, but nobody asked for a refund"})
		case !asked && served && !slices.ContainsFunc(rows[k], func(r flush.EventRow) bool { return !r.Refunded }):
			// The front or the owner refunded an attempt of this event that
			// nobody was served by, but another attempt was served and
			// acknowledged: that one must stay billed (in some generation).
			c.add(Violation{Account: k.account, Event: k.event, Ops: x.opIDs(x.charges[k]),
				Detail: "acknowledged and served, but the ledger refunded it: the refund of an abandoned attempt un-billed the attempt that was served"})
		}
	}
	return c.done(fmt.Sprintf("%d events refunded, %d refund requests; %d events answered refunded by two owners during a handoff (the ledger refunded each once)",
		refunded, countKind(in.Ops, OpRefund), twoOwners))
}

// sameDecider names the node that decided two of the ops, if any two have
// the same known decider.
func sameDecider(ops []Op, idx []int) string {
	seen := map[string]bool{}
	for _, i := range idx {
		d := ops[i].Decider
		if d == "" {
			continue
		}
		if seen[d] {
			return d
		}
		seen[d] = true
	}
	return ""
}

func countKind(ops []Op, kind string) int {
	n := 0
	for i := range ops {
		if ops[i].Kind == kind {
			n++
		}
	}
	return n
}

// CheckG6: the ledger's reconcile is clean: per grant, used equals the
// event log's unrefunded allocations; per account and period, the daily
// aggregates equal the event log.
func CheckG6(in *CheckInput) Result {
	var c collector
	if in.Ledger == nil {
		return Result{Verdict: NotExercised, Summary: "no ledger state"}
	}
	for _, r := range in.Ledger.Reconcile {
		if r.Diff {
			c.add(Violation{Account: r.Account, Detail: fmt.Sprintf("%s %s: counter %d, event log %d (%+d)",
				r.Kind, r.Scope, r.Counter, r.Events, r.Counter-r.Events)})
		}
	}
	return c.done(fmt.Sprintf("%d reconcile rows compared", len(in.Ledger.Reconcile)))
}

// CheckG7: for every rate-limited account, in every window [t1, t2], the
// charges admitted (answered ok, not replayed) that were both sent and
// answered inside the window number at most
//
//	burst*(1 + moves) + rate*(t2-t1)
//
// where moves counts the times the deciding node changed (an ownership
// move: the new owner starts with a full bucket; during a split brain every
// alternation between two owners counts, which is DESIGN's "rate limits may
// double for that window") plus node starts in the window (a restarted
// node's buckets start full). With one stable owner that is the exact
// steady-state bound b + r*t. Only charges whose deciding node is known
// count as moves (gRPC and the embedded client report it).
func CheckG7(in *CheckInput) Result {
	var c collector
	starts := slices.Sorted(slices.Values(in.Starts))
	byAccount := map[string][]int{}
	for i := range in.Ops {
		o := &in.Ops[i]
		if o.Kind != OpCharge {
			continue
		}
		if lim, ok := in.Accounts[o.Account]; ok && lim.Rate > 0 {
			byAccount[o.Account] = append(byAccount[o.Account], i)
		}
	}
	checked, admitted, totalMoves := 0, 0, 0
	worst := 0.0
	for _, acct := range sortedKeys(byAccount) {
		lim := in.Accounts[acct]
		idx := byAccount[acct]
		checked++
		// Moves: changes of the deciding node, by answer time.
		var decided []int
		for _, i := range idx {
			if o := &in.Ops[i]; o.Decider != "" && o.Status != StatusUnknown {
				decided = append(decided, i)
			}
		}
		slices.SortFunc(decided, func(a, b int) int { return cmp.Compare(in.Ops[a].End, in.Ops[b].End) })
		var moves []int64
		for j := 1; j < len(decided); j++ {
			if in.Ops[decided[j]].Decider != in.Ops[decided[j-1]].Decider {
				moves = append(moves, in.Ops[decided[j]].End)
			}
		}
		totalMoves += len(moves)
		var adm []int
		for _, i := range idx {
			if in.Ops[i].Admitted() {
				adm = append(adm, i)
			}
		}
		admitted += len(adm)
		byStart := slices.Clone(adm)
		slices.SortFunc(byStart, func(a, b int) int { return cmp.Compare(in.Ops[a].Start, in.Ops[b].Start) })
		byEnd := slices.Clone(adm)
		slices.SortFunc(byEnd, func(a, b int) int { return cmp.Compare(in.Ops[a].End, in.Ops[b].End) })
		var first *Violation
		for _, i := range byStart {
			t1 := in.Ops[i].Start
			n := 0
			var inWindow []int
			for _, j := range byEnd {
				o := &in.Ops[j]
				if o.Start < t1 {
					continue
				}
				n++
				if len(inWindow) < 5 {
					inWindow = append(inWindow, o.ID)
				}
				t2 := o.End
				m := countIn(moves, t1, t2) + countIn(starts, t1, t2)
				bound := float64(lim.Burst)*float64(1+m) + lim.Rate*float64(t2-t1)/1e9
				worst = max(worst, float64(n)/bound)
				if float64(n) > math.Floor(bound+1e-9) && first == nil {
					first = &Violation{Account: acct, Ops: inWindow, Detail: fmt.Sprintf(
						"%d admitted in %s (window [%s, %s]) with %d moves: bound burst*(1+moves) + rate*t = %d*%d + %.1f*%.3f = %.1f",
						n, time.Duration(t2-t1).Round(time.Millisecond), fmtOffset(t1), fmtOffset(t2), m, lim.Burst, 1+m, lim.Rate,
						float64(t2-t1)/1e9, bound)}
				}
			}
		}
		if first != nil {
			c.add(*first)
		}
	}
	if checked == 0 {
		return Result{Verdict: NotExercised, Summary: "no rate-limited account in the workload"}
	}
	return c.done(fmt.Sprintf("%d rate-limited accounts, %d admissions, %d ownership moves seen, %d node starts; fullest window at %.0f%% of its bound",
		checked, admitted, totalMoves, len(starts), 100*worst))
}

// countIn counts the sorted times in [t1, t2].
func countIn(ts []int64, t1, t2 int64) int {
	lo := sort.Search(len(ts), func(i int) bool { return ts[i] >= t1 })
	hi := sort.Search(len(ts), func(i int) bool { return ts[i] > t2 })
	return hi - lo
}

// minOutage is the shortest ledger outage G8 expects charges in.
const minOutage = 2 * time.Second

// CheckG8: in every window the ledger was down (at least minOutage), some
// charge was sent and acknowledged inside the window.
func CheckG8(in *CheckInput) Result {
	var c collector
	var parts []string
	exercised := 0
	for _, w := range mergeTouching(in.LedgerDown, time.Second) {
		if time.Duration(w.End-w.Start) < minOutage {
			continue
		}
		exercised++
		n, units := 0, int64(0)
		for i := range in.Ops {
			if o := &in.Ops[i]; o.Acked() && o.Reason == "ok" && o.Start >= w.Start && o.End <= w.End {
				n++
				units += o.Units
			}
		}
		joined := ""
		if w.Kind == joinedKind {
			joined = " (faults back to back)"
		}
		parts = append(parts, fmt.Sprintf("%d charges in the %s outage at %s%s", n,
			time.Duration(w.End-w.Start).Round(100*time.Millisecond), fmtOffset(w.Start), joined))
		if n == 0 {
			c.add(Violation{Detail: fmt.Sprintf("no charge acknowledged while the ledger was down [%s, %s]", fmtOffset(w.Start), fmtOffset(w.End))})
		}
	}
	if exercised == 0 {
		return Result{Verdict: NotExercised, Summary: "the ledger was not stopped"}
	}
	return c.done(strings.Join(parts, "; "))
}

// joinedKind marks a window mergeTouching made of several.
const joinedKind = "joined"

// mergeTouching joins windows (sorted by start) that overlap or are less
// than gap apart: a ledger started again and stopped at once by the next
// fault was one outage, as the nodes saw it.
func mergeTouching(ws []Window, gap time.Duration) []Window {
	var out []Window
	for _, w := range ws {
		if n := len(out); n > 0 && w.Start-out[n-1].End < int64(gap) {
			out[n-1].End = max(out[n-1].End, w.End)
			out[n-1].Kind = joinedKind
			continue
		}
		out = append(out, w)
	}
	return out
}

// CheckG9: per account, the period of the answers never goes back in real
// time: an answer that came back before another was sent has a reset no
// later than the other's.
func CheckG9(in *CheckInput) Result {
	var c collector
	byAccount := map[string][]int{}
	for i := range in.Ops {
		if o := &in.Ops[i]; o.Reset != 0 && o.Status != StatusUnknown {
			byAccount[o.Account] = append(byAccount[o.Account], i)
		}
	}
	periods := map[int64]bool{}
	for _, acct := range sortedKeys(byAccount) {
		idx := byAccount[acct]
		byEnd := slices.Clone(idx)
		slices.SortFunc(byEnd, func(a, b int) int { return cmp.Compare(in.Ops[a].End, in.Ops[b].End) })
		byStart := slices.Clone(idx)
		slices.SortFunc(byStart, func(a, b int) int { return cmp.Compare(in.Ops[a].Start, in.Ops[b].Start) })
		p, high := 0, -1
		for _, i := range byStart {
			b := &in.Ops[i]
			periods[b.Reset] = true
			for p < len(byEnd) && in.Ops[byEnd[p]].End < b.Start {
				if high < 0 || in.Ops[byEnd[p]].Reset > in.Ops[high].Reset {
					high = byEnd[p]
				}
				p++
			}
			if high >= 0 && in.Ops[high].Reset > b.Reset {
				a := &in.Ops[high]
				c.add(Violation{Account: acct, Ops: []int{a.ID, b.ID}, Detail: fmt.Sprintf(
					"period went back from %s (answered %s at %s) to %s (answered %s at %s)",
					periodName(a.Reset), a.answeredBy(), fmtOffset(a.End), periodName(b.Reset), b.answeredBy(), fmtOffset(b.End))})
				break // one per account
			}
		}
	}
	names := make([]string, 0, len(periods))
	for _, r := range sortedKeys(periods) {
		names = append(names, periodName(r))
	}
	return c.done(fmt.Sprintf("%d accounts; periods answered: %s", len(byAccount), strings.Join(names, ", ")))
}

// MaxUndecided bounds how long an account may stay undecided (every answer
// unavailable, timeout or transport) while no fault is active: counted from
// the start of the stretch or the end of the last fault within it, whichever
// is later. Faults may chain for longer than any fixed bound (a kill during
// a ledger outage, then a second outage: 26 s in the crashes schedule), and
// an account that owner or ledger cannot decide is right to wait them out;
// the chaos runs' accounts were decided again within about 3 s of the last
// fault's end, so an account still undecided 15 s after it is stuck.
const MaxUndecided = 15 * time.Second

// CheckAvail: per account, no stretch of charges answered undecided goes on
// for longer than MaxUndecided with no fault active (in.Faults): every
// account the workload charges is decided again (ok or refused) once the
// faults that held it pass. The guarantees hold trivially for a cluster that
// refuses everything; this is the check that it does not. (It found
// accounts that refused every charge for minutes after a clock jump.)
func CheckAvail(in *CheckInput) Result {
	var c collector
	byAccount := map[string][]int{}
	for i := range in.Ops {
		if in.Ops[i].Kind == OpCharge {
			byAccount[in.Ops[i].Account] = append(byAccount[in.Ops[i].Account], i)
		}
	}
	faults := slices.Clone(in.Faults)
	slices.SortFunc(faults, func(a, b Window) int { return cmp.Compare(a.Start, b.Start) })
	type stretch struct {
		first, last int
		clear       time.Duration // the longest part of it with no fault active
	}
	var longest stretch
	var longestAcct string
	for _, acct := range sortedKeys(byAccount) {
		idx := byAccount[acct]
		slices.SortStableFunc(idx, func(a, b int) int { return cmp.Compare(in.Ops[a].Start, in.Ops[b].Start) })
		worst := stretch{first: -1}
		first, last := -1, -1
		end := func() {
			if first >= 0 {
				if d := faultFree(faults, in.Ops[first].Start, in.Ops[last].End); worst.first < 0 || d > worst.clear {
					worst = stretch{first, last, d}
				}
			}
			first, last = -1, -1
		}
		for _, i := range idx {
			if in.Ops[i].Status != StatusUnknown {
				end()
				continue
			}
			if first < 0 {
				first = i
			}
			last = i
		}
		end()
		if worst.first >= 0 && (longestAcct == "" || worst.clear > longest.clear) {
			longest, longestAcct = worst, acct
		}
		if worst.clear > MaxUndecided {
			a, b := &in.Ops[worst.first], &in.Ops[worst.last]
			c.add(Violation{Account: acct, Ops: []int{a.ID, b.ID}, Detail: fmt.Sprintf(
				"every charge undecided for %s, from %s to %s, %s of it with no fault active",
				time.Duration(b.End-a.Start).Round(100*time.Millisecond), fmtOffset(a.Start), fmtOffset(b.End),
				worst.clear.Round(100*time.Millisecond))})
		}
	}
	summary := fmt.Sprintf("%d accounts charged", len(byAccount))
	if longestAcct != "" {
		a, b := &in.Ops[longest.first], &in.Ops[longest.last]
		summary += fmt.Sprintf("; undecided the longest with no fault active: %s, %s (a stretch of %s)",
			longestAcct, longest.clear.Round(100*time.Millisecond), time.Duration(b.End-a.Start).Round(100*time.Millisecond))
	}
	return c.done(summary)
}

// faultFree returns the longest part of [from, to] during which none of
// faults (sorted by start) was active.
func faultFree(faults []Window, from, to int64) time.Duration {
	t, longest := from, int64(0)
	for _, w := range faults {
		if w.End <= t {
			continue
		}
		if w.Start >= to {
			break
		}
		if w.Start > t {
			longest = max(longest, w.Start-t)
		}
		t = w.End
	}
	if to > t {
		longest = max(longest, to-t)
	}
	return time.Duration(longest)
}

// answeredBy names who answered: the deciding node, or the way in when the
// answer does not say (HTTP).
func (o *Op) answeredBy() string {
	if o.Decider != "" {
		return "by " + o.Decider
	}
	return "through " + o.Via + "@" + o.Node
}

// CheckSeq: per (node, incarnation), the event log holds each sequence at
// most once and none past the incarnation's settled mark; after the final
// drain each data dir has settled everything it made durable, up to the
// ledger's mark; of the records measured unsettled on destroyed disks, those
// the ledger's mark covers anyway (see SplitLoss) are in the ledger.
func CheckSeq(in *CheckInput) Result {
	var c collector
	if in.Ledger == nil {
		return Result{Verdict: NotExercised, Summary: "no ledger state"}
	}
	marks := settledMarks(in.Ledger)
	seen := map[inc]map[uint64]string{}
	rows := 0
	for _, acct := range sortedKeys(in.Ledger.Events) {
		for _, e := range in.Ledger.Events[acct] {
			if e.Tombstone || e.Seq == 0 {
				continue
			}
			rows++
			k := inc{e.Node, e.Incarnation}
			if seen[k] == nil {
				seen[k] = map[uint64]string{}
			}
			if prev, ok := seen[k][e.Seq]; ok {
				c.add(Violation{Account: acct, Event: e.EventID, Detail: fmt.Sprintf(
					"%s/%s seq %d holds two events (%s and %s)", e.Node, short(e.Incarnation), e.Seq, prev, e.EventID)})
			}
			seen[k][e.Seq] = e.EventID
			mark, ok := marks[k]
			if !ok {
				c.add(Violation{Account: acct, Event: e.EventID, Detail: fmt.Sprintf("%s/%s is not in the nodes table", e.Node, short(e.Incarnation))})
			} else if e.Seq > mark {
				c.add(Violation{Account: acct, Event: e.EventID, Detail: fmt.Sprintf(
					"%s/%s seq %d is past the settled mark %d", e.Node, short(e.Incarnation), e.Seq, mark)})
			}
		}
	}
	for _, l := range in.Logs {
		mark, ok := marks[inc{l.Node, l.Incarnation}]
		switch {
		case !ok:
			c.add(Violation{Detail: fmt.Sprintf("data dir of %s (incarnation %s) is not in the nodes table", l.Node, short(l.Incarnation))})
		case l.Settled != l.Durable:
			c.add(Violation{Detail: fmt.Sprintf("%s/%s: %d records durable but not settled after the final drain (settled %d, durable %d)",
				l.Node, short(l.Incarnation), l.Durable-l.Settled, l.Settled, l.Durable)})
		case l.Settled != mark:
			c.add(Violation{Detail: fmt.Sprintf("%s/%s: the data dir's settled mark %d differs from the ledger's %d",
				l.Node, short(l.Incarnation), l.Settled, mark)})
		}
	}
	_, settledLoss := in.SplitLoss()
	for _, l := range settledLoss {
		// The mark is honest only if the ledger holds what it covers: the
		// charge's row (under whichever node settled the event first), and
		// for a refund, the row refunded.
		var found, refunded bool
		for _, e := range in.Ledger.Events[l.Account] {
			if e.EventID == l.EventID {
				found, refunded = true, e.Refunded || e.Tombstone
			}
		}
		switch {
		case !found:
			c.add(Violation{Account: l.Account, Event: l.EventID, Detail: fmt.Sprintf(
				"%s/%s seq %d was unsettled on the lost disk and the ledger's mark %d covers it, but the ledger holds no row of the event",
				l.Node, short(l.Incarnation), l.Seq, marks[inc{l.Node, l.Incarnation}])})
		case l.Refund && !refunded:
			c.add(Violation{Account: l.Account, Event: l.EventID, Detail: fmt.Sprintf(
				"%s/%s seq %d, a refund unsettled on the lost disk, is covered by the ledger's mark %d, but the ledger's row is not refunded",
				l.Node, short(l.Incarnation), l.Seq, marks[inc{l.Node, l.Incarnation}])})
		}
	}
	summary := fmt.Sprintf("%d incarnations, %d event rows, %d data dirs after the drain", len(marks), rows, len(in.Logs))
	if len(settledLoss) > 0 {
		summary += fmt.Sprintf("; %d records unsettled on lost disks were in the ledger (killed between a settle's commit and its local mark)", len(settledLoss))
	}
	return c.done(summary)
}

// CheckReservations: before the final drain, with every log settled, the
// ledger reserves for each node what the node holds (Holds), beyond it at
// most the units the node counts in doubt: more would be units stranded
// for nobody until the node stops, less units the node could spend that
// no grant backs. Once every node drained, the ledger holds no
// reservation: none per node, and no grant with reserved units.
func CheckReservations(in *CheckInput) Result {
	var c collector
	if in.Ledger == nil {
		return Result{Verdict: NotExercised, Summary: "no ledger state"}
	}
	var doubt, excess int64
	agree := 0
	for _, h := range in.Holds {
		doubt += h.Uncertain
		switch {
		case h.Agrees():
			agree++
			excess += h.Ledger - h.Held
		case h.Ledger < h.Held:
			c.add(Violation{Detail: fmt.Sprintf("before the drain node %s held %d units and the ledger reserved %d for it: %d units no grant backs", h.Node, h.Held, h.Ledger, h.Held-h.Ledger)})
		default:
			c.add(Violation{Detail: fmt.Sprintf("before the drain the ledger reserved %d units for node %s, which held %d (%d in doubt): %d units stranded until it stops",
				h.Ledger, h.Node, h.Held, h.Uncertain, h.Ledger-h.Held-h.Uncertain)})
		}
	}
	for _, s := range in.Strands {
		c.add(Violation{Detail: fmt.Sprintf("node %s's reservation audit found %d units stranded at %s (account grant units: %s)",
			s.Node, s.Units, s.At, strings.Join(s.Accounts, "; "))})
	}
	var units int64
	for _, r := range in.Ledger.Reservations {
		if r.Units != 0 {
			units += r.Units
			c.add(Violation{Account: r.Account, Detail: fmt.Sprintf("node %s still holds %d units of grant %s", r.Node, r.Units, r.Grant)})
		}
	}
	for _, acct := range sortedKeys(in.Ledger.Grants) {
		for _, g := range in.Ledger.Grants[acct] {
			if g.Reserved != 0 {
				c.add(Violation{Account: acct, Detail: fmt.Sprintf("grant %s has %d units reserved", g.Grant, g.Reserved)})
			}
		}
	}
	before := "before the drain not read"
	if in.Holds != nil {
		before = fmt.Sprintf("before the drain %d of %d nodes agree with the ledger (%d units in doubt, %d of them reserved)", agree, len(in.Holds), doubt, excess)
	}
	return c.done(fmt.Sprintf("%s; after it %d reservation rows, %d units held; %d findings of the nodes' reservation audits during the run", before, len(in.Ledger.Reservations), units, len(in.Strands)))
}
