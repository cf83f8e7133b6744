-- 0008_pruned_events: event-log retention (quotad prune). The event log of
-- the months before event_retention.pruned_before is gone; the grants, the
-- daily aggregates and the alerts of those months stay. pruned_allocations
-- keeps what the deleted events had allocated to each grant (unrefunded
-- units) per month, so that reconcile still proves every grant's used units
-- against the log and what was pruned from it, and a month's billing still
-- splits its use between quota and credits.
CREATE TABLE event_retention (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    pruned_before TEXT    NOT NULL  -- "2026-06": no event log before this month
);

CREATE TABLE pruned_allocations (
    account_id TEXT    NOT NULL,
    period     TEXT    NOT NULL,  -- the month the events were billed in
    grant_id   TEXT    NOT NULL,
    units      INTEGER NOT NULL,
    PRIMARY KEY (account_id, period, grant_id)
);
