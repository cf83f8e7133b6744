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
			a.dedup.expire(a.seen, params.DedupWindow, params.DedupMax)
			a.dedup.put(rec.EventID, a.seen, event{gen: rec.Gen, units: rec.Units, seq: seq, period: rec.Period, chargeAt: rec.Wall,
				key: rec.Key, route: rec.Route, allocs: slices.Clone(rec.Allocs)})
		}
	case RecRefund:
		if rec.Origin != "" {
			break // another node's charge: nothing of it is here (see Record.Origin)
		}
		a.advance(rec.Wall)
		a.dedup.expire(a.seen, params.DedupWindow, params.DedupMax)
		a.refunded.expire(a.seen, params.DedupWindow, params.DedupMax)
		if rec.Kept {
			// Held back while replays may be served: pending, nothing returned.
			if e, ok := a.dedup.get(rec.EventID, a.seen, params.DedupWindow); ok && e.gen == rec.Gen {
				e.pending = true
				a.dedup.update(rec.EventID, e)
			}
			break
		}
		if e, ok := a.dedup.get(rec.EventID, a.seen, params.DedupWindow); ok && e.gen == rec.Gen {
			e.refunded = true
			a.dedup.update(rec.EventID, e)
		} else {
			a.refunded.put(rec.EventID, a.seen, struct{}{})
		}
		a.unspend(rec)
	case RecReplay:
		if rec.Origin != "" {
			break // another node's replay: nothing of it is here
		}
		a.advance(rec.Wall)
		a.dedup.expire(a.seen, params.DedupWindow, params.DedupMax)
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
// full):
//
//	version=1 | last seq uvarint | period uvarint | latest wall varint
//	| n × grant (id | monthly byte | starts varint | expires varint | units varint | used varint | allowance varint)
//	| n × route (route | units varint)
//	| n × client id (id | gen uvarint | wall varint | units varint | seq uvarint | period uvarint | charge wall varint
//	                 | flags byte (bit 0: refunded, bit 1: an attempt's refund pending) | replays uvarint | key | route
//	                 | n × (grant | units uvarint))
//	| n × refunded id (id | wall varint)
func (a *Account) AppendCheckpoint(dst []byte) []byte {
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
	dst = binary.AppendUvarint(dst, uint64(a.dedup.len()))
	a.dedup.each(func(id string, wall int64, e event) {
		dst = appendString(dst, id)
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
		dst = append(dst, flags)
		dst = binary.AppendUvarint(dst, uint64(e.replays))
		dst = appendString(dst, e.key)
		dst = appendString(dst, e.route)
		dst = appendAllocs(dst, e.allocs)
	})
	dst = binary.AppendUvarint(dst, uint64(a.refunded.len()))
	a.refunded.each(func(id string, wall int64, _ struct{}) {
		dst = appendString(dst, id)
		dst = binary.AppendVarint(dst, wall)
	})
	return dst
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
	n.period = Period(d.count())
	n.seen = d.varint()
	for i, k := 0, d.count(); i < int(k) && d.err == nil; i++ {
		g := grant{id: d.string(), monthly: d.byte() == 1}
		g.startsAt, g.expiresAt, g.units, g.used, g.allowance = d.varint(), d.varint(), d.varint(), d.varint(), d.varint()
		n.grants = append(n.grants, g)
	}
	for i, k := 0, d.count(); i < int(k) && d.err == nil; i++ {
		n.addRoute(d.string(), d.varint())
	}
	for i, k := 0, d.count(); i < int(k) && d.err == nil; i++ {
		id, gen, wall := d.string(), uint32(d.uvarint()), d.varint()
		e := event{gen: gen, units: d.varint(), seq: d.uvarint(), period: Period(d.count()), chargeAt: d.varint()}
		flags := d.byte()
		e.refunded, e.pending = flags&1 != 0, flags&2 != 0
		e.replays = int32(min(d.uvarint(), 1<<30))
		e.key, e.route = d.string(), d.string()
		e.allocs = d.allocs(nil)
		n.dedup.put(id, wall, e)
	}
	for i, k := 0, d.count(); i < int(k) && d.err == nil; i++ {
		n.refunded.put(d.string(), d.varint(), struct{}{})
	}
	if d.err != nil || len(d.b) != 0 {
		return fmt.Errorf("%w: checkpoint of account %q: %v (%d bytes left)", ErrCorruptRecord, a.cfg.ID, d.err, len(d.b))
	}
	*a = n
	a.Configure(a.cfg)
	return nil
}
