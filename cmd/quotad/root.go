package main

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "quotad",
		Short: "quotaring: exact rate limits, quotas and credits for APIs, charged once",
		Long: `quotad decides for every API request whether its account may go on (rate limit,
monthly quota, prepaid credits), charges it exactly once, and records usage for
billing.

Start here:
  quotad demo            a local demonstration, nothing to install
  quotad bench engine    how fast the engine charges on this machine

Every flag of a command can also be set by an environment variable:
QUOTAD_ + the flag name in upper case with - as _ (--data-dir: QUOTAD_DATA_DIR).
A flag on the command line wins over the environment.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			return bindEnv(cmd.Flags())
		},
	}
	root.AddCommand(newServeCmd(), newDemoCmd(), newBenchCmd(), newMigrateCmd(), newReconcileCmd(), newRevokeCmd(), newAdminCmd(), newChaosCmd())
	return root
}

// bindEnv sets every flag not given on the command line from QUOTAD_<NAME>.
func bindEnv(fs *pflag.FlagSet) error {
	var errs []error
	fs.VisitAll(func(f *pflag.Flag) {
		if f.Changed || f.Name == "help" {
			return
		}
		name := envName(f.Name)
		if v, ok := os.LookupEnv(name); ok {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("environment %s=%q: %v", name, v, err))
			}
		}
	})
	return errors.Join(errs...)
}

func envName(flag string) string {
	return "QUOTAD_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// exitError carries a specific exit code (reconcile's "difference found").
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

func exitCode(err error) int {
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	return 1
}
