package shard

import (
	"encoding/binary"
	"fmt"
	"slices"
)

// ApplyRecord replays a record this account emitted earlier (recovery from
// the log). It never re-decides: the record says what was spent where, so the
// result is the same whatever the config says now. The bucket is not
// touched: a restarted owner starts every bucket full.
func (a *Account) ApplyRecord(seq uint64, rec *Record, params *Params) {
	switch rec.Type {
	case RecCharge:
		if rec.Period > a.period {
			a.rollTo(rec.Period)
		}
		a.seen = max(a.seen, rec.Wall)
		a.spend(rec.Allocs, 1, rec.Reserved)
		if rec.Period == a.period {
			a.addRoute(rec.Route, rec.Units)
		}
		if rec.ClientID {
			a.expireIDs(params)
			a.dedup.put(rec.EventID, a.seen, event{gen: rec.Gen, units: rec.Units, seq: seq, period: rec.Period, chargeAt: rec.Wall,
				key: rec.Key, route: rec.Route, target: rec.Target, allocs: slices.Clone(rec.Allocs)})
		}
	case RecRefund:
		if rec.Released && rec.ReplaySeq != 0 {
			a.refunded.put(takeBackKey(rec.EventID, rec.Gen, "", rec.ReplaySeq), rec.Wall, struct{}{})
		}
		if rec.Origin != "" {
			// Another node's charge: only the use this owner counts of it
			// is here (see unspendElsewhere), and that it was refunded.
			a.unspendElsewhere(rec, params)
			a.refunded.put(elsewhereKey(rec.EventID, rec.Gen, rec.ChargeWall, rec.Origin), rec.Wall, struct{}{})
			break
		}
		a.advance(rec.Wall)
		a.expireIDs(params)
		a.refunded.expire(a.seen, RefundedWindow, params.DedupMax)
		if rec.Kept {
			// Held back while replays may be served: pending, nothing returned.
			if e, ok := a.dedup.get(rec.EventID, a.seen, params.DedupWindow); ok && e.names(rec) {
				e.pending = true
				a.dedup.update(rec.EventID, e)
			}
			break
		}
		if e, ok := a.dedup.get(rec.EventID, a.seen, params.DedupWindow); ok && e.names(rec) {
			e.refunded = true
			a.dedup.update(rec.EventID, e)
		}
		a.refunded.put(refundedKey(rec.EventID, rec.Gen, rec.ChargeWall), a.seen, struct{}{})
		a.unspend(rec)
	case RecReplay:
		if rec.Delta < 0 && rec.ReplaySeq != 0 {
			a.refunded.put(takeBackKey(rec.EventID, rec.Gen, rec.Origin, rec.ReplaySeq), rec.Wall, struct{}{})
		}
		if rec.Origin != "" {
			break // another node's replay: nothing of it is here
		}
		a.advance(rec.Wall)
		a.expireIDs(params)
		if e, ok := a.dedup.get(rec.EventID, a.seen, params.DedupWindow); ok && e.gen == rec.Gen {
			e.replays = max(e.replays+int32(rec.Delta), 0)
			a.dedup.update(rec.EventID, e)
		}
	case RecReserve:
		a.advance(rec.Wall)
		a.reach(rec.Grant)
		if g := a.grant(rec.Grant); g != nil {
			g.allowance += rec.Delta
		}
	}
	if seq > a.LastSeq {
		a.LastSeq = seq
	}
}

const checkpointVersion = 3

