package ring

import (
	"bufio"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/buraksezer/consistent"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the golden files in testdata/")

func metas(ids ...string) []Meta {
	out := make([]Meta, len(ids))
	for i, id := range ids {
		out[i] = Meta{ID: id, State: StateServing}
	}
	return out
}

func seqIDs(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s%d", prefix, i+1)
	}
	return out
}

func mustTable(t testing.TB, l Layout, ids ...string) *Table {
	t.Helper()
	tbl, err := NewTable(l, metas(ids...))
	if err != nil {
		t.Fatal(err)
	}
	return tbl
}

func TestConfigValidate(t *testing.T) {
	valid := LocalConfig()
	valid.NodeID = "node-1"
	if err := valid.Validate(); err != nil {
		t.Fatalf("LocalConfig: %v", err)
	}
	lan := DefaultConfig()
	lan.NodeID = "node-1"
	if err := lan.Validate(); err != nil {
		t.Fatalf("DefaultConfig: %v", err)
	}
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
		want   string
	}{
		{"load 1.0", func(c *Config) { c.Load = 1.0 }, "Load 1"},
		{"load below 1", func(c *Config) { c.Load = 0.5 }, "Load 0.5"},
		{"load NaN", func(c *Config) { c.Load = math.NaN() }, "Load NaN"},
		{"0 partitions", func(c *Config) { c.PartitionCount = 0 }, "PartitionCount 0"},
		{"1 point per member", func(c *Config) { c.ReplicationFactor = 1 }, "ReplicationFactor 1"},
		{"empty id", func(c *Config) { c.NodeID = "" }, "NodeID is empty"},
		{"space in id", func(c *Config) { c.NodeID = "node 1" }, "space"},
		{"long id", func(c *Config) { c.NodeID = strings.Repeat("n", 129) }, "at most 128"},
		{"preset", func(c *Config) { c.Preset = "wan" }, "Preset"},
		{"bind addr", func(c *Config) { c.BindAddr = "localhost" }, "BindAddr"},
		{"port", func(c *Config) { c.BindPort = 70000 }, "ports"},
		{"advertise port unknown", func(c *Config) { c.AdvertiseAddr = "10.0.0.1" }, "advertised port"},
		{"join port", func(c *Config) { c.Join = []string{"seed:http"} }, "port must be"},
		{"join empty", func(c *Config) { c.Join = []string{""} }, "empty Join"},
		{"meta too large", func(c *Config) { c.Meta.RPCAddr = strings.Repeat("a", 600) }, "node meta is"},
		{"bad state", func(c *Config) { c.Meta.State = "sleeping" }, "invalid state"},
		{"rejoin interval", func(c *Config) { c.RejoinInterval = 0 }, "RejoinInterval"},
		{"forget", func(c *Config) { c.ForgetAfter = time.Millisecond }, "ForgetAfter"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := valid
			tc.mutate(&c)
			err := c.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate() = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// TestTooFewPartitions: more members than partitions is an error, not
// consistent's panic; exactly as many fits.
func TestTooFewPartitions(t *testing.T) {
	l := Layout{PartitionCount: 7, ReplicationFactor: 2, Load: 1.01}
	if _, err := NewTable(l, metas(seqIDs("n", 7)...)); err != nil {
		t.Fatalf("7 members on 7 partitions: %v", err)
	}
	_, err := NewTable(l, metas(seqIDs("n", 8)...))
	if !errors.Is(err, ErrTooManyMembers) {
		t.Fatalf("8 members on 7 partitions: %v, want ErrTooManyMembers", err)
	}
	if _, err := NewTable(Layout{PartitionCount: 7, ReplicationFactor: 2, Load: 1}, metas("a")); err == nil {
		t.Fatal("load 1.0 accepted")
	}
	if _, err := NewTable(DefaultLayout(), metas("a", "a")); err == nil {
		t.Fatal("duplicate IDs accepted")
	}
}

// TestFitsMatchesConsistent checks Layout.Fits against consistent itself
// over small layouts: whenever Validate and Fits accept, consistent must not
// panic. (The reverse need not hold: consistent sometimes gets lucky.)
func TestFitsMatchesConsistent(t *testing.T) {
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	for range 2000 {
		l := Layout{
			PartitionCount:    1 + rng.IntN(40),
			ReplicationFactor: 2 + rng.IntN(4),
			Load:              1 + rng.Float64()*2 + 1e-9,
		}
		m := 1 + rng.IntN(l.PartitionCount+3)
		if l.Validate() != nil || !l.Fits(m) {
			continue
		}
		func() {
			defer func() {
				if p := recover(); p != nil {
					t.Fatalf("%+v with %d members: Fits said yes, consistent panicked: %v", l, m, p)
				}
			}()
			cms := make([]consistent.Member, m)
			for i := range cms {
				cms[i] = circleMember(fmt.Sprint("m", i))
			}
			consistent.New(cms, consistent.Config{Hasher: hasher{}, PartitionCount: l.PartitionCount, ReplicationFactor: l.ReplicationFactor, Load: l.Load})
		}()
	}
}

// TestTableMatchesConsistent: the flattened table answers what consistent
// answers, and Partition is consistent's FindPartitionID.
func TestTableMatchesConsistent(t *testing.T) {
	l := DefaultLayout()
	ids := seqIDs("node-", 5)
	tbl := mustTable(t, l, ids...)
	cms := make([]consistent.Member, len(ids))
	for i, id := range ids {
		cms[i] = circleMember(id)
	}
	c := consistent.New(cms, consistent.Config{Hasher: hasher{}, PartitionCount: l.PartitionCount, ReplicationFactor: l.ReplicationFactor, Load: l.Load})
	for _, a := range accounts(5000) {
		if got, want := tbl.Partition(a), c.FindPartitionID([]byte(a)); got != want {
			t.Fatalf("Partition(%s) = %d, consistent says %d", a, got, want)
		}
		o, _ := tbl.Owner(a)
		if want := c.LocateKey([]byte(a)).String(); circleMember(o.ID).String() != want {
			t.Fatalf("Owner(%s) = %s, consistent says %s", a, o.ID, want)
		}
	}
}

// TestTableDeterministic: the table and epoch depend on the set of IDs, not
// on their order; the epoch changes with the set and with the layout.
func TestTableDeterministic(t *testing.T) {
	l := DefaultLayout()
	a := mustTable(t, l, "b", "a", "c")
	b := mustTable(t, l, "c", "b", "a")
	if a.Epoch() != b.Epoch() || !slices.Equal(a.Owners(), b.Owners()) {
		t.Fatal("member order changed the table")
	}
	if mustTable(t, l, "a", "b").Epoch() == a.Epoch() {
		t.Fatal("a different set has the same epoch")
	}
	l2 := l
	l2.PartitionCount = 1031
	if mustTable(t, l2, "a", "b", "c").Epoch() == a.Epoch() {
		t.Fatal("a different layout has the same epoch")
	}
	if e := mustTable(t, l).Epoch(); e != 0 {
		t.Fatalf("empty epoch = %x", e)
	}
	// Epochs must not confuse {"ab"} with {"a","b"}.
	if mustTable(t, l, "ab").Epoch() == mustTable(t, l, "a", "b").Epoch() {
		t.Fatal("epoch is not injective in the IDs")
	}
}

// TestCircleNamesDistinct: consistent names points name+number, so bare IDs
// "n1" and "n11" would collide ("n1"+"10" = "n11"+"0"). Ours must not.
func TestCircleNamesDistinct(t *testing.T) {
	ids := []string{"n", "n1", "n11", "n1@1", "n@", "1", "11", "n1@", "@"}
	seen := map[string]string{}
	for _, id := range ids {
		for i := range 100 {
			p := fmt.Sprintf("%s%d", circleMember(id).String(), i)
			if other, dup := seen[p]; dup {
				t.Fatalf("point %q shared by %q and %q", p, other, id)
			}
			seen[p] = id
		}
	}
}

// TestSpreadSequentialIDs: sequential account ids must spread evenly, not
// only random ones (a weak hash put 46% of such keys on one of three nodes
// in a peer system).
func TestSpreadSequentialIDs(t *testing.T) {
	const keys = 100000
	for _, prefix := range []string{"node-", "quotad-", "10.0.0.", "pod-abc-"} {
		for _, members := range []int{3, 10} {
			tbl := mustTable(t, DefaultLayout(), seqIDs(prefix, members)...)
			count := map[string]int{}
			for i := 1; i <= keys; i++ {
				o, _ := tbl.Owner("acct-" + strconv.Itoa(i))
				count[o.ID]++
			}
			mean := float64(keys) / float64(members)
			limit := 1.3 * mean // the load bound is 1.25x in partitions
			if members == 3 {
				limit = 0.40 * keys
			}
			for id, c := range count {
				if float64(c) > limit || float64(c) < 0.6*mean {
					t.Errorf("%d members %q...: %s has %d of %d keys (%.1f%%)", members, prefix, id, c, keys, 100*float64(c)/keys)
				}
			}
		}
	}
}

// TestGolden pins account -> partition and, for three members, partition
// -> owner. A failure here means a rolling deploy would re-home accounts:
// change the hash, layout or consistent only with a migration plan, then run
//
//	go test ./ring -run TestGolden -rewrite
func TestGolden(t *testing.T) {
	l := DefaultLayout()
	var part bytes.Buffer
	fmt.Fprintf(&part, "# account -> partition, %d partitions, xxhash64. Regenerate: go test ./ring -run TestGolden -rewrite\n", l.PartitionCount)
	odd := []string{"", " ", "ü", "acct-1\x00", "ACCT-1", "acct-01", strings.Repeat("x", 300), "a5c9e2f0-7d5e-4c55-9d3e-08a0d5a4e1b2"}
	for _, a := range append(accounts(50), odd...) {
		fmt.Fprintf(&part, "%q %d\n", a, l.Partition(a))
	}
	golden(t, "partitions.txt", part.Bytes())

	tbl := mustTable(t, l, "node-1", "node-2", "node-3")
	var own bytes.Buffer
	fmt.Fprintf(&own, "# partition -> owner for members node-1..3, layout %+v. Regenerate: go test ./ring -run TestGolden -rewrite\n", l)
	for p, id := range tbl.Owners() {
		fmt.Fprintf(&own, "%d %s\n", p, id)
	}
	fmt.Fprintf(&own, "epoch %x\n", tbl.Epoch())
	golden(t, "owners.txt", own.Bytes())
}

func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *rewrite {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run with -rewrite to create it)", err)
	}
	if bytes.Equal(got, want) {
		return
	}
	gs, ws := bufio.NewScanner(bytes.NewReader(got)), bufio.NewScanner(bytes.NewReader(want))
	for line := 1; ; line++ {
		g, w := gs.Scan(), ws.Scan()
		if !g && !w {
			break
		}
		if gs.Text() != ws.Text() {
			t.Fatalf("%s line %d:\n got  %s\n want %s\nthe mapping changed: accounts would be re-homed (see TestGolden)", path, line, gs.Text(), ws.Text())
		}
	}
}

