package cluster

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/quotaring/quotaring/internal/pgtest"
)

// binary is the quotad built once for this package's tests (set in TestMain).
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "quotad-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary, err = Build(context.Background(), dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := pgtest.Main(m)
	os.RemoveAll(dir)
	os.Exit(code)
}
