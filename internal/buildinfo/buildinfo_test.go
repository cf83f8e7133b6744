package buildinfo

import (
	"runtime/debug"
	"strings"
	"testing"
)

func TestFromBuildInfo(t *testing.T) {
	vcs := func(rev, modified string) []debug.BuildSetting {
		return []debug.BuildSetting{{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: rev},
			{Key: "vcs.time", Value: "2026-12-03T06:20:15Z"}, {Key: "vcs.modified", Value: modified}}
	}
	const rev = "c11a88a69da25ce74e08796e5c1be4e3908e5ca6"
	for _, tc := range []struct {
		name   string
		bi     *debug.BuildInfo
		linked string
		short  string
	}{
		{"no build info", nil, "", "devel"},
		{"go run", &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}}, "", "devel"},
		{"a checkout's pseudo-version", &debug.BuildInfo{Main: debug.Module{Version: "v0.0.0-20261203062015-c11a88a69da2"}, Settings: vcs(rev, "false")},
			"", "v0.0.0-20261203062015-c11a88a69da2"},
		{"a dirty checkout", &debug.BuildInfo{Main: debug.Module{Version: "v0.0.0-20261203062015-c11a88a69da2+dirty"}, Settings: vcs(rev, "true")},
			"", "v0.0.0-20261203062015-c11a88a69da2+dirty"},
		{"VCS stamp without a module version", &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}, Settings: vcs(rev, "true")},
			"", "devel@c11a88a69da2+dirty"},
		{"the linker's version wins", &debug.BuildInfo{Main: debug.Module{Version: "v0.0.0-20261203062015-c11a88a69da2"}, Settings: vcs(rev, "false")},
			"v1.2.3", "v1.2.3@c11a88a69da2"},
		{"a tagged install", &debug.BuildInfo{Main: debug.Module{Version: "v1.2.3"}}, "", "v1.2.3"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := fromBuildInfo(tc.bi, tc.linked, "go1.26.8")
			if got := in.Short(); got != tc.short {
				t.Errorf("Short() = %q, want %q", got, tc.short)
			}
			long := in.String()
			if !strings.HasPrefix(long, "quotad "+in.Version+"\n") || !strings.HasSuffix(long, "built with go1.26.8\n") {
				t.Errorf("String() = %q", long)
			}
			if in.Revision != "" && !strings.Contains(long, "commit "+rev+" (2026-12-03T06:20:15Z)") {
				t.Errorf("String() = %q: want the commit and its time", long)
			}
			if in.Revision == "" && !strings.Contains(long, "commit unknown") {
				t.Errorf("String() = %q: want it to say the commit is unknown", long)
			}
		})
	}
}

func TestReadNeverEmpty(t *testing.T) {
	in := Read()
	if in.Version == "" || in.GoVersion == "" || in.Short() == "" {
		t.Fatalf("Read() = %+v", in)
	}
}
