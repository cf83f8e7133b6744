package chaos

import (
	"fmt"
	"os"
	"path/filepath"
)

// Disk a run needs. Measured: a node's data dir and log take 55-90 MB
// within seconds of its start (Pebble's WAL and memtables, the log), and
// Postgres about 50 MB; a run of 100 nodes kept 6.9 GB. diskPerNode counts
// the scale-ups (at most 3) as nodes.
const (
	diskPerNode  = 100 << 20
	diskPostgres = 200 << 20
)

// diskNeeded is about what a run of nodes needs on the disk of its dir.
func diskNeeded(nodes int) uint64 { return uint64(nodes+3)*diskPerNode + diskPostgres }

// checkDisk refuses a run whose dir (--dir, or the temporary directory)
// is on a file system with less free space than diskNeeded: it filled the
// disk part-way through, every node failing at once.
func (c *Config) checkDisk() error {
	dir := c.Dir
	if dir == "" {
		dir = os.TempDir()
	}
	for { // the nearest existing directory: --dir may not exist yet
		if _, err := os.Stat(dir); err == nil || filepath.Dir(dir) == dir {
			break
		}
		dir = filepath.Dir(dir)
	}
	free, ok := freeBytes(dir)
	if need := diskNeeded(c.Nodes); ok && free < need {
		return fmt.Errorf("chaos: %s has %d MB free, and a run of %d nodes needs about %d MB (about %d MB a node, scale-ups included, "+
			"and Postgres): free some space, give --dir on a larger disk (or set TMPDIR), or fewer --nodes",
			dir, free>>20, c.Nodes, need>>20, diskPerNode>>20)
	}
	return nil
}
