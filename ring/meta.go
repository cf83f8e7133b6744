package ring

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/hashicorp/memberlist"
)

// State is a member's place in its lifecycle. Only StateServing members are
// on the ring; joining and draining members are alive (they gossip, answer
// RPCs, appear in View.Members) but own no partition.
type State string

const (
	// StateJoining is the state a node starts in: it is loading its log and
	// snapshot and must not be given accounts yet.
	StateJoining State = "joining"
	// StateServing members own partitions.
	StateServing State = "serving"
	// StateDraining members are on their way out: they own nothing, so the
	// rest of the ring takes their accounts while they settle and release.
	StateDraining State = "draining"
)

// Valid reports whether s is one of the three states.
func (s State) Valid() bool {
	return s == StateJoining || s == StateServing || s == StateDraining
}

// Meta describes a member. ID and GossipAddr come from memberlist (the node
// name and its advertised address); the rest travels as memberlist node meta,
// encoded by encodeMeta.
type Meta struct {
	ID         string // node name, unique in the cluster
	GossipAddr string // advertised memberlist address, host:port
	RPCAddr    string // internal RPC (router)
	HTTPAddr   string // public HTTP front
	AdminAddr  string // metrics, health, admin API
	State      State
	// Clock is what the member last found of its clock against the
	// ledger's (SetClock).
	Clock ClockVerdict
	// Preset is the memberlist preset the member runs (Config.Preset,
	// quotad serve --ring-preset), filled in by the ring; empty from a
	// member of a version that does not say.
	Preset string
}

// ClockVerdict is what a member last found of the clock it bills by against
// the ledger's. Each node decides an account's month from its own clock; a
// node whose clock is off the ledger's follows the ledger's time only when
// the other members' verdicts side with the ledger, since a wrong ledger
// clock must not carry every node into another month.
type ClockVerdict uint8

const (
	// ClockUnknown: not checked yet (the ledger not reached), or a member
	// of a version that does not say.
	ClockUnknown ClockVerdict = iota
	// ClockAgrees: within the node's tolerance of the ledger's clock.
	ClockAgrees
	// ClockOff: past it.
	ClockOff
)

func (v ClockVerdict) String() string {
	switch v {
	case ClockAgrees:
		return "agrees"
	case ClockOff:
		return "off"
	}
	return "unknown"
}

// MaxMetaSize is the largest encoded meta memberlist accepts (its
// MetaMaxSize). Config.Validate refuses a Meta whose encoding is larger.
const MaxMetaSize = memberlist.MetaMaxSize

// metaVersion is the first byte of the encoded meta. It changes only for an
// incompatible encoding; compatible additions are appended after the known
// fields, and decoders ignore trailing bytes.
const metaVersion = 1

// State codes on the wire. Zero is never written, so a zeroed buffer does not
// decode as a valid member.
const (
	stateCodeJoining  = 1
	stateCodeServing  = 2
	stateCodeDraining = 3
)

// errBadMeta reports node meta this version cannot read: a node from another
// program, a newer incompatible encoding, or corruption.
var errBadMeta = errors.New("ring: bad node meta")

// encodeMeta encodes the parts of m that memberlist does not already carry.
// Layout (every integer big-endian or uvarint as noted):
//
//	+---------+-------+-------------+--------------+---------------+---------------+---------+--------------+
//	| version | state | layout fp   | len+RPCAddr  | len+HTTPAddr  | len+AdminAddr | clock   | len+Preset   |
//	| 1 byte  | 1 byte| 4 bytes     | uvarint+bytes| uvarint+bytes | uvarint+bytes | 1 byte  | uvarint+bytes|
//	+---------+-------+-------------+--------------+---------------+---------------+---------+--------------+
//
// The clock byte, added later, is written only when the verdict is known
// or a preset follows (then 0 for unknown); a decoder that finds none, or
// one it does not know, reads ClockUnknown. The preset, added after it, is
// written only when set; a decoder that finds none (an older node) reads
// "", which is no mismatch. Older decoders ignore both (trailing bytes).
//
// The layout fingerprint lets a node notice a peer that was started with a
// different PartitionCount, ReplicationFactor or Load: such peers compute
// different owners for the same members, which no epoch check can repair.
func encodeMeta(m Meta, layoutFP uint32) ([]byte, error) {
	code, err := stateCode(m.State)
	if err != nil {
		return nil, err
	}
	b := make([]byte, 0, 7+3*binary.MaxVarintLen16+len(m.RPCAddr)+len(m.HTTPAddr)+len(m.AdminAddr))
	b = append(b, metaVersion, code)
	b = binary.BigEndian.AppendUint32(b, layoutFP)
	for _, s := range []string{m.RPCAddr, m.HTTPAddr, m.AdminAddr} {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	switch {
	case m.Clock == ClockAgrees || m.Clock == ClockOff:
		b = append(b, byte(m.Clock))
	case m.Preset != "":
		b = append(b, byte(ClockUnknown))
	}
	if m.Preset != "" {
		b = binary.AppendUvarint(b, uint64(len(m.Preset)))
		b = append(b, m.Preset...)
	}
	if len(b) > MaxMetaSize {
		return nil, fmt.Errorf("ring: node meta is %d bytes, memberlist allows %d: shorten the addresses", len(b), MaxMetaSize)
	}
	return b, nil
}

// decodeMeta is the inverse of encodeMeta; id and gossipAddr come from the
// memberlist node that carried b.
func decodeMeta(id, gossipAddr string, b []byte) (Meta, uint32, error) {
	m := Meta{ID: id, GossipAddr: gossipAddr}
	if len(b) < 6 || b[0] != metaVersion {
		return m, 0, errBadMeta
	}
	switch b[1] {
	case stateCodeJoining:
		m.State = StateJoining
	case stateCodeServing:
		m.State = StateServing
	case stateCodeDraining:
		m.State = StateDraining
	default:
		return m, 0, errBadMeta
	}
	fp := binary.BigEndian.Uint32(b[2:6])
	rest := b[6:]
	for _, dst := range []*string{&m.RPCAddr, &m.HTTPAddr, &m.AdminAddr} {
		n, k := binary.Uvarint(rest)
		if k <= 0 || n > uint64(len(rest)-k) {
			return Meta{ID: id, GossipAddr: gossipAddr}, 0, errBadMeta
		}
		*dst = string(rest[k : k+int(n)])
		rest = rest[k+int(n):]
	}
	if len(rest) == 0 {
		return m, fp, nil
	}
	switch v := ClockVerdict(rest[0]); v {
	case ClockAgrees, ClockOff:
		m.Clock = v
	case ClockUnknown:
	default:
		return m, fp, nil // a newer field this version does not know: the preset cannot follow
	}
	// NB: a preset that does not parse is read as none, as from an older
	// node: the member is not refused for a field this version may not know.
	if n, k := binary.Uvarint(rest[1:]); k > 0 && n > 0 && n <= uint64(len(rest)-1-k) {
		m.Preset = string(rest[1+k : 1+k+int(n)])
	}
	return m, fp, nil
}

func stateCode(s State) (byte, error) {
	switch s {
	case StateJoining:
		return stateCodeJoining, nil
	case StateServing:
		return stateCodeServing, nil
	case StateDraining:
		return stateCodeDraining, nil
	}
	return 0, fmt.Errorf("ring: invalid state %q (want joining, serving or draining)", s)
}
