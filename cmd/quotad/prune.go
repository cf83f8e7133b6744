package main

import (
	"context"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/shard"
)

func newPruneCmd() *cobra.Command {
	var dsn, before string
	var lost []string
	var dryRun bool
	cmd := &cobra.Command{
		Use:         "prune --before MONTH",
		Annotations: map[string]string{argFlag: "before"},
		Short:       "Drop the event log of old months (retention); billing figures stay",
		Long: `Drop the ledger's event log (a row per charge) of every month before --before,
oldest first, each month in a transaction of its own: on Postgres its
partition is dropped, on SQLite its rows are deleted. What billing reads
stays: the grants' used units, the daily usage aggregates (quotad admin
usage), the alerts. quotad reconcile still checks every grant (against the
log and what was pruned from it) and compares the months still in the log.

A month goes only when nothing can change its events any more:

  - --before must be over: a node refunds a charge's receipt in the charge's
    month and the next only, so on 2 December the latest is --before 2026-11,
    which drops October and before;
  - --before and every month dropped must be final: every node heard from
    during the month has been heard from since it ended (a running node
    writes its heartbeat every 2 s), so no charge or refund of it waits in a
    node's log. A node stopped cleanly (SIGTERM) records that it left nothing
    unsettled; one gone for good otherwise (crashed and never restarted, its
    disk lost, its reservations freed with quotad revoke) holds the months it
    was heard from back: name it with --lost-node.

Run it as a role that may drop the event log's partitions (the ledger's
owner, as for quotad migrate), from a cron job once a month for example:
--before two months back keeps last month and this one. --dry-run counts
the events each month holds and changes nothing.`,
		Example: `  quotad prune --ledger "$OWNER_DSN" --before 2026-09 --dry-run
  quotad prune --ledger "$OWNER_DSN" --before "$(date -u -d '-2 month' +%Y-%m)"`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if before == "" {
				return fmt.Errorf("--before is required: the first month whose event log stays, such as 2026-09")
			}
			p, ok := shard.ParsePeriod(before)
			if !ok || p.String() != before {
				return fmt.Errorf("--before %q: want a month such as 2026-09", before)
			}
			l, err := openMigratedLedger(cmd.Context(), dsn)
			if err != nil {
				return err
			}
			defer l.Close()
			return runPrune(cmd.Context(), cmd.OutOrStdout(), l, flush.PruneOptions{Before: p, DryRun: dryRun, Lost: lost})
		},
	}
	ledgerFlag(cmd, &dsn)
	cmd.Flags().StringVar(&before, "before", "", "the first month whose event log stays, such as 2026-09: every month before it is dropped (required)")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "check and count the events of each month that would go; change nothing")
	cmd.Flags().StringSliceVar(&lost, "lost-node", nil, "a node gone for good (revoked) whose last heartbeat would otherwise hold its months back; repeat or comma-separate")
	return cmd
}

func runPrune(ctx context.Context, out io.Writer, l flush.Ledger, o flush.PruneOptions) error {
	verb := "dropped"
	if o.DryRun {
		verb = "would drop"
	}
	var total int64
	o.Progress = func(m flush.PrunedMonth) {
		total += m.Events
		fmt.Fprintf(out, "%s the event log of %v: %d events\n", verb, m.Period, m.Events)
	}
	res, err := l.PruneEvents(ctx, o)
	if err != nil {
		return err
	}
	switch {
	case o.DryRun && len(res.Months) == 0:
		fmt.Fprintf(out, "dry run: no event log before %v to drop\n", o.Before)
	case o.DryRun:
		fmt.Fprintf(out, "dry run: %d events in %d months before %v would go; nothing changed\n", total, len(res.Months), o.Before)
	default:
		fmt.Fprintf(out, "%d events in %d months dropped; the ledger holds no event log before %v\n", total, len(res.Months), res.PrunedBefore)
	}
	return nil
}
