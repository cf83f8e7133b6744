package flush

// Replays in the ledger. An owner answers a retry of a client id it has
// charged with Replayed: billed once, served again. The HTTP front may then
// refund the first attempt (RefundAttempt: its upstream failed) while the
// replayed retry was served, and that refund must not un-bill the event. The
// owner knows, and keeps the refund pending; but when the refund reaches the
// account's next owner (the account moved), only the ledger can tell. So
// the owner logs every replay (Delta 1) and every replay taken back (Delta
// -1: the retry's own upstream failed; logged wherever the account is by
// then), and the ledger counts them on the event (events.replays) beside the
// retries other owners charged and served (served_again): an attempt's
// refund is kept while either is above zero, and applies when the last is
// taken back; a replay that settles after the event was refunded bills it
// again. A take-back can settle before its replay (another owner logged it,
// or the replay's owner was down): it waits in replay_takebacks, and the
// replay, when it settles, is cancelled by it.
//
// A take-back names its replay (Replay.ReplaySeq, with the replay's node):
// the node that logs it counts a name once, and so does the ledger, in
// takeback_names, for a take-back asked again that another owner logged
// after the account moved (the HTTP front retries one whose answer was
// lost). Counted twice, it released the attempt's pending refund while
// another replay may have been served.
//
// Replays are counted by node (events.replayed_by, one entry per replay):
// a take-back counts off a replay of the node that answered it (Origin, or
// the batch's node), and waits for that node's replay when none has settled
// yet. Counted on one number, the take-back of another node's replay that
// had not settled yet counted off this node's, which had: this node's own
// take-back then waited for ever, and the late replay billed an event whose
// every attempt failed. Rows of older builds have no names: replays beyond
// replayed_by are theirs, and any take-back counts them off.

import (
	"fmt"
	"slices"
	"strings"

	"github.com/quotaring/quotaring/shard"
)

// Replay is a settled replay record (shard.RecReplay), or the replay taken
// back that a released refund carries (shard.Record.Released).
type Replay struct {
	Seq     uint64
	Account string
	EventID string       // the ledger's id (shard.LedgerEventID)
	Period  shard.Period // the charge's
	Wall    int64        // Unix ns
	// Delta is 1 for a retry answered Replayed (served, unless taken back
	// later), -1 for one taken back.
	Delta int64
	// Origin: the node that answered the replay, when it is not the
	// batch's (the account moved before the replay was taken back).
	Origin string
	// Released: the take-back that released its charge's pending refund at
	// the node that answered it. That refund follows in the batch and
	// applies by itself: this one only counts the replay off.
	Released bool
	// ReplaySeq names the replay a take-back (Delta -1) counts off: the seq
	// of its record at the node that answered it (replayNode). A take-back
	// of a replay named before counts nothing (takeback_names): the same
	// take-back asked again, logged at another owner after the account
	// moved. 0: not named (an older build's, or one without the receipt).
	ReplaySeq uint64
}

// replayRow is what settling a replay reads of the event's row.
type replayRow struct {
	refunded, tombstone, pending bool
	servedAgain, replays         int64
	replayedBy                   []string // the nodes whose replays count, one entry per replay
	node                         string
	refundWall                   *int64 // Unix ns; nil: none (an attempt's refund, or none)
}

// replayOutcome is what a replay did to the event.
type replayOutcome uint8

const (
	replayCounted  replayOutcome = iota // replays moved; billing unchanged
	replayBilled                        // the refunded event is billed again (the replay was served)
	replayRefunded                      // the last replay taken back released the pending refund
)

// A replay that bills a refunded event again spends units nobody reserved:
// the owner that answered it spent nothing (it took the id for billed),
// while the refund, settled first, gave the units back, and another node
// may have reserved and spent them since. Two ways there: an owner that
// restarted with its data dir after another owner refunded the event
// (its dedup memory comes back from its log), and an owner cut off from
// the ring that still takes the account for its own. Billed anyway, a hard
// limit was overshot (used 120 of 100). So, on a hard plan, the ledger
// bills it again only while every grant it took units from has that many
// free (units - used - reserved, this batch's own deltas included);
// otherwise the replay is counted but the event stays refunded: the retry
// was served for free, in the customer's favour (SettleResult.
// UnbilledReplays), as losing a node's disk is.

// grantRoom is what replayFits reads of one of the event's grants.
type grantRoom struct {
	free int64 // units - used - reserved, before this batch's deltas
	hard bool  // the account's plan is hard
}

// replayFits says whether billing allocs of account again keeps every
// grant of a hard plan within its units, given room (by grant id: the
// grants the ledger has; a grant missing there bills nothing, as
// addGrants updates no row) and the deltas p holds so far.
func (p *settlePlan) replayFits(account string, allocs []shard.Alloc, room map[string]grantRoom) bool {
	for _, a := range allocs {
		r, ok := room[a.Grant]
		if !ok || !r.hard {
			continue
		}
		d := p.grants[grantKey{account, a.Grant}]
		if r.free-d.used-d.reserved < a.Units {
			return false
		}
	}
	return true
}

// unbilled is the row a replay leaves when it counts without billing
// (replayFits said no): row, one replay more (next's count and names).
func unbilled(row, next replayRow) replayRow {
	row.replays = next.replays
	return row
}

