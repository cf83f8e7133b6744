package node

import (
	"os"
	"testing"

	"github.com/quotaring/quotaring/internal/pgtest"
)

// TestMain runs the package's tests with a throwaway Postgres server for
// the tests that ask for one (pgtest.NewDB), started when the first does.
func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }
