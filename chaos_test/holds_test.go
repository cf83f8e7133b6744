package chaos

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/quotaring/quotaring/internal/cluster"
)

// holdsByGrant names the grants where the ledger's reservation of a node
// and the node's own allowance differ, from the node's GET
// /admin/v1/reservations: the evidence a RES violation before the drain
// points to (a whole-node sum alone left the account to be found by hand).
func TestHoldsByGrantNamesTheGrantsThatDiffer(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/admin/v1/reservations" {
			http.NotFound(w, r)
			return
		}
		w.Write([]byte(`{"node": "n1", "in_doubt_here": 0,
			"reservations": [
				{"node": "n1", "account": "big-002", "grant": "m:2026-12", "units": 893},
				{"node": "n1", "account": "hard-033", "grant": "m:2026-12", "units": 2},
				{"node": "n2", "account": "hard-040", "grant": "m:2026-12", "units": 3}],
			"held_here": [
				{"node": "n1", "account": "big-002", "grant": "m:2026-12", "units": 893},
				{"node": "n1", "account": "soft-001", "grant": "c1", "units": 4}]}`))
	}))
	defer srv.Close()
	n := &cluster.Node{ID: "n1", Admin: strings.TrimPrefix(srv.URL, "http://")}
	diff, table, err := holdsByGrant(context.Background(), n)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", table)
	want := []string{"hard-033 m:2026-12: ledger 2, node 0", "soft-001 c1: ledger 0, node 4"}
	if strings.Join(diff, "|") != strings.Join(want, "|") {
		t.Fatalf("differing grants %q, want %q (n2's rows are not n1's)", diff, want)
	}
	for _, line := range []string{"big-002 m:2026-12 893 893\n", "hard-033 m:2026-12 2 0 differs\n"} {
		if !strings.Contains(table, line) {
			t.Fatalf("table lacks %q:\n%s", line, table)
		}
	}
	if _, _, err := holdsByGrant(context.Background(), &cluster.Node{ID: "n9", Admin: strings.TrimPrefix(srv.URL, "http://") + "/nope"}); err == nil {
		t.Fatal("no error for a node that does not answer the endpoint")
	}
}