// decideReplay works out the event's next state for a replay that counts on
// row: a replay (1) that no earlier take-back cancelled, or a take-back (-1)
// of a replay counted there (row.replays > 0; otherwise the take-back waits
// in replay_takebacks). node is the batch's. It is the rule both ledgers
// apply:
//
//   - A replay is one more. Of an event an attempt's refund un-billed, it
//     bills the event again, and that refund is pending again (as if the
//     replay had settled before it); likewise of the tombstone the refund of
//     this node's attempt left through another owner (refund pending, node_id
//     this node), in the tombstone's place. Of an event whose own refund (an
//     operator's, refund_wall) was decided before the replay, nothing: that
//     refund covers it; decided after it, the replay is a request after the
//     refund, billed (as a retry charged after it is).
//   - A take-back is one less. When it was the last, no other owner's retry
//     stands (servedAgain <= 0, the count againRow.standing) and the
//     event's attempt's refund is pending, that refund applies, unless the
//     batch's refund record applies it itself (Released).
func decideReplay(row replayRow, r *Replay, node string) (replayRow, replayOutcome) {
	next := row
	if r.Delta < 0 {
		next.replays--
		if next.replays == 0 && !row.refunded && row.pending && row.servedAgain <= 0 && !r.Released {
			next.refunded, next.pending = true, false
			return next, replayRefunded
		}
		return next, replayCounted
	}
	next.replays++
	if !row.refunded {
		return next, replayCounted
	}
	switch {
	case !row.tombstone && (row.refundWall == nil || r.Wall > *row.refundWall):
		next.refunded, next.pending, next.refundWall = false, row.refundWall == nil, nil
		return next, replayBilled
	case row.tombstone && row.pending && row.node == node:
		next.refunded, next.tombstone = false, false
		return next, replayBilled
	}
	return next, replayCounted // covered by the event's own refund
}

// countOn names replay r of node on row (whose replays it counts on):
// false for a take-back that finds no replay of node's to count off (nor an
// older build's unnamed one; none at all when row.replays <= 0), which
// waits in replay_takebacks for it.
func countOn(row replayRow, r *Replay, node string) (replayedBy []string, counts bool) {
	if extra := int64(len(row.replayedBy)) - max(row.replays, 0); extra > 0 {
		// Names of replays an older build counted off (or cleared, taking
		// the event over) without removing them: the oldest go.
		row.replayedBy = row.replayedBy[extra:]
	}
	if r.Delta > 0 {
		return append(slices.Clip(row.replayedBy), node), true
	}
	if rest, ok := takeOne(row.replayedBy, node); ok {
		return rest, true
	}
	return row.replayedBy, row.replays > int64(len(row.replayedBy))
}

// replayNode is the node that answered r's replay.
func (r *Replay) replayNode(batchNode string) string {
	if r.Origin != "" {
		return r.Origin
	}
	return batchNode
}

// replayed plans what a replay did to event ev (see decideReplay): billed
// again, its units (and, in a tombstone's place, which was never billed,
// its request) go back on; refunded, they come off. retomb: the row was a
// tombstone.
func (p *settlePlan) replayed(account string, out replayOutcome, ev refundedEvent, retomb bool) {
	switch out {
	case replayBilled:
		requests := int64(0)
		if retomb {
			requests = 1
		}
		p.addUsage(account, ev.key, ev.route, dayOf(ev.chargeWall), ev.units, requests)
		p.addGrants(account, ev.allocs, 1, 0)
	case replayRefunded:
		p.applyRefund(&Refund{Account: account}, ev)
	}
}

func validReplay(r *Replay) error {
	if r.Account == "" || r.EventID == "" || (r.Delta != 1 && r.Delta != -1) {
		return fmt.Errorf("replay seq %d (account %q, event %q): want account and event id set and a delta of 1 or -1", r.Seq, r.Account, r.EventID)
	}
	return nil
}

// laterGenerations is the range of ledger event ids [lo, hi) that name the
// later generations of a client id's first one (shard.LedgerEventID: id,
// U+001F, the generation), ok false for an id that is a later generation
// itself. A charge of the first generation that meets its event refunded
// takes it over (a retry served), unless a later generation of the id
// stands billed in that month: then it is a retry of that one, charged
// again by an owner that never knew of it (the account moved after the
// refunded id's retry was charged as its next generation at the old
// owner), and billing it billed one request twice (a review). Taken for a
// duplicate instead; as other limits of generations do, that under-bills,
// never over-bills: a use of the id that is new work, and the retry served
// here when the later generation's own attempt fails after all (its refund
// un-bills the id's every use; counting this retry as served under it, as
// served_again does for a retry of one generation, would need the retry's
// own attempt refund, which names the first generation, to count it off
// there).
//
// The months looked in are the charge's and, near its edge, the
// neighbouring one (chargeMonths, where a retry's event is looked for),
// the same on both ledgers; the rows the batch itself charges, refunds or
// replays do not count: Postgres logs a batch's charges before its replays
// and refunds, SQLite one record after the other, so their state in the
// middle of a batch differs between the two (a node that charged or
// refunded both generations knew the id anyway).
func laterGenerations(eventID string) (lo, hi string, ok bool) {
	if strings.ContainsRune(eventID, '\x1f') {
		return "", "", false
	}
	return eventID + "\x1f", eventID + "\x20", true
}

// eventKey names an event of the ledger's log: an account's event id.
type eventKey struct{ account, id string }

// touchedIDs is the set of ledger events b's records name: the rows
// laterGenerations leaves out.
func touchedIDs(b *Batch) map[eventKey]bool {
	ids := make(map[eventKey]bool, len(b.Charges)+len(b.Refunds)+len(b.Replays))
	for i := range b.Charges {
		ids[eventKey{b.Charges[i].Account, b.Charges[i].EventID}] = true
	}
	for i := range b.Refunds {
		ids[eventKey{b.Refunds[i].Account, b.Refunds[i].EventID}] = true
	}
	for i := range b.Replays {
		ids[eventKey{b.Replays[i].Account, b.Replays[i].EventID}] = true
	}
	return ids
}