// TestCompose checks compose against the definition on random ownership
// histories: applying the composed Change to the first set gives the last
// one, Lost only names partitions held, and every partition that was away
// at some point and is back at the end is both Lost and Gained.
func TestCompose(t *testing.T) {
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	const parts = 12
	randomSet := func() map[int]bool {
		s := map[int]bool{}
		for p := range parts {
			if rng.IntN(2) == 0 {
				s[p] = true
			}
		}
		return s
	}
	diff := func(a, b map[int]bool) Change {
		var c Change
		for p := range parts {
			switch {
			case a[p] && !b[p]:
				c.Lost = append(c.Lost, p)
			case b[p] && !a[p]:
				c.Gained = append(c.Gained, p)
			}
		}
		return c
	}
	for range 5000 {
		hist := []map[int]bool{randomSet()}
		var merged Change
		for i := range 1 + rng.IntN(5) {
			hist = append(hist, randomSet())
			c := diff(hist[i], hist[i+1])
			if i == 0 {
				merged = c
			} else {
				merged = compose(merged, c)
			}
		}
		s0, sn := hist[0], hist[len(hist)-1]
		got := map[int]bool{}
		for p := range s0 {
			got[p] = true
		}
		for _, p := range merged.Lost {
			if !got[p] {
				t.Fatalf("Lost %d not held; history %v", p, hist)
			}
			delete(got, p)
		}
		for _, p := range merged.Gained {
			if got[p] {
				t.Fatalf("Gained %d already held; history %v", p, hist)
			}
			got[p] = true
		}
		for p := range parts {
			if got[p] != sn[p] {
				t.Fatalf("partition %d: composed gives %v, want %v; history %v", p, got[p], sn[p], hist)
			}
			away := false
			for _, s := range hist {
				away = away || !s[p]
			}
			if s0[p] && sn[p] && away && !(slices.Contains(merged.Lost, p) && slices.Contains(merged.Gained, p)) {
				t.Fatalf("partition %d left and came back but the composed Change hides it; history %v", p, hist)
			}
		}
	}
}

