package main

import (
	"context"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/shard"
)

func newPruneCmd() *cobra.Command {
	var dsn, before string
	var lost []string
	var dryRun bool
	var keep int
	cmd := &cobra.Command{
		Use:         "prune (--before MONTH | --keep-months N)",
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
    during the month has settled everything it held since it ended, so no
    charge or refund of it waits in a node's log. A node stopped cleanly (SIGTERM) records that it left nothing
    unsettled; one gone for good otherwise (crashed and never restarted, its
    disk lost, its reservations freed with quotad revoke) holds the months it
    was heard from back: name it with --lost-node.

Run it as a role that may drop the event log's partitions (the ledger's
owner, as for quotad migrate), from a job once a month for example, with
--keep-months instead of --before: --keep-months 12 keeps the twelve whole
months before the current one (by the ledger's clock) and drops the rest,
so the same command line serves every month (deploy/kubernetes has such a
CronJob). --keep-months 1 is the least: last month's charges may still be
refunded. --dry-run counts the events each month holds and changes
nothing.`,
		Example: `  QUOTAD_LEDGER="$OWNER_DSN" quotad prune --before 2026-09 --dry-run   # the DSN out of ps
  QUOTAD_LEDGER="$OWNER_DSN" quotad prune --keep-months 12`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			o := flush.PruneOptions{DryRun: dryRun, Lost: lost}
			switch {
			case before != "" && cmd.Flags().Changed("keep-months"):
				return fmt.Errorf("--before and --keep-months: give one (--before names the month, --keep-months counts back from the current one)")
			case before != "":
				p, err := node.ParseMonth(before)
				if err != nil {
					return fmt.Errorf("--before %v", err)
				}
				o.Before = p
			case cmd.Flags().Changed("keep-months"):
				if keep < 1 {
					return fmt.Errorf("--keep-months %d: want 1 or more (whole months kept before the current one, back to 1970-01 at most; last month's charges may still be refunded)", keep)
				}
				o.KeepMonths = keep
			default:
				return fmt.Errorf("--before or --keep-months is required: the first month whose event log stays (such as 2026-09), or how many whole months before the current one to keep (such as 12)")
			}
			l, err := openMigratedLedger(cmd.Context(), dsn)
			if err != nil {
				return err
			}
			defer l.Close()
			return runPrune(cmd.Context(), cmd.OutOrStdout(), l, o)
		},
	}
	ledgerFlag(cmd, &dsn)
	cmd.Flags().StringVar(&before, "before", "", "the first month whose event log stays, such as 2026-09: every month before it is dropped (this or --keep-months)")
	cmd.Flags().IntVar(&keep, "keep-months", 0, "whole months to keep before the current one (by the ledger's clock), 1 or more: the month that many back is --before (this or --before)")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "check and count the events of each month that would go; change nothing")
	cmd.Flags().StringSliceVar(&lost, "lost-node", nil, "a node gone for good (revoked) whose last heartbeat would otherwise hold its months back; repeat or comma-separate")
	markNoEnv(cmd, "lost-node", safetyOverride)
	markNoEnv(cmd, "before", destructiveTarget)
	markNoEnv(cmd, "keep-months", destructiveTarget)
	return cmd
}

func runPrune(ctx context.Context, out io.Writer, l flush.Ledger, o flush.PruneOptions) error {
	if o.KeepMonths > 0 {
		// The month --keep-months names, by the ledger's clock, as
		// --before: so that one reaching back before the ledger's first
		// month is refused as --before 1969-12 is, and the messages
		// below name the month.
		now, err := l.Clock(ctx)
		if err != nil {
			return err
		}
		cur := shard.PeriodOf(now.UnixNano())
		if most := int64(cur) - int64(flush.MinBillingPeriod); int64(o.KeepMonths) > most {
			return fmt.Errorf("--keep-months %d reaches back before %v, the first month a ledger holds (the ledger's month is %v): want 1 to %d",
				o.KeepMonths, flush.MinBillingPeriod, cur, most)
		}
		o.Before, o.KeepMonths = cur-shard.Period(o.KeepMonths), 0
	}
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
		fmt.Fprintf(out, "dry run: %s in %s before %v would go; nothing changed\n", plural(total, "event", "events"), plural(int64(len(res.Months)), "month", "months"), o.Before)
	default:
		fmt.Fprintf(out, "%s in %s dropped; the ledger holds no event log before %v\n", plural(total, "event", "events"), plural(int64(len(res.Months)), "month", "months"), res.PrunedBefore)
	}
	return nil
}
