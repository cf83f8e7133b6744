-- 0004_alert_claim: which claim recorded an alert. A node that retries its
-- claim because the reply was lost finds its own claim there and sends the
-- alert; another node's claim of the same alert is "already sent".
ALTER TABLE alerts ADD COLUMN claim text NOT NULL DEFAULT '';
