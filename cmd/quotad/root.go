package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/quotaring/quotaring/internal/buildinfo"
	"github.com/quotaring/quotaring/node"
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
A flag on the command line wins over the environment. quotad admin is the
exception: its five connection flags have QUOTAD_ADMIN_* twins and the rest
have none (quotad admin --help); so are revoke --force and prune --lost-node
(they override safety checks), revoke --node and prune --before and
--keep-months (they name what is destroyed) and reconcile --data-dir
(QUOTAD_DATA_DIR is a running node's own dir), which have none.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			warnUnknownEnv(cmd.ErrOrStderr(), cmd.Root(), os.Environ())
			return bindEnv(cmd.Flags())
		},
	}
	root.SetFlagErrorFunc(flagError)
	build := buildinfo.Read()
	root.Version = build.Short()
	root.SetVersionTemplate(build.String()) // quotad --version: as quotad version
	root.Flags().BoolP("version", "v", false, "print which build of quotad this is (as quotad version)")
	root.AddCommand(newVersionCmd(build), newServeCmd(), newDemoCmd(), newBenchCmd(), newMigrateCmd(), newReconcileCmd(), newRevokeCmd(), newPruneCmd(), newAdminCmd(), newChaosCmd(), newHealthcheckCmd())
	root.SetHelpCommand(newHelpCmd())
	noStrayArgs(root)
	nameEnvInErrors(root)
	return root
}

// newHelpCmd is 'quotad help [command]': cobra's own printed "Unknown help
// topic" for a mistyped command ('quotad help sevre') and exited 0, which a
// script takes for success; this one exits 1 and names the commands.
func newHelpCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "help [command]",
		Short: "Help about any command",
		Long:  "Help about any command: quotad help serve, quotad help admin grants add (as quotad serve --help).",
		RunE: func(c *cobra.Command, args []string) error {
			cmd, rest, err := c.Root().Find(args)
			if err != nil || cmd == nil || len(rest) > 0 {
				return fmt.Errorf("help %s: no such command; quotad --help lists them", strings.Join(args, " "))
			}
			cmd.InitDefaultHelpFlag()
			return cmd.Help()
		},
	}
}

func newVersionCmd(build buildinfo.Info) *cobra.Command {
	var short bool
	c := &cobra.Command{
		Use:   "version",
		Short: "Print which build of quotad this is: version, commit and Go",
		Long: `Print this quotad's version, the commit it was built from and the Go that built
it. A running node logs the same when it starts, exports it as the
quotaring_build_info metric, and records the short form in the ledger's nodes
table (quotad admin nodes, the admin API's /admin/v1/nodes), where a rolling upgrade
shows which nodes still run the older build.

The version is the one a release build was linked with (the Dockerfile's
VERSION build argument), else the one the go command stamped (a tag, or a
pseudo-version naming the commit, +dirty for uncommitted changes), else
"devel" (go run, -buildvcs=false).`,
		Example: "  quotad version\n  quotad version --short   # one line: v1.2.3, or devel@c11a88a69da2+dirty\n  quotad --version",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if short {
				fmt.Fprintln(cmd.OutOrStdout(), build.Short())
				return nil
			}
			fmt.Fprint(cmd.OutOrStdout(), build.String())
			return nil
		},
	}
	c.Flags().BoolVar(&short, "short", false, "print the version alone, on one line (as the ledger's nodes table records it)")
	return c
}

// nameEnvInErrors makes every command's error say which of the flags it is
// about were set by an environment variable, and by which: a bad value from
// a forgotten export was reported as if it had been typed
// ('node: admin address "http://...": too many colons', from
// QUOTAD_ADMIN_ADDR).
func nameEnvInErrors(c *cobra.Command) {
	if run := c.RunE; run != nil {
		c.RunE = func(cmd *cobra.Command, args []string) error {
			return explainEnv(cmd.Flags(), run(cmd, args))
		}
	}
	if pre := c.PersistentPreRunE; pre != nil { // quotad admin reads its flags (--ca-cert, ...) there
		c.PersistentPreRunE = func(cmd *cobra.Command, args []string) error {
			return explainEnv(cmd.Flags(), pre(cmd, args))
		}
	}
	for _, sub := range c.Commands() {
		nameEnvInErrors(sub)
	}
}

