package main

import (
	"strings"
	"testing"
)

// quotad bench cluster on a cluster without its accounts says how to make
// them (--setup) instead of only "refused: UNKNOWN_ACCOUNT".
func TestBenchClusterWithoutItsAccounts(t *testing.T) {
	n := startAdminTestNode(t)
	_, err := runQuotad(t, "bench", "cluster", "--nodes", n.RPCAddr(), "--accounts", "10", "--concurrency", "1", "--duration", "1s")
	if err == nil || !strings.Contains(err.Error(), "UNKNOWN_ACCOUNT") || !strings.Contains(err.Error(), "--setup --ledger DSN") {
		t.Fatalf("bench cluster without bench accounts: %v; want the refusal and how to create them", err)
	}
}
