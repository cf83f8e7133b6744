-- 0005_alert_delivery: quota alerts are delivered at least once (see the
-- Postgres migration of the same number for the columns). Times are Unix
-- nanoseconds of the ledger's clock, except crossed_at (the owner's).
ALTER TABLE alerts RENAME COLUMN sent_at TO crossed_at;
ALTER TABLE alerts ADD COLUMN used INTEGER NOT NULL DEFAULT 0;
ALTER TABLE alerts ADD COLUMN limit_units INTEGER NOT NULL DEFAULT 0;
ALTER TABLE alerts ADD COLUMN state TEXT NOT NULL DEFAULT 'pending'
    CHECK (state IN ('pending', 'delivered', 'given_up', 'legacy'));
ALTER TABLE alerts ADD COLUMN created_at INTEGER NOT NULL DEFAULT 0;
ALTER TABLE alerts ADD COLUMN claimed_at INTEGER NOT NULL DEFAULT 0;
ALTER TABLE alerts ADD COLUMN finished_at INTEGER;
ALTER TABLE alerts ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE alerts ADD COLUMN last_error TEXT NOT NULL DEFAULT '';
-- Rows recorded before: claimed under the old at-most-once rule, never sent again.
UPDATE alerts SET state = 'legacy', created_at = crossed_at, claimed_at = crossed_at, finished_at = crossed_at;
CREATE INDEX alerts_pending ON alerts (claimed_at) WHERE state = 'pending';
