package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	chaos "github.com/quotaring/quotaring/chaos_test"
)

func newChaosCmd() *cobra.Command {
	var cfg chaos.Config
	var faults string
	cmd := &cobra.Command{
		Use:   "chaos",
		Short: "Break a local cluster on purpose and check that nothing was lost or overspent",
		Long: `Start a cluster of quotad processes on this machine (127.x.y.z) with a
throwaway Postgres from the local binaries (initdb, pg_ctl and postgres on
PATH, or under /usr/lib/postgresql/*/bin), charge it from many clients through
gRPC, the embedded client and the HTTP proxy, inject faults on a schedule drawn
from --seed, heal, let every node settle and drain, and check the guarantees
against the recorded history and the ledger:

  G1    no account acknowledged more than its hard limit
  G2    every acknowledged charge is in the ledger (a destroyed disk's
        unsettled charges are the documented loss, reported as a number)
  G3    no event billed twice; a refused charge leaves no trace
  G4    refunds return units once
  G6    reconcile is clean (counters equal the event log)
  G7    rate limits within burst + rate*t (+ one burst per ownership move)
  G8    charges acknowledged while the ledger was down
  G9    no period goes backwards after a clock jump
  AVAIL no account stays undecided 15 s past the faults that held it
  SEQ   settled sequences contiguous per (node, incarnation)
  RES   reservations agree with the nodes before the final drain (give or
        take the units each counts in doubt); none left after it
  ALERT quota alerts delivered at least once, signed, as the ledger records
        them; a hard account that used its month up has its 80 % and 100 %
  LIVE  nodes come back, drain and exit 0

The faults (--faults all, or a comma-separated list):

` + faultList() + `
It prints a line per fault and a progress line every 10 s, then the table of
invariants. With --out it writes report.md (the table, the first offending
operations of every violation, the faults as applied), report.json,
history.json (every operation: invoke and answer times, the node it went
through, the deciding node, the answer) and report.svg (answers per second
with the faults shaded).

The seed fixes the schedule and each client's choices; the interleavings are
the real processes' own, so a run shows a violation that a rerun of the same
seed may not. Exits 0 when every invariant held, 3 on a violation, 1 when the
run could not be done, 130 when interrupted: Ctrl-C (or SIGTERM) stops the
load, the nodes and Postgres, checks nothing, writes what was recorded so far
to --out and keeps the data dirs and node logs, as a violation does; a
second Ctrl-C ends it at once, the nodes and Postgres with it. A kept
directory holds the ledger too (ledger.sql, a pg_dump of it). Needs about
100 MB of disk a node (scale-ups included) and 200 MB for Postgres, in --dir
or the temporary directory (TMPDIR): a run is refused before it starts where
less is free. Needs 2 cores; run it as a user that may start Postgres (as
root it runs Postgres as the postgres user).`,
		Example: `  quotad chaos --nodes 5 --duration 10m --faults all --seed 42 --out ./chaos-report
  quotad chaos --nodes 3 --duration 2m --faults kill,ledger-down --seed 7`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkChaosFlags(&cfg); err != nil {
				return err
			}
			fs, err := chaos.ParseFaults(faults)
			if err != nil {
				return err
			}
			cfg.Faults = fs
			if cfg.Binary == "" {
				if cfg.Binary, err = os.Executable(); err != nil {
					return fmt.Errorf("find this quotad's path: %w", err)
				}
			}
			cfg.Progress = cmd.ErrOrStderr()
			rep, err := chaos.Run(cmd.Context(), cfg)
			if cmd.Context().Err() != nil && (rep == nil || rep.Interrupted != "") { // Ctrl-C, SIGTERM
				return chaosInterrupted(cmd.OutOrStdout(), rep, cfg.Out, err)
			}
			if rep == nil {
				return err
			}
			// A report that could not be written still has its verdicts.
			printChaosReport(cmd.OutOrStdout(), rep, cfg.Out, err == nil)
			if rep.Violated() {
				msg := "chaos: invariants violated (see above)"
				if err != nil {
					msg += "; " + err.Error()
				}
				return &exitError{code: 3, err: errors.New(msg)}
			}
			return err
		},
	}
	fl := cmd.Flags()
	fl.IntVar(&cfg.Nodes, "nodes", 5, "nodes to start with (at least 3; at most 151 with the default --first-ip)")
	fl.DurationVar(&cfg.Duration, "duration", 10*time.Minute, "how long the fault schedule runs (the whole run takes about a minute more)")
	fl.StringVar(&faults, "faults", "all", "all, or a comma-separated list of: "+chaos.FaultNames())
	fl.Uint64Var(&cfg.Seed, "seed", 1, "seed of the fault schedule and the clients' choices; the report names it")
	fl.StringVar(&cfg.Out, "out", "", "directory to write the report to (report.md, report.json, history.json, report.svg; files of those names there are removed when the run starts, so that a run that ends without a report leaves none)")
	fl.StringVar(&cfg.Dir, "dir", "", "a new or empty directory for the nodes' data dirs and logs (default: a temporary one, removed at the end unless --keep)")
	fl.BoolVar(&cfg.Keep, "keep", false, "keep the temporary directory of data dirs, logs and the ledger's dump (ledger.sql)")
	fl.IntVar(&cfg.Workers, "workers", 16, "client goroutines")
	fl.Float64Var(&cfg.Rate, "rate", 150, "new operations per second the clients start in all, 0.5 to 100000 (their retries and second refunds come on top)")
	fl.DurationVar(&cfg.SettleInterval, "settle-interval", 500*time.Millisecond, "the nodes' --settle-interval (a lost disk loses about this much)")
	fl.IntVar(&cfg.FirstIP, "first-ip", 100, "node i listens on SUBNET.(first-ip + i)")
	fl.StringVar(&cfg.Subnet, "subnet", "", "the first three bytes of the nodes' loopback addresses (default: a random 127.x.y, so that two runs on one machine never meet)")
	fl.StringVar(&cfg.Binary, "binary", "", "the quotad the nodes run (default: this one)")
	return cmd
}

