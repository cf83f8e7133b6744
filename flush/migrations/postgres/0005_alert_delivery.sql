-- 0005_alert_delivery: quota alerts are delivered at least once.
-- A row is claimed (claim, claimed_at) when a node first sees the crossing,
-- and stays 'pending' until its webhook is 'delivered' or 'given_up'. A
-- pending claim older than the lease is taken over by another node (or the
-- same node restarted), so an alert whose node died, or whose receiver was
-- down for longer than one round of retries, is still sent. The columns:
--   crossed_at:  when the owner saw the crossing (was sent_at, which it
--                always was: the claim came before the send)
--   used, limit_units: the webhook's figures, so any node can send it
--   created_at, claimed_at, finished_at: the ledger's clock
--   attempts, last_error: webhook calls so far and the last failure
-- Rows recorded before this migration were claimed under the old
-- at-most-once rule (sent, or lost): 'legacy', never sent again.
ALTER TABLE alerts RENAME COLUMN sent_at TO crossed_at;
ALTER TABLE alerts ADD COLUMN used bigint NOT NULL DEFAULT 0;
ALTER TABLE alerts ADD COLUMN limit_units bigint NOT NULL DEFAULT 0;
ALTER TABLE alerts ADD COLUMN state text NOT NULL DEFAULT 'legacy'
    CHECK (state IN ('pending', 'delivered', 'given_up', 'legacy'));
ALTER TABLE alerts ALTER COLUMN state SET DEFAULT 'pending';
ALTER TABLE alerts ADD COLUMN created_at timestamptz NOT NULL DEFAULT now();
ALTER TABLE alerts ADD COLUMN claimed_at timestamptz NOT NULL DEFAULT now();
ALTER TABLE alerts ADD COLUMN finished_at timestamptz;
ALTER TABLE alerts ADD COLUMN attempts integer NOT NULL DEFAULT 0;
ALTER TABLE alerts ADD COLUMN last_error text NOT NULL DEFAULT '';
UPDATE alerts SET created_at = crossed_at, claimed_at = crossed_at, finished_at = crossed_at;
CREATE INDEX alerts_pending ON alerts (claimed_at) WHERE state = 'pending';