// AppendCheckpoint appends the account's durable state (everything but the
// config, which comes from the snapshot, and the bucket, which restarts
// full), with its remembered ids inline:
//
//	version=3 | last seq uvarint | period uvarint | latest wall varint
//	| n × grant (id | monthly byte | starts varint | expires varint | units varint | used varint | allowance varint)
//	| n × route (route | units varint)
//	| n × client id (id | gen uvarint | wall varint | event)
//	| n × refunded id (id | wall varint)
//
// where event is units varint | seq uvarint | period uvarint | charge wall
// varint | flags byte (bit 0: refunded, bit 1: an attempt's refund pending,
// bit 2: a target follows) | replays uvarint | key | route | n × (grant |
// units uvarint) | [target: 8 bytes, little-endian]. The target comes last:
// a quotad from before it finds bytes left over in a stored id and refuses
// it as corrupt rather than misreading it.
//
// The engine stores the ids apart instead (AppendCheckpointState and
// DrainIDs): a busy account remembers up to Params.DedupMax of them, and
// rewriting them all at every settle cost megabytes a second.
func (a *Account) AppendCheckpoint(dst []byte) []byte {
	dst = a.appendState(dst)
	dst = binary.AppendUvarint(dst, uint64(a.dedup.len()))
	a.dedup.each(func(id string, wall int64, e event) {
		dst = appendString(dst, id)
		dst = appendDedupValue(dst, wall, &e)
	})
	dst = binary.AppendUvarint(dst, uint64(a.refunded.len()))
	a.refunded.each(func(id string, wall int64, _ struct{}) {
		dst = appendString(dst, id)
		dst = binary.AppendVarint(dst, wall)
	})
	return dst
}

// AppendCheckpointState appends the account's state as AppendCheckpoint
// does, with no ids inline (both counts 0): the ids go apart, through
// DrainIDs. A build that does not store ids apart reads it as a state that
// remembers no ids.
func (a *Account) AppendCheckpointState(dst []byte) []byte {
	dst = a.appendState(dst)
	return append(dst, 0, 0)
}

func (a *Account) appendState(dst []byte) []byte {
	dst = append(dst, checkpointVersion)
	dst = binary.AppendUvarint(dst, a.LastSeq)
	dst = binary.AppendUvarint(dst, uint64(a.period))
	dst = binary.AppendVarint(dst, a.seen)
	dst = binary.AppendUvarint(dst, uint64(len(a.grants)))
	for _, g := range a.grants {
		dst = appendString(dst, g.id)
		dst = appendBool(dst, g.monthly)
		for _, v := range [...]int64{g.startsAt, g.expiresAt, g.units, g.used, g.allowance} {
			dst = binary.AppendVarint(dst, v)
		}
	}
	dst = binary.AppendUvarint(dst, uint64(len(a.routes)))
	for r, n := range a.routes {
		dst = appendString(dst, r)
		dst = binary.AppendVarint(dst, n)
	}
	return dst
}

// appendDedupValue encodes a remembered client id (without the id):
// gen uvarint | wall varint | event, as in AppendCheckpoint.
func appendDedupValue(dst []byte, wall int64, e *event) []byte {
	dst = binary.AppendUvarint(dst, uint64(e.gen))
	dst = binary.AppendVarint(dst, wall)
	dst = binary.AppendVarint(dst, e.units)
	dst = binary.AppendUvarint(dst, e.seq)
	dst = binary.AppendUvarint(dst, uint64(e.period))
	dst = binary.AppendVarint(dst, e.chargeAt)
	var flags byte
	if e.refunded {
		flags |= 1
	}
	if e.pending {
		flags |= 2
	}
	if e.target != 0 {
		flags |= 4
	}
	dst = append(dst, flags)
	dst = binary.AppendUvarint(dst, uint64(e.replays))
	dst = appendString(dst, e.key)
	dst = appendString(dst, e.route)
	dst = appendAllocs(dst, e.allocs)
	return appendTarget(dst, e.target)
}

func (d *decoder) dedupValue() (wall int64, e event) {
	e.gen, wall = uint32(d.uvarint()), d.varint()
	e.units, e.seq, e.period, e.chargeAt = d.varint(), d.uvarint(), d.period(), d.varint()
	flags := d.byte()
	if flags&^7 != 0 && d.err == nil {
		// A bit this build does not know: the layout past it is not this
		// build's either. Say so, not just "malformed".
		d.fail(fmt.Sprintf("flags %#x (bits this quotad does not know: written by a newer quotad, run that one or a later one)", flags))
	}
	e.refunded, e.pending = flags&1 != 0, flags&2 != 0
	e.replays = int32(min(d.uvarint(), 1<<30))
	e.key, e.route = d.string(), d.string()
	e.allocs = d.allocs(nil)
	if flags&4 != 0 {
		e.target = d.target()
	}
	return wall, e
}

// Kinds of StoredID.
const (
	IDClient   byte = 'd' // a client id the dedup window remembers
	IDRefunded byte = 'r' // an id refunded by its receipt
	IDSpent    byte = 's' // a client id the dedup window let go this period, with its generation
)

