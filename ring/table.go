package ring

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/buraksezer/consistent"
	"github.com/cespare/xxhash/v2"
)

// Defaults for Layout. They are part of the cluster's identity: the first one
// fixes which partition every account hashes to, the other two which member
// owns each partition. Changing any of them re-homes accounts, so a rolling
// deploy with a different value would give accounts two owners; the golden
// test in testdata/ fails when that happens. doc.go explains the choice.
const (
	DefaultPartitionCount    = 1021
	DefaultReplicationFactor = 100
	DefaultLoad              = 1.25
)

// ErrTooManyMembers is returned (wrapped) when the serving members cannot be
// placed within the load bound: there are more members than partitions.
var ErrTooManyMembers = errors.New("ring: too many members for the partition count")

// Layout is the shape of the ring: every node of a cluster must use the same
// one.
type Layout struct {
	// PartitionCount is the number of partitions accounts hash into
	// (xxhash64 of the account id, modulo PartitionCount). It bounds the
	// cluster size: at most PartitionCount serving members.
	PartitionCount int
	// ReplicationFactor is the number of points (virtual nodes) each member
	// has on the hash circle. At least 2 (see Validate).
	ReplicationFactor int
	// Load bounds a member's partitions to ceil(floor(P/members) * Load).
	// Must be above 1.
	Load float64
}

// DefaultLayout returns the layout quotad uses: 1021 partitions, 100 points
// per member, load bound 1.25.
func DefaultLayout() Layout {
	return Layout{
		PartitionCount:    DefaultPartitionCount,
		ReplicationFactor: DefaultReplicationFactor,
		Load:              DefaultLoad,
	}
}

// Validate refuses layouts with which consistent would panic or misbehave.
func (l Layout) Validate() error {
	if l.PartitionCount < 1 {
		return fmt.Errorf("ring: PartitionCount %d: must be at least 1", l.PartitionCount)
	}
	// NB: consistent places a partition by walking at most len(points)-1
	// points clockwise looking for a member under the bound. With one point
	// per member the walk can miss the only member with room (with one
	// member it misses it always) and consistent panics. Two points per
	// member guarantee every member is visited.
	if l.ReplicationFactor < 2 {
		return fmt.Errorf("ring: ReplicationFactor %d: must be at least 2", l.ReplicationFactor)
	}
	if math.IsNaN(l.Load) || math.IsInf(l.Load, 0) || l.Load <= 1.0 {
		return fmt.Errorf("ring: Load %v: must be a finite number above 1.0 (at 1.0 the members cannot hold every partition and consistent panics)", l.Load)
	}
	return nil
}

// Fits reports whether members serving members can share the partitions
// under the load bound. It repeats consistent's own arithmetic
// (averageLoad), so Fits(m) true means consistent.New cannot panic for lack
// of room.
func (l Layout) Fits(members int) bool {
	if members < 1 {
		return true
	}
	if members > l.PartitionCount {
		return false
	}
	perMember := math.Ceil(float64(l.PartitionCount/members) * l.Load)
	return float64(members)*perMember >= float64(l.PartitionCount)
}

// Partition returns the partition of account: xxhash64 of its bytes modulo
// PartitionCount, the same value consistent.FindPartitionID computes.
func (l Layout) Partition(account string) int {
	return int(xxhash.Sum64String(account) % uint64(l.PartitionCount))
}

// fingerprint names the layout in node meta, to detect peers that disagree.
func (l Layout) fingerprint() uint32 {
	var b [24]byte
	binary.BigEndian.PutUint64(b[0:], uint64(l.PartitionCount))
	binary.BigEndian.PutUint64(b[8:], uint64(l.ReplicationFactor))
	binary.BigEndian.PutUint64(b[16:], math.Float64bits(l.Load))
	return uint32(xxhash.Sum64(b[:]))
}

// Table is an immutable partition table: which member owns each partition
// for one set of members. It is the pure core of the package (no goroutines,
// no I/O) and is safe for concurrent use. Two tables built from the same
// layout and the same member IDs are equal, on any node, whatever the order
// the members were given in.
type Table struct {
	layout  Layout
	epoch   uint64
	members []Meta  // sorted by ID
	owners  []int32 // partition -> index into members; nil when members is empty
}

// NewTable places members on the ring. Every member given owns partitions;
// their State is not consulted (Ring passes only serving members). IDs must
// be unique and non-empty. It returns an error wrapping ErrTooManyMembers
// when the members do not fit the layout, never a panic.
func NewTable(l Layout, members []Meta) (*Table, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	ms := slices.Clone(members)
	slices.SortFunc(ms, func(a, b Meta) int { return strings.Compare(a.ID, b.ID) })
	for i, m := range ms {
		if m.ID == "" {
			return nil, errors.New("ring: member with empty ID")
		}
		if i > 0 && ms[i-1].ID == m.ID {
			return nil, fmt.Errorf("ring: duplicate member ID %q", m.ID)
		}
	}
	t := &Table{layout: l, members: ms, epoch: epochOf(l, ms)}
	if len(ms) == 0 {
		return t, nil
	}
	if !l.Fits(len(ms)) {
		return nil, fmt.Errorf("%w: %d members, %d partitions, load %v", ErrTooManyMembers, len(ms), l.PartitionCount, l.Load)
	}
	owners, err := place(l, ms)
	if err != nil {
		return nil, err
	}
	t.owners = owners
	return t, nil
}

