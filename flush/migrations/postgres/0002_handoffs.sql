-- 0002_handoffs: what an owner handed back, so the next owner can reserve
-- ahead for the accounts that were active (Ledger.Handoffs).
CREATE TABLE handoffs (
    account_id  text        PRIMARY KEY,
    units       bigint      NOT NULL,
    released_at timestamptz NOT NULL
);
CREATE INDEX handoffs_released_at ON handoffs (released_at);
