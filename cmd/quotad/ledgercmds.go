package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
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
	if path, ok := flush.SQLitePath(dsn); ok {
		if _, err := os.Stat(path); err != nil {
			return nil, fmt.Errorf("--ledger %s: no ledger there (%v); check the path (quotad serve and quotad migrate create one)", dsn, err)
		}
		// Read-only first: opening it for writing turns another program's
		// database into WAL mode, and an empty file into a database.
		if v, err := flush.SQLiteSchemaVersion(ctx, path); err != nil {
			return nil, fmt.Errorf("--ledger %s: %w", dsn, err)
		} else if v == 0 {
			return nil, fmt.Errorf("--ledger %s: not a migrated quotaring ledger (no schema); run quotad migrate --ledger ... first, or check the path", dsn)
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
migrated by a newer quotad is refused: run the newer one. It says what it did:
created the schema in an empty database (a new ledger: if you meant an existing
one, check --ledger), migrated from one version to another, or nothing.`,
		Example: `  QUOTAD_LEDGER="$OWNER_DSN" quotad migrate     # as the ledger's owner, before a rolling upgrade
  quotad migrate --ledger sqlite:/var/lib/quotad/ledger.db`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			l, err := openLedger(cmd.Context(), dsn)
			if err != nil {
				return err
			}
			defer l.Close()
			was, err := l.SchemaVersion(cmd.Context())
			if err != nil {
				return err
			}
			if err := l.Migrate(cmd.Context()); err != nil {
				return err
			}
			v, err := l.SchemaVersion(cmd.Context())
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			switch {
			case was == 0:
				fmt.Fprintf(out, "created a new ledger, at schema version %d, in a database that held none: if you meant an existing ledger, check --ledger\n", v)
			case was < v:
				fmt.Fprintf(out, "migrated the ledger from schema version %d to %d\n", was, v)
			default:
				fmt.Fprintf(out, "the ledger is at schema version %d already: nothing to do\n", v)
			}
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
read-only and left exactly as it was. Records the ledger settled already are
named as billed. A data dir that its node found to be older than the ledger
(settled mark conflict: restored from a copy) can never settle: its records
are split into those the ledger billed from the original dir (never bill them
again) and those taken since under reused sequence numbers, listed record by
record: bill exactly those by hand.

Exits 0 when everything agrees, 3 when a difference is found, 1 on errors.`,
		Example: `  quotad reconcile --ledger "$DSN"                          # differences only; exit 3 if any
  quotad reconcile --ledger "$DSN" --all                    # every row
  quotad reconcile --ledger "$DSN" --data-dir /var/lib/quotad/q2   # and what a stopped node's log holds`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runReconcile(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), dsn, dataDirs, all)
		},
	}
	ledgerFlag(cmd, &dsn)
	cmd.Flags().StringSliceVar(&dataDirs, "data-dir", nil, "data dirs of stopped nodes whose unsettled records to list (not read from QUOTAD_DATA_DIR, the running node's own)")
	markNoEnv(cmd, "data-dir", "lists stopped nodes' dirs and is not read from the environment, where QUOTAD_DATA_DIR is a running node's own dir; give them on the command line")
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
	// Every dir is listed, and the summary and the exit code say the
	// ledger's verdict, whatever a dir's problem: a mistyped --data-dir
	// ended the run with exit 1 and no summary, hiding a difference.
	// A dir's error is printed in the report, where it belongs; the error
	// returned only counts them (it was the same text a second time).
	var badDirs []string
	for _, dir := range dataDirs {
		if err := printUnsettled(ctx, out, errOut, l, dir); err != nil {
			fmt.Fprintf(out, "\n%s: %v\n", dir, err)
			badDirs = append(badDirs, dir)
		}
	}
	fmt.Fprintf(out, "\n%d rows compared, %d differences\n", rows, diffs)
	var dirErr error
	if len(badDirs) > 0 {
		dirErr = fmt.Errorf("reconcile: could not list the unsettled records of --data-dir %s (the reason is printed above it)", strings.Join(badDirs, ", "))
	}
	if diffs > 0 {
		err := fmt.Errorf("reconcile: %d differences between counters and the event log: the rows above name each grant and month; "+
			"nothing is changed by this command, and a difference is a bug to report with them (README, \"The ledger\": quotad reconcile)", diffs)
		return &exitError{code: 3, err: errors.Join(err, dirErr)}
	}
	return dirErr
}

