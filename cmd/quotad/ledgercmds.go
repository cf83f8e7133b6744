package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/wal"
)

func ledgerFlag(cmd *cobra.Command, p *string) {
	cmd.Flags().StringVar(p, "ledger", "", "the ledger: postgres://USER:PASSWORD@HOST:PORT/DB or sqlite:/path/ledger.db (required)")
}

func openLedger(ctx context.Context, dsn string) (flush.Ledger, error) {
	if dsn == "" {
		return nil, fmt.Errorf("--ledger is required: postgres://USER:PASSWORD@HOST:PORT/DB or sqlite:/path/ledger.db (QUOTAD_LEDGER)")
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	return flush.Open(ctx, dsn, nil)
}

// openMigratedLedger opens a ledger that must exist already and be
// migrated: the commands that read one (reconcile, revoke) must not create
// an empty SQLite file at a mistyped path and then fail on a missing table.
func openMigratedLedger(ctx context.Context, dsn string) (flush.Ledger, error) {
	if path, ok := flush.SQLitePath(dsn); ok && path != ":memory:" {
		if _, err := os.Stat(path); err != nil {
			return nil, fmt.Errorf("--ledger %s: no ledger there (%v); check the path (quotad serve and quotad migrate create one)", dsn, err)
		}
	}
	l, err := openLedger(ctx, dsn)
	if err != nil {
		return nil, err
	}
	if v, err := l.SchemaVersion(ctx); err != nil || v == 0 {
		l.Close()
		if err == nil {
			err = errors.New("no schema")
		}
		return nil, fmt.Errorf("--ledger %s: not a migrated quotaring ledger (%v); run quotad migrate --ledger ... first, or check the DSN", flush.RedactDSN(dsn), err)
	}
	if err := flush.CheckSchema(ctx, l); err != nil {
		l.Close()
		return nil, fmt.Errorf("--ledger %s: %w", flush.RedactDSN(dsn), err)
	}
	return l, nil
}

func newMigrateCmd() *cobra.Command {
	var dsn string
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Apply the ledger's schema migrations and exit",
		Long: `Apply the embedded schema migrations to the ledger, under a lock (several
nodes starting at once are safe; quotad serve also migrates at start). A ledger
migrated by a newer quotad is refused: run the newer one.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			l, err := openLedger(cmd.Context(), dsn)
			if err != nil {
				return err
			}
			defer l.Close()
			if err := l.Migrate(cmd.Context()); err != nil {
				return err
			}
			v, err := l.SchemaVersion(cmd.Context())
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "ledger at schema version %d\n", v)
			return nil
		},
	}
	ledgerFlag(cmd, &dsn)
	return cmd
}

func newReconcileCmd() *cobra.Command {
	var dsn string
	var dataDirs []string
	var all bool
	cmd := &cobra.Command{
		Use:   "reconcile",
		Short: "Prove that the ledger's counters equal its event log, or name the difference",
		Long: `Compare, per grant, the ledger's used units with the sum of the event log's
unrefunded allocations to it, and per account and month the daily usage
aggregates with the event log. With --data-dir (of stopped nodes), also list
what each node's log holds that is not settled yet; each data dir is opened
read-only and left exactly as it was.

Exits 0 when everything agrees, 3 when a difference is found, 1 on errors.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runReconcile(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), dsn, dataDirs, all)
		},
	}
	ledgerFlag(cmd, &dsn)
	cmd.Flags().StringSliceVar(&dataDirs, "data-dir", nil, "data dirs of stopped nodes whose unsettled records to list")
	cmd.Flags().BoolVar(&all, "all", false, "print every row, not only differences")
	return cmd
}

// reconcileBlock is how many rows quotad reconcile aligns as one table: the
// rows of a large ledger stream through in blocks of this many, so that
// --all on millions of accounts runs in constant memory.
const reconcileBlock = 1000

