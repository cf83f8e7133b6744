-- 0016_usage_monthly: the settled usage of each account by month and route,
-- kept up to date from usage_daily by triggers (whatever writes usage_daily,
-- this build's settles or an earlier one's), so that the config snapshot
-- every node reads every few seconds can carry the month's split by route
-- for each account (a node that takes an account over shows the whole
-- month's routes in the usage endpoint, not only its own charges) at the
-- cost of one row per account and route, not one per key, route and day.
-- A month is the day's UTC month, as Usage and BillingUsage read usage_daily.
-- Settles that write usage_daily while this runs (nodes of the previous
-- build settle through a rolling upgrade) wait for it: otherwise a row
-- written after the fill below read the table, and before the triggers
-- exist, would never reach usage_monthly.
LOCK TABLE usage_daily IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE usage_monthly (
    account_id text   NOT NULL,
    period     text   NOT NULL,  -- "2026-06"
    route      text   NOT NULL,
    units      bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (period, account_id, route)
);

INSERT INTO usage_monthly (account_id, period, route, units)
SELECT account_id, to_char(day, 'YYYY-MM'), route, sum(units)
FROM usage_daily GROUP BY 1, 2, 3;

-- Statement triggers with transition tables: one set-based upsert per
-- settle statement, not one per row. An INSERT ... ON CONFLICT DO UPDATE
-- fires both, the inserted rows in the first and the updated in the second.
CREATE FUNCTION usage_monthly_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO usage_monthly AS m (account_id, period, route, units)
    SELECT account_id, to_char(day, 'YYYY-MM'), route, sum(units)
    FROM new_rows GROUP BY 1, 2, 3 ORDER BY 2, 1, 3
    ON CONFLICT (period, account_id, route) DO UPDATE SET units = m.units + excluded.units;
    RETURN NULL;
END $$;

CREATE FUNCTION usage_monthly_updated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A row's key may change too (nothing does that, but an operator's
    -- UPDATE might): take the old rows off and put the new ones on.
    INSERT INTO usage_monthly AS m (account_id, period, route, units)
    SELECT account_id, period, route, sum(units) FROM (
        SELECT account_id, to_char(day, 'YYYY-MM') AS period, route, units FROM new_rows
        UNION ALL
        SELECT account_id, to_char(day, 'YYYY-MM'), route, -units FROM old_rows
    ) d GROUP BY 1, 2, 3 ORDER BY 2, 1, 3
    ON CONFLICT (period, account_id, route) DO UPDATE SET units = m.units + excluded.units;
    RETURN NULL;
END $$;

CREATE FUNCTION usage_monthly_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE usage_monthly m SET units = m.units - d.units
    FROM (SELECT account_id, to_char(day, 'YYYY-MM') AS period, route, sum(units) AS units
          FROM old_rows GROUP BY 1, 2, 3) d
    WHERE m.period = d.period AND m.account_id = d.account_id AND m.route = d.route;
    RETURN NULL;
END $$;

CREATE TRIGGER usage_monthly_ins AFTER INSERT ON usage_daily
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION usage_monthly_inserted();
CREATE TRIGGER usage_monthly_upd AFTER UPDATE ON usage_daily
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION usage_monthly_updated();
CREATE TRIGGER usage_monthly_del AFTER DELETE ON usage_daily
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION usage_monthly_deleted();