// printUnsettled lists a stopped node's unsettled charges per account. A
// dir that a node found to be older than the ledger (flush.StaleDir) can
// never settle: its records are split into those the ledger billed from
// the original dir (not to bill again) and those taken since under reused
// sequence numbers, which are listed one by one to be billed by hand.
func printUnsettled(ctx context.Context, out, errOut io.Writer, l flush.Ledger, dir string) error {
	switch meta, err := os.Stat(dir); {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("--data-dir %s: does not exist (give a stopped node's data dir)", dir)
	case err != nil:
		return fmt.Errorf("--data-dir %s: %w", dir, err)
	case !meta.IsDir():
		return fmt.Errorf("--data-dir %s: not a directory (give a stopped node's data dir)", dir)
	}
	// Read-only: the dir is evidence. A read-write open would flush the
	// WAL into a new sstable, MANIFEST and WAL, and write the durable mark.
	warn := slog.New(slog.NewTextHandler(errOut, &slog.HandlerOptions{Level: slog.LevelWarn}))
	wl, err := wal.Open(wal.Options{Dir: dir, AnyNode: true, ReadOnly: true, Logger: warn})
	if err != nil {
		return fmt.Errorf("open %s: %w", dir, err) // NB: a dir in use says so itself (wal names the LOCK and fuser)
	}
	defer wl.Close()
	settled, durable := wl.SettledSeq(), wl.DurableSeq()
	mark, known, err := ledgerMark(ctx, l, wl.NodeID(), wl.Incarnation())
	if err != nil {
		return err
	}
	stale, isStale, err := flush.ReadStaleDir(wl)
	if err != nil {
		return fmt.Errorf("%s: %w", dir, err)
	}
	if !known && !isStale && settled > 0 {
		// It settled into a ledger that is not this one: "pending" would
		// read as "settled at the next start", which this ledger refuses.
		return fmt.Errorf("--data-dir %s: this ledger has never seen the dir's node %s (incarnation %s), though the dir settled records into a ledger up to %d: "+
			"--ledger is most likely not the ledger this node settles into (compare it with the node's --ledger); nothing can be told about the dir's records here",
			dir, wl.NodeID(), wl.Incarnation(), settled)
	}
	fmt.Fprintf(out, "\nnode %s (%s): %d records not settled yet\n", wl.NodeID(), dir, durable-settled)
	if !known && !isStale {
		fmt.Fprintf(out, "  this ledger has never seen the dir's incarnation (%s): the node never reached it from this dir (its records settle at its next start, if this is its ledger), or --ledger is not its ledger\n", wl.Incarnation())
	}
	switch {
	case isStale && stale.OtherProcess:
		return printOtherProcess(ctx, out, l, wl, stale, settled, durable, mark)
	case isStale:
		billed := min(max(stale.Billed, settled), durable)
		fmt.Fprintf(out, "  this data dir is older than the ledger: on %s the node found the ledger had it (incarnation %s) settled to %d while the dir held records only to %d when it opened",
			stale.Found.UTC().Format(time.RFC3339), stale.Incarnation, stale.LedgerMark, stale.Billed)
		if known {
			fmt.Fprintf(out, " (the ledger's mark is %d now)", mark)
		}
		fmt.Fprintln(out, "; none of these records can be settled from it")
		if billed > settled {
			sum, err := unsettledUnits(wl, settled, billed, nil)
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "  records %d to %d: in the dir when it was restored, and settled by the ledger from the original dir: already billed, do not bill them again\n", settled+1, billed)
			printUnits(out, "    ", sum, "units billed already")
		}
		if durable > billed {
			var lines []string
			sum, err := unsettledUnits(wl, billed, durable, &lines)
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "  records %d to %d: charges taken since, under sequence numbers the ledger settled for other charges: in no ledger, BILL THEM BY HAND\n", billed+1, durable)
			printUnits(out, "    ", sum, "units to bill by hand")
			fmt.Fprintln(out, "  to bill by hand, record by record:")
			for _, line := range lines {
				fmt.Fprintln(out, "    "+line)
			}
		} else {
			fmt.Fprintln(out, "  no charge was taken since it was restored: nothing to bill by hand")
		}
		fmt.Fprintf(out, "  then run quotad revoke --node %s and start the node with an empty data dir\n", wl.NodeID())
		return nil
	case known && mark > durable:
		// No node found it (the ledger was never reached from this dir),
		// so nothing recorded where the copy's own records end.
		fmt.Fprintf(out, "  this data dir is older than the ledger: the ledger has it (incarnation %s) settled to %d, beyond this log's end at %d, and no node "+
			"started on it reached the ledger to record which of its records the ledger billed from the original dir: those and the charges taken "+
			"since under reused sequence numbers cannot be told apart here; none of them can be settled from this dir\n", wl.Incarnation(), mark, durable)
		sum, err := unsettledUnits(wl, settled, durable, nil)
		if err != nil {
			return err
		}
		// NB: not "units pending": some were billed already, and billing
		// them by hand would bill those twice.
		printUnits(out, "    ", sum, "units billed already or to bill by hand (which, this dir cannot tell: compare with the ledger's event log for this incarnation)")
		fmt.Fprintf(out, "  then run quotad revoke --node %s and start the node with an empty data dir\n", wl.NodeID())
		return nil
	case known && mark > settled:
		sum, err := unsettledUnits(wl, settled, mark, nil)
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "  records %d to %d: settled by the ledger (its answer was not recorded here before the node stopped): already billed; the node's next start marks them\n", settled+1, mark)
		printUnits(out, "    ", sum, "units billed already")
		settled = mark
		if durable > settled {
			fmt.Fprintf(out, "  records %d to %d: not settled yet; the node settles them at its next start\n", settled+1, durable)
		}
	}
	sum, err := unsettledUnits(wl, settled, durable, nil)
	if err != nil {
		return err
	}
	printUnits(out, "  ", sum, "units pending")
	return nil
}