// StoredID is one remembered id as the engine stores it apart from the
// account's checkpoint: its kind, the id, and its value (nil in DrainIDs
// for an id dropped since the last drain).
type StoredID struct {
	Kind  byte
	ID    string
	Value []byte
}

// DrainIDs calls fn with each remembered id that changed since the last
// drain (put, updated, or dropped: Value nil), and forgets what changed.
// When it reports reset, fn had every id, and whatever was stored for the
// account must be dropped before they are written. The account must be
// checkpointed (AppendCheckpointState) in the same write; if that write
// fails, call RewriteIDs.
func (a *Account) DrainIDs(fn func(StoredID)) (reset bool) {
	resetD := a.dedup.drain(func(id string, wall int64, e event, present bool) {
		var v []byte
		if present {
			v = appendDedupValue(make([]byte, 0, 64), wall, &e)
		}
		fn(StoredID{Kind: IDClient, ID: id, Value: v})
	})
	resetR := a.refunded.drain(func(id string, wall int64, _ struct{}, present bool) {
		var v []byte
		if present {
			v = binary.AppendVarint(make([]byte, 0, 8), wall)
		}
		fn(StoredID{Kind: IDRefunded, ID: id, Value: v})
	})
	resetS := a.spent.drain(func(id string, wall int64, s spentID, present bool) {
		var v []byte
		if present {
			v = appendSpentValue(make([]byte, 0, 16), wall, s)
		}
		fn(StoredID{Kind: IDSpent, ID: id, Value: v})
	})
	if resetD != resetR || resetD != resetS {
		panic("shard: an account's id windows disagree on a full rewrite") // all are set together
	}
	return resetD
}

// appendSpentValue encodes a spent client id (without the id): gen uvarint
// | wall varint | flags byte (bit 0: refunded).
func appendSpentValue(dst []byte, wall int64, s spentID) []byte {
	dst = binary.AppendUvarint(dst, uint64(s.gen))
	dst = binary.AppendVarint(dst, wall)
	return appendBool(dst, s.refunded)
}

func (d *decoder) spentValue() (wall int64, s spentID) {
	s.gen, wall = uint32(d.uvarint()), d.varint()
	switch f := d.byte(); f {
	case 0, 1:
		s.refunded = f == 1
	default:
		if d.err == nil {
			d.fail(fmt.Sprintf("flags %#x (bits this quotad does not know: written by a newer quotad, run that one or a later one)", f))
		}
	}
	return wall, s
}

// MayHaveStoredIDs reports whether ids drained from this account may be
// stored: it remembers some, has changes not drained yet, or its stored
// ids are unknown. False means what is stored for it holds no ids.
func (a *Account) MayHaveStoredIDs() bool {
	return a.dedup.len() > 0 || a.refunded.len() > 0 || a.spent.len() > 0 ||
		len(a.dedup.changed) > 0 || len(a.refunded.changed) > 0 || len(a.spent.changed) > 0 ||
		a.dedup.all || a.refunded.all || a.spent.all
}

// RewriteIDs makes the next DrainIDs write every id over whatever is
// stored: the last drain's write failed, or what is stored is not this
// state's.
func (a *Account) RewriteIDs() {
	a.dedup.rewriteAll()
	a.refunded.rewriteAll()
	a.spent.rewriteAll()
}

// ForgetIDs drops every remembered client id: the account came back from
// another owner, which may have refunded or charged them since, so what
// this node remembers of them is stale (the ledger's unique event ids
// decide from here on, as after a move to a node that never had it). So
// are the generations of the ids spent: a retry of a charge the other
// owner made must take generation 0 (see nextGen). The refunds remembered
// stay: a receipt refunded here is refunded for good, and with
// --events=false nothing else stops a second refund of it. The next
// DrainIDs rewrites the stored ids.
func (a *Account) ForgetIDs() {
	a.dedup = idWindow[event]{}
	a.spent = idWindow[spentID]{}
	a.RewriteIDs()
}