// explainEnv adds to err, for every flag set from the environment that err
// names (--flag) or whose value it quotes, the variable that set it. The
// value itself is not repeated: it may be a secret.
func explainEnv(fs *pflag.FlagSet, err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	var from []string
	fs.VisitAll(func(f *pflag.Flag) {
		env := f.Annotations[envAnnotation]
		if len(env) == 0 {
			return
		}
		vs := []string{f.Value.String()}
		if sv, ok := f.Value.(pflag.SliceValue); ok {
			vs = sv.GetSlice() // a list's error quotes the entry, not "[a,b]"
		}
		quoted := func(v string) bool {
			// Quoted, or a path (or URL) as it is: errors from the data
			// dir, TLS files and the like name the path bare.
			return v != "" && (strings.Contains(msg, strconv.Quote(v)) || len(v) > 1 && strings.Contains(v, "/") && strings.Contains(msg, v))
		}
		if mentionsFlag(msg, f.Name) || slices.ContainsFunc(vs, quoted) {
			from = append(from, fmt.Sprintf("--%s came from the environment variable %s", f.Name, env[0]))
		}
	})
	if len(from) == 0 {
		return err
	}
	return fmt.Errorf("%w (%s)", err, strings.Join(from, "; "))
}

// mentionsFlag reports whether msg names --name, and not merely a longer
// flag that starts with it.
func mentionsFlag(msg, name string) bool {
	flag := "--" + name
	for i := strings.Index(msg, flag); i >= 0; {
		end := i + len(flag)
		if end == len(msg) || !(msg[end] == '-' || msg[end] >= 'a' && msg[end] <= 'z' || msg[end] >= '0' && msg[end] <= '9') {
			return true
		}
		j := strings.Index(msg[end:], flag)
		if j < 0 {
			return false
		}
		i = end + j
	}
	return false
}

// noStrayArgs makes every command that declares no arguments refuse them
// ('quotad migrate extra' was accepted and the word ignored).
func noStrayArgs(c *cobra.Command) {
	if c.Args == nil && !c.HasSubCommands() {
		c.Args = noArgs
	}
	if c.HasParent() && c.HasSubCommands() && c.Run == nil && c.RunE == nil {
		// A group such as 'quotad bench': cobra prints its help and exits 0
		// for a mistyped subcommand ('quotad bench clsuter'), which a script
		// takes for success.
		c.RunE = unknownSubcommand
		c.DisableFlagsInUseLine = true // "quotad bench" alone prints this help
	}
	for _, sub := range c.Commands() {
		noStrayArgs(sub)
	}
}

// argFlag annotates a command whose main value is a flag: a word given
// as an argument instead ('quotad revoke n1') is most likely meant for it.
const argFlag = "quotaring/arg-flag"

// noArgs refuses arguments to a command that takes only flags, saying so
// (cobra's own message, 'unknown command "n1" for "quotad revoke"', read
// as if revoke had subcommands), and which flag a word was likely meant for.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) == 0 {
		return nil
	}
	if f := cmd.Annotations[argFlag]; f != "" && len(args) == 1 {
		return fmt.Errorf("%s takes no arguments, only flags: did you mean --%s %s?", cmd.CommandPath(), f, args[0])
	}
	return fmt.Errorf("%s takes no arguments, only flags (got %q): see %s --help", cmd.CommandPath(), strings.Join(args, " "), cmd.CommandPath())
}

// flagError adds to a flag cobra could not parse the closest flag of the
// command, if one is near, and where the flags are listed: "unknown
// flag: --duraton" said nothing more.
func flagError(cmd *cobra.Command, err error) error {
	msg := err.Error()
	if name, ok := strings.CutPrefix(msg, "unknown flag: --"); ok {
		best, dist := "", 3 // at most 2 edits away
		cmd.Flags().VisitAll(func(f *pflag.Flag) {
			if d := editDistance(name, f.Name); !f.Hidden && d < dist {
				best, dist = f.Name, d
			}
		})
		if best != "" {
			return fmt.Errorf("%w: did you mean --%s? (%s --help lists the flags)", err, best, cmd.CommandPath())
		}
	}
	return fmt.Errorf("%w (%s --help lists the flags)", err, cmd.CommandPath())
}

// editDistance is the Levenshtein distance of a and b, in bytes.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}

