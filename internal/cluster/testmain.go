package cluster

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/quotaring/quotaring/internal/pgtest"
)

// Main runs the tests of a package that starts clusters, from its TestMain:
// it builds quotad once into a temporary directory and sets *binary to it,
// runs the tests with a package Postgres (pgtest.Main), removes the binary
// and returns the exit code.
//
//	var binary string
//	func TestMain(m *testing.M) { os.Exit(cluster.Main(m, &binary)) }
func Main(m *testing.M, binary *string) int {
	dir, err := os.MkdirTemp("", "quotad-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	if *binary, err = Build(context.Background(), dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return pgtest.Main(m)
}
