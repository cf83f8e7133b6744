package flush

// Settle and reservations on SQLite: the same steps as on Postgres (see
// postgres_settle.go), one statement per row inside one BEGIN IMMEDIATE
// transaction. With one writer, no row locks are needed: the transaction
// sees and changes the ledger alone.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/quotaring/quotaring/shard"
)

// Settle applies a batch exactly once (see Batch).
func (s *SQLite) Settle(ctx context.Context, b *Batch) (SettleResult, error) {
	var res SettleResult
	if err := validateBatch(b); err != nil {
		return res, err
	}
	op := fmt.Sprintf("settle %s/%s (%d, %d]", b.Node, b.Incarnation, b.Prev, b.Next)
	st := &sqliteSettle{s: s, b: b, res: &res, plan: newSettlePlan(), now: s.now().UnixNano()}
	err := s.write(ctx, func(tx *sql.Tx) error {
		res.RoundTrips = 1 // BEGIN
		st.tx = tx
		if err := st.run(ctx); err != nil {
			return err
		}
		res.RoundTrips++ // COMMIT
		return nil
	})
	if errors.Is(err, errAppliedBefore) {
		return SettleResult{RoundTrips: res.RoundTrips}, nil
	}
	if err != nil {
		return SettleResult{RoundTrips: res.RoundTrips}, s.fail(op, err)
	}
	res.Applied = true
	return res, nil
}

// sqliteSettle is one Settle call's state.
type sqliteSettle struct {
	s    *SQLite
	b    *Batch
	tx   *sql.Tx
	res  *SettleResult
	plan *settlePlan
	now  int64
	// touched is touchedIDs(b), made when first needed.
	touched map[eventKey]bool
}

func (st *sqliteSettle) exec(ctx context.Context, query string, args ...any) (sql.Result, error) {
	st.res.RoundTrips++
	return st.tx.ExecContext(ctx, query, args...)
}

// grantRoom reads what replayFits needs of account's grants in allocs
// (the settle's write transaction holds the database: nothing reserves
// meanwhile).
func (st *sqliteSettle) grantRoom(ctx context.Context, account string, allocs []shard.Alloc) (map[string]grantRoom, error) {
	room := map[string]grantRoom{}
	for _, a := range allocs {
		if _, ok := room[a.Grant]; ok {
			continue
		}
		var r grantRoom
		err := st.queryRow(ctx, `SELECT g.units - g.used - g.reserved, p.hard FROM grants g
			JOIN accounts a ON a.account_id = g.account_id JOIN plans p ON p.plan_id = a.plan_id
			WHERE g.account_id = ? AND g.grant_id = ?`, account, a.Grant).Scan(&r.free, &r.hard)
		switch {
		case errors.Is(err, sql.ErrNoRows):
			continue
		case err != nil:
			return nil, err
		}
		room[a.Grant] = r
	}
	return room, nil
}

func (st *sqliteSettle) queryRow(ctx context.Context, query string, args ...any) *sql.Row {
	st.res.RoundTrips++
	return st.tx.QueryRowContext(ctx, query, args...)
}

func (st *sqliteSettle) run(ctx context.Context) error {
	b := st.b
	r, err := st.exec(ctx, `UPDATE nodes SET settled_seq = ?, heartbeat_at = ?, stopped_at = NULL,
		settled_through = CASE WHEN ? IS NULL THEN settled_through ELSE min(?, ?) END WHERE node_id = ? AND incarnation = ? AND settled_seq = ?
		AND (? = '' OR process IS NULL OR process = ?)`,
		int64(b.Next), st.now, nullNanos(b.DrainedAt), st.now, nullNanos(b.DrainedAt), b.Node, b.Incarnation, int64(b.Prev), b.Process, b.Process)
	if err != nil {
		return err
	}
	if n, _ := r.RowsAffected(); n == 0 {
		var mark *int64
		var process *string
		err := st.queryRow(ctx, `SELECT settled_seq, process FROM nodes WHERE node_id = ? AND incarnation = ?`, b.Node, b.Incarnation).Scan(&mark, &process)
		if err != nil && !errors.Is(err, sql.ErrNoRows) {
			return err
		}
		return markOutcome(b, mark, process, false)
	}
	if b.Events {
		if err := st.logInOrder(ctx); err != nil {
			return err
		}
	} else {
		for i := range b.Charges {
			st.plan.billCharge(&b.Charges[i])
		}
		for i := range b.Refunds {
			r := &b.Refunds[i]
			st.plan.applyRefund(r, eventOfRefund(r))
		}
	}
	if err := st.applyUsage(ctx); err != nil {
		return err
	}
	return st.applyGrants(ctx)
}