// unknownSubcommand runs a group command: alone it prints the group's
// help; with a word it refuses it, suggesting the closest subcommand.
func unknownSubcommand(cmd *cobra.Command, args []string) error {
	if len(args) == 0 {
		return cmd.Help()
	}
	var names []string
	for _, sub := range cmd.Commands() {
		if sub.IsAvailableCommand() {
			names = append(names, sub.Name())
		}
	}
	msg := fmt.Sprintf("unknown command %q for %s (its commands: %s)", args[0], cmd.CommandPath(), strings.Join(names, ", "))
	if cmd.SuggestionsMinimumDistance <= 0 {
		cmd.SuggestionsMinimumDistance = 2 // cobra's default for the root's own suggestions
	}
	if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
		msg += fmt.Sprintf(": did you mean %s %s?", cmd.CommandPath(), s[0])
	}
	return errors.New(msg)
}

// warnUnknownEnv warns about QUOTAD_* variables that no command reads: a
// misspelt QUOTAD_SETTLE_INTRVAL would otherwise be ignored in silence, and
// so would QUOTAD_UNITS, which looks like the twin of quotad admin grants
// add --units but is not: quotad admin's flags have no QUOTAD_<FLAG> twins
// (adminEnv has the few it reads), nor do the flags marked noEnv.
func warnUnknownEnv(w io.Writer, root *cobra.Command, environ []string) {
	known := map[string]bool{}
	notRead := map[string]string{} // QUOTAD_<FLAG> of flags without twins (quotad admin's, noEnv): what to say instead
	var walk func(c *cobra.Command, admin bool)
	walk = func(c *cobra.Command, admin bool) {
		admin = admin || c.Parent() == root && c.Name() == "admin"
		for _, fs := range []*pflag.FlagSet{c.LocalNonPersistentFlags(), c.PersistentFlags()} {
			fs.VisitAll(func(f *pflag.Flag) {
				switch {
				case f.Name == "help", f.Name == "version" && c == root: // NB: QUOTAD_VERSION sets nothing: warned about
				case f.Annotations[noEnv] != nil:
					notRead[envName(f.Name)] = fmt.Sprintf("%s's --%s %s", c.CommandPath(), f.Name, f.Annotations[noEnv][0])
				case !admin:
					known[envName(f.Name)] = true
					if secretFlags[f.Name] {
						known[envName(f.Name)+"_FILE"] = true
					}
				case notRead[envName(f.Name)] == "":
					notRead[envName(f.Name)] = adminEnvHint(f.Name)
				}
			})
		}
		for _, sub := range c.Commands() {
			walk(sub, admin)
		}
	}
	walk(root, false)
	for _, e := range adminEnv {
		known[e.env] = true
		if e.secret {
			known[e.env+"_FILE"] = true
		}
	}
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		switch {
		case !strings.HasPrefix(name, "QUOTAD_") || known[name]:
		case notRead[name] != "":
			fmt.Fprintf(w, "quotad: warning: %s is not read: %s\n", name, notRead[name])
		default:
			fmt.Fprintf(w, "quotad: warning: %s matches no flag of any quotad command; ignored (a typo?)\n", name)
		}
	}
}

// adminEnvHint says where quotad admin's flag comes from instead of
// QUOTAD_<FLAG>.
func adminEnvHint(flag string) string {
	for _, e := range adminEnv {
		if e.flag == flag {
			return fmt.Sprintf("quotad admin's --%s is set by %s", flag, e.env)
		}
	}
	return fmt.Sprintf("the flags of quotad admin's commands have no environment twins; give --%s on the command line", flag)
}

// bindEnv sets every flag not given on the command line from QUOTAD_<NAME>,
// or for a secret (secretFlags) from the file QUOTAD_<NAME>_FILE names.
func bindEnv(fs *pflag.FlagSet) error {
	var errs []error
	fs.VisitAll(func(f *pflag.Flag) {
		if f.Changed || f.Name == "help" || f.Name == "version" || f.Annotations[noEnv] != nil {
			return
		}
		name := envName(f.Name)
		v, from, ok, err := lookupEnv(name, secretFlags[f.Name], false)
		switch {
		case err != nil:
			errs = append(errs, err)
		case ok:
			if err := setFromEnv(fs, f.Name, from, v); err != nil {
				errs = append(errs, err)
			}
		}
	})
	return errors.Join(errs...)
}

// noEnv annotates a flag that has no environment twin: one that overrides
// a safety check (revoke --force, prune --lost-node), where a variable left
// set in a shell or a job's environment would override it on every run,
// unseen; or one whose twin means something else (reconcile --data-dir
// lists stopped nodes' dirs, QUOTAD_DATA_DIR is the running node's own).
// Its QUOTAD_<FLAG>, unless another command reads it, gets a warning.
const noEnv = "quotaring/no-env"

