package node

import (
	"path/filepath"
	"strings"
	"testing"
)

// startAdminNode starts one node with the admin API on a fresh SQLite
// ledger, with the plan pro and the account acme.
func startAdminNode(t *testing.T) *Node {
	t.Helper()
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	nd := startNodesWith(t, dsn, func(c *Config) { c.AdminToken = testAdminToken })[0]
	if status, raw := adminCall(t, nd, testAdminToken, "PUT", "/admin/v1/plans/pro", map[string]any{"monthly_quota": 100, "hard": true}, nil); status != 200 {
		t.Fatalf("put plan: %d %s", status, raw)
	}
	if status, raw := adminCall(t, nd, testAdminToken, "PUT", "/admin/v1/accounts/acme", map[string]any{"plan": "pro"}, nil); status != 200 {
		t.Fatalf("put account: %d %s", status, raw)
	}
	return nd
}

func TestAdminAPIInput(t *testing.T) {
	nd := startAdminNode(t)

	// Ids that list as another ("acme\u200b" as acme) or do not read back
	// as stored (0xFF comes back as U+FFFD) are refused for new plans,
	// accounts and grants, naming the character and where it is.
	t.Run("ids", func(t *testing.T) {
		for path, want := range map[string]string{
			"/admin/v1/accounts/acme%E2%80%8B": "character 5 (U+200B, at byte 5) is a format character",
			"/admin/v1/accounts/acme%C2%A0":    "character 5 (U+00A0, at byte 5) is a space",
			"/admin/v1/accounts/acme%C2%85":    "character 5 (U+0085, at byte 5) is a control character",
			"/admin/v1/accounts/acme%FF":       "byte 5 (0xFF) is not UTF-8",
		} {
			if p := wantProblem(t, nd, "PUT", path, map[string]any{"plan": "pro"}, 400, "id"); !strings.Contains(p.Detail, want) {
				t.Errorf("PUT %s: %q, want it to say %q", path, p.Detail, want)
			}
		}
		wantProblem(t, nd, "PUT", "/admin/v1/plans/pro%E2%80%8B", map[string]any{"monthly_quota": 1, "hard": true}, 400, "id")
		wantProblem(t, nd, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": 5, "id": "order\u200b1"}, 400, "id")
		wantProblem(t, nd, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": 5, "id": "order\u00a01"}, 400, "id")
		var accounts struct{ Accounts []struct{ ID string } }
		if adminCall(t, nd, testAdminToken, "GET", "/admin/v1/accounts", nil, &accounts); len(accounts.Accounts) != 1 {
			t.Fatalf("accounts %+v, want acme alone", accounts)
		}
	})
}