// TestSlowSubscriber: a subscriber that never reads does not block
// delivery, and what it finally reads is the composition of everything.
func TestSlowSubscriber(t *testing.T) {
	s := &subscriber{ch: make(chan Change, 1)}
	s.deliver(Change{Epoch: 1, Gained: []int{1, 2, 3}})
	s.deliver(Change{Epoch: 2, Lost: []int{2}})
	s.deliver(Change{Epoch: 3, Gained: []int{2, 4}, Lost: []int{1}})
	s.deliver(Change{Epoch: 4, Lost: []int{4}})
	if len(s.ch) != 1 {
		t.Fatalf("%d Changes queued, want 1 composed", len(s.ch))
	}
	c := <-s.ch
	want := Change{Epoch: 4, Gained: []int{2, 3}}
	if c.Epoch != want.Epoch || !slices.Equal(c.Gained, want.Gained) || len(c.Lost) != 0 {
		t.Fatalf("composed %+v, want %+v", c, want)
	}
}

func TestMetaRoundTrip(t *testing.T) {
	m := Meta{ID: "n1", GossipAddr: "127.0.0.1:7946", RPCAddr: "10.0.0.1:9000", HTTPAddr: ":8080", AdminAddr: "", State: StateDraining}
	b, err := encodeMeta(m, 42)
	if err != nil {
		t.Fatal(err)
	}
	got, fp, err := decodeMeta("n1", "127.0.0.1:7946", b)
	if err != nil || got != m || fp != 42 {
		t.Fatalf("decode = %+v, %d, %v", got, fp, err)
	}
	// Appended fields from a newer version are ignored.
	if got, _, err := decodeMeta("n1", "127.0.0.1:7946", append(b, 9, 2, 3)); err != nil || got != m {
		t.Fatalf("decode with trailing bytes = %+v, %v", got, err)
	}
	// The clock verdict rides after the addresses, and is read back; a
	// meta without it (an older node) reads ClockUnknown.
	for _, v := range []ClockVerdict{ClockAgrees, ClockOff} {
		mc := m
		mc.Clock = v
		bc, err := encodeMeta(mc, 42)
		if err != nil || len(bc) != len(b)+1 {
			t.Fatalf("encode with clock %v: %d bytes, %v; want %d", v, len(bc), err, len(b)+1)
		}
		if got, _, err := decodeMeta("n1", "127.0.0.1:7946", append(bc, 7, 7)); err != nil || got != mc {
			t.Fatalf("decode with clock %v = %+v, %v", v, got, err)
		}
	}
	for _, bad := range [][]byte{nil, {2, 1, 0, 0, 0, 0}, {1, 9, 0, 0, 0, 0, 0, 0, 0}, b[:len(b)-3]} {
		if _, _, err := decodeMeta("n1", "", bad); !errors.Is(err, errBadMeta) {
			t.Fatalf("decode(%v) = %v, want errBadMeta", bad, err)
		}
	}
	if _, err := encodeMeta(Meta{State: StateServing, RPCAddr: strings.Repeat("a", MaxMetaSize)}, 0); err == nil {
		t.Fatal("oversized meta accepted")
	}
}

