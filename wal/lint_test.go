package wal

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// allowedGlobals are the package-level variables of wal: error sentinels and
// an immutable table. Anything else would be process-global mutable state,
// which blocks running two logs (two nodes) in one process.
var allowedGlobals = map[string]bool{
	"ErrCorrupt": true, "ErrClosed": true, "ErrNodeMismatch": true,
	"errShortFrame": true, "errBadChecksum": true, "castagnoli": true,
}

// parseSources parses the non-test Go files of the package.
func parseSources(t *testing.T) []*ast.File {
	t.Helper()
	names, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	var files []*ast.File
	for _, n := range names {
		if strings.HasSuffix(n, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, n, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	return files
}

func TestLintNoPackageState(t *testing.T) {
	for _, f := range parseSources(t) {
		for _, d := range f.Decls {
			g, ok := d.(*ast.GenDecl)
			if !ok || g.Tok != token.VAR {
				continue
			}
			for _, s := range g.Specs {
				for _, n := range s.(*ast.ValueSpec).Names {
					if !allowedGlobals[n.Name] {
						t.Errorf("package-level var %s: keep state in Log", n.Name)
					}
				}
			}
		}
	}
}

// TestLintNoRawAtomics forbids atomic.AddUint64-style functions: use the
// atomic.Uint64-style types, which cannot be read without atomics by mistake.
var atomicTypes = map[string]bool{
	"Bool": true, "Int32": true, "Int64": true, "Uint32": true, "Uint64": true,
	"Uintptr": true, "Pointer": true, "Value": true,
}

func TestLintNoRawAtomics(t *testing.T) {
	for _, f := range parseSources(t) {
		ast.Inspect(f, func(n ast.Node) bool {
			sel, ok := n.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			if id, ok := sel.X.(*ast.Ident); ok && id.Name == "atomic" && !atomicTypes[sel.Sel.Name] {
				t.Errorf("raw atomic.%s: use an atomic type", sel.Sel.Name)
			}
			return true
		})
	}
}