// markNoEnv keeps flag out of bindEnv; why ends the warning's sentence
// "QUOTAD_X is not read: <command>'s --flag ...".
func markNoEnv(cmd *cobra.Command, flag, why string) {
	if err := cmd.Flags().SetAnnotation(flag, noEnv, []string{why}); err != nil {
		panic(err) // a programming error: no such flag
	}
}

// safetyOverride is markNoEnv's why for a flag that overrides a check.
const safetyOverride = "overrides a safety check and has no environment twin; give it on the command line"

// destructiveTarget is markNoEnv's why for a flag that names what a command
// destroys (prune's months, revoke's node): a variable left set turned a
// bare `quotad prune`, refused without it, into dropping event-log months.
const destructiveTarget = "names what the command destroys and has no environment twin; give it on the command line"

// secretFlags are the flags whose values are secrets. Each also reads
// QUOTAD_<FLAG>_FILE: the path of a file that holds the value (a mounted
// Kubernetes Secret, a Docker or systemd credential), so that the secret
// is in neither the command line nor the environment. Errors never quote
// their values.
var secretFlags = map[string]bool{"admin-token": true, "rpc-token": true, "gossip-key": true, "alert-secret": true, "ledger": true}

// maxSecretFile bounds what a QUOTAD_*_FILE may hold: a secret is a line,
// and a larger file is the wrong one.
const maxSecretFile = 64 << 10

// lookupEnv returns the value of the variable env, or for a secret the
// content of the file env_FILE names (without its trailing line break),
// and which variable gave it. Setting both is an error, and so is a file
// that cannot be read, is empty or is too large. emptyUnset counts an
// empty env as unset.
func lookupEnv(env string, secret, emptyUnset bool) (v, from string, ok bool, err error) {
	v, ok = os.LookupEnv(env)
	ok = ok && !(emptyUnset && v == "")
	if !secret {
		return v, env, ok, nil
	}
	fileEnv := env + "_FILE"
	path, fileSet := os.LookupEnv(fileEnv)
	if !fileSet || path == "" {
		if ok && v != "" && node.NotASecretAlone(v) {
			// As for a file below: export X="$(cat f)" keeps no line
			// break, but X=$'...\n' or a YAML block scalar does.
			return "", "", false, fmt.Errorf("%s holds more than the secret (spaces around it, a line break, control characters or a byte-order mark): set it to the secret alone", env)
		}
		return v, env, ok, nil
	}
	if ok && v != "" { // NB: an empty one is unset here, as quotad admin reads its own
		return "", "", false, fmt.Errorf("both %s and %s are set: set one of them", env, fileEnv)
	}
	f, err := os.Open(path)
	if err != nil {
		return "", "", false, fmt.Errorf("%s: %v", fileEnv, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxSecretFile+1))
	switch {
	case err != nil:
		return "", "", false, fmt.Errorf("%s: read %s: %v", fileEnv, path, err)
	case len(b) > maxSecretFile:
		return "", "", false, fmt.Errorf("%s: %s is larger than %d KiB: it should hold the secret alone, on one line", fileEnv, path, maxSecretFile>>10)
	}
	v = strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	if strings.TrimSpace(v) == "" {
		return "", "", false, fmt.Errorf("%s: %s is empty: it should hold the secret", fileEnv, path)
	}
	if node.NotASecretAlone(v) {
		// A second line, spaces around it, a byte-order mark: kept, they
		// would make a token no client can send, found only when calls
		// fail.
		return "", "", false, fmt.Errorf("%s: %s holds more than the secret (spaces around it, a second line, control characters or a byte-order mark): "+
			"write the secret alone, with at most one final line break", fileEnv, path)
	}
	return v, fileEnv, true, nil
}

// envAnnotation marks a flag set from the environment; its value is the
// variable's name (explainEnv).
const envAnnotation = "quotad-env"

// setFromEnv sets flag from the variable env and remembers where it came
// from. An error quotes the value unless it is a secret.
func setFromEnv(fs *pflag.FlagSet, flag, env, v string) error {
	if err := fs.Set(flag, v); err != nil {
		if secretFlags[flag] {
			return fmt.Errorf("environment %s (--%s): %v", env, flag, err)
		}
		return fmt.Errorf("environment %s=%q: %v", env, v, err)
	}
	return fs.SetAnnotation(flag, envAnnotation, []string{env})
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
