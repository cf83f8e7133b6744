package shard

import (
	"encoding/binary"
	"fmt"
	"math"
	"strconv"
)

// RecordType says what a Record changed.
type RecordType uint8

// Record types. The numbers are part of the log format: never reuse one.
const (
	RecCharge  RecordType = 1 // units spent from grants
	RecRefund  RecordType = 2 // an event's units returned to its grants
	RecReserve RecordType = 3 // this node's allowance on a grant changed by Delta
	RecReplay  RecordType = 4 // a retry answered Replayed (Delta 1), or one taken back (Delta -1)
)

func (t RecordType) String() string {
	switch t {
	case RecCharge:
		return "charge"
	case RecRefund:
		return "refund"
	case RecReserve:
		return "reserve"
	case RecReplay:
		return "replay"
	}
	return fmt.Sprintf("rectype(%d)", uint8(t))
}

// Alloc is the part of a charge that one grant paid.
type Alloc struct {
	Grant string
	Units int64
}

// Record is one state change to log before answering. Strings refer to the
// caller's request and the account's grants: Encode copies them out.
type Record struct {
	Type     RecordType
	Wall     int64 // when it happened, Unix ns
	Account  string
	EventID  string // charge, refund
	ClientID bool   // charge: EventID came from the client
	// Attempt marks a refund of one attempt's charge (RefundAttempt, the
	// HTTP front's): the ledger keeps the event when a retry was served
	// under it elsewhere. A refund without it returns the event's units.
	Attempt bool
	// Origin, on an attempt's refund, names the node that charged the
	// attempt when it is not this one (the account moved since): this node
	// holds nothing of that charge but the use it counts of it (from the
	// ledger), which the record lowers; the rest is the ledger's to decide.
	// Empty: this node charged it. On a replay taken back, it names the
	// node that answered the replay.
	Origin string
	// Kept marks an attempt's refund held back because retries answered
	// Replayed may have been served under the charge (the event stays
	// billed; its units stay spent): the ledger holds it pending too, so
	// that the last replay's take-back releases it wherever that is logged.
	Kept bool
	// Released marks an attempt's refund that was held back (Kept) and
	// applies now, released by the take-back of the charge's last replay:
	// the ledger counts that replay off first.
	Released bool
	// Gen is the generation of a client id: 0 for its first charge, n after
	// n refunded charges of the same id (a retry of work that failed is
	// charged again). The ledger's event id is LedgerEventID(EventID, Gen).
	Gen uint32
	// Reserved says the units came from (charge) or went back to (refund)
	// this node's reservation: the ledger moves them between used and this
	// node's reserved units accordingly. Refunds no longer set it (their
	// units go back to the grant's free units: see Account.refund); the
	// ledger and recovery still honour it on records older versions logged.
	Reserved bool
	Key      string // charge, refund: API key id
	Route    string // charge, refund
	Units    int64  // charge, refund: total units
	Period   Period // charge, refund: the period the charge was billed in
	// ChargeWall is, on a refund, when the refunded charge happened (so usage
	// by day is corrected on the right day).
	ChargeWall int64
	Allocs     []Alloc // charge, refund: per grant; sums to Units
	Grant      string  // reserve
	Delta      int64   // reserve: allowance change (negative: released); replay: 1 answered, -1 taken back
	// A replay's log record holds EventID, Gen, Period, Delta and Origin;
	// Charge fills Key, Route, Units, ChargeWall and Allocs too, from the
	// charge replayed, for the caller's receipt (they are not encoded).

	// Target is, on a charge with a client id, the digest of the request
	// the id names (Charge.Target; 0: none), so that a restarted owner
	// still refuses the id for another request.
	Target uint64

	// ReplaySeq is, on a replay taken back (Delta -1) and on the refund a
	// take-back released (Released), the seq of the replay's own record at
	// the node that answered it (Origin, or this one): it names the replay,
	// so that the ledger counts a take-back asked twice (at two owners) off
	// once, and a restarted owner still knows it was taken back. 0: not
	// named (a caller without the replay's receipt, or an older build).
	ReplaySeq uint64

	allocBuf [4]Alloc
}

// reset clears r for reuse, keeping its inline allocation buffer.
func (r *Record) reset(t RecordType, account string, wall int64) {
	*r = Record{Type: t, Account: account, Wall: wall, allocBuf: r.allocBuf}
	r.Allocs = r.allocBuf[:0]
}