// printOtherProcess is printUnsettled for a dir whose node found that a
// later process had started as it on a copy of the dir (StaleDir's
// OtherProcess): its records past its settled mark can never settle from
// it, and the ledger's event log tells which of them are billed (the same
// event at this incarnation and seq: a record the copy held too, settled
// by the other process, or one this dir sent in a settle whose answer
// never came) from those to bill by hand. It calls one to bill by hand
// only where the ledger has settled that seq (mark, the ledger's mark of
// the incarnation) with another event, its month's event log is there
// (not pruned) and the log holds events of the incarnation at all (not
// --events=off); the rest it cannot tell yet, and says why.
func printOtherProcess(ctx context.Context, out io.Writer, l flush.Ledger, wl *wal.Log, stale flush.StaleDir, settled, durable, mark uint64) error {
	fmt.Fprintf(out, "  on %s the node found that another process had started as it (incarnation %s) on a copy of this dir, and the ledger refused this one's settles from then on: "+
		"none of these records can be settled from it\n", stale.Found.UTC().Format(time.RFC3339), stale.Incarnation)
	if durable <= settled {
		fmt.Fprintln(out, "  nothing to bill by hand; do not start a node on this dir again")
		return nil
	}
	type record struct {
		seq     uint64
		refund  bool
		account string
		event   string
		period  shard.Period
		line    string
	}
	var recs []record
	var rec shard.Record
	err := wl.Scan(settled, durable, func(seq uint64, p []byte) error {
		if err := rec.Decode(p); err != nil {
			return err
		}
		delta, ok := billedDelta(&rec)
		if !ok {
			return nil
		}
		recs = append(recs, record{seq: seq, refund: rec.Type == shard.RecRefund, account: rec.Account,
			event: shard.LedgerEventID(rec.EventID, rec.Gen), period: rec.Period, line: recordLine(seq, &rec, delta)})
		return nil
	})
	if err != nil {
		return err
	}
	// The ledger's events of each account these records name.
	type origin struct {
		node, inc string
		seq       uint64
	}
	byID := map[[2]string]flush.EventRow{}
	seen := map[string]bool{}
	ours := 0 // the events of this incarnation among those read
	for _, r := range recs {
		if seen[r.account] {
			continue
		}
		seen[r.account] = true
		rows, err := l.Events(ctx, r.account)
		if err != nil {
			return fmt.Errorf("read the ledger's events of %s: %w", r.account, err)
		}
		for _, e := range rows {
			byID[[2]string{e.Account, e.EventID}] = e
			if e.Node == wl.NodeID() && e.Incarnation == wl.Incarnation() {
				ours++
			}
		}
	}
	pruned, err := l.EventsPrunedBefore(ctx)
	if err != nil {
		return err
	}
	var billed, toBill, undecided, refunds []string
	for _, r := range recs {
		e, ok := byID[[2]string{r.account, r.event}]
		switch {
		case r.refund && ok && e.Refunded:
			refunds = append(refunds, r.line+"  (refunded in the ledger)")
		case r.refund:
			refunds = append(refunds, r.line+"  (not refunded in the ledger: refund it by hand only if its charge is billed)")
		case ok && !e.Tombstone && (origin{e.Node, e.Incarnation, e.Seq} == origin{wl.NodeID(), wl.Incarnation(), r.seq}):
			billed = append(billed, r.line)
		case ok && !e.Tombstone:
			billed = append(billed, r.line+fmt.Sprintf("  (a retry: the ledger billed the event from %s/%s seq %d)", e.Node, e.Incarnation, e.Seq))
		case r.seq > mark:
			undecided = append(undecided, r.line+fmt.Sprintf("  (the other process has settled only to seq %d: if the copy held this record, it bills it)", mark))
		case pruned != 0 && r.period < pruned:
			undecided = append(undecided, r.line+fmt.Sprintf("  (the event log of %v was pruned)", r.period))
		case ours == 0:
			undecided = append(undecided, r.line+"  (the ledger's event log holds no event of this incarnation: --events=off?)")
		default:
			toBill = append(toBill, r.line)
		}
	}
	section := func(title string, ls []string) {
		if len(ls) == 0 {
			return
		}
		fmt.Fprintf(out, "  %s (%d):\n", title, len(ls))
		for _, line := range ls {
			fmt.Fprintln(out, "    "+line)
		}
	}
	section("charges the ledger billed already (the same event in its event log): do not bill them again", billed)
	section("charges in no ledger (the other process settled other charges under their numbers): BILL THEM BY HAND", toBill)
	section("charges this cannot tell yet: do not bill them now; run this again once the other process has settled past them, "+
		"or compare with its dir (quotad reconcile --data-dir on it, once stopped)", undecided)
	section("refunds", refunds)
	if len(toBill) == 0 && len(undecided) == 0 {
		fmt.Fprintln(out, "  nothing to bill by hand")
	}
	fmt.Fprintf(out, "  do not start a node on this dir again, nor run quotad revoke --node %s while the other process runs as it\n", wl.NodeID())
	return nil
}