// withMembers returns a table with the same owners and updated member
// details (addresses), when the IDs are the same, to skip a rebuild.
func (t *Table) withMembers(members []Meta) (*Table, bool) {
	ms := slices.Clone(members)
	slices.SortFunc(ms, func(a, b Meta) int { return strings.Compare(a.ID, b.ID) })
	if !slices.EqualFunc(ms, t.members, func(a, b Meta) bool { return a.ID == b.ID }) {
		return nil, false
	}
	if slices.Equal(ms, t.members) {
		return t, true
	}
	return &Table{layout: t.layout, epoch: t.epoch, members: ms, owners: t.owners}, true
}

// place runs consistent's bounded-load placement and flattens its answer
// into a slice, so lookups take no lock and allocate nothing.
func place(l Layout, ms []Meta) (owners []int32, err error) {
	// NB: Fits already rules out the panics we know of. This recover is the
	// backstop for ones we don't: a panic here would kill the ring's only
	// goroutine and with it the node, while an error keeps the last ring.
	defer func() {
		if p := recover(); p != nil {
			owners, err = nil, fmt.Errorf("ring: consistent panicked placing %d members: %v", len(ms), p)
		}
	}()
	cms := make([]consistent.Member, len(ms))
	index := make(map[string]int32, len(ms))
	for i, m := range ms {
		cms[i] = circleMember(m.ID)
		index[circleMember(m.ID).String()] = int32(i)
	}
	c := consistent.New(cms, consistent.Config{
		Hasher:            hasher{},
		PartitionCount:    l.PartitionCount,
		ReplicationFactor: l.ReplicationFactor,
		Load:              l.Load,
	})
	owners = make([]int32, l.PartitionCount)
	for p := range owners {
		o := c.GetPartitionOwner(p)
		if o == nil {
			return nil, fmt.Errorf("ring: partition %d has no owner", p)
		}
		owners[p] = index[o.String()]
	}
	return owners, nil
}

// circleMember is a member's name on consistent's circle. consistent names
// its points fmt.Sprintf("%s%d", name, i), so the bare IDs "node-1" and
// "node-11" would share the point "node-110" (i=10 and i=0). The "@" ends the
// ID: the last "@" in a point name separates name from number, so distinct
// IDs always give distinct points.
type circleMember string

func (m circleMember) String() string { return string(m) + "@" }

// hasher is consistent's Hasher: xxhash64.
type hasher struct{}

func (hasher) Sum64(b []byte) uint64 { return xxhash.Sum64(b) }

// epochOf hashes the layout and the sorted member IDs. The empty set is
// epoch 0; no other set is.
func epochOf(l Layout, sorted []Meta) uint64 {
	if len(sorted) == 0 {
		return 0
	}
	d := xxhash.New()
	var b [binary.MaxVarintLen64]byte
	_, _ = d.WriteString("quotaring/ring/v1")
	binary.BigEndian.PutUint32(b[:4], l.fingerprint())
	_, _ = d.Write(b[:4])
	for _, m := range sorted {
		_, _ = d.Write(binary.AppendUvarint(b[:0], uint64(len(m.ID))))
		_, _ = d.WriteString(m.ID)
	}
	if e := d.Sum64(); e != 0 {
		return e
	}
	return 1
}

// Layout returns the layout the table was built with.
func (t *Table) Layout() Layout { return t.layout }

// Epoch names the set of members: see the package doc.
func (t *Table) Epoch() uint64 { return t.epoch }

// Members returns the members on the table, sorted by ID. The slice is a
// copy.
func (t *Table) Members() []Meta { return slices.Clone(t.members) }

// Partition returns the partition account hashes to.
func (t *Table) Partition(account string) int { return t.layout.Partition(account) }

// Owner returns the member that owns account, or false when the table has no
// members.
func (t *Table) Owner(account string) (Meta, bool) {
	return t.OwnerOfPartition(t.layout.Partition(account))
}

// OwnerOfPartition returns the owner of partition p, or false when the table
// has no members or p is out of range.
func (t *Table) OwnerOfPartition(p int) (Meta, bool) {
	if p < 0 || p >= len(t.owners) {
		return Meta{}, false
	}
	return t.members[t.owners[p]], true
}

// Owners returns partition -> owner ID, or nil when there are no members.
func (t *Table) Owners() []string {
	if t.owners == nil {
		return nil
	}
	out := make([]string, len(t.owners))
	for p, i := range t.owners {
		out[p] = t.members[i].ID
	}
	return out
}

// PartitionsOf returns the partitions id owns, ascending.
func (t *Table) PartitionsOf(id string) []int {
	var out []int
	for p, i := range t.owners {
		if t.members[i].ID == id {
			out = append(out, p)
		}
	}
	return out
}
