//go:build !linux

package pgtest

import (
	"errors"
	"os"
	"syscall"
)

// childCredential: switching to the postgres user is implemented on Linux
// only; elsewhere run the tests as a normal user.
func childCredential() (*syscall.Credential, error) {
	if os.Geteuid() == 0 {
		return nil, errors.New("pgtest: running as root is supported on Linux only")
	}
	return nil, nil
}

// childSysProcAttr: no parent-death signal outside Linux, so a killed test
// process may leave its postmaster running there.
func childSysProcAttr(*syscall.Credential) *syscall.SysProcAttr { return nil }

func fileOwner(os.FileInfo) (uid, gid uint32, ok bool) { return 0, 0, false }

// writeOwnerFile and reapStale rely on /proc; outside Linux stale servers are
// not reaped.
func writeOwnerFile(string) error { return nil }

func reapStale(string, func(string, ...any)) {}