// ledgerMark is the ledger's settled mark of (node, incarnation), and
// whether the ledger knows that incarnation. It only reads.
func ledgerMark(ctx context.Context, l flush.Ledger, node, inc string) (uint64, bool, error) {
	rows, err := l.Nodes(ctx)
	if err != nil {
		return 0, false, err
	}
	for _, r := range rows {
		if r.Node == node && r.Incarnation == inc {
			return r.Settled, true, nil
		}
	}
	return 0, false, nil
}

// acctPeriod is an account and one of its billing months.
type acctPeriod struct{ account, period string }

// unsettledUnits sums the units of the charges and refunds in (after, upto]
// by account and month and, when lines is not nil, appends one line per
// charge or refund.
func unsettledUnits(wl *wal.Log, after, upto uint64, lines *[]string) (map[acctPeriod]int64, error) {
	units := map[acctPeriod]int64{}
	var rec shard.Record
	err := wl.Scan(after, upto, func(seq uint64, p []byte) error {
		if err := rec.Decode(p); err != nil {
			return err
		}
		delta, ok := billedDelta(&rec)
		if !ok {
			return nil
		}
		units[acctPeriod{rec.Account, rec.Period.String()}] += delta
		if lines != nil {
			*lines = append(*lines, recordLine(seq, &rec, delta))
		}
		return nil
	})
	return units, err
}

