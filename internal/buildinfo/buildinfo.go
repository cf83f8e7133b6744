// Package buildinfo says which build of quotad is running: `quotad version`
// prints it, a node logs it when it starts, exports it as the
// quotaring_build_info metric and records it in the ledger's nodes table
// (so that an operator, and quotad prune, can see which nodes still run an
// older build during a rolling upgrade).
//
// The version comes from, in order:
//
//  1. the linker: a release build sets it with
//     go build -ldflags "-X github.com/quotaring/quotaring/internal/buildinfo.version=v1.2.3"
//     (the Dockerfile passes its VERSION build argument this way, since its
//     build context holds no .git);
//  2. the module version the go command stamped (a go install of a tagged
//     version, or a go build in a git checkout: a pseudo-version that names
//     the commit, with +dirty for uncommitted changes);
//  3. "devel" (go run, or a build with -buildvcs=false).
//
// The commit, its time and whether the tree was modified come from the
// go command's VCS stamp where there is one.
package buildinfo

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"
)

// version is set at link time by release builds (-ldflags -X, see the
// package doc) and never written at run time.
var version string

// Info describes one build.
type Info struct {
	Version   string // see the package doc; never empty
	Revision  string // the commit's full hash; "" when not stamped
	Time      string // the commit's time (RFC 3339); "" when not stamped
	Modified  bool   // built from a tree with uncommitted changes
	GoVersion string // the Go toolchain that built it
}

// Read returns this binary's build.
func Read() Info {
	bi, _ := debug.ReadBuildInfo()
	return fromBuildInfo(bi, version, runtime.Version())
}

// fromBuildInfo is Read over given inputs (bi may be nil).
func fromBuildInfo(bi *debug.BuildInfo, linked, goVersion string) Info {
	in := Info{Version: linked, GoVersion: goVersion}
	if bi != nil {
		if in.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			in.Version = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				in.Revision = s.Value
			case "vcs.time":
				in.Time = s.Value
			case "vcs.modified":
				in.Modified = s.Value == "true"
			}
		}
	}
	if in.Version == "" {
		in.Version = "devel"
	}
	return in
}

// Short is the version with what it does not say already: the commit's
// first 12 hex digits and +dirty. It is what the ledger's nodes table
// records ("v1.2.3", "v0.0.0-20261203062015-c11a88a69da2",
// "devel@c11a88a69da2+dirty").
func (in Info) Short() string {
	s := in.Version
	if rev := shortRev(in.Revision); rev != "" && !strings.Contains(s, rev) {
		s += "@" + rev
	}
	if in.Modified && !strings.Contains(s, "dirty") {
		s += "+dirty"
	}
	return s
}

// String is the long form `quotad version` prints.
func (in Info) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "quotad %s\n", in.Version)
	if in.Revision != "" {
		fmt.Fprintf(&b, "commit %s", in.Revision)
		if in.Time != "" {
			fmt.Fprintf(&b, " (%s)", in.Time)
		}
		if in.Modified {
			b.WriteString(", with uncommitted changes")
		}
		b.WriteString("\n")
	} else {
		b.WriteString("commit unknown (built without VCS information: go run, -buildvcs=false, or outside a git checkout)\n")
	}
	fmt.Fprintf(&b, "built with %s\n", in.GoVersion)
	return b.String()
}

func shortRev(rev string) string {
	if len(rev) > 12 {
		return rev[:12]
	}
	return rev
}