// logInOrder applies the batch's charges, replays and refunds to the event
// log in log order (by Seq), as the node took them. The event log has one
// row per event, whatever its month (Postgres keys it by month): charged
// all before the refunds, a charge refunded and then charged again in the
// next month within one batch (its id forgotten by then) found the first
// charge's row still billed, was taken for a duplicate, and the refund
// then left the event billed zero times though it was served.
func (st *sqliteSettle) logInOrder(ctx context.Context) error {
	var ins *sql.Stmt
	if len(st.b.Charges) > 0 {
		var err error
		ins, err = st.tx.PrepareContext(ctx, `INSERT INTO events (account_id, event_id, client_id, key_id, route, units, charged_at, period,
			node_id, incarnation, seq, allocations)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
		ON CONFLICT (account_id, event_id) DO NOTHING`)
		if err != nil {
			return err
		}
		defer ins.Close()
	}
	cs, rps, rfs := st.b.Charges, st.b.Replays, st.b.Refunds
	for len(cs)+len(rps)+len(rfs) > 0 {
		// The lowest Seq of the three heads (each slice is in log order).
		next, kind := uint64(math.MaxUint64), 0
		if len(cs) > 0 && cs[0].Seq < next {
			next, kind = cs[0].Seq, 1
		}
		if len(rps) > 0 && rps[0].Seq < next {
			next, kind = rps[0].Seq, 2
		}
		if len(rfs) > 0 && rfs[0].Seq < next {
			kind = 3
		}
		var err error
		switch kind {
		case 1:
			err, cs = st.logCharge(ctx, ins, &cs[0]), cs[1:]
		case 2:
			r := &rps[0]
			if err = st.settleReplay(ctx, r); err != nil {
				err = fmt.Errorf("replay of %s/%s: %w", r.Account, r.EventID, err)
			}
			rps = rps[1:]
		case 3:
			err, rfs = st.logRefund(ctx, &rfs[0]), rfs[1:]
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// logCharge inserts a charge into the event log with ins; a charge whose
// event id is there already from another origin is a duplicate.
func (st *sqliteSettle) logCharge(ctx context.Context, ins *sql.Stmt, c *Charge) error {
	st.res.RoundTrips++
	r, err := ins.ExecContext(ctx, c.Account, c.EventID, c.ClientID, c.Key, c.Route, c.Units, c.Wall, c.Period.String(),
		st.b.Node, st.b.Incarnation, int64(c.Seq), encodeAllocs(c.Allocs))
	if err != nil {
		return err
	}
	if n, _ := r.RowsAffected(); n == 1 {
		st.plan.billCharge(c)
		return nil
	}
	name, moved, err := st.resolveName(ctx, c.Account, c.EventID, c.Period, c.Wall, true)
	if err != nil {
		return err
	}
	if moved {
		return st.logCharge(ctx, ins, c) // the plain name is free now
	}
	orig := c
	if name != c.EventID {
		named := *c
		named.EventID = name
		c = &named
	}
	var node, inc string
	var seq int64
	var refunded, tombstone, pending bool
	var refundWall sql.NullInt64
	var ag againRow
	var servedBy, owed string
	if err := st.queryRow(ctx, `SELECT node_id, incarnation, seq, refunded, tombstone, refund_pending, served_again, refund_wall, served_by, owed
		FROM events WHERE account_id = ? AND event_id = ?`,
		c.Account, c.EventID).Scan(&node, &inc, &seq, &refunded, &tombstone, &pending, &ag.served, &refundWall, &servedBy, &owed); err != nil {
		return err
	}
	if node == st.b.Node && inc == st.b.Incarnation && uint64(seq) == c.Seq {
		return nil // this very record was settled before, in another range
	}
	if err := ag.decode(servedBy, owed); err != nil {
		return fmt.Errorf("event %s/%s: %w", c.Account, c.EventID, err)
	}
	rest, mine := takeOne(ag.owed, st.b.Node)
	// Debts of an older build's (unnamed: see owed.go): any node's late
	// charge pays them, and none takes the event over while they stand.
	debts := ag.unnamed() < 0
	switch {
	case mine:
		// The late charge of an attempt whose refund settled first,
		// never served: it pays this node's debt back, billed or not.
		ag.owed, ag.served = rest, ag.served+1
		if err := st.writeAgain(ctx, c.Account, c.EventID, ag); err != nil {
			return err
		}
	case tombstone && pending && node == st.b.Node:
		// The charge of the attempt whose refund left the tombstone: the
		// row is that refunded charge now, no tombstone, so that another
		// attempt, served, takes it over owing nothing for this one.
		if _, err := st.exec(ctx, `UPDATE events SET tombstone = 0, refund_pending = 0, incarnation = ?, seq = ? WHERE account_id = ? AND event_id = ?`,
			st.b.Incarnation, int64(c.Seq), c.Account, c.EventID); err != nil {
			return err
		}
	case tombstone && pending && node != st.b.Node && !debts:
		// The tombstone of one attempt's refund (node's charge, not
		// settled yet: see tombstone) and this is another attempt,
		// served: it takes the event over and is billed, and the
		// refunded attempt's charge, when it arrives, is owed.
		return st.takeOver(ctx, c, append(ag.owed, node))
	case refunded && !tombstone && !debts && (!refundWall.Valid || c.Wall > refundWall.Int64):
		// The event was refunded (its attempt failed) and this retry,
		// charged by another owner, was served: it takes the event over
		// and is billed, the other nodes' late charges still owed. Not a
		// retry charged before the event's own refund (refund_wall):
		// that refund covers it. Nor a retry of a later generation of
		// the id that stands billed (laterGenerations): a duplicate.
		stands, err := st.laterGenerationBilled(ctx, orig)
		if err != nil {
			return err
		}
		if !stands {
			return st.takeOver(ctx, c, ag.owed)
		}
	case debts:
		// An older build's debt, paid back by this late charge.
		ag.served++
		if err := st.writeAgain(ctx, c.Account, c.EventID, ag); err != nil {
			return err
		}
	case !refunded:
		// A retry served by another owner while the event stands billed:
		// the event's own attempt must not refund it any more.
		ag.served, ag.servedBy = ag.served+1, append(ag.servedBy, st.b.Node)
		if err := st.writeAgain(ctx, c.Account, c.EventID, ag); err != nil {
			return err
		}
	}
	st.res.Duplicates = append(st.res.Duplicates, chargeRef(orig))
	st.plan.reservedCharge(c)
	return nil
}

// archivedName is the name an event's row takes in the SQLite event log
// when a use of its id in another month needs the plain name (resolveName).
// U+001E cannot be in a client id (shard: storable) nor in a generation's
// suffix (LedgerEventID).
func archivedName(eventID string, p shard.Period) string { return eventID + "\x1e" + p.String() }

// resolveName finds the row of the event log that a record of eventID in
// period p (at wall: a charge's or replay's time, a refund's charge time)
// is about. Postgres keys the log by id and month; SQLite's has one row per
// id, so an Idempotency-Key used again in a later month (an owner's
// generations of an id start again each month: shard.Account.nextGen) met
// the earlier month's row and was taken for a retry, never billed. A row of
// another month, farther from the record than a retry comes from its first
// attempt (the owners' dedup window, as Postgres looks across a month's
// edge: crossMonthWindow), and not of this batch, is another use of the
// id: a charge moves that row (and its waiting take-backs) to the row's
// archived name and takes the plain one (moved: insert it again); a refund
// or a replay of a use that was moved finds it at its archived name, and
// one of a use not charged yet leaves its tombstone or waiting take-back
// there.
func (st *sqliteSettle) resolveName(ctx context.Context, account, eventID string, p shard.Period, wall int64, charge bool) (name string, moved bool, err error) {
	arch := archivedName(eventID, p)
	var one int
	switch err := st.queryRow(ctx, `SELECT 1 FROM events WHERE account_id = ? AND event_id = ?`, account, arch).Scan(&one); {
	case err == nil:
		return arch, false, nil
	case !errors.Is(err, sql.ErrNoRows):
		return "", false, err
	}
	var period, node, inc string
	var chargedAt, seq int64
	switch err := st.queryRow(ctx, `SELECT period, charged_at, node_id, incarnation, seq FROM events WHERE account_id = ? AND event_id = ?`,
		account, eventID).Scan(&period, &chargedAt, &node, &inc, &seq); {
	case errors.Is(err, sql.ErrNoRows):
		return eventID, false, nil
	case err != nil:
		return "", false, err
	}
	if d := wall - chargedAt; period == p.String() || max(d, -d) <= crossMonthWindow() {
		return eventID, false, nil
	}
	if node == st.b.Node && inc == st.b.Incarnation && uint64(seq) > st.b.Prev {
		// Charged in this very batch: one event, as Postgres takes an id
		// twice in one batch (conformance RetryAcrossMonthsOneBatch: a
		// retry at a node whose clock jumped a month ahead).
		return eventID, false, nil
	}
	if !charge {
		return arch, false, nil
	}
	other, ok := shard.ParsePeriod(period)
	if !ok {
		return "", false, fmt.Errorf("event %s/%s: the event log's period %q is not YYYY-MM", account, eventID, period)
	}
	for _, q := range []string{`UPDATE events SET event_id = ? WHERE account_id = ? AND event_id = ?`,
		`UPDATE replay_takebacks SET event_id = ? WHERE account_id = ? AND event_id = ?`} {
		if _, err := st.exec(ctx, q, archivedName(eventID, other), account, eventID); err != nil {
			return "", false, err
		}
	}
	return eventID, true, nil
}

// laterGenerationBilled says a later generation of c's client id stands
// billed (see laterGenerations).
func (st *sqliteSettle) laterGenerationBilled(ctx context.Context, c *Charge) (bool, error) {
	lo, hi, ok := laterGenerations(c.EventID)
	if !ok || !c.ClientID {
		return false, nil
	}
	if st.touched == nil {
		st.touched = touchedIDs(st.b)
	}
	for _, p := range chargeMonths(c) {
		rows, err := st.tx.QueryContext(ctx, `SELECT event_id FROM events WHERE account_id = ? AND event_id >= ? AND event_id < ? AND period = ?
			AND NOT refunded AND NOT tombstone`, c.Account, lo, hi, p.String())
		st.res.RoundTrips++
		if err != nil {
			return false, err
		}
		stands := false
		for rows.Next() {
			var id string
			if err := rows.Scan(&id); err != nil {
				rows.Close()
				return false, err
			}
			stands = stands || !st.touched[eventKey{c.Account, id}]
		}
		rows.Close()
		if err := rows.Err(); err != nil || stands {
			return stands, err
		}
	}
	return false, nil
}

// takeOver gives the event's row to charge c (this batch's node's), billed:
// unrefunded, no tombstone, no served retries, the late charges of owed
// still owed.
func (st *sqliteSettle) takeOver(ctx context.Context, c *Charge, owed []string) error {
	if _, err := st.exec(ctx, `UPDATE events SET refunded = 0, refunded_at = NULL, refund_wall = NULL, tombstone = 0, served_again = ?, served_by = '[]', owed = ?,
			replays = 0, replayed_by = '[]', refund_pending = 0, client_id = ?,
			key_id = ?, route = ?, units = ?, charged_at = ?, period = ?, node_id = ?, incarnation = ?, seq = ?, allocations = ?
		WHERE account_id = ? AND event_id = ?`, -int64(len(owed)), encodeNodes(owed), c.ClientID, c.Key, c.Route, c.Units, c.Wall, c.Period.String(),
		st.b.Node, st.b.Incarnation, int64(c.Seq), encodeAllocs(c.Allocs), c.Account, c.EventID); err != nil {
		return err
	}
	st.plan.billCharge(c)
	return nil
}

func (st *sqliteSettle) settleReplay(ctx context.Context, r *Replay) error {
	node := r.replayNode(st.b.Node)
	if r.Delta < 0 && r.ReplaySeq != 0 {
		res, err := st.exec(ctx, `INSERT INTO takeback_names (account_id, event_id, period, node_id, replay_seq) VALUES (?, ?, ?, ?, ?)
			ON CONFLICT DO NOTHING`, r.Account, r.EventID, r.Period.String(), node, int64(r.ReplaySeq))
		if err != nil {
			return err
		}
		if n, err := res.RowsAffected(); err != nil || n == 0 {
			return err // n == 0: this replay was taken back before, the same take-back asked again
		}
	}
	if name, _, err := st.resolveName(ctx, r.Account, r.EventID, r.Period, r.Wall, false); err != nil {
		return err
	} else if name != r.EventID {
		named := *r
		named.EventID = name
		r = &named
	}
	if r.Delta > 0 {
		res, err := st.exec(ctx, `UPDATE replay_takebacks SET count = count - 1 WHERE account_id = ? AND event_id = ? AND node_id = ? AND count > 0`,
			r.Account, r.EventID, node)
		if err != nil {
			return err
		}
		if n, _ := res.RowsAffected(); n > 0 {
			return nil // taken back before it settled
		}
	}
	var row replayRow
	var ev refundedEvent
	var refundWall sql.NullInt64
	var allocs, replayedBy string
	// servedAgain: the retries served under the event (againRow.standing).
	err := st.queryRow(ctx, `SELECT refunded, tombstone, refund_pending, served_again + json_array_length(owed), replays, replayed_by, node_id, refund_wall, key_id, route, charged_at, units, allocations
		FROM events WHERE account_id = ? AND event_id = ?`, r.Account, r.EventID).Scan(&row.refunded, &row.tombstone, &row.pending, &row.servedAgain,
		&row.replays, &replayedBy, &row.node, &refundWall, &ev.key, &ev.route, &ev.chargeWall, &ev.units, &allocs)
	switch {
	case errors.Is(err, sql.ErrNoRows) && r.Delta > 0:
		return nil // its charge is not in the log (events were off): nothing to count on
	case errors.Is(err, sql.ErrNoRows):
		row.replays = 0
	case err != nil:
		return err
	default:
		if row.replayedBy, err = decodeNodes(replayedBy); err != nil {
			return fmt.Errorf("replayed_by: %w", err)
		}
	}
	names, counts := countOn(row, r, node)
	if r.Delta < 0 && !counts {
		_, err := st.exec(ctx, `INSERT INTO replay_takebacks (account_id, event_id, node_id, count) VALUES (?, ?, ?, 1)
			ON CONFLICT (account_id, event_id, node_id) DO UPDATE SET count = count + 1`, r.Account, r.EventID, node)
		return err
	}
	if refundWall.Valid {
		row.refundWall = &refundWall.Int64
	}
	if ev.allocs, err = decodeAllocs(allocs); err != nil {
		return err
	}
	next, out := decideReplay(row, r, st.b.Node)
	if out == replayBilled {
		room, err := st.grantRoom(ctx, r.Account, ev.allocs)
		if err != nil {
			return err
		}
		if !st.plan.replayFits(r.Account, ev.allocs, room) {
			next, out = unbilled(row, next), replayCounted
			st.res.UnbilledReplays = append(st.res.UnbilledReplays, EventRef{Account: r.Account, EventID: r.EventID})
		}
	}
	retomb := row.tombstone && !next.tombstone
	if _, err := st.exec(ctx, `UPDATE events SET refunded = ?1,
			refunded_at = CASE WHEN NOT ?1 THEN NULL WHEN refunded THEN refunded_at ELSE ?2 END,
			tombstone = ?3, refund_pending = ?4, replays = ?5, refund_wall = CASE WHEN ?6 THEN refund_wall END,
			node_id = CASE WHEN ?7 THEN ?8 ELSE node_id END, incarnation = CASE WHEN ?7 THEN ?9 ELSE incarnation END,
			seq = CASE WHEN ?7 THEN ?10 ELSE seq END, replayed_by = ?13
		WHERE account_id = ?11 AND event_id = ?12`, next.refunded, st.now, next.tombstone, next.pending, next.replays,
		next.refundWall != nil, retomb, st.b.Node, st.b.Incarnation, int64(r.Seq), r.Account, r.EventID, encodeNodes(names)); err != nil {
		return err
	}
	st.plan.replayed(r.Account, out, ev, retomb)
	return nil
}

// logRefund applies a refund to the event log (see Batch: who may refund
// an event that retries were served under).
func (st *sqliteSettle) logRefund(ctx context.Context, r *Refund) error {
	orig := r
	if name, _, err := st.resolveName(ctx, r.Account, r.EventID, r.Period, r.ChargeWall, false); err != nil {
		return err
	} else if name != r.EventID {
		named := *r
		named.EventID = name
		r = &named
	}
	var node, servedByText, owedText string
	var refunded, pending bool
	var replays int64
	var ag againRow
	var wasRefundWall sql.NullInt64
	err := st.queryRow(ctx, `SELECT node_id, refunded, served_again, refund_pending, replays, refund_wall, served_by, owed FROM events WHERE account_id = ? AND event_id = ?`,
		r.Account, r.EventID).Scan(&node, &refunded, &ag.served, &pending, &replays, &wasRefundWall, &servedByText, &owedText)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return st.tombstone(ctx, r)
	case err != nil:
		return err
	}
	if err := ag.decode(servedByText, owedText); err != nil {
		return fmt.Errorf("event %s/%s: %w", r.Account, r.EventID, err)
	}
	served := ag.standing() // the retries served under the event
	origin := st.b.Node     // the node that charged the refunded attempt
	if r.Origin != "" {
		origin = r.Origin
	}
	apply := false
	switch {
	case r.Released && !refunded && node != origin:
		// Logged before, kept, on this row that another node's attempt
		// holds: it counted this node's unbilled retry off then (the
		// default case below). Counted again, the second record un-billed
		// the attempt served elsewhere. But when its take-back (settled
		// just before it) left nothing served under the event, the
		// event's own pending refund applies now: decideReplay leaves it
		// to this record.
		apply = served <= 0 && replays <= 0 && pending
	case refunded && r.Attempt && r.Origin != "" && r.Origin != st.b.Node && node != r.Origin &&
		(!wasRefundWall.Valid || r.ChargeWall > wasRefundWall.Int64):
		// The refund of a retry another node charged after the event was
		// refunded, whose charge has not settled yet (settled, it would
		// have taken the event over): that charge is owed, one served
		// retry fewer, so that it does not take the event over and bill
		// a request whose attempt failed (see logCharge).
		ag.served, ag.owed = ag.served-1, append(ag.owed, origin)
		if err := st.writeAgain(ctx, r.Account, r.EventID, ag); err != nil {
			return err
		}
	case refunded:
	case !r.Attempt || served <= 0 && replays <= 0 && (r.Origin == "" || node == origin):
		// The event's refund, or nobody else's retry was served and no
		// replay stands (see replay.go). (An attempt another node
		// charged, named by Origin, whose charge has not settled yet is
		// not this row's: below.)
		apply = true
	case node == origin:
		// A retry another node charged, or a replay, was served under
		// the event: keep it until those are refunded too.
		if _, err := st.exec(ctx, `UPDATE events SET refund_pending = 1 WHERE account_id = ? AND event_id = ?`, r.Account, r.EventID); err != nil {
			return err
		}
	default:
		// The refund of a retry another node charged, never billed: that
		// node's served retry counted off, or, its charge not settled
		// yet, a debt of that node's (owed: the charge will not count as
		// served when it settles); the event's own pending refund
		// applies now if it was the last.
		counted := false
		if rest, ok := takeOne(ag.servedBy, origin); ok {
			ag.servedBy, counted = rest, true
		} else if ag.unnamed() > 0 {
			counted = true // an older build's count
		} else {
			ag.owed = append(ag.owed, origin)
		}
		ag.served--
		if err := st.writeAgain(ctx, r.Account, r.EventID, ag); err != nil {
			return err
		}
		apply = counted && served == 1 && replays <= 0 && pending
	}
	if !apply {
		st.res.DuplicateRefunds = append(st.res.DuplicateRefunds, refundRef(orig))
		return nil
	}
	var ev refundedEvent
	var allocs string
	// The event's own refund keeps when it was decided: the retries
	// charged before it are covered by it (see logCharge).
	var refundWall any
	if !r.Attempt {
		refundWall = r.Wall
	}
	if err := st.queryRow(ctx, `UPDATE events SET refunded = 1, refunded_at = ?, refund_wall = ?, refund_pending = 0, served_again = ?, served_by = '[]'
		WHERE account_id = ? AND event_id = ?
		RETURNING key_id, route, charged_at, units, allocations`, st.now, refundWall, ag.refunded(), r.Account, r.EventID).
		Scan(&ev.key, &ev.route, &ev.chargeWall, &ev.units, &allocs); err != nil {
		return err
	}
	if ev.allocs, err = decodeAllocs(allocs); err != nil {
		return err
	}
	st.plan.applyRefund(r, ev)
	return nil
}

// writeAgain writes an event's served_again and its names.
func (st *sqliteSettle) writeAgain(ctx context.Context, account, event string, ag againRow) error {
	_, err := st.exec(ctx, `UPDATE events SET served_again = ?, served_by = ?, owed = ? WHERE account_id = ? AND event_id = ?`,
		ag.served, encodeNodes(ag.servedBy), encodeNodes(ag.owed), account, event)
	return err
}

// tombstone records a refund that arrived before its charge. An attempt's
// refund of another node's charge (Origin) stands for that charge only: the
// tombstone names that node and is marked refund_pending, and a charge from
// any other node (another attempt, served) takes the event over (logCharge).
func (st *sqliteSettle) tombstone(ctx context.Context, r *Refund) error {
	node, onlyOrigin := st.b.Node, r.Attempt && r.Origin != ""
	if onlyOrigin {
		node = r.Origin
	}
	if _, err := st.exec(ctx, `INSERT INTO events (account_id, event_id, client_id, key_id, route, units, charged_at, period,
			node_id, incarnation, seq, allocations, refunded, refunded_at, tombstone, refund_pending)
		VALUES (?, ?, 0, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1, ?, 1, ?)`,
		r.Account, r.EventID, r.Key, r.Route, r.Units, r.ChargeWall, r.Period.String(),
		node, st.b.Incarnation, int64(r.Seq), encodeAllocs(r.Allocs), st.now, onlyOrigin); err != nil {
		return err
	}
	st.plan.reservedRefund(r)
	return nil
}

func (st *sqliteSettle) applyUsage(ctx context.Context) error {
	rows := st.plan.usageRows()
	if len(rows) == 0 {
		return nil
	}
	up, err := st.tx.PrepareContext(ctx, `INSERT INTO usage_daily (account_id, key_id, route, day, units, requests) VALUES (?, ?, ?, ?, ?, ?)
		ON CONFLICT (account_id, key_id, route, day) DO UPDATE
		SET units = units + excluded.units, requests = requests + excluded.requests`)
	if err != nil {
		return err
	}
	defer up.Close()
	for _, u := range rows {
		st.res.RoundTrips++
		if _, err := up.ExecContext(ctx, u.account, u.key, u.route, dayString(u.day), u.units, u.requests); err != nil {
			return err
		}
	}
	return nil
}

// applyGrants creates missing monthly grants, then per grant: used, the
// node's reservation (never below zero), and reserved as the sum of the
// reservations.
func (st *sqliteSettle) applyGrants(ctx context.Context) error {
	for _, g := range st.plan.grantRows() {
		if per, ok := shard.MonthlyPeriod(g.grant); ok {
			if _, err := st.exec(ctx, sqliteMonthlySQL, g.grant, per.String(), per.Start(), per.End(), g.account); err != nil {
				return err
			}
		}
		r, err := st.exec(ctx, `UPDATE grants SET used = used + ? WHERE account_id = ? AND grant_id = ?`, g.used, g.account, g.grant)
		if err != nil {
			return err
		}
		if n, _ := r.RowsAffected(); n == 0 {
			return fmt.Errorf("%w: grant %q of account %q (no such account, or a grant that was never added)", ErrNotFound, g.grant, g.account)
		}
		if g.reserved == 0 {
			continue
		}
		st.res.RoundTrips += 2
		if err := moveReservation(ctx, st.tx, st.b.Node, g.account, g.grant, g.reserved); err != nil {
			return err
		}
	}
	return nil
}

// sqliteMonthlySQL creates a monthly grant from the account's plan if it
// does not exist. Arguments: grant id, period, starts, expires, account.
const sqliteMonthlySQL = `INSERT INTO grants (account_id, grant_id, kind, period, units, starts_at, expires_at)
SELECT a.account_id, ?, 'monthly', ?, p.monthly_quota, ?, ?
FROM accounts a JOIN plans p ON p.plan_id = a.plan_id
WHERE a.account_id = ?
ON CONFLICT (account_id, grant_id) DO NOTHING`

// moveReservation moves node's reservation on a grant by delta (never
// below zero) and sets the grant's reserved total to the sum of its
// reservations.
func moveReservation(ctx context.Context, tx *sql.Tx, node, account, grant string, delta int64) error {
	if _, err := tx.ExecContext(ctx, `INSERT INTO reservations (account_id, grant_id, node_id, units) VALUES (?, ?, ?, max(?, 0))
		ON CONFLICT (account_id, grant_id, node_id) DO UPDATE SET units = max(units + ?, 0)`,
		account, grant, node, delta, delta); err != nil {
		return err
	}
	_, err := tx.ExecContext(ctx, `UPDATE grants SET reserved = (SELECT coalesce(sum(units), 0) FROM reservations r
		WHERE r.account_id = grants.account_id AND r.grant_id = grants.grant_id)
		WHERE account_id = ? AND grant_id = ?`, account, grant)
	return err
}

// Reserve reserves up to req.Need units for node from the account's active
// grants, soonest-expiring first.
func (s *SQLite) Reserve(ctx context.Context, node string, req ReserveRequest) (ReserveResult, error) {
	var res ReserveResult
	if node == "" || req.Account == "" {
		return res, fmt.Errorf("%w: reserve: node and account must be set", ErrInvalid)
	}
	wall := req.Wall.UnixNano()
	err := s.write(ctx, func(tx *sql.Tx) error {
		if err := s.needAccount(ctx, tx, req.Account); err != nil {
			return err
		}
		// The account's month: a later one when a node whose clock ran
		// ahead reserved or billed it there (see Ledger.Reserve).
		var later sql.NullInt64
		if err := tx.QueryRowContext(ctx, `SELECT max(starts_at) FROM grants WHERE account_id = ? AND kind = 'monthly' AND starts_at > ?`,
			req.Account, wall).Scan(&later); err != nil {
			return err
		}
		if later.Valid {
			wall = later.Int64
		}
		per := shard.PeriodOf(wall)
		if _, err := tx.ExecContext(ctx, sqliteMonthlySQL, shard.MonthlyGrantID(per), per.String(), per.Start(), per.End(), req.Account); err != nil {
			return err
		}
		var active []activeGrant
		if err := queryEach(ctx, tx, `SELECT g.grant_id, g.units, g.used, g.reserved, coalesce(g.expires_at, 0), coalesce(r.units, 0) FROM grants g
			LEFT JOIN reservations r ON r.account_id = g.account_id AND r.grant_id = g.grant_id AND r.node_id = ?
			WHERE g.account_id = ? AND g.starts_at <= ? AND (g.expires_at IS NULL OR g.expires_at > ?) ORDER BY g.grant_id`,
			[]any{node, req.Account, wall, wall}, func(scan func(...any) error) error {
				var g activeGrant
				err := scan(&g.id, &g.units, &g.used, &g.reserved, &g.expires, &g.mine)
				active = append(active, g)
				return err
			}); err != nil {
			return err
		}
		sortSpending(active)
		res = reserveTake(active, req.Need)
		for _, a := range res.Granted {
			r, err := tx.ExecContext(ctx, `UPDATE grants SET reserved = reserved + ?
				WHERE account_id = ? AND grant_id = ? AND used + reserved + ? <= units`, a.Units, req.Account, a.Grant, a.Units)
			if err != nil {
				return err
			}
			if n, _ := r.RowsAffected(); n != 1 {
				return fmt.Errorf("grant %s of %s changed inside its transaction", a.Grant, req.Account)
			}
			if _, err := tx.ExecContext(ctx, `INSERT INTO reservations (account_id, grant_id, node_id, units) VALUES (?, ?, ?, ?)
				ON CONFLICT (account_id, grant_id, node_id) DO UPDATE SET units = units + excluded.units`,
				req.Account, a.Grant, node, a.Units); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return ReserveResult{}, s.fail(fmt.Sprintf("reserve %d units of %s for %s", req.Need, req.Account, node), err)
	}
	return res, nil
}

// Release hands units of node's reservations on an account's grants back,
// never below zero.
func (s *SQLite) Release(ctx context.Context, node, account string, allocs []shard.Alloc, key ReleaseKey) error {
	if err := validRelease(node, account, allocs); err != nil || len(allocs) == 0 {
		return err
	}
	ids, units := allocColumns(allocs)
	return s.fail(fmt.Sprintf("release %s's reservations of %s", node, account), s.write(ctx, func(tx *sql.Tx) error {
		for i, id := range ids {
			var held int64
			var inc string
			var seq int64
			err := tx.QueryRowContext(ctx, `SELECT units, released_inc, released_seq FROM reservations WHERE account_id = ? AND grant_id = ? AND node_id = ?`,
				account, id, node).Scan(&held, &inc, &seq)
			if errors.Is(err, sql.ErrNoRows) {
				continue
			}
			if err != nil {
				return err
			}
			if key.Seq != 0 && inc == key.Incarnation && uint64(seq) >= key.Seq {
				continue // applied already: this is a retry after a lost answer
			}
			if err := moveReservation(ctx, tx, node, account, id, -min(units[i], held)); err != nil {
				return err
			}
			if key.Seq != 0 {
				if _, err := tx.ExecContext(ctx, `UPDATE reservations SET released_inc = ?, released_seq = ? WHERE account_id = ? AND grant_id = ? AND node_id = ?`,
					key.Incarnation, int64(key.Seq), account, id, node); err != nil {
					return err
				}
			}
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO handoffs (account_id, units, released_at) VALUES (?, ?, ?)
			ON CONFLICT (account_id) DO UPDATE SET units = excluded.units, released_at = excluded.released_at`,
			account, sumUnits(units), s.now().UnixNano())
		return err
	}))
}

// Handoffs lists the accounts released since the given time, with the units
// released.
func (s *SQLite) Handoffs(ctx context.Context, since time.Time) ([]Handoff, error) {
	var out []Handoff
	err := s.read(ctx, func(tx *sql.Tx) error {
		return queryEach(ctx, tx, `SELECT account_id, units FROM handoffs WHERE released_at >= ? ORDER BY account_id`,
			[]any{since.UnixNano()}, func(scan func(...any) error) error {
				var h Handoff
				err := scan(&h.Account, &h.Units)
				out = append(out, h)
				return err
			})
	})
	return out, s.fail("list handoffs", err)
}

// ReleaseNode frees every reservation node holds.
func (s *SQLite) ReleaseNode(ctx context.Context, node string) ([]Released, error) {
	var out []Released
	err := s.write(ctx, func(tx *sql.Tx) error {
		if err := queryEach(ctx, tx, `DELETE FROM reservations WHERE node_id = ? RETURNING account_id, grant_id, units`, []any{node},
			func(scan func(...any) error) error {
				var r Released
				err := scan(&r.Account, &r.Grant, &r.Units)
				if r.Units > 0 {
					out = append(out, r)
				}
				return err
			}); err != nil {
			return err
		}
		for _, r := range out {
			if _, err := tx.ExecContext(ctx, `UPDATE grants SET reserved = max(reserved - ?, 0) WHERE account_id = ? AND grant_id = ?`,
				r.Units, r.Account, r.Grant); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, s.fail("release the reservations of "+node, err)
	}
	sortReleased(out)
	return out, nil
}

// Reservations lists the reservations held (units > 0).
func (s *SQLite) Reservations(ctx context.Context) ([]Reservation, error) {
	return s.reservations(ctx, "list reservations", `SELECT node_id, account_id, grant_id, units FROM reservations WHERE units > 0
		ORDER BY node_id, account_id, grant_id`, nil)
}

// ReservationsOf lists the reservations node holds (units > 0).
func (s *SQLite) ReservationsOf(ctx context.Context, node string) ([]Reservation, error) {
	return s.reservations(ctx, "list the reservations of "+node, `SELECT node_id, account_id, grant_id, units FROM reservations WHERE units > 0 AND node_id = ?
		ORDER BY account_id, grant_id`, []any{node})
}

func (s *SQLite) reservations(ctx context.Context, op, query string, args []any) ([]Reservation, error) {
	var out []Reservation
	err := s.read(ctx, func(tx *sql.Tx) error {
		return queryEach(ctx, tx, query, args, func(scan func(...any) error) error {
			var v Reservation
			err := scan(&v.Node, &v.Account, &v.Grant, &v.Units)
			out = append(out, v)
			return err
		})
	})
	return out, s.fail(op, err)
}