// chaosInterrupted says what an interrupted run leaves: no verdicts, and
// where what it recorded went. It exits 130, as a shell does for Ctrl-C.
func chaosInterrupted(out io.Writer, rep *chaos.Report, dir string, err error) error {
	if rep == nil {
		return &exitError{code: 130, err: errors.New("chaos: interrupted before the workload began: nothing was recorded or checked")}
	}
	fmt.Fprintf(out, "\n%s\n%s\n", rep.Command, rep.Interrupted)
	if dir != "" {
		fmt.Fprintf(out, "what was recorded until then: %s (report.md, report.json, history.json, report.svg)\n", dir)
	}
	if rep.Dir != "" {
		fmt.Fprintf(out, "data dirs and node logs in %s\n", filepath.Join(rep.Dir, "nodes"))
	}
	if err == nil {
		err = errors.New("chaos: interrupted")
	}
	return &exitError{code: 130, err: err}
}

// printChaosReport prints the table of invariants and the first offending
// operations of each violation; written says whether the report files
// went to out.
func printChaosReport(out io.Writer, rep *chaos.Report, dir string, written bool) {
	fmt.Fprintf(out, "\n%s\n%d operations; documented loss: %d charges (%d units) on destroyed disks, %d units revoked\n\n",
		rep.Command, rep.Workload.Ops, rep.Loss.Charges, rep.Loss.ChargeUnits, rep.Loss.Revoked)
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "CHECK\tVERDICT\tWHAT WAS CHECKED")
	for _, r := range rep.Results {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", r.ID, r.Verdict, r.Summary)
	}
	tw.Flush()
	for _, r := range rep.Results {
		for _, v := range r.Violations {
			who := strings.TrimSpace(v.Account + " " + v.Event)
			if who != "" {
				who += ": "
			}
			fmt.Fprintf(out, "\n%s: %s%s\n", r.ID, who, v.Detail)
			for _, id := range v.Ops {
				fmt.Fprintf(out, "    %s\n", rep.Offending[id])
			}
		}
	}
	if dir != "" && written {
		fmt.Fprintf(out, "\nreport in %s (report.md, report.json, history.json, report.svg)\n", dir)
	}
	if rep.Dir != "" {
		fmt.Fprintf(out, "data dirs and node logs in %s\n", filepath.Join(rep.Dir, "nodes"))
	}
}

// checkChaosFlags refuses values chaos.Config would silently replace: a
// zero there means "the default", so --nodes 0 ran five nodes for ten
// minutes and --duration 0 ran the full ten minutes.
func checkChaosFlags(cfg *chaos.Config) error {
	switch {
	case cfg.Nodes < 3:
		return fmt.Errorf("chaos: --nodes %d: want at least 3 (a partition needs two sides and a bridge a third node)", cfg.Nodes)
	case cfg.Duration < chaos.MinDuration:
		return fmt.Errorf("chaos: --duration %s: want at least %s (5 s of steady load, then the faults)", cfg.Duration, chaos.MinDuration)
	case cfg.Workers < 1:
		return fmt.Errorf("chaos: --workers %d: want at least 1", cfg.Workers)
	case !(cfg.Rate >= 0.5 && cfg.Rate <= 100_000): // NB: NaN fails every comparison
		return fmt.Errorf("chaos: --rate %g: want 0.5 to 100000 operations a second (fewer tests nothing; the workload's ticker cannot go faster)", cfg.Rate)
	case cfg.SettleInterval < minSettleInterval:
		return fmt.Errorf("chaos: --settle-interval %s: want at least %s (the nodes' own floor)", cfg.SettleInterval, minSettleInterval)
	case cfg.FirstIP < 2 || cfg.FirstIP > 250:
		return fmt.Errorf("chaos: --first-ip %d: want 2 to 250 (node i listens on SUBNET.(first-ip + i))", cfg.FirstIP)
	case cfg.Nodes > chaos.MaxNodes(cfg.FirstIP):
		return fmt.Errorf("chaos: --nodes %d: want at most %d with --first-ip %d (node i listens on SUBNET.(first-ip + i), up to 3 scale-ups included, under SUBNET.255)",
			cfg.Nodes, chaos.MaxNodes(cfg.FirstIP), cfg.FirstIP)
	}
	return nil
}

// faultList formats chaos.FaultHelp for --help.
func faultList() string {
	var b strings.Builder
	for _, f := range chaos.AllFaults {
		fmt.Fprintf(&b, "  %-16s %s\n", f, wrap(chaos.FaultHelp[f], 60, "                   "))
	}
	return b.String()
}

// wrap breaks s into lines of at most width characters, indenting the
// continuation lines.
func wrap(s string, width int, indent string) string {
	var lines []string
	line := ""
	for _, w := range strings.Fields(s) {
		if line != "" && len(line)+1+len(w) > width {
			lines = append(lines, line)
			line = w
			continue
		}
		if line != "" {
			line += " "
		}
		line += w
	}
	lines = append(lines, line)
	return strings.Join(lines, "\n"+indent)
}