// AppendEncode appends the binary form of r to dst. The layout, after the
// wal's frame (version byte, checksum):
//
//	charge:  type=1 | wall varint | account | event | flags byte (bit 0: client id, bit 1: reserved,
//	         bit 2: a generation follows, bit 7: a target follows) | [gen uvarint] | key | route | units uvarint
//	         | period uvarint | n uvarint | n × (grant | units uvarint) | [target: 8 bytes, little-endian]
//	refund:  type=2 | wall varint | account | event | flags byte (bit 1: reserved, bit 2: generation, bit 3: attempt,
//	         bit 4: origin) | [gen uvarint] | [origin] | key | route | units uvarint | period uvarint | charge wall varint
//	         | n uvarint | n × (grant | units uvarint)
//	reserve: type=3 | wall varint | account | grant | delta varint
//	replay:  type=4 | wall varint | account | event | flags byte (bit 2: generation, bit 4: origin,
//	         bit 7: a replay seq follows) | [gen uvarint] | [origin] | period uvarint | delta varint | [replay seq uvarint]
//
// where a refund's flags also carry bit 5 (Kept), bit 6 (Released) and bit 7
// (a replay seq follows, after the allocations), and a string is a uvarint
// length followed by its bytes. The target and the replay seq come last so
// that a quotad from before them (which ignores bit 7, or refuses it on a
// refund or a replay) finds trailing bytes or a flag it does not take and
// refuses the record as corrupt rather than misreading it. Bit 7 is the
// flags byte's last: a later field needs a new record type (which an older
// quotad refuses by its number).
func (r *Record) AppendEncode(dst []byte) []byte {
	dst = append(dst, byte(r.Type))
	dst = binary.AppendVarint(dst, r.Wall)
	dst = appendString(dst, r.Account)
	switch r.Type {
	case RecCharge:
		dst = appendString(dst, r.EventID)
		dst = r.appendFlags(dst)
		dst = appendString(dst, r.Key)
		dst = appendString(dst, r.Route)
		dst = binary.AppendUvarint(dst, uint64(r.Units))
		dst = binary.AppendUvarint(dst, uint64(r.Period))
		dst = appendAllocs(dst, r.Allocs)
		dst = appendTarget(dst, r.Target)
	case RecRefund:
		dst = appendString(dst, r.EventID)
		dst = r.appendFlags(dst)
		dst = appendString(dst, r.Key)
		dst = appendString(dst, r.Route)
		dst = binary.AppendUvarint(dst, uint64(r.Units))
		dst = binary.AppendUvarint(dst, uint64(r.Period))
		dst = binary.AppendVarint(dst, r.ChargeWall)
		dst = appendAllocs(dst, r.Allocs)
		if r.ReplaySeq != 0 {
			dst = binary.AppendUvarint(dst, r.ReplaySeq)
		}
	case RecReserve:
		dst = appendString(dst, r.Grant)
		dst = binary.AppendVarint(dst, r.Delta)
	case RecReplay:
		dst = appendString(dst, r.EventID)
		dst = r.appendFlags(dst)
		dst = binary.AppendUvarint(dst, uint64(r.Period))
		dst = binary.AppendVarint(dst, r.Delta)
		if r.ReplaySeq != 0 {
			dst = binary.AppendUvarint(dst, r.ReplaySeq)
		}
	}
	return dst
}

func (r *Record) appendFlags(dst []byte) []byte {
	var f byte
	if r.ClientID {
		f |= 1
	}
	if r.Reserved {
		f |= 2
	}
	if r.Gen != 0 {
		f |= 4
	}
	if r.Attempt {
		f |= 8
	}
	if r.Origin != "" {
		f |= 16
	}
	if r.Kept {
		f |= 32
	}
	if r.Released {
		f |= 64
	}
	if (r.Target != 0 && r.Type == RecCharge) || (r.ReplaySeq != 0 && (r.Type == RecRefund || r.Type == RecReplay)) {
		f |= 128
	}
	dst = append(dst, f)
	if r.Gen != 0 {
		dst = binary.AppendUvarint(dst, uint64(r.Gen))
	}
	if r.Origin != "" {
		dst = appendString(dst, r.Origin)
	}
	return dst
}

// flags reads the flags byte and what follows it; it reports whether a
// target (a charge) or a replay seq (a refund, a replay) follows at the
// record's end (bit 7).
func (d *decoder) flags(r *Record) (target bool) {
	f := d.byte()
	r.ClientID, r.Reserved, r.Attempt = f&1 != 0, f&2 != 0, f&8 != 0
	r.Kept, r.Released = f&32 != 0, f&64 != 0
	if f&4 != 0 {
		g := d.uvarint()
		if g == 0 || g > 1<<31 {
			d.fail("generation")
		}
		r.Gen = uint32(g)
	}
	if f&16 != 0 {
		r.Origin = d.string()
	}
	return f&128 != 0
}

// replaySeq reads a record's replay seq (Record.ReplaySeq), never 0.
func (d *decoder) replaySeq() uint64 {
	v := d.uvarint()
	if v == 0 {
		d.fail("replay seq")
	}
	return v
}