// runReconcile writes its report to out and the data dirs' warnings (a dir
// read without its lock) to errOut.
func runReconcile(ctx context.Context, out, errOut io.Writer, dsn string, dataDirs []string, all bool) error {
	l, err := openMigratedLedger(ctx, dsn)
	if err != nil {
		return err
	}
	defer l.Close()
	pruned, err := l.EventsPrunedBefore(ctx)
	if err != nil {
		return err
	}
	if pruned != 0 {
		fmt.Fprintf(out, "the event log before %v was pruned (quotad prune): grants are compared with the log and what was pruned from it, usage from %v on\n\n", pruned, pruned)
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ACCOUNT\tKIND\tSCOPE\tCOUNTER\tEVENT LOG\tDIFFERENCE")
	rows, diffs, printed := 0, 0, 0
	err = l.Reconcile(ctx, func(r flush.ReconcileRow) error {
		rows++
		if r.Diff {
			diffs++
		}
		if !r.Diff && !all {
			return nil
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%+d\n", r.Account, r.Kind, r.Scope, r.Counter, r.Events, r.Counter-r.Events)
		if printed++; printed%reconcileBlock == 0 {
			return tw.Flush() // NB: the rows stream; a tabwriter holds all it is given until Flush
		}
		return nil
	})
	if err != nil {
		return err
	}
	tw.Flush()
	for _, dir := range dataDirs {
		if err := printUnsettled(out, errOut, dir); err != nil {
			return err
		}
	}
	fmt.Fprintf(out, "\n%d rows compared, %d differences\n", rows, diffs)
	if diffs > 0 {
		return &exitError{code: 3, err: fmt.Errorf("reconcile: %d differences between counters and the event log", diffs)}
	}
	return nil
}

// printUnsettled lists a stopped node's unsettled charges per account.
func printUnsettled(out, errOut io.Writer, dir string) error {
	meta, err := os.Stat(dir)
	if err != nil || !meta.IsDir() {
		return fmt.Errorf("--data-dir %s: not a directory", dir)
	}
	// Read-only: the dir is evidence. A read-write open would flush the
	// WAL into a new sstable, MANIFEST and WAL, and write the durable mark.
	warn := slog.New(slog.NewTextHandler(errOut, &slog.HandlerOptions{Level: slog.LevelWarn}))
	l, err := wal.Open(wal.Options{Dir: dir, AnyNode: true, ReadOnly: true, Logger: warn})
	if err != nil {
		return fmt.Errorf("open %s: %w", dir, err) // NB: a dir in use says so itself (wal names the LOCK and fuser)
	}
	defer l.Close()
	units := map[string]int64{}
	var rec shard.Record
	err = l.Scan(l.SettledSeq(), l.DurableSeq(), func(_ uint64, p []byte) error {
		if err := rec.Decode(p); err != nil {
			return err
		}
		switch rec.Type {
		case shard.RecCharge:
			units[rec.Account] += rec.Units
		case shard.RecRefund:
			if !rec.Kept { // a kept refund returned nothing
				units[rec.Account] -= rec.Units
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "\nnode %s (%s): %d records not settled yet\n", l.NodeID(), dir, l.DurableSeq()-l.SettledSeq())
	ids := make([]string, 0, len(units))
	for id := range units {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		fmt.Fprintf(out, "  %s: %+d units pending\n", id, units[id])
	}
	return nil
}

func newRevokeCmd() *cobra.Command {
	var dsn, nodeID string
	var dryRun, force bool
	cmd := &cobra.Command{
		Use:         "revoke",
		Short:       "Free a lost node's reservations",
		Annotations: map[string]string{argFlag: "node"},
		Long: `Free every reservation a node holds in the ledger. Use it for a node that is
gone for good (its disk lost): its reservations otherwise stay frozen so that
nobody can overshoot a hard limit. Freeing them may let through, twice, up
to the units the lost node had reserved but not settled: the command says how
many. A node that comes back frees and re-reserves by itself; never revoke a
node that is running: a running node writes its heartbeat to the ledger every
2 s, and revoke refuses a node heard from in the last 2 minutes unless --force,
or unless it stopped cleanly since (SIGTERM: the ledger records the stop); a
node id the ledger has never seen is refused too.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if nodeID == "" {
				return fmt.Errorf("--node is required: the id of the lost node")
			}
			l, err := openMigratedLedger(cmd.Context(), dsn)
			if err != nil {
				return err
			}
			defer l.Close()
			return runRevoke(cmd.Context(), cmd.OutOrStdout(), l, nodeID, dryRun, force, time.Now())
		},
	}
	ledgerFlag(cmd, &dsn)
	cmd.Flags().StringVar(&nodeID, "node", "", "the lost node's id (required)")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "only list what would be freed")
	cmd.Flags().BoolVar(&force, "force", false, "revoke even though the node was heard from in the last 2 minutes (only when you know it is stopped)")
	return cmd
}

// revokeQuiet is how long a node must have been silent (no heartbeat in
// the ledger, written every flush.HeartbeatEvery) before revoke frees it
// without --force.
const revokeQuiet = 2 * time.Minute

func runRevoke(ctx context.Context, out io.Writer, l flush.Ledger, nodeID string, dryRun, force bool, now time.Time) error {
	nodes, err := l.Nodes(ctx)
	if err != nil {
		return err
	}
	var known []string
	for _, n := range nodes {
		if !slices.Contains(known, n.Node) {
			known = append(known, n.Node)
		}
	}
	last := flush.LatestRunning(nodes)[nodeID].Heartbeat // zero when every incarnation stopped cleanly
	switch {
	case !slices.Contains(known, nodeID):
		return fmt.Errorf("the ledger has never seen a node %q (it knows: %s); check the id (quotad serve --node-id)", nodeID, strings.Join(known, ", "))
	case now.Sub(last) < revokeQuiet && !force && !dryRun:
		return fmt.Errorf("node %s was heard from %s ago (its last heartbeat, at %s): it may be running, and freeing a running node's reservations lets its accounts overshoot. Stop it first, or wait until it has been silent for %s; --force if you know it is stopped",
			nodeID, now.Sub(last).Round(time.Second), last.UTC().Format(time.RFC3339), revokeQuiet)
	}
	held, err := l.Reservations(ctx)
	if err != nil {
		return err
	}
	var total int64
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ACCOUNT\tGRANT\tUNITS")
	for _, r := range held {
		if r.Node == nodeID && r.Units != 0 {
			fmt.Fprintf(tw, "%s\t%s\t%d\n", r.Account, r.Grant, r.Units)
			total += r.Units
		}
	}
	tw.Flush()
	if dryRun {
		fmt.Fprintf(out, "dry run: node %s holds %d units reserved; revoking may let through twice what it charged of them and did not settle (at most %d)\n", nodeID, total, total)
		if now.Sub(last) < revokeQuiet && !force {
			fmt.Fprintf(out, "note: it was heard from %s ago: revoke without --force refuses a node heard from in the last %s\n", now.Sub(last).Round(time.Second), revokeQuiet)
		}
		return nil
	}
	freed, err := l.ReleaseNode(ctx, nodeID)
	if err != nil {
		return err
	}
	var n int64
	for _, f := range freed {
		n += f.Units
	}
	fmt.Fprintf(out, "revoked node %s: freed %d units it held reserved; what it had charged of them and not settled (at most %d: quotad reconcile --data-dir on its disk counts it, if the disk can still be read) may be let through twice\n", nodeID, n, n)
	return nil
}
