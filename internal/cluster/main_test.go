package cluster

import (
	"os"
	"testing"
)

// binary is the quotad built once for this package's tests (set in TestMain).
var binary string

func TestMain(m *testing.M) { os.Exit(Main(m, &binary)) }
