package flush

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
)

// A route table stored before SetRoutes refused unmatchable patterns is
// applied, and its unmatchable patterns are logged once per version.
func TestRefresherWarnsOfUnmatchableRoutes(t *testing.T) {
	ctx := context.Background()
	l, e := ledgerRig(t, nil)
	v, err := l.SetRoutes(ctx, 1, map[string]int64{"POST /v1/exports": 25, "GET /v1/tasks": 1})
	if err != nil {
		t.Fatal(err)
	}
	mustExecSQL(t, l, fmt.Sprintf(`UPDATE route_weights SET pattern = 'get /v1/tasks' WHERE version = %d AND pattern = 'GET /v1/tasks'`, v))

	var out bytes.Buffer
	r := &Refresher{Ledger: l, Engine: e, Logger: slog.New(slog.NewTextHandler(&out, nil))}
	for range 2 {
		if err := r.RefreshOnce(ctx); err != nil {
			t.Fatalf("refresh with a stored unmatchable pattern: %v; want it applied", err)
		}
	}
	if s := e.Snapshot(); s == nil || s.Routes.Version != v {
		t.Fatalf("engine snapshot %+v, want routes version %d", s, v)
	}
	if n := strings.Count(out.String(), "level=WARN"); n != 1 || !strings.Contains(out.String(), `get /v1/tasks`) || !strings.Contains(out.String(), "quotad admin routes set") {
		t.Fatalf("%d warnings, want 1 naming the pattern and the fix:\n%s", n, out.String())
	}
	if _, err := l.SetRoutes(ctx, 1, map[string]int64{"GET /v1/tasks": 1}); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if err := r.RefreshOnce(ctx); err != nil || out.Len() != 0 {
		t.Fatalf("refresh of a clean table: %v, logged %q", err, out.String())
	}
}
