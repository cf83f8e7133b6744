package main

import (
	"errors"
	"fmt"
	"io"
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
			warnUnknownEnv(cmd.ErrOrStderr(), cmd.Root(), os.Environ())
			return bindEnv(cmd.Flags())
		},
	}
	root.AddCommand(newServeCmd(), newDemoCmd(), newBenchCmd(), newMigrateCmd(), newReconcileCmd(), newRevokeCmd(), newAdminCmd(), newChaosCmd())
	noStrayArgs(root)
	return root
}

// noStrayArgs makes every command that declares no arguments refuse them
// ('quotad migrate extra' was accepted and the word ignored).
func noStrayArgs(c *cobra.Command) {
	if c.Args == nil && !c.HasSubCommands() {
		c.Args = cobra.NoArgs
	}
	for _, sub := range c.Commands() {
		noStrayArgs(sub)
	}
}

// warnUnknownEnv warns about QUOTAD_* variables that match no flag of any
// command: a misspelt QUOTAD_SETTLE_INTRVAL would otherwise be ignored in
// silence.
func warnUnknownEnv(w io.Writer, root *cobra.Command, environ []string) {
	known := map[string]bool{}
	var walk func(*cobra.Command)
	walk = func(c *cobra.Command) {
		c.Flags().VisitAll(func(f *pflag.Flag) { known[envName(f.Name)] = true })
		c.PersistentFlags().VisitAll(func(f *pflag.Flag) { known[envName(f.Name)] = true })
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(root)
	for _, name := range adminEnv { // quotad admin's flags: QUOTAD_ADMIN_<NAME>
		known["QUOTAD_ADMIN_"+strings.ToUpper(name)] = true
	}
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "QUOTAD_") && !known[name] {
			fmt.Fprintf(w, "quotad: warning: %s matches no flag of any quotad command; ignored (a typo?)\n", name)
		}
	}
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
