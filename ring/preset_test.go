package ring

import (
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/logbuf"
)

// The preset rides in node meta after the clock byte, and an older node's
// meta (no preset, with or without a clock verdict) reads Preset "": no
// mismatch. The bytes are what encodeMeta wrote before the preset existed.
func TestMetaPresetIsBackwardCompatible(t *testing.T) {
	fp := DefaultLayout().fingerprint()
	for _, tc := range []struct {
		name  string
		old   string
		clock ClockVerdict
	}{
		{"no clock", "\x01\x02\x16\xcd\n\x02\x0e127.0.0.2:7000\x01h\x01a", ClockUnknown},
		{"clock off", "\x01\x02\x16\xcd\n\x02\x0e127.0.0.2:7000\x01h\x01a\x02", ClockOff},
	} {
		m, gotFP, err := decodeMeta("n2", "g", []byte(tc.old))
		if err != nil || gotFP != fp || m.Preset != "" || m.Clock != tc.clock || m.AdminAddr != "a" {
			t.Fatalf("%s: older meta decodes as %+v, %x, %v", tc.name, m, gotFP, err)
		}
		r := &Ring{cfg: Config{Preset: PresetLAN}, layout: DefaultLayout()}
		if mm, bad := r.mismatchOf(m, gotFP, err); bad {
			t.Fatalf("%s: an older node's meta is a mismatch: %+v", tc.name, mm)
		}
		// And an older decoder reads a newer node's meta as before: the
		// new bytes extend the old ones.
		m.Preset = PresetLocal
		b, err := encodeMeta(m, fp)
		if err != nil {
			t.Fatal(err)
		}
		old := tc.old
		if tc.clock == ClockUnknown {
			old += "\x00" // the clock byte, unknown, written before a preset
		}
		if !strings.HasPrefix(string(b), old) {
			t.Fatalf("%s: new meta %q does not extend the old %q", tc.name, b, old)
		}
		got, _, err := decodeMeta("n2", "g", b)
		if err != nil || got != m {
			t.Fatalf("%s: round trip with a preset: %+v, %v; want %+v", tc.name, got, err, m)
		}
	}
}

// Two nodes of one cluster started with different --ring-preset time
// failure detection differently. That was silent; now each names the other
// in an ERROR line with both presets and lists it in Mismatches (for the
// metric), and the mismatch clears when the member leaves. Like a layout
// mismatch, the member is not refused: the ring is the same for both.
func TestRingPresetMismatchIsNamed(t *testing.T) {
	var logs1, logs2 logbuf.Buffer
	withLogs := func(b *logbuf.Buffer) nodeOpt {
		return func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(b, nil)) }
	}
	n1 := startNode(t, "node-1", withLogs(&logs1))
	n2 := startNode(t, "node-2", withLogs(&logs2), withJoin(n1.Self().GossipAddr), func(c *Config) { c.Preset = PresetLAN })
	n3 := startNode(t, "node-3", withJoin(n1.Self().GossipAddr))
	for _, n := range []*node{n1, n2, n3} {
		n.serve(t)
	}
	eventually(t, 10*time.Second, func() error { return agree([]*node{n1, n2, n3}, "node-1", "node-2", "node-3") })
	want1 := []Mismatch{{Member: "node-2", Reason: MismatchPreset, Theirs: PresetLAN, Ours: PresetLocal}}
	if got := n1.Mismatches(); !slices.Equal(got, want1) {
		t.Fatalf("node-1 Mismatches() = %+v, want %+v", got, want1)
	}
	want2 := []Mismatch{
		{Member: "node-1", Reason: MismatchPreset, Theirs: PresetLocal, Ours: PresetLAN},
		{Member: "node-3", Reason: MismatchPreset, Theirs: PresetLocal, Ours: PresetLAN},
	}
	if got := n2.Mismatches(); !slices.Equal(got, want2) {
		t.Fatalf("node-2 Mismatches() = %+v, want %+v", got, want2)
	}
	line := func(logs *logbuf.Buffer, member, theirs, ours string) error {
		for l := range strings.SplitSeq(logs.String(), "\n") {
			if strings.Contains(l, "level=ERROR") && strings.Contains(l, "--ring-preset") && strings.Contains(l, "member="+member) &&
				strings.Contains(l, "theirs="+theirs) && strings.Contains(l, "ours="+ours) {
				return nil
			}
		}
		return fmt.Errorf("no ERROR naming %s's preset %s against ours %s:\n%s", member, theirs, ours, logs.String())
	}
	for _, err := range []error{line(&logs1, "node-2", PresetLAN, PresetLocal), line(&logs2, "node-1", PresetLocal, PresetLAN)} {
		if err != nil {
			t.Fatal(err)
		}
	}
	if strings.Count(logs1.String(), "member=node-2") != 1 {
		t.Errorf("the mismatch is logged more than once:\n%s", logs1.String())
	}
	if strings.Contains(logs1.String(), "member=node-3") {
		t.Errorf("node-3, of the same preset, is named:\n%s", logs1.String())
	}
	if err := n2.Leave(testCtx(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, func() error {
		if got := n1.Mismatches(); len(got) != 0 {
			return fmt.Errorf("node-1 still lists %+v after node-2 left", got)
		}
		return nil
	})
}