func FuzzDecodeMeta(f *testing.F) {
	b, _ := encodeMeta(Meta{RPCAddr: "a", HTTPAddr: "b", AdminAddr: "c", State: StateServing}, 7)
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		m, fp, err := decodeMeta("n", "g", b)
		if err != nil {
			return
		}
		again, err := encodeMeta(m, fp)
		if err != nil {
			t.Fatalf("decoded %+v does not encode: %v", m, err)
		}
		if !bytes.HasPrefix(b, again) {
			t.Fatalf("re-encoding %x gave %x", b, again)
		}
	})
}

// BenchmarkOwner measures a lookup on a table built directly (no network).
//
//	go test ./ring -run '^$' -bench 'Owner|NewTable' -benchmem
func BenchmarkOwner(b *testing.B) {
	keys := accounts(4096)
	for _, members := range []int{3, 10, 100} {
		b.Run(fmt.Sprintf("members=%d", members), func(b *testing.B) {
			tbl := mustTable(b, DefaultLayout(), seqIDs("node-", members)...)
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if _, ok := tbl.Owner(keys[i&4095]); !ok {
					b.Fatal("no owner")
				}
				i++
			}
		})
	}
}

// BenchmarkNewTable measures a rebuild (what a membership change costs).
func BenchmarkNewTable(b *testing.B) {
	for _, members := range []int{3, 10, 100} {
		b.Run(fmt.Sprintf("members=%d", members), func(b *testing.B) {
			ms := metas(seqIDs("node-", members)...)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := NewTable(DefaultLayout(), ms); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// memberlist's warnings and errors repeat once per packet while their cause
// lasts (a peer with another gossip key); each kind goes out once per
// memberlistLogEvery, with the count held back, and INFO lines all go out.
func TestMemberlistErrorsAreSampled(t *testing.T) {
	var buf bytes.Buffer
	now := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	lg := log.New(newSlogWriter(slog.New(slog.NewTextHandler(&buf, nil)), func() time.Time { return now }), "", 0)
	for i := range 50 {
		lg.Printf("[ERR] memberlist: Decrypt packet failed: No installed keys could decrypt the message from=127.0.0.%d:7946", i)
		lg.Printf("[INFO] memberlist: line %d", i)
	}
	lg.Printf("[WARN] memberlist: Conflicting address for n2. Mine: 127.0.0.2:7946 Theirs: 127.0.0.9:7946")
	now = now.Add(memberlistLogEvery)
	lg.Printf("[ERR] memberlist: Decrypt packet failed: No installed keys could decrypt the message from=127.0.0.1:7946")
	out := buf.String()
	if n := strings.Count(out, "Decrypt packet failed"); n != 2 || !strings.Contains(out, "similar_lines_held_back=49") {
		t.Errorf("50 decrypt errors, then one %s later: %d lines out, want 2, the second with 49 held back:\n%s", memberlistLogEvery, n, out)
	}
	if n := strings.Count(out, "level=INFO"); n != 50 || !strings.Contains(out, "Conflicting address for n2") {
		t.Errorf("INFO lines out: %d, want 50, and the other kind of warning:\n%s", n, out)
	}
}

func TestSplitLevel(t *testing.T) {
	for _, tc := range []struct {
		in    string
		level slog.Level
		msg   string
	}{
		{"[DEBUG] memberlist: hi", slog.LevelDebug, "memberlist: hi"},
		{"[WARN] x", slog.LevelWarn, "x"},
		{"[ERR] x", slog.LevelError, "x"},
		{"[INFO] x", slog.LevelInfo, "x"},
		{"plain", slog.LevelInfo, "plain"},
		{"[ODD] x", slog.LevelInfo, "[ODD] x"},
	} {
		level, msg := splitLevel([]byte(tc.in))
		if level != tc.level || string(msg) != tc.msg {
			t.Errorf("splitLevel(%q) = %v %q", tc.in, level, msg)
		}
	}
}

// A partition's tenure is the table since which this node has owned it
// without a break: kept while it stays the node's, 0 while another node owns
// it, and new when it comes back, though the members and so the epoch are
// those of before.
func TestTenure(t *testing.T) {
	l := DefaultLayout()
	s0 := &snapshot{table: mustTable(t, l)}
	two, three := mustTable(t, l, "n1", "n2"), mustTable(t, l, "n1", "n2", "n3")
	s1 := &snapshot{table: two, gen: 1, tenure: tenureOf(s0, two, 1, "n1")}
	s2 := &snapshot{table: three, gen: 2, tenure: tenureOf(s1, three, 2, "n1")}
	s3 := &snapshot{table: two, gen: 3, tenure: tenureOf(s2, two, 3, "n1")}
	if two.Epoch() != s3.table.Epoch() {
		t.Fatal("the same members made another epoch")
	}
	var kept, back int
	for p := range l.PartitionCount {
		o1, o2 := ownerID(two, p), ownerID(three, p)
		switch {
		case o1 != "n1":
			if s1.tenure[p]|s2.tenure[p]|s3.tenure[p] != 0 {
				t.Fatalf("partition %d, never n1's: tenures %d %d %d, want 0", p, s1.tenure[p], s2.tenure[p], s3.tenure[p])
			}
		case o2 == "n1":
			kept++
			if s1.tenure[p] != 1 || s2.tenure[p] != 1 || s3.tenure[p] != 1 {
				t.Fatalf("partition %d, n1's throughout: tenures %d %d %d, want 1 1 1", p, s1.tenure[p], s2.tenure[p], s3.tenure[p])
			}
		default:
			back++
			if s1.tenure[p] != 1 || s2.tenure[p] != 0 || s3.tenure[p] != 3 {
				t.Fatalf("partition %d, n1's, then %s's, then n1's again: tenures %d %d %d, want 1 0 3", p, o2, s1.tenure[p], s2.tenure[p], s3.tenure[p])
			}
		}
	}
	if kept == 0 || back == 0 {
		t.Fatalf("%d partitions kept, %d came back: want some of each", kept, back)
	}
}
