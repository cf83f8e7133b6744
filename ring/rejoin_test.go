package ring

import (
	"context"
	"log/slog"
	"slices"
	"testing"
	"time"
)

// TestRejoinTargets checks, without a network, whom Rejoin contacts: every
// address of every seed and the known members that are not alive, never
// itself or an alive member, and no member forgotten after ForgetAfter.
func TestRejoinTargets(t *testing.T) {
	now := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	cfg := LocalConfig()
	cfg.NodeID = "self"
	cfg.Join = []string{"svc.local", "10.0.0.9:7000", "[fd00::1]:7000", "10.0.0.1"}
	cfg.ForgetAfter = time.Hour
	tbl, _ := NewTable(DefaultLayout(), nil)
	r := &Ring{
		cfg:      cfg,
		log:      slog.New(slog.DiscardHandler),
		resolver: fakeResolver{"svc.local": {"10.0.0.1", "10.0.0.2", "10.0.0.3"}},
		now:      func() time.Time { return now },
		self:     Meta{ID: "self", GossipAddr: "10.0.0.1:7946"},
		known: map[string]knownMember{
			"alive":     {addr: "10.0.0.2:7946", lastAlive: now.Add(-2 * time.Hour)},
			"dead":      {addr: "10.0.0.5:7946", lastAlive: now.Add(-time.Minute)},
			"long-dead": {addr: "10.0.0.6:7946", lastAlive: now.Add(-2 * time.Hour)},
		},
	}
	r.state.Store(&snapshot{table: tbl, members: []Meta{
		{ID: "alive", GossipAddr: "10.0.0.2:7946"},
		{ID: "self", GossipAddr: "10.0.0.1:7946"},
	}})
	got, errs := r.rejoinTargets(context.Background())
	if len(errs) != 0 {
		t.Fatal(errs)
	}
	want := []string{"10.0.0.3:7946", "10.0.0.9:7000", "[fd00::1]:7000", "10.0.0.5:7946"}
	if !slices.Equal(got, want) {
		t.Fatalf("targets = %v, want %v", got, want)
	}
	if _, ok := r.known["long-dead"]; ok {
		t.Fatal("a member dead for longer than ForgetAfter was kept")
	}
	if _, ok := r.known["alive"]; !ok {
		t.Fatal("an alive member was forgotten")
	}

	r.resolver = fakeResolver{}
	if _, errs := r.rejoinTargets(context.Background()); len(errs) != 1 {
		t.Fatalf("unresolvable seed gave errors %v, want one", errs)
	}
}

func TestSplitSeed(t *testing.T) {
	for _, tc := range []struct{ in, host, port string }{
		{"10.0.0.1:7000", "10.0.0.1", "7000"},
		{"10.0.0.1", "10.0.0.1", "7946"},
		{"localhost:7000", "localhost", "7000"},
		{"quotad-gossip.default.svc", "quotad-gossip.default.svc", "7946"},
		{"[::1]:7000", "::1", "7000"},
		{"::1", "::1", "7946"},
		{"[::1]", "::1", "7946"},
	} {
		h, p, err := splitSeed(tc.in, 7946)
		if err != nil || h != tc.host || p != tc.port {
			t.Errorf("splitSeed(%q) = %q, %q, %v; want %q, %q", tc.in, h, p, err, tc.host, tc.port)
		}
	}
	for _, bad := range []string{"host:http", "host:0", ":7000", "a:b:c", "garbage!!", "bad host:7000", "a..b", "quotad gossip"} {
		if _, _, err := splitSeed(bad, 7946); err == nil {
			t.Errorf("splitSeed(%q) accepted", bad)
		}
	}
}
