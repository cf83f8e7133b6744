package flush

import (
	"os"
	"testing"

	"github.com/quotaring/quotaring/internal/pgtest"
)

// TestMain runs the package's tests with a throwaway Postgres started on
// first use (pgtest): the ledger tests need a real one. Without the
// binaries they skip, or fail with QUOTARING_REQUIRE_PG=1 (CI).
func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }
