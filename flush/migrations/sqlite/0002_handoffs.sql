-- 0002_handoffs: what an owner handed back, so the next owner can reserve
-- ahead for the accounts that were active (Ledger.Handoffs). released_at is
-- Unix nanoseconds.
CREATE TABLE handoffs (
    account_id  TEXT    PRIMARY KEY,
    units       INTEGER NOT NULL,
    released_at INTEGER NOT NULL
);
CREATE INDEX handoffs_released_at ON handoffs (released_at);