// LedgerEventID is the event id the ledger keeps for a charge: the id
// itself for its first generation, then id + U+001F + the generation (a unit
// separator, which an Idempotency-Key, printable ASCII, cannot contain).
func LedgerEventID(id string, gen uint32) string {
	if gen == 0 {
		return id
	}
	return id + "\x1f" + strconv.FormatUint(uint64(gen), 10)
}

func appendString(dst []byte, s string) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

func appendAllocs(dst []byte, as []Alloc) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(as)))
	for _, a := range as {
		dst = appendString(dst, a.Grant)
		dst = binary.AppendUvarint(dst, uint64(a.Units))
	}
	return dst
}

// Decode reads a record written by AppendEncode. The strings are copies, so
// r does not refer to b afterwards.
func (r *Record) Decode(b []byte) error {
	d := decoder{b: b}
	t := RecordType(d.byte())
	r.reset(t, "", 0)
	r.Wall = d.varint()
	r.Account = d.string()
	switch t {
	case RecCharge:
		r.EventID = d.string()
		target := d.flags(r)
		r.Key, r.Route = d.string(), d.string()
		r.Units, r.Period = d.count(), d.period()
		r.Allocs = d.allocs(r.Allocs)
		if target {
			r.Target = d.target()
		}
	case RecRefund:
		r.EventID = d.string()
		replaySeq := d.flags(r)
		r.Key, r.Route = d.string(), d.string()
		r.Units, r.Period = d.count(), d.period()
		r.ChargeWall = d.varint()
		r.Allocs = d.allocs(r.Allocs)
		if replaySeq {
			r.ReplaySeq = d.replaySeq()
		}
	case RecReserve:
		r.Grant = d.string()
		r.Delta = d.varint()
	case RecReplay:
		r.EventID = d.string()
		replaySeq := d.flags(r)
		r.Period = d.period()
		if r.Delta = d.varint(); r.Delta != 1 && r.Delta != -1 && d.err == nil {
			d.fail("replay delta")
		}
		if replaySeq {
			r.ReplaySeq = d.replaySeq()
		}
	default:
		return fmt.Errorf("%w: unknown type %d (a newer quotad's? run that one or a later one)", ErrCorruptRecord, t)
	}
	if d.err != nil {
		return fmt.Errorf("%w: %s record: %v", ErrCorruptRecord, t, d.err)
	}
	if len(d.b) != 0 {
		return fmt.Errorf("%w: %s record: %d trailing bytes (a newer quotad's? run that one or a later one)", ErrCorruptRecord, t, len(d.b))
	}
	return nil
}

// decoder reads the primitives of the record format, remembering the first
// error so callers check once.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("truncated or malformed %s", what)
	}
	d.b = nil
}

func (d *decoder) byte() byte {
	if len(d.b) < 1 {
		d.fail("byte")
		return 0
	}
	c := d.b[0]
	d.b = d.b[1:]
	return c
}

func (d *decoder) varint() int64 {
	v, n := binary.Varint(d.b)
	if n <= 0 {
		d.fail("varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) uvarint() uint64 {
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail("uvarint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

// appendTarget appends a request digest (Charge.Target) as 8 bytes,
// little-endian, or nothing for 0 (none): the record or stored id says in
// its flags whether one follows.
func appendTarget(dst []byte, target uint64) []byte {
	if target == 0 {
		return dst
	}
	return binary.LittleEndian.AppendUint64(dst, target)
}

// target reads what appendTarget wrote for a digest; 0, which is written
// as none, is malformed.
func (d *decoder) target() uint64 {
	if len(d.b) < 8 {
		d.fail("target")
		return 0
	}
	v := binary.LittleEndian.Uint64(d.b)
	d.b = d.b[8:]
	if v == 0 {
		d.fail("target (0 is written as none)")
	}
	return v
}

// count reads a non-negative int64.
func (d *decoder) count() int64 {
	v := d.uvarint()
	if v > 1<<62 {
		d.fail("count")
		return 0
	}
	return int64(v)
}

// period reads a Period, which is never negative and fits its int32.
func (d *decoder) period() Period {
	v := d.uvarint()
	if v > math.MaxInt32 {
		d.fail("period")
		return 0
	}
	return Period(v)
}

func (d *decoder) string() string {
	n := d.uvarint()
	if n > uint64(len(d.b)) {
		d.fail("string")
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}

func (d *decoder) allocs(dst []Alloc) []Alloc {
	n := d.uvarint()
	if n > uint64(len(d.b)) { // each alloc takes at least 2 bytes
		d.fail("allocations")
		return dst
	}
	for i := uint64(0); i < n && d.err == nil; i++ {
		dst = append(dst, Alloc{Grant: d.string(), Units: d.count()})
	}
	return dst
}
