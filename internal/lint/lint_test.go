// Package lint holds tests that encode the project's rules, so CI fails when
// one is broken (the idea of pebble's internal/lint): shard stays pure, no
// raw atomics, no package-level mutable state, one errors package.
package lint

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// moduleRoot is two levels up from internal/lint.
const moduleRoot = "../.."

type file struct {
	path string // relative to the module root
	ast  *ast.File
}

func sources(t *testing.T) []file {
	t.Helper()
	var out []file
	fset := token.NewFileSet()
	err := filepath.WalkDir(moduleRoot, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "node_modules") && p != moduleRoot {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") || strings.HasSuffix(p, ".pb.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, p, nil, parser.SkipObjectResolution|parser.ParseComments)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(moduleRoot, p)
		out = append(out, file{path: filepath.ToSlash(rel), ast: f})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(out) < 10 {
		t.Fatalf("found only %d source files: is the module root right?", len(out))
	}
	return out
}

func imports(f *ast.File) map[string]string { // local name -> path
	m := map[string]string{}
	for _, im := range f.Imports {
		p, _ := strconv.Unquote(im.Path.Value)
		name := p[strings.LastIndex(p, "/")+1:]
		if im.Name != nil {
			name = im.Name.Name
		}
		m[name] = p
	}
	return m
}

// TestShardIsPure: no I/O, no clock, no goroutines, no locks in shard.
func TestShardIsPure(t *testing.T) {
	allowed := map[string]bool{"errors": true, "fmt": true, "time": true, "slices": true, "strings": true,
		"strconv": true, "encoding/binary": true, "math": true, "math/bits": true, "sort": true, "maps": true, "cmp": true, "unicode/utf8": true}
	clockCalls := map[string]bool{"Now": true, "Since": true, "Until": true, "Sleep": true, "After": true, "Tick": true,
		"NewTimer": true, "NewTicker": true, "AfterFunc": true}
	for _, f := range sources(t) {
		if !strings.HasPrefix(f.path, "shard/") {
			continue
		}
		for _, p := range imports(f.ast) {
			if !allowed[p] {
				t.Errorf("%s imports %q: shard may only import pure packages", f.path, p)
			}
		}
		ast.Inspect(f.ast, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.GoStmt:
				t.Errorf("%s: a go statement: shard starts no goroutines", f.path)
			case *ast.SelectorExpr:
				if id, ok := n.X.(*ast.Ident); ok && id.Name == "time" && clockCalls[n.Sel.Name] {
					t.Errorf("%s: time.%s: shard never reads the clock; time is passed in", f.path, n.Sel.Name)
				}
			}
			return true
		})
	}
}

// TestNoRawAtomics: use atomic.Int64-style types, never atomic.AddInt64.
func TestNoRawAtomics(t *testing.T) {
	for _, f := range sources(t) {
		local := ""
		for name, p := range imports(f.ast) {
			if p == "sync/atomic" {
				local = name
			}
		}
		if local == "" {
			continue
		}
		ast.Inspect(f.ast, func(n ast.Node) bool {
			if call, ok := n.(*ast.CallExpr); ok {
				if sel, ok := call.Fun.(*ast.SelectorExpr); ok {
					if id, ok := sel.X.(*ast.Ident); ok && id.Name == local {
						t.Errorf("%s: %s.%s: use the typed atomics (atomic.Int64, ...)", f.path, local, sel.Sel.Name)
					}
				}
			}
			return true
		})
	}
}

// packageVarAllowed lists the package-level variables that exist on purpose,
// with why.
var packageVarAllowed = map[string]string{
	"internal/pgtest.current":    "the one server per test package, set only by pgtest.Main (TestMain scope)",
	"internal/buildinfo.version": "set only by the linker (-ldflags -X) in release builds; read-only at run time",
}

// TestNoPackageLevelMutableState: several nodes run in one process (tests,
// quotad demo), so registries, loggers, clocks and caches live in values.
// Package-level variables may only be sentinel errors, tables written as
// composite literals, or interface assertions.
func TestNoPackageLevelMutableState(t *testing.T) {
	for _, f := range sources(t) {
		pkg := filepath.ToSlash(filepath.Dir(f.path))
		for _, d := range f.ast.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok || gd.Tok != token.VAR || isEmbed(gd) {
				continue
			}
			for _, spec := range gd.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, name := range vs.Names {
					if name.Name == "_" {
						continue
					}
					if _, ok := packageVarAllowed[pkg+"."+name.Name]; ok {
						continue
					}
					if i >= len(vs.Values) || !immutableInit(vs.Values[i]) {
						t.Errorf("%s: package-level var %s: keep state in values (a Config field, a struct), or add it to packageVarAllowed with the reason", f.path, name.Name)
					}
				}
			}
		}
	}
}

// isEmbed reports a //go:embed variable (read-only files in the binary).
func isEmbed(gd *ast.GenDecl) bool {
	docs := []*ast.CommentGroup{gd.Doc}
	for _, s := range gd.Specs {
		docs = append(docs, s.(*ast.ValueSpec).Doc)
	}
	for _, d := range docs {
		if d != nil && hasEmbed(d) {
			return true
		}
	}
	return false
}

func hasEmbed(d *ast.CommentGroup) bool {
	for _, c := range d.List {
		if strings.HasPrefix(c.Text, "//go:embed") {
			return true
		}
	}
	return false
}

func immutableInit(e ast.Expr) bool {
	switch e := e.(type) {
	case *ast.CompositeLit, *ast.BasicLit:
		return true
	case *ast.CallExpr:
		if sel, ok := e.Fun.(*ast.SelectorExpr); ok {
			if id, ok := sel.X.(*ast.Ident); ok {
				switch id.Name + "." + sel.Sel.Name {
				case "errors.New", "fmt.Errorf", "regexp.MustCompile", "template.Must", "crc32.MakeTable":
					return true
				}
			}
		}
	}
	return false
}

// TestOneErrorsPackage: the standard errors package (with fmt.Errorf's %w)
// only; no log package either (log/slog, passed in).
func TestOneErrorsPackage(t *testing.T) {
	banned := map[string]string{
		"github.com/pkg/errors":         "use errors and fmt.Errorf with %w",
		"github.com/cockroachdb/errors": "use errors and fmt.Errorf with %w",
		"log":                           "use log/slog, passed in through a Config",
	}
	exceptions := map[string]string{
		"ring/logbridge.go log": "memberlist's Config.Logger is a *log.Logger: the bridge writes it to slog",
	}
	for _, f := range sources(t) {
		for _, p := range imports(f.ast) {
			if _, ok := exceptions[f.path+" "+p]; ok {
				continue
			}
			if why, ok := banned[p]; ok {
				t.Errorf("%s imports %s: %s", f.path, p, why)
			}
		}
	}
}