// RestoreIDs adds the ids stored apart by DrainIDs to a state restored
// from AppendCheckpointState, in any order.
func (a *Account) RestoreIDs(ids []StoredID) error {
	var dIDs, rIDs, sIDs []string
	var dWalls, rWalls, sWalls []int64
	var dVals []event
	var sVals []spentID
	for _, s := range ids {
		d := decoder{b: s.Value}
		switch s.Kind {
		case IDClient:
			wall, e := d.dedupValue()
			dIDs, dWalls, dVals = append(dIDs, s.ID), append(dWalls, wall), append(dVals, e)
		case IDRefunded:
			rIDs, rWalls = append(rIDs, s.ID), append(rWalls, d.varint())
		case IDSpent:
			wall, v := d.spentValue()
			sIDs, sWalls, sVals = append(sIDs, s.ID), append(sWalls, wall), append(sVals, v)
		default:
			return fmt.Errorf("%w: stored id %q of account %q has kind %d, this build knows %q, %q and %q (a newer quotad's? run that one or a later one)", ErrCorruptRecord, s.ID, a.cfg.ID, s.Kind, IDClient, IDRefunded, IDSpent)
		}
		if d.err != nil {
			return fmt.Errorf("%w: stored id %q of account %q: %v", ErrCorruptRecord, s.ID, a.cfg.ID, d.err)
		}
		if len(d.b) != 0 {
			return fmt.Errorf("%w: stored id %q of account %q: %d bytes left over (a newer quotad's? run that one or a later one)", ErrCorruptRecord, s.ID, a.cfg.ID, len(d.b))
		}
	}
	a.dedup.restore(dIDs, dWalls, dVals)
	a.refunded.restore(rIDs, rWalls, make([]struct{}, len(rIDs)))
	a.spent.restore(sIDs, sWalls, sVals)
	return nil
}

func appendBool(dst []byte, b bool) []byte {
	if b {
		return append(dst, 1)
	}
	return append(dst, 0)
}

// RestoreCheckpoint replaces the account's durable state with a checkpoint
// written by AppendCheckpoint, then re-applies the current config (units and
// credits come from the config, use and allowances from the checkpoint).
func (a *Account) RestoreCheckpoint(b []byte) error {
	d := decoder{b: b}
	if v := d.byte(); v != checkpointVersion {
		return fmt.Errorf("%w: checkpoint of account %q has version %d, this build reads %d", ErrCorruptRecord, a.cfg.ID, v, checkpointVersion)
	}
	var n Account
	n.cfg = a.cfg
	n.LastSeq = d.uvarint()
	n.period = d.period()
	n.seen = d.varint()
	for i, k := 0, d.count(); i < int(k) && d.err == nil; i++ {
		g := grant{id: d.string(), monthly: d.byte() == 1}
		g.startsAt, g.expiresAt, g.units, g.used, g.allowance = d.varint(), d.varint(), d.varint(), d.varint(), d.varint()
		n.grants = append(n.grants, g)
	}
	for i, k := 0, d.count(); i < int(k) && d.err == nil; i++ {
		n.addRoute(d.string(), d.varint())
	}
	inline := 0
	for i, k := 0, d.count(); i < int(k) && d.err == nil; i++ {
		id := d.string()
		wall, e := d.dedupValue()
		n.dedup.put(id, wall, e)
		inline++
	}
	for i, k := 0, d.count(); i < int(k) && d.err == nil; i++ {
		n.refunded.put(d.string(), d.varint(), struct{}{})
		inline++
	}
	if d.err != nil || len(d.b) != 0 {
		return fmt.Errorf("%w: checkpoint of account %q: %v (%d bytes left)", ErrCorruptRecord, a.cfg.ID, d.err, len(d.b))
	}
	n.dedup.changed, n.refunded.changed = nil, nil
	if inline > 0 {
		// Written inline (by a build before ids were stored apart, or by
		// AppendCheckpoint): the next drain stores them all apart, over
		// anything stored before.
		n.RewriteIDs()
	}
	*a = n
	a.Configure(a.cfg)
	return nil
}

// names says refund record rec is of the charge e: the same generation, and
// the same charge time (ChargeWall, when the record has one). Live, a
// receipt's refund of an earlier use of the id (last month's, of the same
// generation) left the remembered charge alone; replayed by generation
// alone, it marked the remembered one refunded, and the client's retry of
// that charge was billed again after a restart.
func (e event) names(rec *Record) bool {
	return e.gen == rec.Gen && (rec.ChargeWall == 0 || rec.ChargeWall == e.chargeAt)
}
