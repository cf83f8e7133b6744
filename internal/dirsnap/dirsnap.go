// Package dirsnap is how tests check that an operation left a directory
// alone: take a snapshot of every file's bytes before it, and compare after.
// A data dir that quotad reconcile reads, or that the log opens read-only or
// refuses to open, is evidence and must stay byte-identical.
//
//	before := dirsnap.Take(t, dir)
//	... // the operation
//	before.Unchanged(t, dir, "reconcile")
package dirsnap

import (
	"bytes"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// Snapshot is the contents of every file of a directory, by name (its top
// level only: the data dirs it is for have no subdirectories).
type Snapshot map[string][]byte

// Take reads every file in dir.
func Take(t testing.TB, dir string) Snapshot {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	s := Snapshot{}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		s[e.Name()] = b
	}
	return s
}

// Unchanged reports whether dir holds exactly the files of s with the same
// bytes, and marks the test failed for each file what (the operation)
// changed, removed or created.
func (s Snapshot) Unchanged(t testing.TB, dir, what string) bool {
	t.Helper()
	after := Take(t, dir)
	ok := true
	for _, name := range slices.Sorted(maps.Keys(s)) {
		switch a, found := after[name]; {
		case !found:
			t.Errorf("%s removed %s", what, name)
			ok = false
		case !bytes.Equal(a, s[name]):
			t.Errorf("%s changed %s", what, name)
			ok = false
		}
	}
	for _, name := range slices.Sorted(maps.Keys(after)) {
		if _, found := s[name]; !found {
			t.Errorf("%s created %s", what, name)
			ok = false
		}
	}
	return ok
}