// billedDelta is what a record changes of its account's billed units: a
// charge's units, less a refund's; ok is false for the other records (and
// a kept refund, which returned nothing).
func billedDelta(rec *shard.Record) (delta int64, ok bool) {
	switch {
	case rec.Type == shard.RecCharge:
		return rec.Units, true
	case rec.Type == shard.RecRefund && !rec.Kept:
		return -rec.Units, true
	}
	return 0, false
}

// recordLine is one charge or refund of a data dir, to bill (or not) by
// hand, with delta its billedDelta.
func recordLine(seq uint64, rec *shard.Record, delta int64) string {
	what := "charge"
	if delta < 0 {
		what = "refund"
	}
	return fmt.Sprintf("seq %d  %s  %s  month %s  event %q  key %s  route %q  %+d units  at %s",
		seq, what, rec.Account, rec.Period.String(), shard.LedgerEventID(rec.EventID, rec.Gen), rec.Key, rec.Route, delta,
		time.Unix(0, rec.Wall).UTC().Format(time.RFC3339Nano))
}

// printUnits prints units by account (and month, when there are several),
// sorted, each after indent and followed by what.
func printUnits(out io.Writer, indent string, units map[acctPeriod]int64, what string) {
	keys := make([]acctPeriod, 0, len(units))
	months := map[string]map[string]bool{}
	for k := range units {
		keys = append(keys, k)
		if months[k.account] == nil {
			months[k.account] = map[string]bool{}
		}
		months[k.account][k.period] = true
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].account != keys[j].account {
			return keys[i].account < keys[j].account
		}
		return keys[i].period < keys[j].period
	})
	for _, k := range keys {
		name := k.account
		if what != "units pending" || len(months[k.account]) > 1 {
			name += " " + k.period
		}
		fmt.Fprintf(out, "%s%s: %+d %s\n", indent, name, units[k], what)
	}
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
		Example: `  quotad revoke --ledger "$DSN" --node q2 --dry-run   # what would be freed, and the overshoot it allows
  quotad revoke --ledger "$DSN" --node q2`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if nodeID == "" {
				return fmt.Errorf("--node is required: the id of the lost node")
			}
			l, err := openMigratedLedger(cmd.Context(), dsn)
			if err != nil {
				return err
			}
			defer l.Close()
			// NB: by the ledger's clock, which wrote the heartbeats: by this
			// machine's, minutes ahead, a running node looked silent and
			// was freed without --force (its accounts could overshoot).
			now, err := l.Clock(cmd.Context())
			if err != nil {
				return fmt.Errorf("read the ledger's clock: %w", err)
			}
			return runRevoke(cmd.Context(), cmd.OutOrStdout(), l, nodeID, dryRun, force, now)
		},
	}
	ledgerFlag(cmd, &dsn)
	cmd.Flags().StringVar(&nodeID, "node", "", "the lost node's id (required)")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "only list what would be freed")
	cmd.Flags().BoolVar(&force, "force", false, "revoke even though the node was heard from in the last 2 minutes (only when you know it is stopped)")
	markNoEnv(cmd, "force", safetyOverride)
	markNoEnv(cmd, "node", destructiveTarget)
	return cmd
}

// revokeQuiet is how long a node must have been silent (no heartbeat in
// the ledger, written every flush.HeartbeatEvery) before revoke frees it
// without --force.
const revokeQuiet = flush.LostNodeQuiet

// runRevoke frees nodeID's reservations; now is the ledger's clock (how
// long ago the node was heard from is measured by the clock that wrote its
// heartbeats).
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
		knows := "it knows: " + strings.Join(known, ", ")
		if len(known) == 0 {
			knows = "it knows no node: is --ledger the one the cluster settles into?"
		}
		return fmt.Errorf("the ledger has never seen a node %q (%s); check the id (quotad serve --node-id)", nodeID, knows)
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
